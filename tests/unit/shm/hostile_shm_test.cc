// Hostile same-host peers against the shm transport, with real processes: a target process
// (forked, unprivileged when the test runs as root) exports regions, and a second process
// receives their descriptors through the real fd protocol and tries to reach more than it was
// exported: bytes outside the range, write access to a read-only region, write access through
// /proc, access after revocation, and cross-memory attach. Afterwards a legitimate peer still
// moves bytes exactly.
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <grp.h>
#include <memory>
#include <poll.h>
#include <random>
#include <signal.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "kvwire/memory.h"
#include "kvwire/shm_options.h"
#include "src/util/mutex.h"
#include "tests/support/child_end.h"
#include "tests/support/fake_target_hooks.h"
#include "tests/support/shm_regions.h"
#include "tests/support/socket_io.h"
#include "transport/shm/fd_client.h"
#include "transport/shm/fd_protocol.h"
#include "transport/shm/host_region_key.h"
#include "transport/shm/seqpacket.h"
#include "transport/shm/shareable_registry.h"
#include "transport/shm/shm_endpoint.h"
#include "transport/shm/shm_transport.h"
#include "transport/shm/write_guard.h"

namespace kvwire::transport {
namespace {

using ::kvwire::testing::Describe;
using ::kvwire::testing::FakeTargetHooks;
using ::kvwire::testing::FakeTargetHooksOptions;
using ::kvwire::testing::MakeRegion;
using ::kvwire::testing::ReadAll;
using ::kvwire::testing::ReadString;
using ::kvwire::testing::ReapAndJudge;
using ::kvwire::testing::WaitReady;
using ::kvwire::testing::WriteAll;
using ::kvwire::testing::WriteString;
using ::testing::HasSubstr;

constexpr PeerId kPeer = 7;
constexpr char kToken[] = "session-token-of-peer-7";
// A second, legitimate peer, still served after peer 7 is dropped.
constexpr PeerId kLegitPeer = 8;
constexpr char kLegitToken[] = "session-token-of-peer-8";
constexpr uid_t kTargetUid = 65534;  // nobody: the target and a same-uid attacker
constexpr uid_t kOtherUid = 65533;   // an attacker under another uid

// --- plumbing ------------------------------------------------------------------------------

absl::Time Soon() { return absl::Now() + absl::Seconds(30); }

size_t Page() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// In a forked child running as root: become an ordinary process of `uid` (no capabilities),
// still dumpable (a credential change clears that, and an ordinary process has it set).
bool BecomeUser(uid_t uid) {
  if (geteuid() != 0) return true;  // already unprivileged: stay the same uid
  if (setgroups(0, nullptr) != 0 || setresgid(uid, uid, uid) != 0 ||
      setresuid(uid, uid, uid) != 0) {
    return false;
  }
  return prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) == 0;
}

// The engine's side of the target: both peers' tokens; where they "handshook" from is set
// once known (0: not published yet, so not served).
FakeTargetHooksOptions BothPeers() {
  FakeTargetHooksOptions options;
  options.tokens = {{kToken, kPeer}, {kLegitToken, kLegitPeer}};
  return options;
}

// --- the target process --------------------------------------------------------------------

// Regions of the target (index = id - 1):
//   1 kSubRange: page 1 of a 4-page buffer, read-only; the other pages hold a secret ('S').
//   2 kWholeRw:  a whole 4-page buffer, read-write.
//   3 kHeap:     heap memory, read-write (cross-memory attach only).
//   4 kWholeRo:  a whole 4-page buffer, read-only.
enum RegionIndex : uint32_t { kSubRange = 0, kWholeRw = 1, kHeap = 2, kWholeRo = 3 };
constexpr char kSecret = 'S';
constexpr char kHeapByte = 'H';
constexpr char kReadOnlyByte = 'O';
constexpr char kSubRangeByte = 'R';

struct TargetConfig {
  bool drop_privileges = true;  // run as kTargetUid when the test runs as root
  bool allow_cma = false;
  bool deny_ptrace = false;
};

enum Command : uint32_t {
  kExit = 0,
  kDump = 1,
  kRevoke = 2,      // everything the engine does when it revokes: unexport, deregister, drop
  kUnexport = 5,    // Engine::Unexport of the region from the hostile peer only
  kDeregister = 6,  // Engine::DeregisterMemory
  kDropPeer = 7,    // the hostile peer's close
  kFill = 8,        // the owner writes kOwnerByte over the region
  kMoveMany = 9,    // the owner's buffer is moved onto a fresh memfd 20 times
};
constexpr char kOwnerByte = 'F';
struct CommandMessage {
  Command command;
  uint32_t region;
};

struct TargetInfo {
  std::string endpoint;
  pid_t pid = -1;
  std::vector<RemoteRegionDesc> descs;
  int whole_ro_memfd = -1;  // the target's descriptor number of kWholeRo's memfd
};

[[noreturn]] void RunTarget(int control, const TargetConfig& config) {
  const pid_t test_process = getppid();
  if (config.drop_privileges && !BecomeUser(kTargetUid)) _exit(9);
  FakeTargetHooks hooks(BothPeers());
  // The peers handshook from the test process; their tokens are bound to it.
  hooks.set_peer_pid(static_cast<uint32_t>(test_process));
  ShmTransportOptions options;
  options.engine_name = "hostile-target";
  options.allow_cma = config.allow_cma;
  options.deny_ptrace = config.deny_ptrace;
  // The default: RevocationTest.PeerClose proves the move (the target drops root first where
  // the test runs as root, so its write guard is a user-mode-only userfaultfd then).
  options.request_timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<Transport>> transport = CreateShmTransport(options, &hooks);
  if (!transport.ok()) _exit(10);
  const size_t page = Page();
  absl::StatusOr<ShareableBuffer> big = ShareableBuffer::Create(4 * page, "hostile-big");
  absl::StatusOr<ShareableBuffer> rw = ShareableBuffer::Create(4 * page, "hostile-rw");
  absl::StatusOr<ShareableBuffer> ro = ShareableBuffer::Create(4 * page, "hostile-ro");
  if (!big.ok() || !rw.ok() || !ro.ok()) _exit(11);
  std::memset(big->data(), kSecret, big->size());
  std::memset(big->data() + page, kSubRangeByte, page);
  std::mt19937_64 rng(5);
  for (size_t i = 0; i < rw->size(); ++i) rw->data()[i] = static_cast<std::byte>(rng());
  std::memset(ro->data(), kReadOnlyByte, ro->size());
  std::vector<std::byte> heap(16 * page, std::byte{kHeapByte});
  std::vector<LocalRegion> regions = {MakeRegion(1, big->data() + page, page, kRemoteRead),
                                      MakeRegion(2, rw->data(), rw->size(), kRemoteReadWrite),
                                      MakeRegion(3, heap.data(), heap.size(), kRemoteReadWrite),
                                      MakeRegion(4, ro->data(), ro->size(), kRemoteRead)};
  std::string descs;
  for (const LocalRegion& region : regions) {
    if (absl::Status s = (*transport)->RegisterRegion(region); !s.ok()) {
      std::fprintf(stderr, "target: RegisterRegion %d: %s\n", static_cast<int>(region.id),
                   s.ToString().c_str());
      _exit(12);
    }
    hooks.AddRegion(region, /*exported=*/true);
    const RemoteRegionDesc desc = Describe(region);
    descs.append(reinterpret_cast<const char*>(&desc), sizeof(desc));
  }
  if (!WriteString(control, (*transport)->Endpoint(), Soon()) ||
      !WriteString(control, descs, Soon()) ||
      !WriteString(control, absl::StrCat(ro->fd()), Soon())) {
    _exit(13);
  }
  while (true) {
    CommandMessage message;
    if (!ReadAll(control, &message, sizeof(message), absl::Now() + absl::Seconds(120))) _exit(14);
    if (message.command == kExit) break;
    if (message.region >= regions.size()) _exit(15);
    const LocalRegion& region = regions[message.region];
    std::string reply = "ok";
    if (message.command == kDump) {
      reply.assign(reinterpret_cast<const char*>(region.base), region.length);
    } else if (message.command == kRevoke) {
      // What the engine does when it revokes: the region is no longer exported, the transport
      // forgets it, and the peer is dropped.
      hooks.SetExported(region.id, false);
      (*transport)->DeregisterRegion(region.id);
      (*transport)->DropPeer(kPeer);
    } else if (message.command == kUnexport) {
      hooks.SetExportedTo(region.id, kPeer, false);
      (*transport)->RevokeExport(kPeer, region.id);
    } else if (message.command == kDeregister) {
      hooks.SetExported(region.id, false);
      (*transport)->DeregisterRegion(region.id);
    } else if (message.command == kDropPeer) {
      // The move runs on the transport's own thread: answered once it is done (or failed).
      const uint64_t before = shm::RebackCount();
      (*transport)->DropPeer(kPeer);
      const absl::Time deadline = absl::Now() + absl::Seconds(20);
      while (shm::RebackCount() == before && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      if (shm::RebackCount() == before) reply = "the peer's close moved nothing within 20 s";
    } else if (message.command == kFill) {
      std::memset(region.base, kOwnerByte, region.length);
    } else if (message.command == kMoveMany) {
      const uint64_t before = shm::RebackCount();
      for (int i = 0; i < 20; ++i) {
        if (absl::Status moved = shm::RebackShareable(region.base); !moved.ok()) {
          reply = moved.ToString();
        }
      }
      if (reply == "ok" && shm::RebackCount() - before != 20) reply = "not moved 20 times";
    }
    if (!WriteString(control, reply, Soon())) _exit(19);
  }
  (*transport)->Shutdown();
  _exit(0);
}

// Starts a target process before this process has threads of its own.
class Target {
 public:
  ~Target() { Stop(); }

  ::testing::AssertionResult Start(const TargetConfig& config) {
    int fds[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
      return ::testing::AssertionFailure() << "socketpair: " << strerror(errno);
    }
    pid_ = fork();
    if (pid_ < 0) return ::testing::AssertionFailure() << "fork: " << strerror(errno);
    if (pid_ == 0) {
      close(fds[0]);
      RunTarget(fds[1], config);
    }
    close(fds[1]);
    control_ = fds[0];
    std::string descs, memfd;
    if (!ReadString(control_, &info_.endpoint, Soon()) || !ReadString(control_, &descs, Soon()) ||
        !ReadString(control_, &memfd, Soon())) {
      return ::testing::AssertionFailure() << "the target process did not start";
    }
    info_.pid = pid_;
    info_.descs.resize(descs.size() / sizeof(RemoteRegionDesc));
    std::memcpy(info_.descs.data(), descs.data(), descs.size());
    info_.whole_ro_memfd = std::stoi(memfd);
    return ::testing::AssertionSuccess();
  }

  std::string Call(Command command, uint32_t region) {
    CommandMessage message{command, region};
    std::string reply;
    EXPECT_TRUE(WriteAll(control_, &message, sizeof(message), Soon()));
    EXPECT_TRUE(ReadString(control_, &reply, Soon()))
        << "target did not answer command " << command;
    return reply;
  }

  void Stop() {
    if (pid_ <= 0) return;
    CommandMessage exit_message{kExit, 0};
    (void)WriteAll(control_, &exit_message, sizeof(exit_message), Soon());
    close(control_);
    int status = 0;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        ADD_FAILURE() << "the target process did not exit";
        break;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "target status " << status;
    pid_ = -1;
  }

  const TargetInfo& info() const { return info_; }

 private:
  pid_t pid_ = -1;
  int control_ = -1;
  TargetInfo info_;
};

// A peer speaking the fd protocol directly, as a hostile process would (no ShmChannel checks).
struct RawPeer {
  shm::UniqueFd socket;

  absl::Status Connect(const std::string& endpoint_text) {
    absl::StatusOr<shm::ShmEndpoint> endpoint = shm::ParseEndpoint(endpoint_text);
    if (!endpoint.ok()) return endpoint.status();
    absl::StatusOr<shm::UniqueFd> connected = shm::ConnectSeqpacket(endpoint->socket_name, Soon());
    if (!connected.ok()) return connected.status();
    socket = *std::move(connected);
    return absl::OkStatus();
  }

  absl::StatusOr<shm::FdResponse> Fetch(RegionId region) {
    shm::FdRequest request;
    request.kind = shm::FdRequestKind::kFetch;
    request.region = region;
    request.token = kToken;
    absl::StatusOr<shm::FdResponse> response = shm::CallFdServer(socket.get(), request, Soon());
    if (!response.ok()) return response.status();
    if (response->reply.code != absl::StatusCode::kOk) {
      return absl::Status(response->reply.code, response->reply.message);
    }
    return response;
  }
};

std::string Errno(int err) { return absl::StrCat(strerrorname_np(err), " (", strerror(err), ")"); }

// Every way a holder of `fd` might change the file's bytes. Returns what worked ("" if none).
std::string TryToWrite(int fd, size_t length) {
  std::string worked;
  const char byte = 'W';
  if (pwrite(fd, &byte, 1, 0) == 1) absl::StrAppend(&worked, " pwrite");
  void* map = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map != MAP_FAILED) {
    absl::StrAppend(&worked, " mmap(PROT_WRITE,MAP_SHARED)");
    static_cast<char*>(map)[1] = byte;
    munmap(map, length);
  }
  map = mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, 0);
  if (map != MAP_FAILED) {
    if (mprotect(map, length, PROT_READ | PROT_WRITE) == 0) {
      absl::StrAppend(&worked, " mprotect(PROT_WRITE)");
      static_cast<char*>(map)[2] = byte;
    }
    munmap(map, length);
  }
  if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(length)) ==
      0) {
    absl::StrAppend(&worked, " fallocate(PUNCH_HOLE)");
  }
  return worked;
}

