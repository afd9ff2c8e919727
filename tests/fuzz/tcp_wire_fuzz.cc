// The tcp transport's wire (transport/tcp/tcp_wire.h) and its stream reader
// (transport/tcp/tcp_reader.cc) as a data connection's two ends drive them: the input is
// what the peer sends, pushed through a real socket (a socketpair) into the real
// HeaderReader, and each header goes through the same decode-and-check sequence as
// tcp_server_connection.cc Handshake/Serve (target side) or tcp_client_connection.cc
// ReaderLoop (initiator side). The engine is replaced by one 64 KiB region (id 1) whose
// bounds this harness checks as the region registry would, so that a payload the reader
// writes lands in memory that ASan watches.
//
// Input: byte 0 bit 0 picks the side (0: target reading a dialer's hello and requests,
// 1: initiator reading hello reply and responses to READs it posted); the rest is the stream.
#include <sys/socket.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <unistd.h>
#include <vector>

#include "tests/fuzz/fuzz_util.h"
#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::transport {
namespace {

namespace wire = tcp_wire;

constexpr uint64_t kRegionId = 1;
constexpr size_t kRegionBytes = 64 << 10;
constexpr uint64_t kMaxOpBytes = 1 << 20;
// More than fits the socket's buffer would block the single thread that writes and reads.
constexpr size_t kMaxStreamBytes = 96 << 10;

// The target side: hello, then requests until the stream ends or is refused.
void ServeTarget(int fd, std::vector<std::byte>& region) {
  std::array<std::byte, wire::kHelloBytes> raw;
  if (!RecvExact(fd, raw.data(), raw.size()).ok()) return;
  wire::Hello hello;
  if (!wire::DecodeHello(raw.data(), &hello).ok() || hello.version != wire::kVersion) return;
  KVWIRE_FUZZ_CHECK(hello.token_len <= wire::kMaxTokenBytes);
  std::string token(hello.token_len, '\0');
  if (!RecvExact(fd, token.data(), token.size()).ok()) return;

  HeaderReader reader(fd, wire::kRequestBytes, /*output=*/nullptr);
  uint64_t expected_seq = 0;
  while (true) {
    absl::StatusOr<const std::byte*> next = reader.Next();
    if (!next.ok()) return;
    wire::RequestHeader h;
    if (!wire::DecodeRequest(*next, kMaxOpBytes, &h).ok()) return;
    KVWIRE_FUZZ_CHECK(h.length <= kMaxOpBytes);
    if (h.sequence != expected_seq++) return;
    const bool write = h.kind == wire::kKindWrite;
    if (h.region != kRegionId || h.offset > kRegionBytes || h.length > kRegionBytes - h.offset) {
      return;  // ResolveIncoming refuses: the stream ends with an error response
    }
    if (!reader.Expect(write ? h.length : 0, h.follow).ok()) return;
    if (write && !reader.ReadTrailing(region.data() + h.offset, h.length).ok()) return;
  }
}

// The initiator side with READs of known lengths in flight: hello reply, then responses.
void RunInitiator(int fd, std::vector<std::byte>& region) {
  std::array<std::byte, wire::kHelloReplyBytes> raw;
  if (!RecvExact(fd, raw.data(), raw.size()).ok()) return;
  wire::HelloReply reply;
  if (!wire::DecodeHelloReply(raw.data(), &reply).ok()) return;
  KVWIRE_FUZZ_CHECK(reply.message_len <= wire::kMaxMessageBytes);
  std::string message(reply.message_len, '\0');
  if (!RecvExact(fd, message.data(), message.size()).ok()) return;
  if (reply.code != 0) {
    (void)wire::CodeFromWire(reply.code);
    return;
  }

  HeaderReader reader(fd, wire::kResponseBytes, /*output=*/nullptr);
  // Posted READs: op i reads (i * 1031) % 4096 bytes into the region at i * 4096.
  constexpr uint64_t kOps = kRegionBytes / 4096;
  for (uint64_t op = 0; op < kOps; ++op) {
    absl::StatusOr<const std::byte*> next = reader.Next();
    if (!next.ok()) return;
    wire::ResponseHeader h;
    if (!wire::DecodeResponse(*next, &h).ok()) return;
    if (h.code != 0) {
      std::string text(h.message_len, '\0');
      if (reader.Expect(h.message_len, 0).ok()) {
        (void)reader.ReadTrailing(reinterpret_cast<std::byte*>(text.data()), text.size());
      }
      (void)wire::CodeFromWire(h.code);
      return;
    }
    const uint64_t payload = (op * 1031) % 4096;
    if (h.sequence != op || h.kind != wire::kKindRead || h.payload_len != payload) return;
    if (!reader.Expect(payload, h.follow).ok()) return;
    // Every other op as if the engine had ended the transfer meanwhile: dropped, not written.
    const absl::Status s = op % 2 == 0 ? reader.ReadTrailing(region.data() + op * 4096, payload)
                                       : reader.DiscardTrailing(payload);
    if (!s.ok()) return;
  }
}

}  // namespace
}  // namespace kvwire::transport

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || size - 1 > kvwire::transport::kMaxStreamBytes) return 0;
  int fds[2];
  KVWIRE_FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
  const int buffer_bytes = 1 << 20;
  (void)::setsockopt(fds[1], SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
  (void)::setsockopt(fds[0], SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
  // The whole stream is queued before the reader runs, then the peer's end is closed, so that
  // every read ends (with data or end of stream) and nothing waits.
  size_t sent = 0;
  while (sent < size - 1) {
    const ssize_t n = ::send(fds[1], data + 1 + sent, size - 1 - sent, MSG_NOSIGNAL);
    KVWIRE_FUZZ_CHECK(n > 0);
    sent += static_cast<size_t>(n);
  }
  ::close(fds[1]);
  std::vector<std::byte> region(kvwire::transport::kRegionBytes);
  if ((data[0] & 1) == 0) {
    kvwire::transport::ServeTarget(fds[0], region);
  } else {
    kvwire::transport::RunInitiator(fds[0], region);
  }
  ::close(fds[0]);
  return 0;
}
