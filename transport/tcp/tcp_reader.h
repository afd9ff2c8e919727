// Reads fixed-size headers and the bytes that follow them (payloads, messages) from a
// blocking socket, such that trailing bytes always land directly in their destination:
// headers are read ahead only as far as the sender's `follow` hint (tcp_wire.h) guarantees
// that no trailing byte is crossed. One thread uses a reader at a time.
#ifndef KVWIRE_TRANSPORT_TCP_TCP_READER_H_
#define KVWIRE_TRANSPORT_TCP_TCP_READER_H_

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvwire::transport {

// Output queued by the owner of a reader, flushed before the reader blocks (so that queued
// responses never wait for more input).
class PendingOutput {
 public:
  virtual ~PendingOutput() = default;
  virtual bool HasPending() const = 0;
  virtual absl::Status Flush() = 0;
};

class HeaderReader {
 public:
  // `output` may be null; it must outlive the reader.
  HeaderReader(int fd, size_t header_bytes, PendingOutput* output);

  // Receives until one whole header is buffered and returns it (valid until the next call).
  // Errors are those of RecvSome (tcp_socket.h) or of PendingOutput::Flush.
  absl::StatusOr<const std::byte*> Next();

  // Declares what follows the header just returned by Next(): `trailing` bytes of its own,
  // then `follow` more headers without trailing bytes in between. Reading ahead into the
  // header buffer is limited to those headers. FailedPrecondition (a protocol error) if
  // bytes are already buffered where trailing bytes should be: the peer's hints lied.
  absl::Status Expect(uint64_t trailing, uint16_t follow);

  // Receives the `length` trailing bytes directly into `dest` (nullptr with length 0 is
  // fine), reading ahead declared headers in the same calls. With `cancelled`, the flag is
  // checked before every receive into `dest` and the reader never blocks in one for long:
  // once it is set, the rest is received and dropped and the result is Cancelled, so memory
  // the owner of `dest` has taken back is not written later (beyond a receive already in
  // the kernel when the flag flips).
  absl::Status ReadTrailing(std::byte* dest, size_t length,
                            const std::atomic<bool>* cancelled = nullptr);
  // ReadTrailing for a part of the trailing bytes that is not their end: no header is read
  // ahead with it (the stream holds more trailing bytes first). A cancelled part drops only
  // its own `length` bytes; the caller drops the rest.
  absl::Status ReadTrailingPart(std::byte* dest, size_t length,
                                const std::atomic<bool>* cancelled = nullptr);
  // Receives and drops the `length` trailing bytes (through a small scratch buffer).
  absl::Status DiscardTrailing(uint64_t length);

  // The non-blocking forms, for connections on the I/O pool (tcp_io_pool.h); they never wait
  // and keep their progress in the reader (and in `*done`), so that the caller returns to
  // epoll when the socket runs dry and calls again when it is readable.
  //
  // Next() without waiting: the header, or nullptr when it is not all there yet.
  absl::StatusOr<const std::byte*> TryNext();
  // ReadTrailing without waiting: receives trailing bytes [*done, length) into `dest`
  // (nullptr: received and dropped) and advances *done; true once all `length` are in.
  // When the socket runs dry mid-payload, the socket's receive low-water mark (SO_RCVLOWAT)
  // is raised to what is left of it (at most kLowWaterBytes, and at most a quarter of the
  // socket's receive buffer, so that the window never closes first): the bytes are on their way
  // (the sender sends an op whole), and the I/O thread is then woken once per that many
  // bytes instead of once per loopback segment (~64 KiB), each wake-up costing the sender an
  // interrupt and the receiver a context switch. TryNext lowers it again before waiting for
  // a header.
  absl::StatusOr<bool> TryReadTrailing(std::byte* dest, size_t length, size_t* done);

  // The bytes received after the last header returned and not consumed yet (after a header
  // without trailing bytes: the headers that follow it, the last perhaps in part). Valid
  // until the next call.
  absl::Span<const std::byte> Ahead() const { return {buffer_.data() + begin_, buffered()}; }

  // The most a receive waits for before the I/O thread is woken mid-payload.
  static constexpr size_t kLowWaterBytes = 256 << 10;

 private:
  // Flushes pending output before blocking; `wait_all` fills all of iov when it blocks.
  absl::StatusOr<size_t> Receive(iovec* iov, size_t count, bool wait_all);
  // Moves buffered bytes to the front when that makes room for `want` more.
  void Compact(size_t want);
  // Sets SO_RCVLOWAT to `bytes` unless it is already; a failure only costs wake-ups.
  void SetLowWater(size_t bytes);
  size_t buffered() const { return end_ - begin_; }

  const int fd_;
  const size_t header_bytes_;
  PendingOutput* const output_;
  std::vector<std::byte> buffer_;
  std::vector<std::byte> scratch_;  // for DiscardTrailing, allocated on first use
  size_t begin_ = 0;                // first unconsumed byte
  size_t end_ = 0;                  // one past the last received byte
  size_t ahead_ = 0;                // bytes not yet received that are known to be headers
  size_t low_water_ = 1;            // the socket's SO_RCVLOWAT (the kernel's default: 1)
  size_t low_water_cap_ = 0;        // the highest mark for this socket; 0: not known yet
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_READER_H_
