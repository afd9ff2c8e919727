#include "src/util/log.h"

#include <sys/time.h>

#include <cstdio>
#include <ctime>
#include <unistd.h>

namespace kvwire {
namespace log_internal {
std::atomic<int> g_min_level{static_cast<int>(LogLevel::kWarning)};
}  // namespace log_internal

void SetLogLevel(LogLevel level) {
  log_internal::g_min_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

LogLevel GetLogLevel() {
  return static_cast<LogLevel>(log_internal::g_min_level.load(std::memory_order_relaxed));
}

bool ParseLogLevel(std::string_view text, LogLevel* level) {
  if (text == "debug")
    *level = LogLevel::kDebug;
  else if (text == "info")
    *level = LogLevel::kInfo;
  else if (text == "warning" || text == "warn")
    *level = LogLevel::kWarning;
  else if (text == "error")
    *level = LogLevel::kError;
  else if (text == "off")
    *level = LogLevel::kOff;
  else
    return false;
  return true;
}

namespace {
const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARN";
    case LogLevel::kError:
      return "ERROR";
    case LogLevel::kOff:
      break;
  }
  return "?";
}
}  // namespace

LogLine::LogLine(LogLevel level, std::string_view component) {
  timeval tv;
  gettimeofday(&tv, nullptr);
  tm parts;
  gmtime_r(&tv.tv_sec, &parts);
  char stamp[32];
  std::snprintf(stamp, sizeof(stamp), "%02d:%02d:%02d.%06ld", parts.tm_hour, parts.tm_min,
                parts.tm_sec, static_cast<long>(tv.tv_usec));
  stream_ << stamp << ' ' << LevelName(level) << " pid=" << getpid() << ' ' << component << ": ";
}

LogLine::~LogLine() {
  stream_ << '\n';
  const std::string line = stream_.str();
  // One write(2) so that lines of concurrent threads and processes do not interleave.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

}  // namespace kvwire
