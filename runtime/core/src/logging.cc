#include "moe/core/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace moe::core {
namespace {

LogLevel LevelFromEnv() {
  const char* v = std::getenv("MOESERVE_LOG_LEVEL");
  if (v == nullptr) return LogLevel::kInfo;
  if (std::strcmp(v, "debug") == 0) return LogLevel::kDebug;
  if (std::strcmp(v, "warning") == 0) return LogLevel::kWarning;
  if (std::strcmp(v, "error") == 0) return LogLevel::kError;
  return LogLevel::kInfo;
}

std::atomic<int>& Threshold() {
  static std::atomic<int> threshold{static_cast<int>(LevelFromEnv())};
  return threshold;
}

const char* Tag(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "?";
}

}  // namespace

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= Threshold().load(); }
void SetLogLevel(LogLevel level) { Threshold().store(static_cast<int>(level)); }

void LogMessage(LogLevel level, std::string_view text) {
  std::string line = std::string("moeserve ") + Tag(level) + ": " + std::string(text) + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace moe::core
