// kvwire-tcp-probe: the kernel's share of a tcp op stream on this host, without kvwire in the
// way (issue 25: "find where the time goes first"). One process, a sender thread and a
// receiver thread on a loopback tcp connection with the transport's socket buffers (4 MiB,
// TCP_NODELAY), moving ops laid out as kvwire's wire puts them: a 64-byte header before each
// op's payload, batches of --batch ops per send. It measures two changes kvwire could make and
// prints what each costs per MiB on each side, so that they are judged before being built:
//
//   --recv per-op   one recvmsg per op: its payload and the next header (what kvwire's
//                   HeaderReader does with the `follow` hint); the header positions are known
//                   only once the previous header is read.
//   --recv block    a batch's headers first, then its payloads: the receiver reads the headers
//                   and then scatters 64 payloads per recvmsg (a different wire layout).
//   --send sendmsg  one sendmsg per batch of iovecs (what kvwire does): the kernel copies.
//   --send splice   vmsplice of the batch into a pipe, then splice to the socket: the socket
//                   references the sender's pages instead of copying them.
//
//   --pool MIB      each op's payload at a random place in a pool of MIB on each side
//                   (a KV cache: cold in the caches), instead of one batch's buffer reused
//                   (hot, kvwire-perf's default pattern).
//
//   --ranges FILE   the ops are one request's ranges, as `kvwire-perf --workload kv
//                   --dump-ranges FILE` writes them (the same layout, blocks and merging as
//                   that workload), sent --requests times over pools of the size the file
//                   names; prints the time per request too (total / requests: sent back to
//                   back, with no wait between them): the same bytes' floor through the bare
//                   kernel, to set beside kvwire-perf's kv request over tcp.
//
//   kvwire-tcp-probe [--size BYTES] [--batch OPS] [--mib TOTAL] [--pool MIB]
//                    [--ranges FILE [--requests N]] [--recv per-op|block] [--send sendmsg|splice]
//
// Both threads block in their calls (no epoll), so wake-ups differ from kvwire's I/O loop;
// the CPU per MiB of each side is the figure to compare, not the bandwidth of one run.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <new>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

constexpr size_t kHeaderBytes = 64;
constexpr int kSocketBuffer = 4 << 20;  // TcpTransportOptions::socket_buffer_bytes
constexpr size_t kScatter = 64;         // payloads per recvmsg in block mode
// Bounds on what the command line and a ranges file may ask for: no product of them wraps, and
// a pool or an op list too large to allocate is refused with an error, not a crash.
constexpr size_t kMaxSize = size_t{1} << 30;
constexpr size_t kMaxMib = size_t{1} << 20;  // 1 TiB
constexpr size_t kMaxRequests = 100000;
constexpr size_t kMaxRangeOps = 1 << 20;

struct Options {
  size_t size = 20480;  // a DeepSeek-V4-Pro page's bytes on one layer, about
  size_t batch = 256;   // kvwire's kMaxBatchOps
  size_t mib = 2048;
  size_t pool_mib = 0;  // 0: hot
  std::string ranges;   // a kvwire-perf --dump-ranges file
  size_t requests = 50;
  bool block = false;
  bool splice = false;
};

// One op of the stream: where its payload is on each side.
struct Op {
  size_t src = 0;
  size_t dst = 0;
  size_t length = 0;
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "kvwire-tcp-probe: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

double ThreadCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
}

// Moves `iov` forward past `n` bytes.
void Advance(std::vector<iovec>& iov, size_t& first, size_t n) {
  while (n > 0) {
    iovec& v = iov[first];
    const size_t step = std::min(n, v.iov_len);
    v.iov_base = static_cast<char*>(v.iov_base) + step;
    v.iov_len -= step;
    n -= step;
    if (v.iov_len == 0) ++first;
  }
}