// Legitimate use through the real initiator: WRITE then READ back `desc` byte-exact, or READ
// only for a read-only region (compared with `expected`).
void LegitimatePeerMovesExactBytes(Transport& initiator, const TargetInfo& info,
                                   const RemoteRegionDesc& desc, const std::string& expected_ro) {
  PeerLink link;
  link.peer = 1;
  link.peer_name = "target";
  link.remote_endpoint = info.endpoint;
  link.token = kLegitToken;
  link.remote_pid = static_cast<uint32_t>(info.pid);
  link.deadline = Soon();
  absl::StatusOr<std::unique_ptr<Channel>> channel = initiator.Connect(link);
  ASSERT_TRUE(channel.ok()) << channel.status();
  ASSERT_TRUE((*channel)->AddRemoteRegions({desc}).ok());
  std::vector<std::byte> local(desc.length);
  auto post = [&](OpKind kind) {
    PostRequest request;
    request.transfer_id = 1;
    request.kind = kind;
    request.ops.push_back(WireOp{local.data(), desc.id, 0, desc.length});
    absl::Status result = absl::InternalError("done not called");
    (*channel)->Post(std::move(request), [&](absl::Status s) { result = std::move(s); });
    return result;
  };
  if ((desc.access & kRemoteWrite) != 0) {
    std::mt19937_64 rng(desc.id * 31);
    for (std::byte& b : local) b = static_cast<std::byte>(rng());
    const std::vector<std::byte> written = local;
    ASSERT_TRUE(post(OpKind::kWrite).ok());
    std::fill(local.begin(), local.end(), std::byte{0});
    ASSERT_TRUE(post(OpKind::kRead).ok());
    EXPECT_TRUE(local == written) << "region " << desc.id << " did not read back exactly";
  } else {
    ASSERT_TRUE(post(OpKind::kRead).ok());
    ASSERT_EQ(expected_ro.size(), local.size());
    EXPECT_EQ(std::memcmp(local.data(), expected_ro.data(), local.size()), 0)
        << "region " << desc.id << " read differs";
  }
  (*channel)->Close(absl::CancelledError("test over"));
}

