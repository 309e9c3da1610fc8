// moeserve: serves Mixture-of-Experts models larger than the GPUs at hand.
#include <cstring>
#include <iostream>
#include <string>

#include "commands.h"

namespace {

constexpr const char* kVersion = "0.1.0";

void PrintUsage(std::ostream& out) {
  out << "moeserve " << kVersion << ": runs Mixture-of-Experts language models (qwen3_moe, qwen2_moe, mixtral,\n"
      << "glm4_moe) from Hugging Face checkpoints.\n\n"
      << "usage: moeserve COMMAND [flags]      (moeserve COMMAND --help for its flags)\n\n"
      << "commands:\n"
      << "  serve        serve a model over gRPC with continuous batching (one process, CPU backend)\n"
      << "  generate     run one prompt (token ids) through a model and print the tokens and speed\n"
      << "  make-model   write a random-weight checkpoint at a real model's shape (tiny, qwen3-30b-a3b)\n"
      << "  bench        benchmarks: `bench experts` (the CPU expert pool vs the read-bandwidth roofline),\n"
      << "               `bench load` (loading and attaching the expert arena), `bench serve` (load generator)\n"
      << "  version      print the version\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    PrintUsage(std::cerr);
    return 2;
  }
  const std::string command = argv[1];
  if (command == "generate") return moe::deploy::GenerateCommand(argc - 2, argv + 2);
  if (command == "make-model") return moe::deploy::MakeModelCommand(argc - 2, argv + 2);
  if (command == "bench") return moe::deploy::BenchCommand(argc - 2, argv + 2);
  if (command == "serve") return moe::deploy::ServeCommand(argc - 2, argv + 2);
  if (command == "version" || command == "--version") {
    std::cout << "moeserve " << kVersion << "\n";
    return 0;
  }
  if (command == "help" || command == "--help" || command == "-h") {
    PrintUsage(std::cout);
    return 0;
  }
  std::cerr << "moeserve: unknown command '" << command << "'\n\n";
  PrintUsage(std::cerr);
  return 2;
}
