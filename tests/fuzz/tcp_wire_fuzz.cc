// The tcp transport's wire (transport/tcp/tcp_wire.h) as a data connection's two ends read
// it: the input is what the peer sends, pushed through a real socket (a socketpair).
//   Target side: the dialer's hello (decoded as TcpServer does: DecodeHello, then the token),
//   then the real ServerConnection (transport/tcp/tcp_server_connection.cc) serving the
//   stream on a real one-thread I/O pool, every op checked by core::CheckIncoming (the
//   engine's own access check: export, bounds, permission, read grant) over three 64 KiB heap
//   regions that ASan watches: 1 read-write, 2 read-only, 3 readable only under grant 1 (as
//   the input names the one live grant, whose real id is random), which covers its bytes
//   [4096, 12288).
//   Initiator side: the hello reply (decoded as tcp_channel.cc does), then the real
//   ClientConnection (tcp_client_connection.cc) with one READ request of 16 ops posted, whose
//   responses the input supplies.
//
// Input: byte 0 bit 0 picks the side (0: target reading a dialer's hello and requests,
// 1: initiator reading hello reply and responses to READs it posted); bit 1 has the initiator
// verify checksums (the response's CRC fields are then read and checked); the rest is the
// stream.
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <poll.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <sanitizer/asan_interface.h>

