// kvwire-perf's side channel under hostile input: a real target process, and a client that
// speaks (or does not speak) its line protocol over a real socket. Strangers are turned away
// without ending the target, an oversize or malformed RUN is refused with an ERROR line (the
// target stays up and serves the next correct request), every wait has a deadline, and the
// target listens on loopback unless told otherwise.
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <signal.h>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "perf/perf_options.h"
#include "perf/session.h"
#include "perf/side_channel.h"
#include "tests/perf/perf_target.h"

namespace kvwire::perf {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

using Target = ::kvwire::testing::PerfTarget;

// The HELLO a kvwire-perf initiator with these options would send.
std::string HelloFor(const std::vector<std::string>& args) {
  std::vector<const char*> argv = {"kvwire-perf"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  argv.push_back("127.0.0.1");
  absl::StatusOr<PerfOptions> o = ParsePerfOptions(static_cast<int>(argv.size()), argv.data());
  if (!o.ok()) return "";
  return absl::StrCat("HELLO ", kProtocol, " ", EncodeSettings(AgreedSettings(*o)));
}

absl::StatusOr<LineSocket> Dial(const Target& target) {
  return LineSocket::Dial("127.0.0.1", target.port(), absl::Seconds(10));
}

TEST(PerfSideChannelTest, StrangersAreTurnedAwayAndTheTargetKeepsWaiting) {
  const std::vector<std::string> test = {"-s", "4K", "-n", "16", "--check"};
  std::vector<std::string> args = test;
  args.insert(args.end(), {"--side-timeout", "2"});
  Target target(args);
  ASSERT_GT(target.port(), 0);

  {  // Not this protocol.
    absl::StatusOr<LineSocket> s = Dial(target);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(s->SendLine("GET / HTTP/1.1").ok());
    absl::StatusOr<std::string> reply = s->ReadLine(absl::Seconds(10));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_THAT(*reply, StartsWith("ERROR target speaks kvwire-perf/1"));
    EXPECT_EQ(s->ReadLine(absl::Seconds(10)).status().code(), absl::StatusCode::kUnavailable);
  }
  {  // A line without end.
    absl::StatusOr<LineSocket> s = Dial(target);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(s->SendLine(std::string(100 << 10, 'x')).ok());
    absl::StatusOr<std::string> reply = s->ReadLine(absl::Seconds(10));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_THAT(*reply, HasSubstr("line longer than 65536 bytes"));
  }
  {  // Silence: turned away at the deadline (--side-timeout 2), not waited for.
    absl::StatusOr<LineSocket> s = Dial(target);
    ASSERT_TRUE(s.ok()) << s.status();
    const absl::Time start = absl::Now();
    absl::StatusOr<std::string> reply = s->ReadLine(absl::Seconds(15));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_THAT(*reply, HasSubstr("no answer from the peer"));
    EXPECT_LT(absl::Now() - start, absl::Seconds(2) + absl::Seconds(5));
  }
  EXPECT_TRUE(target.Alive());

  // A real initiator is served afterwards, every byte checked.
  args = test;
  args.insert(args.end(), {"-p", absl::StrCat(target.port()), "127.0.0.1"});
  const std::string cmd = absl::StrCat(KVWIRE_PERF_BIN, " ", absl::StrJoin(args, " "), " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_THAT(out, HasSubstr(" ok\n"));
  EXPECT_EQ(target.Wait(absl::Seconds(30)), 0);
}

TEST(PerfSideChannelTest, OversizeAndMalformedRunsAreRefusedAndTheTargetServesOn) {
  const std::vector<std::string> test = {"-s", "4K", "--check"};
  Target target(test);
  ASSERT_GT(target.port(), 0);
  absl::StatusOr<LineSocket> s = Dial(target);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(s->SendLine(HelloFor(test)).ok());
  absl::StatusOr<std::string> reply = s->ReadLine(absl::Seconds(30));
  ASSERT_TRUE(reply.ok()) << reply.status();
  ASSERT_THAT(*reply, StartsWith("OK port="));

  auto exchange = [&](const std::string& line) -> std::string {
    if (absl::Status st = s->SendLine(line); !st.ok()) return st.ToString();
    absl::StatusOr<std::string> r = s->ReadLine(absl::Seconds(30));
    return r.ok() ? *r : r.status().ToString();
  };
  // With --check, a RUN clears its destination blocks: a size beyond the buffer would have the
  // target clear memory it does not own.
  EXPECT_EQ(exchange("RUN 1099511627776 0"),
            "ERROR RUN size 1099511627776 is not one of the agreed sizes (4096)");
  EXPECT_THAT(exchange("RUN 18446744073709551616 0"), StartsWith("ERROR malformed RUN line"));
  EXPECT_THAT(exchange("RUN -1 0"), StartsWith("ERROR malformed RUN line"));
  EXPECT_THAT(exchange("RUN 4096"), StartsWith("ERROR malformed RUN line"));
  EXPECT_THAT(exchange("RUN"), StartsWith("ERROR malformed RUN line"));
  EXPECT_THAT(exchange(""), StartsWith("ERROR unexpected"));
  EXPECT_THAT(exchange("\x01\xff garbage"), StartsWith("ERROR unexpected"));
  // A correct RUN with a malformed DONE, then a correct exchange.
  EXPECT_EQ(exchange("RUN 4096 0"), "READY");
  EXPECT_THAT(exchange("DONE 4096 x,y"), StartsWith("ERROR bad op count list"));
  EXPECT_EQ(exchange("RUN 4096 0"), "READY");
  EXPECT_THAT(exchange("DONE 8192 0"), StartsWith("ERROR expected \"DONE 4096 <ops>\""));
  EXPECT_EQ(exchange("RUN 4096 0"), "READY");
  EXPECT_EQ(exchange("DONE 4096 0"), "CHECK ok");
  EXPECT_TRUE(target.Alive());
  ASSERT_TRUE(s->SendLine("BYE").ok());
  EXPECT_EQ(target.Wait(absl::Seconds(30)), 0);
}

// The listening sockets of `pid` in /proc/net/tcp{,6}, as "local-address-hex:port-hex".
std::vector<std::string> ListeningAddresses(pid_t pid, int port) {
  std::vector<std::string> found;
  const std::string port_hex = absl::StrFormat(":%04X", port);
  for (const char* table : {"net/tcp", "net/tcp6"}) {
    std::ifstream in(absl::StrCat("/proc/", pid, "/", table));
    std::string line;
    while (std::getline(in, line)) {
      // "  sl  local_address rem_address   st ..." ; st 0A = LISTEN.
      std::vector<std::string> cols;
      for (size_t i = 0; i < line.size();) {
        const size_t b = line.find_first_not_of(' ', i);
        if (b == std::string::npos) break;
        const size_t e = line.find(' ', b);
        cols.push_back(line.substr(b, e - b));
        i = e == std::string::npos ? line.size() : e;
      }
      if (cols.size() > 3 && cols[3] == "0A" && absl::EndsWith(cols[1], port_hex)) {
        found.push_back(cols[1]);
      }
    }
  }
  return found;
}

TEST(PerfSideChannelTest, ListensOnLoopbackByDefault) {
  Target target({"-s", "4K"});
  ASSERT_GT(target.port(), 0);
  const std::vector<std::string> listening = ListeningAddresses(target.pid(), target.port());
  ASSERT_EQ(listening.size(), 1u);
  EXPECT_EQ(listening[0], absl::StrFormat("0100007F:%04X", target.port()));  // 127.0.0.1
}

}  // namespace
}  // namespace kvwire::perf