// Receives every byte of `iov`, at most `per_call` entries per recvmsg; counts the calls.
void ReceiveAll(int fd, std::vector<iovec> iov, size_t per_call, uint64_t* calls) {
  size_t first = 0;
  while (first < iov.size()) {
    msghdr m{};
    m.msg_iov = &iov[first];
    m.msg_iovlen = std::min(per_call, iov.size() - first);
    const ssize_t n = recvmsg(fd, &m, 0);
    if (n <= 0) Die("recvmsg");
    ++*calls;
    Advance(iov, first, static_cast<size_t>(n));
  }
}

void SendAll(int fd, std::vector<iovec> iov) {
  size_t first = 0;
  while (first < iov.size()) {
    msghdr m{};
    m.msg_iov = &iov[first];
    m.msg_iovlen = std::min<size_t>(IOV_MAX, iov.size() - first);
    const ssize_t n = sendmsg(fd, &m, 0);
    if (n <= 0) Die("sendmsg");
    Advance(iov, first, static_cast<size_t>(n));
  }
}

// vmsplice into `pipe_fds`, then splice on to the socket, until every byte of `iov` went.
void SpliceAll(int fd, const int pipe_fds[2], std::vector<iovec> iov) {
  size_t first = 0;
  while (first < iov.size()) {
    const ssize_t n =
        vmsplice(pipe_fds[1], &iov[first], std::min<size_t>(IOV_MAX, iov.size() - first), 0);
    if (n <= 0) Die("vmsplice");
    Advance(iov, first, static_cast<size_t>(n));
    for (size_t left = static_cast<size_t>(n); left > 0;) {
      // No SPLICE_F_MORE: it could hold the stream's last segment back.
      const ssize_t moved = splice(pipe_fds[0], nullptr, fd, nullptr, left, SPLICE_F_MOVE);
      if (moved <= 0) Die("splice");
      left -= static_cast<size_t>(moved);
    }
  }
}

bool ParseSize(const char* text, size_t* out) {
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (end == text || *end != '\0' || value == 0) return false;
  *out = static_cast<size_t>(value);
  return true;
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    bool ok = value != nullptr;
    if (flag == "--size" && ok) {
      ok = ParseSize(value, &o.size) && o.size <= kMaxSize;
    } else if (flag == "--batch" && ok) {
      ok = ParseSize(value, &o.batch) && o.batch <= 1024;
    } else if (flag == "--mib" && ok) {
      ok = ParseSize(value, &o.mib) && o.mib <= kMaxMib;
    } else if (flag == "--ranges" && ok) {
      o.ranges = value;
    } else if (flag == "--requests" && ok) {
      ok = ParseSize(value, &o.requests) && o.requests <= kMaxRequests;
    } else if (flag == "--pool" && ok) {
      ok = ParseSize(value, &o.pool_mib) && o.pool_mib <= kMaxMib;
    } else if (flag == "--recv" && ok) {
      o.block = std::string(value) == "block";
      ok = o.block || std::string(value) == "per-op";
    } else if (flag == "--send" && ok) {
      o.splice = std::string(value) == "splice";
      ok = o.splice || std::string(value) == "sendmsg";
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "usage: kvwire-tcp-probe [--size BYTES] [--batch OPS<=1024] [--mib TOTAL] "
                   "[--pool MIB] [--ranges FILE [--requests N]] [--recv per-op|block] "
                   "[--send sendmsg|splice]\n");
      std::exit(2);
    }
    ++i;
  }
  return o;
}

}  // namespace

