// Minimal leveled logging to stderr: MOE_LOG(kWarning) << "text";
// Thread-safe: each message is written with one call. The level threshold comes from
// MOESERVE_LOG_LEVEL (debug, info, warning, error; default info).
#pragma once

#include <sstream>
#include <string_view>

namespace moe::core {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

bool LogEnabled(LogLevel level);
void SetLogLevel(LogLevel level);
void LogMessage(LogLevel level, std::string_view text);

namespace internal {
class LogLine {
 public:
  explicit LogLine(LogLevel level) : level_(level) {}
  ~LogLine() { LogMessage(level_, stream_.str()); }
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};
}  // namespace internal

}  // namespace moe::core

#define MOE_LOG(level)                                                  \
  if (!::moe::core::LogEnabled(::moe::core::LogLevel::level)) {         \
  } else                                                                \
    ::moe::core::internal::LogLine(::moe::core::LogLevel::level).stream()
