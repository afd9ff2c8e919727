// Structured logging: one line per event, "ts level component: message key=value ...".
// Levels are filtered once at the call site; fields carry ids (peer, transfer, region) so
// lines can be grepped per request or transfer.
//
//   KVW_LOG(kInfo, "engine") << "peer connected" << Kv("peer", id) << Kv("transport", t);
#ifndef KVWIRE_UTIL_LOG_H_
#define KVWIRE_UTIL_LOG_H_

#include <atomic>
#include <sstream>
#include <string>
#include <string_view>

namespace kvwire {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

namespace log_internal {
extern std::atomic<int> g_min_level;
}  // namespace log_internal

// Process-wide minimum level (default kWarning; KVWIRE_LOG_LEVEL via EngineOptions).
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Accepts debug|info|warning|error|off.
bool ParseLogLevel(std::string_view text, LogLevel* level);

inline bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= log_internal::g_min_level.load(std::memory_order_relaxed);
}

template <typename T>
struct KvField {
  std::string_view key;
  const T& value;
};
template <typename T>
KvField<T> Kv(std::string_view key, const T& value) {
  return KvField<T>{key, value};
}

// Collects one line and writes it to stderr (atomically, one write) on destruction.
class LogLine {
 public:
  LogLine(LogLevel level, std::string_view component);
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;

  template <typename T>
  LogLine& operator<<(const KvField<T>& field) {
    stream_ << ' ' << field.key << '=' << field.value;
    return *this;
  }
  template <typename T>
  LogLine& operator<<(const T& value) {
    stream_ << value;
    return *this;
  }

 private:
  std::ostringstream stream_;
};

}  // namespace kvwire

#define KVW_LOG(level, component)                         \
  if (!::kvwire::LogEnabled(::kvwire::LogLevel::level)) { \
  } else                                                  \
    ::kvwire::LogLine(::kvwire::LogLevel::level, component)

#endif  // KVWIRE_UTIL_LOG_H_