// The ops and the pool size: --ranges' requests, or --mib of --size ops (hot or over --pool).
size_t MakeOps(const Options& o, std::vector<Op>* ops, size_t* request_ops) {
  if (!o.ranges.empty()) {
    if (o.pool_mib != 0) {
      std::fprintf(stderr, "kvwire-tcp-probe: --ranges brings its own pool; drop --pool\n");
      std::exit(2);
    }
    std::FILE* file = std::fopen(o.ranges.c_str(), "r");
    if (file == nullptr) Die("open " + o.ranges);
    unsigned long long pool = 0, count = 0, bytes = 0, pages = 0;
    if (std::fscanf(file, "kvwire-kv-ranges %llu %llu %llu %llu", &pool, &count, &bytes, &pages) !=
            4 ||
        pool == 0 || pool > (kMaxMib << 20) || count == 0 || count > kMaxRangeOps ||
        count * o.requests > kMaxRangeOps * 8) {
      std::fprintf(stderr,
                   "kvwire-tcp-probe: %s: not a kvwire-perf --dump-ranges file, or "
                   "more than this probe takes (pool up to 1 TiB, ops x --requests up to %zu)\n",
                   o.ranges.c_str(), kMaxRangeOps * 8);
      std::exit(1);
    }
    std::vector<Op> request;
    for (unsigned long long i = 0; i < count; ++i) {
      unsigned long long src = 0, dst = 0, length = 0;
      if (std::fscanf(file, "%llu %llu %llu", &src, &dst, &length) != 3 || length == 0 ||
          length > pool || src > pool - length || dst > pool - length) {
        std::fprintf(stderr, "kvwire-tcp-probe: %s: range %llu is malformed or out of the pool\n",
                     o.ranges.c_str(), i);
        std::exit(1);
      }
      request.push_back(Op{src, dst, length});
    }
    std::fclose(file);
    for (size_t r = 0; r < o.requests; ++r) ops->insert(ops->end(), request.begin(), request.end());
    *request_ops = request.size();
    return pool;
  }
  const size_t count = std::max<size_t>(1, (o.mib << 20) / (o.size * o.batch)) * o.batch;
  const size_t pool = std::max(o.size * o.batch, o.pool_mib << 20);
  const size_t slots = pool / o.size;
  uint64_t state = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < count; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    // Hot: one batch's buffer reused; a pool: slots in random order, the same on both sides.
    const size_t slot = o.pool_mib == 0 ? i % o.batch : static_cast<size_t>((state >> 33) % slots);
    ops->push_back(Op{slot * o.size, slot * o.size, o.size});
  }
  *request_ops = 0;
  return pool;
}

int Run(int argc, char** argv);

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "kvwire-tcp-probe: not enough memory for the pools and ops asked for\n");
    return 1;
  }
}

