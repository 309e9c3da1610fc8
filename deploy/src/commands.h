// The subcommands of the `moeserve` binary. Each Add* declares its subcommand and flags under
// the root app; after a successful parse, `*selected` holds what the named command runs, which
// returns the process exit code: 0 on success, 1 on a runtime error, 2 on a usage error.
#pragma once

#include "flags.h"

namespace moe::deploy {

void AddGenerateCommand(CLI::App& root, CommandRun* selected);
void AddMakeModelCommand(CLI::App& root, CommandRun* selected);
void AddBenchCommand(CLI::App& root, CommandRun* selected);
void AddServeCommand(CLI::App& root, CommandRun* selected);
void AddChatTemplateCommand(CLI::App& root, CommandRun* selected);
void AddTokenizeCommand(CLI::App& root, CommandRun* selected);
void AddInspectCommand(CLI::App& root, CommandRun* selected);
void AddProfileExpertsCommand(CLI::App& root, CommandRun* selected);
void AddWorkerCommand(CLI::App& root, CommandRun* selected);
// `bench model`, declared under `bench` by AddBenchCommand.
void AddBenchModel(CLI::App& bench, CommandRun* selected);
// `bench control`, likewise.
void AddBenchControl(CLI::App& bench, CommandRun* selected);

// Parses argv and runs the command it names: help on stdout with exit 0, a usage error on stderr
// with exit 2 ("moeserve generate: error: --max-new-tokens: ..."), else the command's own code.
int RunMoeserve(int argc, char** argv);

}  // namespace moe::deploy
