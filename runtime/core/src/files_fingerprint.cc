#include "moe/core/files_fingerprint.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moe::core {
namespace {

void Mix(uint64_t& h, const std::string& text) {
  for (char c : text) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  h = (h ^ 0xffu) * 1099511628211ull;  // ends each field, so "ab"+"c" differs from "a"+"bc"
}

}  // namespace

std::string WeightFilesFingerprint(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str()); d != nullptr) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (absl::EndsWith(name, ".safetensors") || absl::EndsWith(name, ".json")) names.push_back(name);
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  uint64_t h = 14695981039346656037ull;  // FNV-1a
  for (const std::string& name : names) {
    struct stat st;
    if (::stat(absl::StrCat(dir, "/", name).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    Mix(h, name);
    Mix(h, absl::StrCat(st.st_size, ".", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec));
  }
  return absl::StrFormat("%016x", h);
}

}  // namespace moe::core