int Run(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  std::vector<Op> ops;
  size_t request_ops = 0;
  const size_t pool_bytes = MakeOps(o, &ops, &request_ops);
  size_t total_bytes = 0;
  for (const Op& op : ops) total_bytes += op.length;

  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) Die("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (setsockopt(listener, SOL_SOCKET, SO_RCVBUF, &kSocketBuffer, sizeof(kSocketBuffer)) != 0 ||
      bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    Die("listen on 127.0.0.1");
  }
  std::vector<char> source(pool_bytes, 'k');  // touched, as kvwire-perf's buffers are
  std::vector<char> dest(pool_bytes, 0);
  // One header per op, numbered (the receiver checks the framing), never changed once sent:
  // safe to splice.
  std::vector<char> headers(kHeaderBytes * ops.size(), 'h');
  for (size_t i = 0; i < ops.size(); ++i) {
    const uint64_t index = i;
    std::memcpy(headers.data() + i * kHeaderBytes, &index, sizeof(index));
  }
  // Batches of --batch ops, as kvwire's writer sends them (it also caps one at 4 MiB).
  std::vector<size_t> batch_starts;
  for (size_t i = 0; i < ops.size();) {
    batch_starts.push_back(i);
    size_t bytes = 0;
    const size_t first = i;
    while (i < ops.size() && i - first < o.batch && bytes < (4u << 20)) bytes += ops[i++].length;
  }
  batch_starts.push_back(ops.size());

  double send_cpu = 0;
  std::thread sender([&] {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSocketBuffer, sizeof(kSocketBuffer)) ||
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) ||
        connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      Die("connect");
    }
    int pipe_fds[2] = {-1, -1};
    if (o.splice) {
      if (pipe2(pipe_fds, O_CLOEXEC) != 0) Die("pipe2");
      (void)fcntl(pipe_fds[1], F_SETPIPE_SZ, 1 << 20);  // the default pipe-max-size
    }
    std::vector<iovec> iov;
    const double cpu0 = ThreadCpuSeconds();
    for (size_t b = 0; b + 1 < batch_starts.size(); ++b) {
      const size_t first = batch_starts[b];
      const size_t count = batch_starts[b + 1] - first;
      iov.clear();
      char* const batch_headers = headers.data() + first * kHeaderBytes;
      if (o.block) iov.push_back({batch_headers, kHeaderBytes * count});
      for (size_t i = 0; i < count; ++i) {
        if (!o.block) iov.push_back({batch_headers + i * kHeaderBytes, kHeaderBytes});
        iov.push_back({source.data() + ops[first + i].src, ops[first + i].length});
      }
      if (o.splice) {
        SpliceAll(fd, pipe_fds, iov);
      } else {
        SendAll(fd, iov);
      }
    }
    send_cpu = ThreadCpuSeconds() - cpu0;
    char done = 0;
    if (recv(fd, &done, 1, 0) != 1) Die("recv (end)");
    close(fd);
    if (o.splice) {
      close(pipe_fds[0]);
      close(pipe_fds[1]);
    }
  });

  const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) Die("accept");
  uint64_t calls = 0;
  std::vector<char> header(kHeaderBytes * o.batch);
  // Each header must name the op the receiver expects there: a framing mismatch would
  // otherwise still add up to the right byte count.
  auto check = [&](const char* at, size_t op) {
    uint64_t index = 0;
    std::memcpy(&index, at, sizeof(index));
    if (index != op) {
      std::fprintf(stderr, "kvwire-tcp-probe: op %zu's header names op %llu: framing broken\n", op,
                   static_cast<unsigned long long>(index));
      std::exit(1);
    }
  };
  const auto start = std::chrono::steady_clock::now();
  const double cpu0 = ThreadCpuSeconds();
  for (size_t b = 0; b + 1 < batch_starts.size(); ++b) {
    const size_t first = batch_starts[b];
    const size_t count = batch_starts[b + 1] - first;
    if (o.block) {
      ReceiveAll(fd, {{header.data(), kHeaderBytes * count}}, 1, &calls);
      for (size_t i = 0; i < count; ++i) check(header.data() + i * kHeaderBytes, first + i);
      std::vector<iovec> payloads;
      for (size_t i = 0; i < count; ++i) {
        payloads.push_back({dest.data() + ops[first + i].dst, ops[first + i].length});
      }
      ReceiveAll(fd, std::move(payloads), kScatter, &calls);
    } else {
      // The first header alone; then each payload with the header after it.
      ReceiveAll(fd, {{header.data(), kHeaderBytes}}, 1, &calls);
      for (size_t i = 0; i < count; ++i) {
        check(header.data(), first + i);
        std::vector<iovec> iov = {{dest.data() + ops[first + i].dst, ops[first + i].length}};
        if (i + 1 < count) iov.push_back({header.data(), kHeaderBytes});
        ReceiveAll(fd, std::move(iov), 2, &calls);
      }
    }
  }
  const double recv_cpu = ThreadCpuSeconds() - cpu0;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (send(fd, "x", 1, MSG_NOSIGNAL) != 1) Die("send (end)");
  sender.join();
  close(fd);
  close(listener);
  const double mib = static_cast<double>(total_bytes) / (1 << 20);
  if (request_ops > 0) {
    std::printf("ranges %s: %zu ops per request, %.3f ms per request (back to back); ",
                o.ranges.c_str(), request_ops, seconds * 1e3 / static_cast<double>(o.requests));
  } else {
    std::printf("size %zu batch %zu pool %zu MiB ", o.size, o.batch, o.pool_mib);
  }
  std::printf(
      "recv %s send %s: %.2f GB/s, sender %.3f ms CPU/MiB, receiver %.3f ms CPU/MiB, %.1f "
      "recvmsg/MiB\n",
      o.block ? "block" : "per-op", o.splice ? "splice" : "sendmsg",
      static_cast<double>(total_bytes) / seconds / 1e9, send_cpu * 1e3 / mib, recv_cpu * 1e3 / mib,
      static_cast<double>(calls) / mib);
  return 0;
}
