// GPU memory over the shm transport on a real device (the build's runtime, or --emulated):
// two processes (this program, and itself again in the --child role) each run a kvwire engine
// over shm on device 0; this side moves GPU -> GPU both ways with byte verification, then
// measures the IPC-shm bandwidth against a plain device-to-device copy (CopyAsync within one
// process) for 1 MiB, 16 MiB and 256 MiB, printing one row per size (decimal GB/s, the median
// of several runs), one at a time (latency included) and streamed (many in flight):
//
//   gpu shm: SIZE   | D2D IPC-SHM ratio R (one at a time) | D2D IPC-SHM ratio R (streamed)
// A benchmark, not a speed assertion. Without a
// device the test skips with the runtime's one-line reason. perf/gpu-check.sh runs it; the
// bundle starts the child through its loader (KVWIRE_GPU_SHM_SELF: the command words).
//
// With --emulated (both processes) the emulated runtime stands in for the device, with sizes
// up to 16 MiB: a check of this program itself on machines without a GPU (its numbers say
// nothing about a GPU).
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "src/gpu/runtime.h"
#include "tests/support/emulated_gpu.h"

extern char** environ;

namespace kvwire::gpu {
namespace {

constexpr uint64_t kSizes[] = {1ull << 20, 16ull << 20, 256ull << 20};

// --emulated: the emulated runtime in place of the build's (set by main, before any engine).
kvwire::testing::EmulatedGpu* emulated = nullptr;

Runtime& TestRuntime() { return emulated != nullptr ? emulated->runtime() : DefaultRuntime(); }
uint64_t MaxBytes() { return emulated != nullptr ? 16ull << 20 : 256ull << 20; }
constexpr int kRuns = 5;
// Transfers in flight at once while measuring.
constexpr size_t kWindow = 16;

#define KVW_ASSERT_OK(expr)                                \
  do {                                                     \
    const absl::Status status_ = (expr);                   \
    ASSERT_TRUE(status_.ok()) << #expr << ": " << status_; \
  } while (0)

uint8_t PatternByte(uint64_t i, uint32_t seed) {
  return static_cast<uint8_t>((i ^ (i >> 8) ^ (i >> 16)) * 31 + seed);
}
std::vector<uint8_t> Pattern(uint64_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = PatternByte(i, seed);
  return v;
}

EngineOptions ShmEngine(const std::string& name) {
  EngineOptions options;
  options.name = name;
  options.transport = "shm";
  // One runtime copy per op: splitting a device copy buys nothing (no wire to share).
  options.max_op_bytes = MaxBytes();
  options.transfer_timeout = absl::Seconds(60);
  return options;
}

int Child() {
  auto fail = [](const std::string& what) {
    std::printf("ERR %s\n", what.c_str());
    std::fflush(stdout);
    return 1;
  };
  Runtime& rt = TestRuntime();
  if (absl::StatusOr<int> n = rt.DeviceCount(); !n.ok()) return fail(n.status().ToString());
  auto engine = Engine::Create(ShmEngine("gpu-shm-child"));
  if (!engine.ok()) return fail(engine.status().ToString());
  auto buffer = DeviceBuffer::Allocate(rt, 0, MaxBytes());
  if (!buffer.ok()) return fail(buffer.status().ToString());
  auto stream = Stream::Create(rt, 0);
  if (!stream.ok()) return fail(stream.status().ToString());
  const std::vector<uint8_t> fill = Pattern(MaxBytes(), 1);
  if (absl::Status s = stream->Copy(buffer->data(), fill.data(), MaxBytes()); !s.ok()) {
    return fail(s.ToString());
  }
  RegionOptions ropts;
  ropts.kind = MemoryKind::kGpu;
  ropts.export_to_all_peers = true;
  auto id = (*engine)->RegisterMemory(buffer->data(), MaxBytes(), ropts);
  if (!id.ok()) return fail(id.status().ToString());
  std::printf("READY %s %llu\n", (*engine)->address().c_str(),
              static_cast<unsigned long long>(*id));
  std::fflush(stdout);
  char c;
  while (read(STDIN_FILENO, &c, 1) > 0) {
  }
  engine->reset();
  return 0;
}

// The child process: started with pipes on stdin/stdout; stdin closed (and the child reaped,
// SIGKILL after a grace period) on destruction.
class ChildProcess {
 public:
  ~ChildProcess() {
    if (to_child_ >= 0) close(to_child_);
    if (from_child_ >= 0) close(from_child_);
    if (pid_ <= 0) return;
    // The child's end is part of the test: a sanitizer report (non-zero exit), a signal, or
    // a hang (killed after 10 s) fails it.
    int status = 0;
    pid_t reaped = 0;
    for (int i = 0; i < 1000 && (reaped = waitpid(pid_, &status, WNOHANG)) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (reaped == 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      ADD_FAILURE() << "gpu-shm child " << pid_ << " did not exit within 10 s and was killed";
    } else if (WIFSIGNALED(status)) {
      ADD_FAILURE() << "gpu-shm child " << pid_ << " died of signal " << WTERMSIG(status);
    } else if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
      ADD_FAILURE() << "gpu-shm child " << pid_ << " exited with status " << WEXITSTATUS(status)
                    << " (a sanitizer report or a failed check; see its stderr)";
    }
  }

