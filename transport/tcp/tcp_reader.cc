#include "transport/tcp/tcp_reader.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <poll.h>

#include "absl/strings/str_cat.h"

#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::transport {
namespace {

// Payloads are received in pieces of at most this size (measured on loopback: 16 KiB and
// 1 MiB pieces are both slower than 64-128 KiB).
constexpr size_t kRecvPieceBytes = 64 << 10;

// How long a cancellable receive sleeps in poll before it looks at the flag again.
constexpr int kCancelCheckMs = 20;

// True when `fd` has input (or an error/hang-up to report) within `timeout_ms`.
bool WaitReadable(int fd, int timeout_ms) {
  pollfd entry{fd, POLLIN, 0};
  return ::poll(&entry, 1, timeout_ms) != 0;  // errors surface in the next recv
}

}  // namespace

HeaderReader::HeaderReader(int fd, size_t header_bytes, PendingOutput* output)
    : fd_(fd),
      header_bytes_(header_bytes),
      output_(output),
      buffer_((tcp_wire::kMaxFollow + 1) * header_bytes) {}

absl::StatusOr<size_t> HeaderReader::Receive(iovec* iov, size_t count, bool wait_all) {
  if (output_ != nullptr && output_->HasPending()) {
    // Only block after the queued output is on its way: the peer may be waiting for it.
    absl::StatusOr<size_t> n = RecvSome(fd_, iov, count, RecvMode::kNonBlocking);
    if (!n.ok() || *n > 0) return n;
    if (absl::Status s = output_->Flush(); !s.ok()) return s;
  }
  return RecvSome(fd_, iov, count, wait_all ? RecvMode::kWaitAll : RecvMode::kSome);
}

void HeaderReader::Compact(size_t want) {
  if (begin_ == end_) {
    begin_ = end_ = 0;
  } else if (buffer_.size() - end_ < want && begin_ > 0) {
    std::memmove(buffer_.data(), buffer_.data() + begin_, buffered());
    end_ -= begin_;
    begin_ = 0;
  }
}

absl::StatusOr<const std::byte*> HeaderReader::Next() {
  SetLowWater(1);  // a blocking wait must see any byte (TryReadTrailing may have raised it)
  while (buffered() < header_bytes_) {
    const size_t need = header_bytes_ - buffered();
    Compact(std::max(need, ahead_));
    const size_t want = std::min(std::max(need, ahead_), buffer_.size() - end_);
    iovec iov{buffer_.data() + end_, want};
    absl::StatusOr<size_t> n = Receive(&iov, 1, /*wait_all=*/false);
    if (!n.ok()) return n.status();
    end_ += *n;
    ahead_ -= std::min(ahead_, *n);
  }
  const std::byte* header = buffer_.data() + begin_;
  begin_ += header_bytes_;
  return header;
}

void HeaderReader::SetLowWater(size_t bytes) {
  if (bytes > 1) {
    if (low_water_cap_ == 0) {
      // A mark near the receive window would hold the sender up until the window closed (the
      // kernel then wakes us anyway): keep it to a quarter of the buffer, whose usable half
      // is the window. The buffer is what net.core.rmem_max left of socket_buffer_bytes.
      int buffer = 0;
      socklen_t len = sizeof(buffer);
      low_water_cap_ = ::getsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &buffer, &len) == 0 && buffer > 0
                           ? std::clamp<size_t>(static_cast<size_t>(buffer) / 4, 1, kLowWaterBytes)
                           : 1;
    }
    bytes = std::min(bytes, low_water_cap_);
  }
  if (bytes == low_water_) return;
  const int value = static_cast<int>(bytes);
  if (::setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &value, sizeof(value)) == 0) low_water_ = bytes;
}

absl::StatusOr<const std::byte*> HeaderReader::TryNext() {
  // A header may be all that comes (the peer waits for our answer): any byte wakes us.
  SetLowWater(1);
  while (buffered() < header_bytes_) {
    const size_t need = header_bytes_ - buffered();
    Compact(std::max(need, ahead_));
    const size_t want = std::min(std::max(need, ahead_), buffer_.size() - end_);
    iovec iov{buffer_.data() + end_, want};
    absl::StatusOr<size_t> n = RecvSome(fd_, &iov, 1, RecvMode::kNonBlocking);
    if (!n.ok()) return n.status();
    if (*n == 0) return nullptr;
    end_ += *n;
    ahead_ -= std::min(ahead_, *n);
  }
  const std::byte* header = buffer_.data() + begin_;
  begin_ += header_bytes_;
  return header;
}

