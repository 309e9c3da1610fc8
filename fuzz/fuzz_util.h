// Helpers the fuzz targets share: a per-process scratch directory for the inputs that the code
// under test reads as files, and the invariant check that turns a broken contract into a crash
// libFuzzer (or the corpus driver) reports.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "moe/core/tensor.h"
#include "moe/runtime/weight_source.h"

namespace moe::fuzz {

// A violated invariant is a finding: print what broke and stop with SIGABRT, which libFuzzer
// records as a crash with the input, and which fails the corpus test.
#define MOE_FUZZ_CHECK(cond, ...)                                                       \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "%s:%d: invariant failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                \
      std::fputc('\n', stderr);                                                         \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it when the process
// exits normally. Targets hold one in a function-local static.
class ScratchDir {
 public:
  explicit ScratchDir(std::string_view name) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/moe-" + std::string(name) + "-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::fprintf(stderr, "cannot create a scratch directory %s\n", pattern.c_str());
      std::abort();
    }
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Writes `size` bytes to `path`, replacing it. A failure here is the machine's (a full disk),
// not the code under test's, so it stops the run with a message instead of passing silently.
inline void WriteFileOrDie(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  out.close();
  if (!out) {
    std::fprintf(stderr, "cannot write %zu bytes to %s\n", size, path.c_str());
    std::abort();
  }
}

// Reads every byte of every tensor `source` lists, so that a view past the end of its file
// faults (or trips ASan) here rather than in a forward pass; checks that each view's byte count
// is what its shape says and fits in `max_bytes` (the input's size). Returns a checksum so the
// reads are not optimised away.
inline uint64_t ReadEveryTensor(const runtime::WeightSource& source, uint64_t max_bytes) {
  uint64_t sum = 0;
  for (const std::string& name : source.Names()) {
    MOE_FUZZ_CHECK(source.Has(name), "Names() lists %s but Has() denies it", name.c_str());
    MOE_FUZZ_CHECK(!source.FileOf(name).empty(), "no file for listed tensor %s", name.c_str());
    auto view = source.Get(name);
    MOE_FUZZ_CHECK(view.ok(), "Names() lists %s but Get() fails", name.c_str());
    int64_t numel = 1;
    for (int64_t d : view->shape) {
      MOE_FUZZ_CHECK(d >= 0 && !__builtin_mul_overflow(numel, d, &numel),
                     "tensor %s: shape %s has a negative dimension or more elements than int64 holds", name.c_str(),
                     core::ShapeString(view->shape).c_str());
    }
    int64_t bytes = 0;
    MOE_FUZZ_CHECK(!__builtin_mul_overflow(numel, core::DTypeSize(view->dtype), &bytes),
                   "tensor %s: byte count overflows int64", name.c_str());
    MOE_FUZZ_CHECK(static_cast<uint64_t>(bytes) <= max_bytes, "tensor %s: %lld bytes from a %llu-byte input",
                   name.c_str(), static_cast<long long>(bytes), static_cast<unsigned long long>(max_bytes));
    MOE_FUZZ_CHECK(bytes == 0 || view->data != nullptr, "tensor %s: %lld bytes at a null pointer", name.c_str(),
                   static_cast<long long>(bytes));
    const auto* p = static_cast<const uint8_t*>(view->data);
    for (int64_t i = 0; i < bytes; ++i) sum = sum * 31 + p[i];
  }
  return sum;
}

}  // namespace moe::fuzz