  absl::Status Start() {
    const char* self = std::getenv("KVWIRE_GPU_SHM_SELF");
    std::vector<std::string> args =
        absl::StrSplit(self != nullptr ? self : "/proc/self/exe", ' ', absl::SkipEmpty());
    args.push_back("--child");
    if (emulated != nullptr) args.push_back("--emulated");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
      return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    to_child_ = in[1];
    from_child_ = out[0];
    if (rc != 0) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("spawning ", argv[0], ": ", std::strerror(rc)));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> ReadLine(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    std::string line;
    while (true) {
      const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (ms <= 0) return absl::DeadlineExceededError("the child printed no line in time");
      pollfd p{from_child_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(ms)) <= 0) continue;
      char c;
      const ssize_t n = read(from_child_, &c, 1);
      if (n <= 0) return absl::UnavailableError(absl::StrCat("the child exited; said: ", line));
      if (c == '\n') return line;
      line.push_back(c);
    }
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Enough repetitions of `size` that one run moves about 1 GiB (at least 4; 64 MiB emulated).
int Repetitions(uint64_t size) {
  const uint64_t run = emulated != nullptr ? 64ull << 20 : 1ull << 30;
  return static_cast<int>(std::max<uint64_t>(4, run / size));
}

class GpuShmTransferTest : public ::testing::Test {
 protected:
  void CopyToHost(std::vector<uint8_t>* out, const void* device, uint64_t bytes) {
    out->resize(bytes);
    KVW_ASSERT_OK(stream_.Copy(out->data(), device, bytes));
  }
  absl::Status Move(OpKind kind, RegionId local, uint64_t local_offset, uint64_t remote_offset,
                    uint64_t length) {
    std::vector<Op> ops = {Op{local, local_offset, remote_region_, remote_offset, length}};
    auto id = engine_->Transfer(peer_, kind, ops);
    if (!id.ok()) return id.status();
    return engine_->Wait(*id, absl::Seconds(60));
  }