absl::StatusOr<bool> HeaderReader::TryReadTrailing(std::byte* dest, size_t length, size_t* done) {
  Compact(ahead_);
  if (dest == nullptr && scratch_.empty()) scratch_.resize(kRecvPieceBytes);
  while (*done < length) {
    const size_t left = length - *done;
    const size_t piece = std::min(left, kRecvPieceBytes);
    std::byte* into = dest == nullptr ? scratch_.data() : dest + *done;
    // Headers are read ahead only with the last piece (see ReadTrailing).
    iovec iov[2] = {{into, piece}, {buffer_.data() + end_, 0}};
    if (piece == left) iov[1].iov_len = std::min(ahead_, buffer_.size() - end_);
    absl::StatusOr<size_t> n =
        RecvSome(fd_, iov, iov[1].iov_len > 0 ? 2 : 1, RecvMode::kNonBlocking);
    if (!n.ok()) return n.status();
    if (*n == 0) {
      // Only this op's own bytes count: what follows it may be nothing until we answer.
      SetLowWater(std::min(left, kLowWaterBytes));
      return false;
    }
    const size_t into_dest = std::min(*n, piece);
    *done += into_dest;
    const size_t extra = *n - into_dest;
    end_ += extra;
    ahead_ -= extra;
  }
  return true;
}

absl::Status HeaderReader::Expect(uint64_t trailing, uint16_t follow) {
  const size_t promised = std::min<size_t>(follow, tcp_wire::kMaxFollow) * header_bytes_;
  if (trailing > 0) {
    if (buffered() > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("read-ahead hint overran ", trailing, " bytes of payload/message"));
    }
    ahead_ = promised;
  } else {
    // The headers after this one may already be (partly) buffered.
    ahead_ = promised > buffered() ? promised - buffered() : 0;
  }
  return absl::OkStatus();
}

absl::Status HeaderReader::DiscardTrailing(uint64_t length) {
  constexpr size_t kScratchBytes = 256 << 10;
  if (scratch_.empty()) scratch_.resize(kScratchBytes);
  // Only the last piece may read ahead: before it, the stream holds more trailing bytes.
  const size_t ahead = ahead_;
  ahead_ = 0;
  while (length > scratch_.size()) {
    if (absl::Status s = ReadTrailing(scratch_.data(), scratch_.size()); !s.ok()) return s;
    length -= scratch_.size();
  }
  ahead_ = ahead;
  return ReadTrailing(scratch_.data(), length);
}

absl::Status HeaderReader::ReadTrailingPart(std::byte* dest, size_t length,
                                            const std::atomic<bool>* cancelled) {
  const size_t ahead = ahead_;
  ahead_ = 0;
  absl::Status s = ReadTrailing(dest, length, cancelled);
  ahead_ = ahead;
  return s;
}

absl::Status HeaderReader::ReadTrailing(std::byte* dest, size_t length,
                                        const std::atomic<bool>* cancelled) {
  SetLowWater(1);  // as in Next
  Compact(ahead_);
  while (length > 0) {
    if (cancelled != nullptr && cancelled->load(std::memory_order_acquire)) {
      if (absl::Status s = DiscardTrailing(length); !s.ok()) return s;
      return absl::CancelledError(
          absl::StrCat("receive cancelled; ", length, " trailing bytes dropped"));
    }
    // Receiving in moderate pieces keeps the socket's queue short and cache-hot; one receive
    // of a whole MiB is ~20% slower on loopback. Headers are read ahead with the last piece.
    const size_t piece = std::min(length, kRecvPieceBytes);
    iovec iov[2] = {{dest, piece}, {buffer_.data() + end_, 0}};
    if (piece == length) iov[1].iov_len = std::min(ahead_, buffer_.size() - end_);
    // Waiting for all of it is safe: the read-ahead headers were sent in the same batch as
    // the payload (that is what `follow` promises), so they are on their way.
    const size_t count = iov[1].iov_len > 0 ? 2 : 1;
    absl::StatusOr<size_t> n = cancelled == nullptr
                                   ? Receive(iov, count, /*wait_all=*/true)
                                   : RecvSome(fd_, iov, count, RecvMode::kNonBlocking);
    if (!n.ok()) return n.status();
    if (*n == 0) {  // cancellable and nothing there yet
      WaitReadable(fd_, kCancelCheckMs);
      continue;
    }
    const size_t into_dest = std::min(*n, length);
    dest += into_dest;
    length -= into_dest;
    const size_t extra = *n - into_dest;
    end_ += extra;
    ahead_ -= extra;
  }
  return absl::OkStatus();
}

}  // namespace kvwire::transport
