// The tcp transport's wire (transport/tcp/tcp_wire.h) as a data connection's two ends read
// it: the input is what the peer sends, pushed through a real socket (a socketpair).
//   Target side: the dialer's hello (decoded as TcpServer does: DecodeHello, then the token),
//   then the real ServerConnection (transport/tcp/tcp_server_connection.cc) serving the
//   stream on its own thread, every op validated by TargetHooks::ResolveIncoming through the
//   engine's real RegionRegistry::ResolveForPeer (exported, bounds, permission), as
//   Engine::Impl::ResolveIncoming does, over one 64 KiB heap region (id 1, read-write) and
//   one read-only one (id 2) that ASan watches.
//   Initiator side: the hello reply and responses to READs it posted, read with the real
//   HeaderReader in the sequence tcp_client_connection.cc ReaderLoop follows.
//
// Input: byte 0 bit 0 picks the side (0: target reading a dialer's hello and requests,
// 1: initiator reading hello reply and responses to READs it posted); the rest is the stream.
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <poll.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "src/core/region_registry.h"
#include "tests/fuzz/fuzz_util.h"
#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_server_connection.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::transport {
namespace {

namespace wire = tcp_wire;

constexpr size_t kRegionBytes = 64 << 10;
constexpr uint64_t kMaxOpBytes = 1 << 20;
constexpr PeerId kPeer = 7;
// More than fits the socket's buffer would block the single thread that writes and reads.
constexpr size_t kMaxStreamBytes = 96 << 10;

// The engine's side of the target: its region registry, nothing else.
class RegistryHooks : public TargetHooks {
 public:
  explicit RegistryHooks(core::RegionRegistry& regions) : regions_(regions) {}
  absl::StatusOr<PeerId> PeerForToken(const std::string&) override { return kPeer; }
  absl::StatusOr<IncomingAccess> ResolveIncoming(PeerId peer, RegionId region, uint64_t offset,
                                                 uint64_t length, OpKind kind) override {
    absl::StatusOr<core::ResolvedRange> r =
        regions_.ResolveForPeer(peer, region, offset, length, kind);
    if (!r.ok()) return r.status();
    return IncomingAccess{r->data, r->gpu_device, std::move(r->pin)};
  }
  absl::StatusOr<LocalRegion> ExportedRegion(PeerId peer, RegionId region) override {
    return regions_.ExportedRegion(peer, region);
  }
  void OnWriteArrived(PeerId, TransferId) override {}
  void OnPeerError(PeerId, const absl::Status&) override {}

 private:
  core::RegionRegistry& regions_;
};

// The target side: the hello as TcpServer reads it, then the real ServerConnection.
void ServeTarget(int fd, int peer_fd, std::vector<std::byte>& rw, std::vector<std::byte>& ro) {
  std::array<std::byte, wire::kHelloBytes> raw;
  if (!RecvExact(fd, raw.data(), raw.size()).ok()) return;
  wire::Hello hello;
  if (!wire::DecodeHello(raw.data(), &hello).ok() || hello.version != wire::kVersion) return;
  KVWIRE_FUZZ_CHECK(hello.token_len <= wire::kMaxTokenBytes);
  std::string token(hello.token_len, '\0');
  if (!RecvExact(fd, token.data(), token.size()).ok()) return;

  core::RegionRegistry regions;
  LocalRegion a;
  a.base = rw.data();
  a.length = rw.size();
  a.access = kRemoteRead | kRemoteWrite;
  LocalRegion b = a;
  b.base = ro.data();
  b.length = ro.size();
  b.access = kRemoteRead;
  KVWIRE_FUZZ_CHECK(regions.Add(a, /*export_to_all=*/true) == 1);
  KVWIRE_FUZZ_CHECK(regions.Add(b, /*export_to_all=*/true) == 2);
  RegistryHooks hooks(regions);
  // Whatever the connection answers is read and dropped, so that its sends never block.
  std::atomic<bool> done{false};
  std::thread drain([&] {
    std::vector<char> sink(64 << 10);
    while (!done.load()) {
      pollfd p{peer_fd, POLLIN, 0};
      if (::poll(&p, 1, 10) <= 0) continue;
      if (::recv(peer_fd, sink.data(), sink.size(), 0) <= 0) break;
    }
  });
  {
    ServerConnection conn(std::make_unique<Socket>(::dup(fd)), "fuzz", kPeer, &hooks, kMaxOpBytes,
                          GpuStaging{});
    if (conn.Start().ok()) {
      // The stream ends after the input: the connection serves it and returns.
      while (!conn.Exited()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }  // stops and joins
  done.store(true);
  drain.join();
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
  ::shutdown(fds[1], SHUT_WR);  // end of stream; the target's answers still have a reader
  std::vector<std::byte> region(kvwire::transport::kRegionBytes);
  if ((data[0] & 1) == 0) {
    std::vector<std::byte> read_only(kvwire::transport::kRegionBytes);
    kvwire::transport::ServeTarget(fds[0], fds[1], region, read_only);
  } else {
    kvwire::transport::RunInitiator(fds[0], region);
  }
  ::close(fds[0]);
  ::close(fds[1]);
  return 0;
}
