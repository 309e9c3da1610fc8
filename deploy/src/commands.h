// The subcommands of the `moeserve` binary. Each takes the arguments after its name and
// returns the process exit code: 0 on success, 1 on a runtime error, 2 on a usage error.
#pragma once

namespace moe::deploy {

int GenerateCommand(int argc, char** argv);
int MakeModelCommand(int argc, char** argv);
int BenchCommand(int argc, char** argv);
int ServeCommand(int argc, char** argv);

}  // namespace moe::deploy
