// Runs a fuzz target's LLVMFuzzerTestOneInput over every file of the directories named on the
// command line (not their subdirectories), in name order, so that the seed corpus and the saved
// findings run as ordinary tests in a build without libFuzzer. A crash or a broken invariant in
// the target fails the test by its signal; an empty or missing corpus fails it with exit code 2.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) __attribute__((weak));

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR... (runs every file of each DIR through the fuzz target)\n", argv[0]);
    return 2;
  }
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  int ran = 0;
  for (int a = 1; a < argc; ++a) {
    const fs::path dir = argv[a];
    std::error_code error;
    if (!fs::is_directory(dir, error)) {
      std::fprintf(stderr, "%s: not a directory (the corpus of this target is missing)\n", dir.c_str());
      return 2;
    }
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file()) files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
    for (const fs::path& file : files) {
      std::ifstream in(file, std::ios::binary);
      if (!in) {
        std::fprintf(stderr, "%s: cannot open\n", file.c_str());
        return 2;
      }
      const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::fprintf(stderr, "running %s (%zu bytes)\n", file.c_str(), bytes.size());
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++ran;
    }
  }
  if (ran == 0) {
    std::fprintf(stderr, "no inputs in the directories given: a target without a corpus tests nothing\n");
    return 2;
  }
  std::fprintf(stderr, "%d inputs ran without a finding\n", ran);
  return 0;
}