  Stream stream_;
  std::unique_ptr<Engine> engine_;
  PeerId peer_ = 0;
  RegionId remote_region_ = 0;
};

TEST_F(GpuShmTransferTest, GpuToGpuBetweenTwoProcessesVerifiedAndMeasured) {
  Runtime& rt = TestRuntime();
  absl::StatusOr<int> count = rt.DeviceCount();
  if (!count.ok()) GTEST_SKIP() << count.status().message();
  ChildProcess child;
  KVW_ASSERT_OK(child.Start());
  absl::StatusOr<std::string> ready = child.ReadLine(absl::Seconds(60));
  ASSERT_TRUE(ready.ok()) << ready.status();
  std::vector<std::string> words = absl::StrSplit(*ready, ' ');
  ASSERT_TRUE(words.size() == 3 && words[0] == "READY" &&
              absl::SimpleAtoi(words[2], &remote_region_))
      << *ready;

  auto engine = Engine::Create(ShmEngine("gpu-shm-parent"));
  ASSERT_TRUE(engine.ok()) << engine.status();
  engine_ = std::move(*engine);
  auto stream = Stream::Create(rt, 0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  stream_ = std::move(*stream);
  auto a = DeviceBuffer::Allocate(rt, 0, MaxBytes());
  auto b = DeviceBuffer::Allocate(rt, 0, MaxBytes());
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  RegionOptions ropts;
  ropts.kind = MemoryKind::kGpu;
  auto local_a = engine_->RegisterMemory(a->data(), MaxBytes(), ropts);
  auto local_b = engine_->RegisterMemory(b->data(), MaxBytes(), ropts);
  ASSERT_TRUE(local_a.ok() && local_b.ok()) << local_a.status() << " " << local_b.status();
  auto peer = engine_->Connect(words[1]);
  ASSERT_TRUE(peer.ok()) << peer.status();
  peer_ = *peer;
  KVW_ASSERT_OK(engine_->WaitForRemoteRegion(peer_, remote_region_, absl::Seconds(30)));
  EngineStats stats = engine_->Stats();
  ASSERT_EQ(stats.peers.size(), 1u);
  EXPECT_THAT(stats.peers[0].transport, ::testing::HasSubstr("gpu-ipc"));
  EXPECT_EQ(stats.TransportStatValue("gpu", "shm_ipc_opens"), 1u);

  // READ the child's whole region, and an odd sub-range to an odd place.
  KVW_ASSERT_OK(Move(OpKind::kRead, *local_a, 0, 0, MaxBytes()));
  std::vector<uint8_t> got;
  CopyToHost(&got, a->data(), MaxBytes());
  ASSERT_TRUE(got == Pattern(MaxBytes(), 1)) << "READ of the whole region differs";
  const uint64_t odd = (1 << 20) + 3;
  KVW_ASSERT_OK(Move(OpKind::kRead, *local_a, 777, 4097, odd));
  CopyToHost(&got, static_cast<uint8_t*>(a->data()) + 777, odd);
  for (uint64_t i = 0; i < odd; ++i) ASSERT_EQ(got[i], PatternByte(4097 + i, 1)) << i;
  // WRITE a new pattern into the child, READ it back elsewhere.
  const uint64_t w = (MaxBytes() >> 4) + 5;
  const std::vector<uint8_t> fresh = Pattern(w, 2);
  KVW_ASSERT_OK(stream_.Copy(b->data(), fresh.data(), w));
  KVW_ASSERT_OK(Move(OpKind::kWrite, *local_b, 0, 12345, w));
  KVW_ASSERT_OK(Move(OpKind::kRead, *local_a, 0, 12345, w));
  CopyToHost(&got, a->data(), w);
  ASSERT_TRUE(got == fresh) << "WRITE then READ back differs";

  // Two ways to move `size` n times: one at a time (each copy or transfer waited for before
  // the next: latency included) and streamed (copies queued back to back on one stream;
  // kWindow transfers in flight).
  std::printf("gpu shm: %-6s | %-30s | %-30s  (GB/s, median of %d runs)\n", "size",
              "one at a time: d2d ipc-shm ratio", "streamed: d2d ipc-shm ratio", kRuns);
  std::vector<Op> ops(1);
  auto transfer = [&]() -> absl::StatusOr<TransferId> {
    return engine_->Transfer(peer_, OpKind::kRead, ops);
  };
  for (uint64_t size : kSizes) {
    if (size > MaxBytes()) continue;
    ops[0] = Op{*local_a, 0, remote_region_, 0, size};
    const int n = Repetitions(size);
    const int serial_n = std::min(n, 64);
    std::vector<double> d2d_serial, shm_serial, d2d, shm;
    auto rate = [](uint64_t bytes, std::chrono::steady_clock::duration d) {
      return static_cast<double>(bytes) / std::chrono::duration<double>(d).count() / 1e9;
    };
    for (int run = 0; run <= kRuns; ++run) {  // run 0 warms up
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < serial_n; ++i) {
        KVW_ASSERT_OK(stream_.Copy(a->data(), b->data(), size));
      }
      auto t1 = std::chrono::steady_clock::now();
      for (int i = 0; i < serial_n; ++i) {
        absl::StatusOr<TransferId> id = transfer();
        ASSERT_TRUE(id.ok()) << id.status();
        KVW_ASSERT_OK(engine_->Wait(*id, absl::Seconds(60)));
      }
      auto t2 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) KVW_ASSERT_OK(stream_.CopyAsync(a->data(), b->data(), size));
      KVW_ASSERT_OK(stream_.Synchronize());
      auto t3 = std::chrono::steady_clock::now();
      std::deque<TransferId> inflight;
      for (int i = 0; i < n; ++i) {
        if (inflight.size() >= kWindow) {
          KVW_ASSERT_OK(engine_->Wait(inflight.front(), absl::Seconds(60)));
          inflight.pop_front();
        }
        absl::StatusOr<TransferId> id = transfer();
        ASSERT_TRUE(id.ok()) << id.status();
        inflight.push_back(*id);
      }
      for (TransferId id : inflight) KVW_ASSERT_OK(engine_->Wait(id, absl::Seconds(60)));
      auto t4 = std::chrono::steady_clock::now();
      if (run == 0) continue;
      d2d_serial.push_back(rate(size * serial_n, t1 - t0));
      shm_serial.push_back(rate(size * serial_n, t2 - t1));
      d2d.push_back(rate(size * n, t3 - t2));
      shm.push_back(rate(size * n, t4 - t3));
    }
    const double ds = Median(d2d_serial), ss = Median(shm_serial), d = Median(d2d), s = Median(shm);
    std::printf("gpu shm: %-6s | %8.1f %8.1f  ratio %.2f   | %8.1f %8.1f  ratio %.2f\n",
                absl::StrCat(size >> 20, "MiB").c_str(), ds, ss, ss / ds, d, s, s / d);
  }
  std::fflush(stdout);
  stats = engine_->Stats();
  EXPECT_EQ(stats.TransportStatValue("gpu", "shm_ipc_opens"), 1u);
  EXPECT_GT(stats.TransportStatValue("gpu", "shm_device_copies"), 0u);
  engine_.reset();
}

}  // namespace
}  // namespace kvwire::gpu

int main(int argc, char** argv) {
  bool child = false, use_emulated = false;
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--child") == 0) {
      child = true;
    } else if (std::strcmp(argv[i], "--emulated") == 0) {
      use_emulated = true;
    } else {
      rest.push_back(argv[i]);
    }
  }
  std::unique_ptr<kvwire::testing::EmulatedGpu> emulated;
  if (use_emulated) {
    emulated = std::make_unique<kvwire::testing::EmulatedGpu>();
    kvwire::gpu::emulated = emulated.get();
    kvwire::gpu::SetDefaultRuntime(&emulated->runtime());
  }
  if (child) return kvwire::gpu::Child();
  int n = static_cast<int>(rest.size());
  rest.push_back(nullptr);  // argv[argc], which gtest moves along when it removes its flags
  ::testing::InitGoogleTest(&n, rest.data());
  return RUN_ALL_TESTS();
}
