#include "control_secret.h"

#include <sys/random.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "moe/core/file.h"

namespace moe::deploy {

std::string NewControlSecret() {
  uint8_t bytes[32] = {};
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  std::string hex;
  for (uint8_t b : bytes) absl::StrAppendFormat(&hex, "%02x", b);
  return hex;
}

absl::StatusOr<std::string> ReadControlSecret(const std::string& path) {
  auto text = core::ReadBoundedFile(path, 4096, "control-plane secret file");
  if (!text.ok()) return text.status();
  std::string line(absl::StripAsciiWhitespace(text->substr(0, text->find('\n'))));
  const bool printable = std::all_of(line.begin(), line.end(), [](char c) { return c > ' ' && c < 127; });
  if (line.size() < 16 || line.size() > 1024 || !printable) {
    return absl::InvalidArgumentError(absl::StrCat(
        "control-plane secret file ", path,
        ": its first line must hold 16 to 1024 printable characters without spaces (e.g. `openssl rand -hex 32`)"));
  }
  return line;
}

bool SecretsMatch(std::string_view a, std::string_view b) {
  if (a.empty() || b.empty()) return false;
  uint8_t diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < b.size(); ++i) diff |= static_cast<uint8_t>(a[i % a.size()] ^ b[i]);
  return diff == 0;
}

}  // namespace moe::deploy