std::unique_ptr<Transport> MakeInitiator(bool allow_cma) {
  static FakeTargetHooks hooks(BothPeers());
  ShmTransportOptions options;
  options.engine_name = "legit-initiator";
  options.allow_cma = allow_cma;
  options.request_timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<Transport>> transport = CreateShmTransport(options, &hooks);
  EXPECT_TRUE(transport.ok()) << transport.status();
  return transport.ok() ? *std::move(transport) : nullptr;
}

// --- (a) a sub-range export --------------------------------------------------------------

TEST(HostileShmTest, SubRangeExportHandsOutNoByteBeyondTheRange) {
  Target target;
  ASSERT_TRUE(target.Start(TargetConfig{}));
  const RemoteRegionDesc& sub = target.info().descs[kSubRange];
  RawPeer peer;
  ASSERT_TRUE(peer.Connect(target.info().endpoint).ok());
  absl::StatusOr<shm::FdResponse> fetched = peer.Fetch(sub.id);
  if (fetched.ok()) {
    // Whatever descriptor came, it must hold the region's bytes and nothing else.
    struct stat info;
    ASSERT_EQ(fstat(fetched->fd.get(), &info), 0);
    std::string all(static_cast<size_t>(info.st_size), '\0');
    ASSERT_EQ(pread(fetched->fd.get(), all.data(), all.size(), 0),
              static_cast<ssize_t>(all.size()));
    const size_t secret = static_cast<size_t>(std::count(all.begin(), all.end(), kSecret));
    std::printf(
        "attack (a): got a %lld-byte memfd for a %llu-byte region at offset %llu; %zu "
        "secret bytes outside the region were readable\n",
        static_cast<long long>(info.st_size), static_cast<unsigned long long>(sub.length),
        static_cast<unsigned long long>(fetched->reply.memfd_offset), secret);
    EXPECT_EQ(secret, 0u) << "bytes outside the exported range reached the peer";
    EXPECT_EQ(static_cast<uint64_t>(info.st_size), sub.length);
    EXPECT_EQ(fetched->reply.memfd_offset, 0u);
  } else {
    std::printf("attack (a): sub-range fetch refused: %s\n", fetched.status().ToString().c_str());
    EXPECT_EQ(fetched.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(fetched.status().message(), HasSubstr("part of"));
  }
  // The target still serves a legitimate peer byte-exact.
  std::unique_ptr<Transport> initiator = MakeInitiator(false);
  ASSERT_NE(initiator, nullptr);
  LegitimatePeerMovesExactBytes(*initiator, target.info(), target.info().descs[kWholeRw], "");
  LegitimatePeerMovesExactBytes(*initiator, target.info(), target.info().descs[kWholeRo],
                                std::string(4 * Page(), kReadOnlyByte));
  initiator->Shutdown();
}

// --- (b), (c) write access to a read-only export ------------------------------------------

TEST(HostileShmTest, ReadOnlyExportCannotBeWrittenEvenThroughProc) {
  Target target;
  ASSERT_TRUE(target.Start(TargetConfig{}));
  const RemoteRegionDesc& ro = target.info().descs[kWholeRo];
  RawPeer peer;
  ASSERT_TRUE(peer.Connect(target.info().endpoint).ok());
  absl::StatusOr<shm::FdResponse> fetched = peer.Fetch(ro.id);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  const int fd = fetched->fd.get();
  // (a) on a whole-buffer export: the file is the region and nothing else.
  struct stat info;
  ASSERT_EQ(fstat(fd, &info), 0);
  EXPECT_EQ(static_cast<uint64_t>(info.st_size), ro.length);
  EXPECT_EQ(fetched->reply.memfd_offset, 0u);
  char beyond = 0;
  EXPECT_EQ(pread(fd, &beyond, 1, static_cast<off_t>(ro.length)), 0) << "bytes past the region";
  // (b) on the descriptor as received.
  const std::string direct = TryToWrite(fd, ro.length);
  std::printf("attack (b): writes through the received descriptor that worked:%s\n",
              direct.empty() ? " none" : direct.c_str());
  EXPECT_EQ(direct, "");
  // (c) reopen it read-write through /proc (the open itself may succeed: it is what it allows
  // afterwards that counts).
  const std::string path = absl::StrCat("/proc/self/fd/", fd);
  shm::UniqueFd reopened(open(path.c_str(), O_RDWR | O_CLOEXEC));
  const int open_errno = errno;
  std::string via_proc;
  if (reopened.valid()) {
    via_proc = TryToWrite(reopened.get(), ro.length);
    if (fcntl(reopened.get(), F_ADD_SEALS, F_SEAL_WRITE) == 0) {
      absl::StrAppend(&via_proc, " F_ADD_SEALS");
    }
  }
  std::printf("attack (c): open(%s, O_RDWR): %s; writes that worked:%s\n", path.c_str(),
              reopened.valid() ? "opened" : Errno(open_errno).c_str(),
              via_proc.empty() ? " none" : via_proc.c_str());
  EXPECT_EQ(via_proc, "");
  // The target's bytes are untouched, and it still serves a legitimate peer.
  const std::string after = target.Call(kDump, kWholeRo);
  EXPECT_EQ(std::count(after.begin(), after.end(), kReadOnlyByte),
            static_cast<ptrdiff_t>(ro.length))
      << "the read-only region changed";
  std::unique_ptr<Transport> initiator = MakeInitiator(false);
  ASSERT_NE(initiator, nullptr);
  LegitimatePeerMovesExactBytes(*initiator, target.info(), ro,
                                std::string(ro.length, kReadOnlyByte));
  LegitimatePeerMovesExactBytes(*initiator, target.info(), target.info().descs[kWholeRw], "");
  initiator->Shutdown();
}

// --- a leaked session token -----------------------------------------------------------------

// Another process that learned the token (it travels on the control connection) presents it
// on the target's shm socket: refused, because the socket's SO_PEERCRED pid is not the pid the
// peer handshook from.
TEST(HostileShmTest, SessionTokenServesOnlyTheProcessThatHandshook) {
  Target target;
  ASSERT_TRUE(target.Start(TargetConfig{}));
  const RemoteRegionDesc rw = target.info().descs[kWholeRw];
  int fds[2];
  ASSERT_EQ(pipe2(fds, O_CLOEXEC), 0);
  const pid_t thief = fork();
  ASSERT_GE(thief, 0);
  if (thief == 0) {
    close(fds[0]);
    RawPeer peer;
    std::string result;
    if (absl::Status connected = peer.Connect(target.info().endpoint); !connected.ok()) {
      result = connected.ToString();
    } else {
      absl::StatusOr<shm::FdResponse> fetched = peer.Fetch(rw.id);
      result = fetched.ok() ? "fetched the memfd" : fetched.status().ToString();
    }
    (void)!write(fds[1], result.data(), result.size());
    _exit(0);
  }
  close(fds[1]);
  std::string result;
  char buffer[1024];
  while (WaitReady(fds[0], POLLIN, Soon())) {
    const ssize_t n = read(fds[0], buffer, sizeof(buffer));
    if (n <= 0) break;
    result.append(buffer, static_cast<size_t>(n));
  }
  close(fds[0]);
  // The thief's end is part of the test (a sanitizer report in it exits non-zero).
  EXPECT_EQ(ReapAndJudge(thief, absl::Seconds(30)), "") << "the thief process";
  std::printf("attack (token): another process presenting the token: %s\n", result.c_str());
  EXPECT_THAT(result, HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(result, HasSubstr(absl::StrCat("handshook from pid ", getpid())));
  // The process that handshook is still served.
  RawPeer peer;
  ASSERT_TRUE(peer.Connect(target.info().endpoint).ok());
  EXPECT_TRUE(peer.Fetch(rw.id).ok());
  std::unique_ptr<Transport> initiator = MakeInitiator(false);
  ASSERT_NE(initiator, nullptr);
  LegitimatePeerMovesExactBytes(*initiator, target.info(), rw, "");
  initiator->Shutdown();
}

// Posts one op and returns its status.
absl::Status PostOne(Channel& channel, OpKind kind, RegionId region, std::byte* local,
                     uint64_t length) {
  PostRequest request;
  request.transfer_id = 9;
  request.kind = kind;
  request.ops.push_back(WireOp{local, region, 0, length});
  absl::Status result = absl::InternalError("done not called");
  channel.Post(std::move(request), [&](absl::Status s) { result = std::move(s); });
  return result;
}

PeerLink LinkTo(const std::string& endpoint, pid_t pid, const char* token = kLegitToken) {
  PeerLink link;
  link.peer = 1;
  link.peer_name = "target";
  link.remote_endpoint = endpoint;
  link.token = token;
  link.remote_pid = static_cast<uint32_t>(pid);
  link.deadline = Soon();
  return link;
}

// --- (d) revocation ----------------------------------------------------------------------

// Linux cannot take a mapping (or descriptor) of a memfd back from the process that holds it,
// so revocation moves the owner instead: the buffer's bytes go into a fresh memfd mapped over
// the owner's range (shareable_registry.h). The peer's kept mapping then reaches an orphaned
// copy: none of the owner's later writes, and its own writes never reach the owner. A
// legitimate peer's existing mapping follows the move (epoch table) and keeps moving exact
// bytes. Each revocation path: Unexport, DeregisterMemory, the peer's close.
class RevocationTest : public ::testing::TestWithParam<Command> {};

std::vector<std::byte> Pattern(size_t length, uint64_t seed) {
  std::vector<std::byte> bytes(length);
  std::mt19937_64 rng(seed);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
  return bytes;
}

bool SameBytes(const std::string& dump, const std::vector<std::byte>& expected) {
  return dump.size() == expected.size() &&
         std::memcmp(dump.data(), expected.data(), dump.size()) == 0;
}

TEST_P(RevocationTest, AKeptMappingReachesNothingOfTheOwnerAndALegitimatePeerFollows) {
  const Command revoke = GetParam();
  if (absl::Status guard = shm::WriteGuardAvailable(); revoke == kDropPeer && !guard.ok()) {
    // A close moves only under the write guard; without it the transport keeps today's
    // fallback, which ShmMoveEngineTest/PeerCloseTest.*/GuardUnavailable checks.
    GTEST_SKIP() << "the write guard is not available here: " << guard.message();
  }
  Target target;
  ASSERT_TRUE(target.Start(TargetConfig{}));
  const RemoteRegionDesc rw = target.info().descs[kWholeRw];

  // The legitimate peer maps the region first and moves bytes through its mapping.
  std::unique_ptr<Transport> initiator = MakeInitiator(false);
  ASSERT_NE(initiator, nullptr);
  absl::StatusOr<std::unique_ptr<Channel>> legit =
      initiator->Connect(LinkTo(target.info().endpoint, target.info().pid, kLegitToken));
  ASSERT_TRUE(legit.ok()) << legit.status();
  ASSERT_TRUE((*legit)->AddRemoteRegions({rw, target.info().descs[kWholeRo]}).ok());
  std::vector<std::byte> first = Pattern(rw.length, 1);
  ASSERT_TRUE(PostOne(**legit, OpKind::kWrite, rw.id, first.data(), rw.length).ok());
  ASSERT_TRUE(SameBytes(target.Call(kDump, kWholeRw), first));

  // The hostile peer maps it too, and keeps the mapping.
  RawPeer peer;
  ASSERT_TRUE(peer.Connect(target.info().endpoint).ok());
  absl::StatusOr<shm::FdResponse> fetched = peer.Fetch(rw.id);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  auto* map = static_cast<char*>(
      mmap(nullptr, rw.length, PROT_READ | PROT_WRITE, MAP_SHARED, fetched->fd.get(), 0));
  ASSERT_NE(map, MAP_FAILED) << Errno(errno);
  fetched->fd.Reset();  // a hostile peer may keep either; the mapping is the stronger hold

  ASSERT_EQ(target.Call(revoke, kWholeRw), "ok");
  // New requests are refused, on the old connection and on a new one.
  EXPECT_FALSE(peer.Fetch(rw.id).ok());
  RawPeer again;
  ASSERT_TRUE(again.Connect(target.info().endpoint).ok());
  absl::StatusOr<shm::FdResponse> refetched = again.Fetch(rw.id);
  std::printf("attack (d): fetch after revocation: %s\n", refetched.status().ToString().c_str());
  EXPECT_FALSE(refetched.ok());

  // The owner kept its bytes; the kept mapping's writes do not reach them.
  std::memset(map, 'X', rw.length);
  const std::string kept = target.Call(kDump, kWholeRw);
  size_t reached = 0;
  for (size_t i = 0; i < kept.size() && i < first.size(); ++i) {
    reached += kept[i] != static_cast<char>(first[i]) ? 1 : 0;
  }
  std::printf("attack (d): a kept mapping wrote all %llu bytes; %zu of the owner's changed\n",
              static_cast<unsigned long long>(rw.length), reached);
  EXPECT_TRUE(SameBytes(kept, first)) << "the owner's bytes changed: " << reached;
  // The owner's later writes do not reach the kept mapping.
  ASSERT_EQ(target.Call(kFill, kWholeRw), "ok");
  const std::string owner = target.Call(kDump, kWholeRw);
  EXPECT_EQ(std::count(owner.begin(), owner.end(), kOwnerByte), static_cast<ptrdiff_t>(rw.length));
  EXPECT_EQ(std::count(map, map + rw.length, kOwnerByte), 0)
      << "the owner's write after revocation reached the kept mapping";
  munmap(map, rw.length);

  // The legitimate peer, through the mapping it made before the move.
  std::vector<std::byte> second = Pattern(rw.length, 2);
  const absl::Status wrote = PostOne(**legit, OpKind::kWrite, rw.id, second.data(), rw.length);
  if (revoke == kDeregister || revoke == kRevoke) {
    // Not exported to anyone any more: its copy fails rather than land in the old memfd.
    std::printf("legitimate peer after DeregisterMemory: %s\n", wrote.ToString().c_str());
    EXPECT_FALSE(wrote.ok());
    const std::string after = target.Call(kDump, kWholeRw);
    EXPECT_EQ(std::count(after.begin(), after.end(), kOwnerByte),
              static_cast<ptrdiff_t>(rw.length));
  } else {
    ASSERT_TRUE(wrote.ok()) << wrote;
    EXPECT_TRUE(SameBytes(target.Call(kDump, kWholeRw), second))
        << "the legitimate peer's WRITE did not reach the owner's memory";
    ASSERT_EQ(target.Call(kFill, kWholeRw), "ok");
    std::vector<std::byte> read(rw.length);
    ASSERT_TRUE(PostOne(**legit, OpKind::kRead, rw.id, read.data(), rw.length).ok());
    EXPECT_EQ(std::count(read.begin(), read.end(), std::byte{kOwnerByte}),
              static_cast<ptrdiff_t>(rw.length))
        << "the legitimate peer's READ did not see the owner's write";
  }
  // Another region the peer holds is untouched by all of it.
  std::vector<std::byte> ro(rw.length);
  ASSERT_TRUE(
      PostOne(**legit, OpKind::kRead, target.info().descs[kWholeRo].id, ro.data(), ro.size()).ok());
  EXPECT_EQ(std::count(ro.begin(), ro.end(), std::byte{kReadOnlyByte}),
            static_cast<ptrdiff_t>(ro.size()));
  (*legit)->Close(absl::CancelledError("test over"));
  initiator->Shutdown();
}

INSTANTIATE_TEST_SUITE_P(HostileShmTest, RevocationTest,
                         ::testing::Values(kUnexport, kDeregister, kDropPeer, kRevoke),
                         [](const ::testing::TestParamInfo<Command>& info) {
                           switch (info.param) {
                             case kUnexport:
                               return std::string("Unexport");
                             case kDeregister:
                               return std::string("DeregisterMemory");
                             case kDropPeer:
                               return std::string("PeerClose");
                             default:
                               return std::string("All");
                           }
                         });

// On by default: a close moves the buffer at a moment the application does not choose, and the
// write guard holds the application's own writes into it off meanwhile (write_guard_test.cc,
// ShmMoveEngineTest.WritesDuringMovesTest); where the guard is unavailable the transport turns
// it off (ShmMoveEngineTest.PeerCloseTest/GuardUnavailable).
TEST(HostileShmTest, RevocationAtAPeersCloseIsTheDefault) {
  EXPECT_TRUE(ShmTransportOptions().revoke_on_peer_close);
  EXPECT_TRUE(::kvwire::ShmOptions().revoke_on_close);
}

// A legitimate peer copying while the owner moves the buffer again and again: every copy that
// reported success is in the owner's memory (WRITE) or came from it (READ), byte for byte.
TEST(HostileShmTest, CopiesDuringMovesLandInTheOwnersMemory) {
  Target target;
  ASSERT_TRUE(target.Start(TargetConfig{}));
  const RemoteRegionDesc rw = target.info().descs[kWholeRw];
  std::unique_ptr<Transport> initiator = MakeInitiator(false);
  ASSERT_NE(initiator, nullptr);
  absl::StatusOr<std::unique_ptr<Channel>> legit =
      initiator->Connect(LinkTo(target.info().endpoint, target.info().pid, kLegitToken));
  ASSERT_TRUE(legit.ok()) << legit.status();
  ASSERT_TRUE((*legit)->AddRemoteRegions({rw}).ok());
  // One writer per page, each writing its page's next pattern and reading it back.
  const size_t pages = rw.length / Page();
  std::vector<std::vector<std::byte>> last(pages);
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::atomic<int> copies{0};
  // Copies that started after the first move began and ended before the last one ended: the
  // moves run in another process and take milliseconds, so on a loaded machine the writers
  // may not run at all while a fixed number of moves happens. The owner moves on until they
  // have (it was 100 moves and `copies > 0` before, which a loaded machine could miss).
  std::atomic<bool> moving{false};
  std::atomic<int> during{0};
  std::vector<std::thread> writers;
  for (size_t p = 0; p < pages; ++p) {
    writers.emplace_back([&, p] {
      for (uint64_t round = 0; !stop.load(); ++round) {
        const bool started_moving = moving.load();
        std::vector<std::byte> bytes = Pattern(Page(), p * 1000003 + round);
        PostRequest request;
        request.kind = OpKind::kWrite;
        request.ops.push_back(WireOp{bytes.data(), rw.id, p * Page(), Page()});
        absl::Status status = absl::InternalError("done not called");
        (*legit)->Post(std::move(request), [&](absl::Status s) { status = std::move(s); });
        if (!status.ok()) {
          ++failures;
          continue;
        }
        last[p] = bytes;
        std::vector<std::byte> back(Page());
        PostRequest read;
        read.kind = OpKind::kRead;
        read.ops.push_back(WireOp{back.data(), rw.id, p * Page(), Page()});
        (*legit)->Post(std::move(read), [&](absl::Status s) { status = std::move(s); });
        if (!status.ok() || back != bytes) ++failures;
        ++copies;
        if (started_moving && moving.load()) ++during;
      }
    });
  }
  // Every writer running first, then at least 100 moves and enough copies among them.
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (copies.load() < static_cast<int>(pages) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  const int kWanted = 8 * static_cast<int>(pages);
  int moves = 0;
  moving = true;
  while ((moves < 100 || during.load() < kWanted) && absl::Now() < deadline) {
    ASSERT_EQ(target.Call(kMoveMany, kWholeRw), "ok");
    moves += 20;
  }
  moving = false;
  stop = true;
  for (std::thread& t : writers) t.join();
  std::printf("copies during %d moves: %d (%d in all), failed or read back wrong: %d\n", moves,
              during.load(), copies.load(), failures.load());
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GE(moves, 100);
  EXPECT_GE(during.load(), kWanted) << "the writers hardly ran while the buffer was moved";
  const std::string owner = target.Call(kDump, kWholeRw);
  for (size_t p = 0; p < pages; ++p) {
    if (last[p].empty()) continue;
    EXPECT_EQ(std::memcmp(owner.data() + p * Page(), last[p].data(), Page()), 0)
        << "page " << p << ": the last successful WRITE is not in the owner's memory";
  }
  (*legit)->Close(absl::CancelledError("test over"));
  initiator->Shutdown();
}

// --- (e) cross-memory attach -----------------------------------------------------------------

// Empty when this kernel lets a process use process_vm_readv at all (on itself), else why not.
std::string CmaUnavailable() {
  uint64_t word = 42, copy = 0;
  iovec local{&copy, sizeof(copy)};
  iovec remote{&word, sizeof(word)};
  if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == sizeof(copy)) return "";
  return absl::StrCat("process_vm_readv on this process itself: ", Errno(errno));
}

std::string Dump(Target& target, RegionIndex index) { return target.Call(kDump, index); }

ptrdiff_t CountOf(const std::string& bytes, char c) {
  return std::count(bytes.begin(), bytes.end(), c);
}

TEST(HostileShmTest, CmaIsOffByDefaultAndNeverUsedOnATargetThatDidNotOptIn) {
  EXPECT_FALSE(ShmTransportOptions().allow_cma) << "cross-memory attach must be opt-in";
  Target target;
  ASSERT_TRUE(target.Start(TargetConfig{.drop_privileges = false}));  // default options
  // An initiator that wants CMA, against a target that did not opt in.
  std::unique_ptr<Transport> initiator = MakeInitiator(true);
  ASSERT_NE(initiator, nullptr);
  absl::StatusOr<std::unique_ptr<Channel>> channel =
      initiator->Connect(LinkTo(target.info().endpoint, target.info().pid));
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::printf("attack (e): data path to a target with default options: %s\n",
              (*channel)->Describe().c_str());
  const RemoteRegionDesc heap = target.info().descs[kHeap];
  const absl::Status added = (*channel)->AddRemoteRegions({heap});
  std::printf("attack (e): heap region over shm: %s\n", added.ToString().c_str());
  std::vector<std::byte> local(heap.length, std::byte{'Z'});
  if (added.ok()) (void)PostOne(**channel, OpKind::kWrite, heap.id, local.data(), heap.length);
  EXPECT_EQ(added.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(added.message(), HasSubstr("does not offer it"));
  EXPECT_EQ(CountOf(Dump(target, kHeap), kHeapByte), static_cast<ptrdiff_t>(heap.length))
      << "the initiator wrote the target's heap by cross-memory attach";
  (*channel)->Close(absl::CancelledError("test over"));
  // Whole buffers still move over shm.
  LegitimatePeerMovesExactBytes(*initiator, target.info(), target.info().descs[kWholeRw], "");
  initiator->Shutdown();
}

// A hostile peer advertises another process's pid and probe word (both are public in that
// process's Hello) behind its own socket, so that an initiator with CMA on would write into the
// victim. The initiator checks the socket's SO_PEERCRED pid against the claim.
TEST(HostileShmTest, CmaRefusedWhenTheSocketIsNotTheClaimedProcess) {
  if (const std::string why = CmaUnavailable(); !why.empty()) {
    GTEST_SKIP() << "the kernel refuses cross-memory attach entirely: " << why;
  }
  Target victim;
  // Same uid as this process, CMA offered: the case where an initiator could attach.
  ASSERT_TRUE(victim.Start(TargetConfig{.drop_privileges = false, .allow_cma = true}));
  absl::StatusOr<shm::ShmEndpoint> forged = shm::ParseEndpoint(victim.info().endpoint);
  ASSERT_TRUE(forged.ok());
  forged->socket_name = absl::StrCat("kvwire-hostile-decoy.", getpid());
  absl::StatusOr<shm::UniqueFd> listener = shm::ListenSeqpacket(forged->socket_name, 4);
  ASSERT_TRUE(listener.ok()) << listener.status();
  // The decoy answers the session check like a real fd server, then holds the connection.
  std::atomic<bool> stop{false};
  std::thread decoy([&] {
    shm::UniqueFd connection;
    const absl::Time deadline = Soon();
    while (!stop.load() && absl::Now() < deadline) {
      if (!connection.valid()) {
        absl::StatusOr<shm::UniqueFd> accepted = shm::AcceptSeqpacket(listener->get());
        if (accepted.ok()) connection = *std::move(accepted);
      }
      if (connection.valid()) {
        absl::StatusOr<shm::ReceivedMessage> message = shm::ReceiveMessage(
            connection.get(), shm::kMaxFdMessageBytes, absl::Now() + absl::Milliseconds(10));
        if (message.ok() && !message->eof) {
          absl::StatusOr<shm::FdRequest> request = shm::DecodeRequest(message->bytes);
          shm::FdReply reply;
          reply.region = request.ok() ? request->region : 0;
          (void)shm::SendMessage(connection.get(), shm::EncodeReply(reply), -1, Soon());
        }
      } else {
        absl::SleepFor(absl::Milliseconds(2));
      }
    }
  });
  std::unique_ptr<Transport> initiator = MakeInitiator(true);
  ASSERT_NE(initiator, nullptr);
  absl::StatusOr<std::unique_ptr<Channel>> channel =
      initiator->Connect(LinkTo(shm::EncodeEndpoint(*forged), victim.info().pid));
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::printf("attack (e): data path to the decoy claiming pid %d: %s\n", victim.info().pid,
              (*channel)->Describe().c_str());
  const RemoteRegionDesc heap = victim.info().descs[kHeap];  // the victim's heap address
  const absl::Status added = (*channel)->AddRemoteRegions({heap});
  std::vector<std::byte> local(heap.length, std::byte{'Z'});
  if (added.ok()) {
    std::printf(
        "attack (e): write through the decoy: %s\n",
        PostOne(**channel, OpKind::kWrite, heap.id, local.data(), heap.length).ToString().c_str());
  }
  (*channel)->Close(absl::CancelledError("test over"));
  stop = true;
  decoy.join();
  EXPECT_EQ(added.code(), absl::StatusCode::kFailedPrecondition) << added;
  EXPECT_THAT((*channel)->Describe(), HasSubstr(absl::StrCat("belongs to pid ", getpid())));
  EXPECT_EQ(CountOf(Dump(victim, kHeap), kHeapByte), static_cast<ptrdiff_t>(heap.length))
      << "the initiator wrote into a process that was not its peer";

  // The real peer (same uid, its own socket, CMA offered) still gets CMA, byte-exact.
  absl::StatusOr<std::unique_ptr<Channel>> real =
      initiator->Connect(LinkTo(victim.info().endpoint, victim.info().pid));
  ASSERT_TRUE(real.ok()) << real.status();
  EXPECT_EQ((*real)->Describe(), "shm memfd+cma");
  ASSERT_TRUE((*real)->AddRemoteRegions({heap}).ok());
  std::mt19937_64 rng(17);
  for (std::byte& b : local) b = static_cast<std::byte>(rng());
  const std::vector<std::byte> written = local;
  ASSERT_TRUE(PostOne(**real, OpKind::kWrite, heap.id, local.data(), heap.length).ok());
  std::fill(local.begin(), local.end(), std::byte{0});
  ASSERT_TRUE(PostOne(**real, OpKind::kRead, heap.id, local.data(), heap.length).ok());
  EXPECT_TRUE(local == written);
  const std::string dumped = Dump(victim, kHeap);
  ASSERT_EQ(dumped.size(), written.size());
  EXPECT_EQ(std::memcmp(dumped.data(), written.data(), written.size()), 0);
  (*real)->Close(absl::CancelledError("test over"));
  initiator->Shutdown();
}

// What the kernel grants a same-host process outside kvwire's protocol: with the ptrace access
// check passed (same uid, target dumpable) it reaches ALL memory of the target, exported or
// not. deny_ptrace (the target non-dumpable) or another uid makes the kernel refuse.
struct KernelReach {
  std::string cma, proc_fd, proc_mem;  // "ok" or the errno
  bool AllRefused() const { return cma != "ok" && proc_fd != "ok" && proc_mem != "ok"; }
  std::string Text() const {
    return absl::StrCat("process_vm_readv: ", cma,
                        "; open /proc/<pid>/fd/<memfd> O_RDWR: ", proc_fd,
                        "; open /proc/<pid>/mem: ", proc_mem);
  }
};

// Runs the probes in a child process of `uid` (when this process is root).
KernelReach ProbeFromAnotherProcess(uid_t uid, const TargetInfo& target) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return {"pipe failed", "", ""};
  const pid_t child = fork();
  if (child == 0) {
    close(fds[0]);
    std::string out;
    if (!BecomeUser(uid)) {
      out = "setuid failed\n\n\n";
    } else {
      const RemoteRegionDesc& heap = target.descs[kHeap];
      char byte = 0;
      iovec local{&byte, 1};
      iovec remote{reinterpret_cast<void*>(heap.address), 1};
      out += process_vm_readv(target.pid, &local, 1, &remote, 1, 0) == 1 && byte == kHeapByte
                 ? "ok"
                 : Errno(errno);
      out += "\n";
      const std::string fd_path = absl::StrCat("/proc/", target.pid, "/fd/", target.whole_ro_memfd);
      const int fd = open(fd_path.c_str(), O_RDWR | O_CLOEXEC);
      out += fd >= 0 ? "ok" : Errno(errno);
      out += "\n";
      const std::string mem_path = absl::StrCat("/proc/", target.pid, "/mem");
      const int mem = open(mem_path.c_str(), O_RDONLY | O_CLOEXEC);
      out += mem >= 0 ? "ok" : Errno(errno);
      out += "\n";
    }
    (void)!write(fds[1], out.data(), out.size());
    _exit(0);
  }
  close(fds[1]);
  std::string text;
  char buffer[512];
  const absl::Time deadline = Soon();
  while (WaitReady(fds[0], POLLIN, deadline)) {
    const ssize_t n = read(fds[0], buffer, sizeof(buffer));
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  close(fds[0]);
  EXPECT_EQ(ReapAndJudge(child, absl::Seconds(30)), "") << "the probing process";
  std::vector<std::string> lines = absl::StrSplit(text, '\n');
  lines.resize(3);
  return {lines[0], lines[1], lines[2]};
}

TEST(HostileShmTest, DenyPtraceShutsOutSameUidProcessesTheKernelWouldLetIn) {
  if (const std::string why = CmaUnavailable(); !why.empty()) {
    GTEST_SKIP() << "the kernel refuses cross-memory attach entirely: " << why;
  }
  const uid_t same_uid = geteuid() == 0 ? kTargetUid : geteuid();
  {
    Target open_target;
    ASSERT_TRUE(open_target.Start(TargetConfig{}));
    const KernelReach same = ProbeFromAnotherProcess(same_uid, open_target.info());
    std::printf("same-uid process, default target: %s\n", same.Text().c_str());
    if (geteuid() == 0) {
      const KernelReach other = ProbeFromAnotherProcess(kOtherUid, open_target.info());
      std::printf("other-uid process, default target: %s\n", other.Text().c_str());
      EXPECT_TRUE(other.AllRefused()) << other.Text();
    } else {
      std::printf("not root: no other uid to try\n");
    }
  }
  Target hardened;
  ASSERT_TRUE(hardened.Start(TargetConfig{.deny_ptrace = true}));
  const KernelReach denied = ProbeFromAnotherProcess(same_uid, hardened.info());
  std::printf("same-uid process, deny_ptrace target: %s\n", denied.Text().c_str());
  EXPECT_TRUE(denied.AllRefused()) << denied.Text();
  // It still serves a legitimate peer over the fd path.
  std::unique_ptr<Transport> initiator = MakeInitiator(false);
  ASSERT_NE(initiator, nullptr);
  LegitimatePeerMovesExactBytes(*initiator, hardened.info(), hardened.info().descs[kWholeRw], "");
  LegitimatePeerMovesExactBytes(*initiator, hardened.info(), hardened.info().descs[kWholeRo],
                                std::string(4 * Page(), kReadOnlyByte));
  initiator->Shutdown();
}

TEST(HostileShmTest, DenyPtraceWithCmaIsRefused) {
  FakeTargetHooks hooks(BothPeers());
  ShmTransportOptions options;
  options.allow_cma = true;
  options.deny_ptrace = true;
  absl::StatusOr<std::unique_ptr<Transport>> transport = CreateShmTransport(options, &hooks);
  EXPECT_EQ(transport.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvwire::transport
