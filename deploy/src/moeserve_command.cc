// The root of the command line: subcommands, help, version, and how parse errors are reported.
#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "commands.h"

namespace moe::deploy {
namespace {

constexpr const char* kVersion = "0.1.0";

// The names of `app`'s subcommands, for "unknown command" errors.
std::vector<std::string> CommandNames(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    names.push_back(sub->get_name());
  return names;
}

// The deepest subcommand the user named, for "moeserve bench load: error: ..." and its help.
CLI::App* Deepest(CLI::App& root) {
  CLI::App* at = &root;
  while (true) {
    std::vector<CLI::App*> parsed = at->get_subcommands();
    if (parsed.empty()) return at;
    at = parsed.front();
  }
}

std::string Path(const CLI::App& app) {
  std::string path = app.get_name();
  for (const CLI::App* p = app.get_parent(); p != nullptr; p = p->get_parent()) path = p->get_name() + " " + path;
  return path;
}

// The help of `app`, its usage line naming the whole command ("Usage: moeserve bench load").
std::string Help(const CLI::App& app) {
  return app.get_parent() != nullptr ? app.help(Path(*app.get_parent())) : app.help();
}

// A word that is not a flag where a subcommand of `app` is expected: named as unknown, with the
// list, before CLI11 would call it "A subcommand is required".
bool UnknownCommand(const CLI::App& app, const std::string& word) {
  if (word.empty() || word[0] == '-') return false;
  for (const std::string& name : CommandNames(app)) {
    if (name == word) return false;
  }
  std::cerr << Path(app) << ": unknown command '" << word << "' (commands: " << absl::StrJoin(CommandNames(app), ", ")
            << "; see " << Path(app) << " --help)\n";
  return true;
}

}  // namespace

int RunMoeserve(int argc, char** argv) {
  CLI::App root(absl::StrCat("moeserve ", kVersion,
                             ": serves Mixture-of-Experts language models (qwen3_moe, qwen2_moe, mixtral, glm4_moe,\n"
                             "deepseek_v3) from Hugging Face checkpoints. `moeserve COMMAND --help` explains each "
                             "command."),
                "moeserve");
  root.get_formatter()->column_width(36);  // subcommands share the root's formatter
  root.require_subcommand(0, 1);
  root.set_version_flag("--version", std::string("moeserve ") + kVersion);
  CommandRun selected;
  AddServeCommand(root, &selected);
  AddGenerateCommand(root, &selected);
  AddMakeModelCommand(root, &selected);
  AddBenchCommand(root, &selected);
  AddChatTemplateCommand(root, &selected);
  AddTokenizeCommand(root, &selected);
  AddInspectCommand(root, &selected);
  AddProfileExpertsCommand(root, &selected);
  AddWorkerCommand(root, &selected);
  root.add_subcommand("version", "print the version")->callback([&selected] {
    selected = [] {
      std::cout << "moeserve " << kVersion << "\n";
      return 0;
    };
  });

  if (argc < 2) {
    std::cerr << root.help();
    return 2;
  }
  if (UnknownCommand(root, argv[1])) return 2;
  if (std::string(argv[1]) == "bench" && argc > 2 && UnknownCommand(*root.get_subcommand("bench"), argv[2])) return 2;
  try {
    root.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << Help(*Deepest(root));
    return 0;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << root.help("", CLI::AppFormatMode::All);
    return 0;
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << "\n";
    return 0;
  } catch (const CLI::ExtrasError& e) {
    // Name the first word no flag took: "unknown flag --tempreature" rather than CLI11's list.
    const CLI::App* at = Deepest(root);
    const std::vector<std::string> extras = at->remaining();
    std::string what = e.what();
    for (const std::string& word : extras) {
      if (word.rfind("-", 0) == 0) {
        what = "unknown flag " + word.substr(0, word.find('='));
        break;
      }
    }
    if (what == e.what() && !extras.empty())
      what = "unexpected argument '" + extras.front() + "' (flags start with --)";
    std::cerr << Path(*at) << ": error: " << what << " (see " << Path(*at) << " --help)\n";
    return 2;
  } catch (const CLI::ParseError& e) {
    const CLI::App* at = Deepest(root);
    std::cerr << Path(*at) << ": error: " << e.what() << " (see " << Path(*at) << " --help)\n";
    return 2;
  }
  if (!selected) {
    std::cerr << Path(*Deepest(root)) << ": a command is required\n\n" << Help(*Deepest(root));
    return 2;
  }
  return selected();
}

}  // namespace moe::deploy
