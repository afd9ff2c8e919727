// kvwire-perf's side channel as its target serves it (perf/target.cc, perf/side_channel.cc):
// the initiator's lines - HELLO with its settings, then RUN / DONE per size, BYE - come from
// whoever connects to the target's port. The input is those lines, queued on a real socket
// (a socketpair) that LineSocket reads, and RunTarget's own pieces read them: ReadHello and
// CheckAgreement for the HELLO, then ServeInitiator (every RUN through the real ServeSize)
// against a 64 KiB heap buffer with --check on, so that a size or op count the buffer cannot
// hold shows as an ASan report (heap memory is guarded; a memfd mapping would not be) rather
// than silent corruption.
//
// Input: byte 0 picks the options (bit 0: pool pattern; bits 1-2: threads - 1) and the HELLO
// (bit 3 clear: an initiator that agreed, whose HELLO the harness sends first, so that the
// fuzzing reaches the RUN lines; set: the input's own first line is the HELLO, which must
// agree with the options as RunTarget requires); the rest is the stream of lines.
#include <sys/socket.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "absl/strings/str_cat.h"

#include "perf/perf_options.h"
#include "perf/session.h"
#include "perf/side_channel.h"
#include "perf/target.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

constexpr size_t kBufferBytes = 64 << 10;
// The lines stay in the socketpair's buffer; the answers are drained by a thread, because
// every refused line is answered and a few hundred answers (each a socket buffer entry of
// about 1 KiB) would fill the buffer and hold the target's send for its 60 s deadline.
constexpr size_t kMaxStreamBytes = 16 << 10;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvwire::perf;
  if (size == 0 || size - 1 > kMaxStreamBytes) return 0;
  PerfOptions o;
  o.op = kvwire::OpKind::kWrite;
  o.check = true;
  o.side_timeout_s = 5;
  o.pattern = (data[0] & 1) != 0 ? Pattern::kPool : Pattern::kHot;
  o.threads = 1 + ((data[0] >> 1) & 3);
  const bool own_hello = (data[0] & 8) != 0;

  // On the heap: ASan reports a byte written or read past its end.
  std::vector<std::byte> buffer(kBufferBytes);

  std::string stream;
  if (!own_hello) {
    stream = absl::StrCat("HELLO ", kProtocol, " ", EncodeSettings(AgreedSettings(o)), "\n");
  }
  stream.append(reinterpret_cast<const char*>(data + 1), size - 1);
  int fds[2];
  KVWIRE_FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
  KVWIRE_FUZZ_CHECK(::send(fds[1], stream.data(), stream.size(), MSG_NOSIGNAL) ==
                    static_cast<ssize_t>(stream.size()));
  ::shutdown(fds[1], SHUT_WR);  // the stream ends after the input
  std::thread drain([fd = fds[1]] {
    char sink[4096];
    while (true) {
      const ssize_t n = ::read(fd, sink, sizeof(sink));
      if (n == 0 || (n < 0 && errno != EINTR)) return;  // EOF once fds[0] is closed
    }
  });
  {
    LineSocket sock(fds[0]);
    // As RunTarget: a HELLO in the protocol whose settings agree, then RUN lines until BYE.
    absl::StatusOr<std::map<std::string, std::string>> theirs = ReadHello(o, sock);
    if (theirs.ok() && CheckAgreement(AgreedSettings(o), *theirs, "initiator").ok()) {
      (void)ServeInitiator(o, sock, buffer.data(), buffer.size(), /*kv=*/nullptr);
    }
  }  // closes fds[0], which ends the drain
  drain.join();
  ::close(fds[1]);
  return 0;
}
