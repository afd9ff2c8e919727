// kvwire-perf's side channel as its target serves it (perf/target.cc, perf/side_channel.cc):
// the initiator's lines - HELLO with its settings, then RUN / DONE per size, BYE - come from
// whoever connects to the target's port. The input is those lines, queued on a real socket
// (a socketpair) that LineSocket reads; each RUN goes to the real ServeSize against a 64 KiB
// buffer with --check on, so that a size or op count the buffer cannot hold shows as an ASan
// report rather than silent corruption.
//
// Input: byte 0 picks the options (bit 0: pool pattern; bits 1-2: threads - 1), the rest is
// the stream of lines.
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "perf/perf_options.h"
#include "perf/session.h"
#include "perf/side_channel.h"
#include "perf/target.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

constexpr size_t kBufferBytes = 64 << 10;
// Lines and answers both stay in the socketpair's buffers (nothing reads the answers).
constexpr size_t kMaxStreamBytes = 16 << 10;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvwire::perf;
  if (size == 0 || size - 1 > kMaxStreamBytes) return 0;
  PerfOptions o;
  o.op = kvwire::OpKind::kWrite;
  o.check = true;
  o.pattern = (data[0] & 1) != 0 ? Pattern::kPool : Pattern::kHot;
  o.threads = 1 + ((data[0] >> 1) & 3);

  static absl::StatusOr<kvwire::ShareableBuffer> memory =
      kvwire::ShareableBuffer::Create(kBufferBytes, "kvwire-fuzz");
  KVWIRE_FUZZ_CHECK(memory.ok() && memory->size() == kBufferBytes);
  LocalBuffer buffer;
  buffer.memory = std::move(*memory);

  int fds[2];
  KVWIRE_FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
  KVWIRE_FUZZ_CHECK(::send(fds[1], data + 1, size - 1, MSG_NOSIGNAL) ==
                    static_cast<ssize_t>(size - 1));
  ::shutdown(fds[1], SHUT_WR);  // the stream ends after the input; answers still fit
  {
    LineSocket sock(fds[0]);
    // RunTarget: the HELLO line, then RUN lines until BYE or an error.
    bool first = true;
    while (true) {
      absl::StatusOr<std::string> line = sock.ReadLine(absl::Seconds(5));
      if (!line.ok()) break;
      const std::string prefix = absl::StrCat("HELLO ", kProtocol, " ");
      if (first && absl::StartsWith(*line, prefix)) {
        absl::StatusOr<std::map<std::string, std::string>> theirs =
            DecodeSettings(line->substr(prefix.size()));
        if (!theirs.ok()) break;
        (void)CheckAgreement(AgreedSettings(o), *theirs, "initiator");
        first = false;
        continue;
      }
      first = false;
      std::vector<std::string> parts = absl::StrSplit(*line, ' ');
      if (parts[0] == "BYE") break;
      if (parts[0] != "RUN" || !ServeSize(o, sock, buffer, parts).ok()) break;
    }
  }  // closes fds[0]
  ::close(fds[1]);
  *memory = std::move(buffer.memory);
  return 0;
}
