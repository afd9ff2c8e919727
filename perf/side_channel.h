// The side channel between the two kvwire-perf processes: one TCP connection carrying text
// lines (settings, "run this size", check results), like perftest's port 18515 exchange.
// The data itself moves through the kvwire engine only.
#ifndef KVWIRE_PERF_SIDE_CHANNEL_H_
#define KVWIRE_PERF_SIDE_CHANNEL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvwire::perf {

// A connected socket exchanging '\n'-terminated lines. Move-only; closes on destruction.
class LineSocket {
 public:
  LineSocket() = default;
  explicit LineSocket(int fd) : fd_(fd) {}
  LineSocket(LineSocket&& other) noexcept;
  LineSocket& operator=(LineSocket&& other) noexcept;
  LineSocket(const LineSocket&) = delete;
  LineSocket& operator=(const LineSocket&) = delete;
  ~LineSocket();

  // Dials host:port, retrying refused connections until `timeout` (the target may still be
  // starting).
  static absl::StatusOr<LineSocket> Dial(const std::string& host, int port, absl::Duration timeout);

  absl::Status SendLine(const std::string& line);
  // Next line without its '\n' (at most 64 KiB, else InvalidArgument); Unavailable when the
  // peer closed, DeadlineExceeded when no whole line came within `timeout` (an absolute bound:
  // bytes trickling in do not extend it).
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);

 private:
  int fd_ = -1;
  std::string buffer_;
};

// A listening socket that accepts one peer at a time.
class LineListener {
 public:
  static absl::StatusOr<LineListener> Listen(const std::string& bind, int port);
  LineListener() = default;
  LineListener(LineListener&& other) noexcept;
  LineListener& operator=(LineListener&& other) noexcept;
  LineListener(const LineListener&) = delete;
  LineListener& operator=(const LineListener&) = delete;
  ~LineListener();

  int port() const { return port_; }
  absl::StatusOr<LineSocket> Accept(absl::Duration timeout);

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_SIDE_CHANNEL_H_