#include "src/core/grant_table.h"
#include "src/core/region_registry.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/support/fake_target_hooks.h"
#include "transport/tcp/tcp_client_connection.h"
#include "transport/tcp/tcp_io_pool.h"
#include "transport/tcp/tcp_server_connection.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::transport {
namespace {

namespace wire = tcp_wire;

constexpr size_t kRegionBytes = 64 << 10;
constexpr uint64_t kMaxOpBytes = 1 << 20;
// Grant 1 covers the guarded region's bytes [kGrantBegin, kGrantEnd).
constexpr uint64_t kGrantBegin = 4096;
constexpr uint64_t kGrantEnd = 12288;
constexpr PeerId kPeer = 7;
// More than fits the socket's buffer would block the single thread that writes and reads.
constexpr size_t kMaxStreamBytes = 96 << 10;

// Waits for a connection the input drives to let go; the stream is finite, so this ends
// unless the connection hangs (a finding).
constexpr auto kConnectionDeadline = std::chrono::seconds(20);

// The target side: the hello as TcpServer reads it, then the real ServerConnection.
void ServeTarget(int fd, int peer_fd, std::vector<std::byte>& rw, std::vector<std::byte>& ro,
                 std::vector<std::byte>& guarded) {
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
  LocalRegion c = b;
  c.base = guarded.data();
  c.length = guarded.size();
  c.reads_need_grant = true;
  KVWIRE_FUZZ_CHECK(regions.Add(a, /*export_to_all=*/true) == 1);
  KVWIRE_FUZZ_CHECK(regions.Add(b, /*export_to_all=*/true) == 2);
  KVWIRE_FUZZ_CHECK(regions.Add(c, /*export_to_all=*/true) == 3);
  core::GrantTable grants;
  const GrantRange granted[] = {{3, kGrantBegin, kGrantEnd - kGrantBegin}};
  // Grant ids are random (GrantTable): the inputs name the live grant as 1, translated here.
  const GrantId live_grant = grants.Add(kPeer, granted);
  KVWIRE_FUZZ_CHECK(live_grant != 0 && live_grant != 1);
  // The engine's side of the target: its region registry and grant table, through the engine's
  // own access check.
  kvwire::testing::FakeTargetHooks hooks(kvwire::testing::AnyToken(kPeer));
  hooks.SetResolver([&](PeerId peer, RegionId region, uint64_t offset, uint64_t length, OpKind kind,
                        GrantId grant) -> absl::StatusOr<IncomingAccess> {
    bool grant_refused = false;
    if (grant == 1) grant = live_grant;
    absl::StatusOr<core::ResolvedRange> r = core::CheckIncoming(
        regions, grants, peer, region, offset, length, kind, grant, &grant_refused);
    if (!r.ok()) return r.status();
    return IncomingAccess{r->data, r->gpu_device, std::move(r->pin)};
  });
  // The guarded region's bytes outside the grant: a READ served from them is an ASan report
  // (use-after-poison in sendmsg), not a response the drain thread drops unseen.
  ASAN_POISON_MEMORY_REGION(guarded.data(), kGrantBegin);
  ASAN_POISON_MEMORY_REGION(guarded.data() + kGrantEnd, guarded.size() - kGrantEnd);
  absl::StatusOr<std::shared_ptr<IoPool>> pool = IoPool::Create(1);
  KVWIRE_FUZZ_CHECK(pool.ok());
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
    auto conn = std::make_shared<ServerConnection>(std::make_unique<Socket>(::dup(fd)), "fuzz",
                                                   kPeer, &hooks, kMaxOpBytes, GpuStaging{}, *pool);
    if (conn->Start().ok()) {
      // The stream ends after the input: the connection serves it (or refuses and lingers
      // until the end of the stream) and lets go.
      const auto until = std::chrono::steady_clock::now() + kConnectionDeadline;
      while (!conn->Exited()) {
        KVWIRE_FUZZ_CHECK(std::chrono::steady_clock::now() < until);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    conn->Stop();
    conn->Join();
  }
  (*pool)->Stop();
  done.store(true);
  drain.join();
  ASAN_UNPOISON_MEMORY_REGION(guarded.data(), guarded.size());
  // Neither read-only region was written by any op.
  const auto zero = [](std::byte b) { return b == std::byte{0}; };
  KVWIRE_FUZZ_CHECK(std::all_of(ro.begin(), ro.end(), zero));
  KVWIRE_FUZZ_CHECK(std::all_of(guarded.begin(), guarded.end(), zero));
}

// The initiator side: the hello reply as tcp_channel.cc reads it, then the real
// ClientConnection with one READ request posted (op i reads (i * 1031) % 4096 bytes of remote
// region 5 into the region at i * 4096), completed by the responses in the input.
void RunInitiator(int fd, std::vector<std::byte>& region, bool verify) {
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
  if (reply.version != wire::kVersion) return;

  absl::StatusOr<std::shared_ptr<IoPool>> pool = IoPool::Create(1);
  KVWIRE_FUZZ_CHECK(pool.ok());
  auto conn =
      std::make_shared<ClientConnection>(std::make_unique<Socket>(::dup(fd)), "fuzz",
                                         /*lane=*/0, reply.max_op_bytes, GpuStaging{}, *pool);
  conn->SetVerifyChecksums(verify, "fuzz-peer");
  if (conn->Start().ok()) {
    PostRequest request;
    request.transfer_id = 77;
    request.kind = OpKind::kRead;
    request.cancelled = std::make_shared<std::atomic<bool>>(false);
    constexpr uint64_t kOps = kRegionBytes / 4096;
    for (uint64_t op = 0; op < kOps; ++op) {
      request.ops.push_back(
          WireOp{region.data() + op * 4096, /*remote_region=*/5, op * 4096, (op * 1031) % 4096});
    }
    std::promise<absl::Status> done;
    std::future<absl::Status> ended = done.get_future();
    conn->Post(std::move(request), [&done](absl::Status s) { done.set_value(std::move(s)); });
    // Every response is in the input and the stream then ends: the request completes or
    // fails, never waits.
    KVWIRE_FUZZ_CHECK(ended.wait_for(kConnectionDeadline) == std::future_status::ready);
  }
  conn->Close(absl::CancelledError("fuzz input done"));
  KVWIRE_FUZZ_CHECK(conn->Join());
  (*pool)->Stop();
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
    std::vector<std::byte> guarded(kvwire::transport::kRegionBytes);
    kvwire::transport::ServeTarget(fds[0], fds[1], region, read_only, guarded);
  } else {
    kvwire::transport::RunInitiator(fds[0], region, (data[0] & 2) != 0);
  }
  ::close(fds[0]);
  ::close(fds[1]);
  return 0;
}
