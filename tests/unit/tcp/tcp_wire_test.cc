// The tcp wire format (tcp_wire.h) and the header reader (tcp_reader.h) on a socketpair.
#include "transport/tcp/tcp_wire.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <poll.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_socket.h"

namespace kvwire::transport {
namespace {

namespace wire = tcp_wire;

TEST(TcpWireTest, RequestRoundTripsLittleEndian) {
  wire::RequestHeader h;
  h.kind = wire::kKindWrite;
  h.flags = wire::kFlagCountArrivals;
  h.follow = 3;
  h.op_index = 7;
  h.sequence = 0x0102030405060708;
  h.transfer_id = 42;
  h.region = 9;
  h.offset = 1 << 20;
  h.length = 4096;
  h.grant = 0x1112131415161718;
  std::array<std::byte, wire::kRequestBytes> raw;
  wire::EncodeRequest(h, raw.data());
  // Fixed little-endian layout, whatever the host.
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(raw.data()), 4), "KVWQ");
  EXPECT_EQ(raw[16], std::byte{0x08});
  EXPECT_EQ(raw[23], std::byte{0x01});
  wire::RequestHeader out;
  ASSERT_TRUE(wire::DecodeRequest(raw.data(), 1 << 20, &out).ok());
  EXPECT_EQ(out.kind, h.kind);
  EXPECT_EQ(out.flags, h.flags);
  EXPECT_EQ(out.follow, h.follow);
  EXPECT_EQ(out.op_index, h.op_index);
  EXPECT_EQ(out.sequence, h.sequence);
  EXPECT_EQ(out.transfer_id, h.transfer_id);
  EXPECT_EQ(out.region, h.region);
  EXPECT_EQ(out.offset, h.offset);
  EXPECT_EQ(out.length, h.length);
  EXPECT_EQ(raw[56], std::byte{0x18});  // the read grant, after the length
  EXPECT_EQ(out.grant, h.grant);
}

TEST(TcpWireTest, RejectsMalformedRequests) {
  wire::RequestHeader h;
  h.kind = wire::kKindRead;
  h.length = 100;
  std::array<std::byte, wire::kRequestBytes> raw;
  wire::RequestHeader out;

  wire::EncodeRequest(h, raw.data());
  EXPECT_TRUE(wire::DecodeRequest(raw.data(), 100, &out).ok());
  EXPECT_FALSE(wire::DecodeRequest(raw.data(), 99, &out).ok());  // longer than max_op_bytes

  raw[0] = std::byte{0};
  EXPECT_FALSE(wire::DecodeRequest(raw.data(), 100, &out).ok());

  wire::EncodeRequest(h, raw.data());
  raw[4] = std::byte{0};  // kind 0 is not a kind
  EXPECT_FALSE(wire::DecodeRequest(raw.data(), 100, &out).ok());

  h.flags = wire::kFlagCountArrivals;  // READs are never counted
  wire::EncodeRequest(h, raw.data());
  EXPECT_FALSE(wire::DecodeRequest(raw.data(), 100, &out).ok());

  h.flags = 0;
  wire::EncodeRequest(h, raw.data());
  raw[13] = std::byte{1};  // reserved
  EXPECT_FALSE(wire::DecodeRequest(raw.data(), 100, &out).ok());
}

// End-to-end checksums (EngineOptions::verify_checksums) use words version 2 kept reserved: a
// WRITE's CRC in the request, a READ's (or a WRITE's mismatch) in an OK response.
TEST(TcpWireTest, ChecksumFieldsRoundTripAndAreRefusedWhereTheyDoNotBelong) {
  wire::RequestHeader h;
  h.kind = wire::kKindWrite;
  h.flags = wire::kFlagChecksum | wire::kFlagCountArrivals;
  h.length = 100;
  h.crc = 0xdeadbeef;
  std::array<std::byte, wire::kRequestBytes> raw;
  wire::EncodeRequest(h, raw.data());
  wire::RequestHeader out;
  ASSERT_TRUE(wire::DecodeRequest(raw.data(), 100, &out).ok());
  EXPECT_EQ(out.crc, 0xdeadbeefu);
  EXPECT_EQ(out.flags, h.flags);
  // A READ asks for a checksum but carries none: its word stays reserved.
  h.kind = wire::kKindRead;
  h.flags = wire::kFlagChecksum;
  wire::EncodeRequest(h, raw.data());
  ASSERT_TRUE(wire::DecodeRequest(raw.data(), 100, &out).ok());
  EXPECT_EQ(out.crc, 0u);
  raw[13] = std::byte{1};
  EXPECT_FALSE(wire::DecodeRequest(raw.data(), 100, &out).ok());
  // Without the flag, the WRITE's word is reserved too.
  h.kind = wire::kKindWrite;
  h.flags = 0;
  wire::EncodeRequest(h, raw.data());
  raw[13] = std::byte{1};
  EXPECT_FALSE(wire::DecodeRequest(raw.data(), 100, &out).ok());

  wire::ResponseHeader r;
  r.kind = wire::kKindRead;
  r.flags = wire::kResponseFlagChecksum;
  r.crc = 0x12345678;
  r.payload_len = 100;
  std::array<std::byte, wire::kResponseBytes> rraw;
  wire::EncodeResponse(r, rraw.data());
  wire::ResponseHeader rout;
  ASSERT_TRUE(wire::DecodeResponse(rraw.data(), &rout).ok());
  EXPECT_EQ(rout.crc, 0x12345678u);
  EXPECT_EQ(rout.message_len, 0u);
  EXPECT_EQ(rout.flags, wire::kResponseFlagChecksum);
  r.kind = wire::kKindWrite;
  r.payload_len = 0;
  r.flags = wire::kResponseFlagChecksumMismatch;
  wire::EncodeResponse(r, rraw.data());
  ASSERT_TRUE(wire::DecodeResponse(rraw.data(), &rout).ok());
  EXPECT_EQ(rout.flags, wire::kResponseFlagChecksumMismatch);
  EXPECT_EQ(rout.crc, 0x12345678u);
  // A flag on the wrong kind, an unknown flag, or a flag on an error response is refused.
  rraw[5] = std::byte{wire::kResponseFlagChecksum};
  EXPECT_FALSE(wire::DecodeResponse(rraw.data(), &rout).ok());
  rraw[5] = std::byte{0x80};
  EXPECT_FALSE(wire::DecodeResponse(rraw.data(), &rout).ok());
  r.code = 3;
  r.flags = 0;
  r.message_len = 4;
  wire::EncodeResponse(r, rraw.data());
  rraw[5] = std::byte{wire::kResponseFlagChecksumMismatch};
  EXPECT_FALSE(wire::DecodeResponse(rraw.data(), &rout).ok());
}

TEST(TcpWireTest, ResponseAndHelloRoundTrip) {
  wire::ResponseHeader r;
  r.kind = wire::kKindRead;
  r.follow = 2;
  r.sequence = 5;
  r.payload_len = 77;
  std::array<std::byte, wire::kResponseBytes> raw;
  wire::EncodeResponse(r, raw.data());
  wire::ResponseHeader out;
  ASSERT_TRUE(wire::DecodeResponse(raw.data(), &out).ok());
  EXPECT_EQ(out.follow, 2);
  EXPECT_EQ(out.sequence, 5u);
  EXPECT_EQ(out.payload_len, 77u);
  r.code = 3;
  wire::EncodeResponse(r, raw.data());
  EXPECT_FALSE(wire::DecodeResponse(raw.data(), &out).ok());  // an error carries no payload
  r.payload_len = 0;
  r.message_len = wire::kMaxMessageBytes + 1;
  wire::EncodeResponse(r, raw.data());
  EXPECT_FALSE(wire::DecodeResponse(raw.data(), &out).ok());

  wire::Hello hello;
  hello.token_len = 12;
  hello.lane = 3;
  std::array<std::byte, wire::kHelloBytes> hraw;
  wire::EncodeHello(hello, hraw.data());
  wire::Hello hout;
  ASSERT_TRUE(wire::DecodeHello(hraw.data(), &hout).ok());
  EXPECT_EQ(hout.token_len, 12u);
  EXPECT_EQ(hout.lane, 3u);
  EXPECT_EQ(hout.version, wire::kVersion);
  hello.token_len = wire::kMaxTokenBytes + 1;
  wire::EncodeHello(hello, hraw.data());
  EXPECT_FALSE(wire::DecodeHello(hraw.data(), &hout).ok());

  EXPECT_EQ(wire::CodeFromWire(5), absl::StatusCode::kNotFound);
  EXPECT_EQ(wire::CodeFromWire(1000), absl::StatusCode::kUnknown);
}

class SocketPair : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    a_ = fds[0];
    b_ = fds[1];
    // A bug that blocks the reader fails the test instead of hanging it.
    ASSERT_TRUE(SetIoTimeout(a_, absl::Seconds(10)).ok());
  }
  void TearDown() override {
    ::close(a_);
    ::close(b_);
  }
  int a_ = -1;  // read side
  int b_ = -1;  // write side
};

// Frames of 8-byte "headers" (value = index) each followed by `payload[i]` bytes.
TEST_F(SocketPair, PayloadsLandOnlyInTheirDestination) {
  constexpr size_t kHeader = 8;
  const std::vector<size_t> payloads = {0, 0, 100, 0, 5000, 0, 0, 0, 1, 70000};
  std::vector<std::byte> stream;
  std::vector<uint16_t> follows(payloads.size());
  // follow[i]: headers after i's payload up to and including the next with a payload.
  for (size_t i = payloads.size(); i-- > 0;) {
    if (i + 1 == payloads.size()) {
      follows[i] = 0;
    } else {
      follows[i] = payloads[i + 1] > 0 ? 1 : follows[i + 1] + 1;
    }
  }
  for (size_t i = 0; i < payloads.size(); ++i) {
    std::byte header[kHeader] = {};
    wire::Store32(header, static_cast<uint32_t>(i));
    stream.insert(stream.end(), header, header + kHeader);
    for (size_t j = 0; j < payloads[i]; ++j) stream.push_back(static_cast<std::byte>(i + j));
  }
  // All at once: the reader must still not over-read into payloads.
  ASSERT_TRUE(SendAll(b_, stream.data(), stream.size()).ok());

  HeaderReader reader(a_, kHeader, nullptr);
  for (size_t i = 0; i < payloads.size(); ++i) {
    absl::StatusOr<const std::byte*> header = reader.Next();
    ASSERT_TRUE(header.ok()) << header.status();
    EXPECT_EQ(wire::Load32(*header), i);
    ASSERT_TRUE(reader.Expect(payloads[i], follows[i]).ok());
    std::vector<std::byte> dest(payloads[i] + 2, std::byte{0xEE});
    ASSERT_TRUE(reader.ReadTrailing(dest.data() + 1, payloads[i]).ok());
    EXPECT_EQ(dest.front(), std::byte{0xEE});
    EXPECT_EQ(dest.back(), std::byte{0xEE});
    for (size_t j = 0; j < payloads[i]; ++j) {
      ASSERT_EQ(dest[1 + j], static_cast<std::byte>(i + j)) << i << " " << j;
    }
  }
}

TEST_F(SocketPair, DiscardedPayloadDoesNotLeakIntoHeaders) {
  constexpr size_t kHeader = 8;
  // Payloads larger than the discard scratch buffer, followed by headers read ahead.
  const std::vector<size_t> payloads = {600000, 0, 300000, 10, 0};
  std::vector<uint16_t> follows(payloads.size());
  for (size_t i = payloads.size(); i-- > 0;) {
    follows[i] = i + 1 == payloads.size() ? 0 : payloads[i + 1] > 0 ? 1 : follows[i + 1] + 1;
  }
  std::vector<std::byte> stream;
  for (size_t i = 0; i < payloads.size(); ++i) {
    std::byte header[kHeader] = {};
    wire::Store32(header, static_cast<uint32_t>(i) + 1000);
    stream.insert(stream.end(), header, header + kHeader);
    stream.insert(stream.end(), payloads[i], std::byte{0x77});
  }
  std::thread sender([&] { ASSERT_TRUE(SendAll(b_, stream.data(), stream.size()).ok()); });
  HeaderReader reader(a_, kHeader, nullptr);
  for (size_t i = 0; i < payloads.size(); ++i) {
    absl::StatusOr<const std::byte*> header = reader.Next();
    ASSERT_TRUE(header.ok()) << header.status();
    ASSERT_EQ(wire::Load32(*header), i + 1000);
    ASSERT_TRUE(reader.Expect(payloads[i], follows[i]).ok());
    ASSERT_TRUE(reader.DiscardTrailing(payloads[i]).ok());
  }
  sender.join();
}

TEST_F(SocketPair, LyingFollowHintIsDetected) {
  constexpr size_t kHeader = 8;
  std::vector<std::byte> stream(kHeader * 2 + 64, std::byte{1});
  ASSERT_TRUE(SendAll(b_, stream.data(), stream.size()).ok());
  HeaderReader reader(a_, kHeader, nullptr);
  ASSERT_TRUE(reader.Next().ok());
  // Claims 5 payload-free headers follow; the second header actually carries 64 bytes.
  ASSERT_TRUE(reader.Expect(0, 5).ok());
  ASSERT_TRUE(reader.Next().ok());  // reads ahead up to 4 more "headers": payload bytes
  absl::Status s = reader.Expect(64, 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
}

// A payload cancelled half way: the second half, sent after the flag flips, is dropped (the
// owner took its memory back) and the next header is still read in sync.
TEST_F(SocketPair, CancelledPayloadStopsWritingItsDestination) {
  constexpr size_t kHeader = 8;
  constexpr size_t kPayload = 300000;
  std::vector<std::byte> first(kHeader + kPayload / 2, std::byte{0x11});
  wire::Store32(first.data(), 1);
  std::vector<std::byte> second(kPayload / 2 + kHeader, std::byte{0x22});
  wire::Store32(second.data() + kPayload / 2, 2);
  ASSERT_TRUE(SendAll(b_, first.data(), first.size()).ok());

  HeaderReader reader(a_, kHeader, nullptr);
  ASSERT_TRUE(reader.Next().ok());
  ASSERT_TRUE(reader.Expect(kPayload, 1).ok());
  std::vector<std::byte> dest(kPayload, std::byte{0xEE});
  std::atomic<bool> cancelled{false};
  absl::Status result;
  std::thread receiver([&] { result = reader.ReadTrailing(dest.data(), kPayload, &cancelled); });
  // Wait (bounded) until the receiver has taken the first half off the socket (dest is
  // not looked at while it may be written), then cancel and send the rest.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  int queued = -1;
  while ((::ioctl(a_, FIONREAD, &queued) != 0 || queued > 0) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(queued, 0);
  absl::SleepFor(absl::Milliseconds(30));  // the receiver is back in poll
  cancelled.store(true);
  ASSERT_TRUE(SendAll(b_, second.data(), second.size()).ok());
  receiver.join();
  EXPECT_TRUE(absl::IsCancelled(result)) << result;
  for (size_t i = 0; i < kPayload / 2; ++i) ASSERT_EQ(dest[i], std::byte{0x11}) << i;
  for (size_t i = kPayload / 2; i < kPayload; ++i) ASSERT_EQ(dest[i], std::byte{0xEE}) << i;
  absl::StatusOr<const std::byte*> header = reader.Next();
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(wire::Load32(*header), 2u);
}

class FlushWrites final : public PendingOutput {
 public:
  explicit FlushWrites(int fd) : fd_(fd) {}
  bool HasPending() const override { return pending_; }
  absl::Status Flush() override {
    ++flushes_;
    pending_ = false;
    // Stands for "the peer got our responses and now sends more".
    std::array<std::byte, 8> header{};
    return SendAll(fd_, header.data(), header.size());
  }
  bool pending_ = true;
  int flushes_ = 0;

 private:
  const int fd_;
};

TEST_F(SocketPair, FlushesPendingOutputBeforeBlocking) {
  FlushWrites output(b_);
  HeaderReader reader(a_, 8, &output);
  // Nothing to read until the reader flushes: without the flush this times out.
  absl::StatusOr<const std::byte*> header = reader.Next();
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(output.flushes_, 1);
  // With nothing pending, no flush.
  ASSERT_TRUE(SendAll(b_, std::array<std::byte, 8>{}.data(), 8).ok());
  ASSERT_TRUE(reader.Expect(0, 0).ok());
  ASSERT_TRUE(reader.Next().ok());
  EXPECT_EQ(output.flushes_, 1);
}

// A connected tcp pair on loopback (SO_RCVLOWAT is a tcp matter: unix sockets ignore it).
class TcpPair : public ::testing::Test {
 protected:
  void SetUp() override {
    const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(listener, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    // The transport's size (socket_buffer_bytes), before the handshake fixes the window scale.
    ASSERT_TRUE(ConfigureSocket(listener, 4 << 20).ok());
    ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(::listen(listener, 1), 0);
    ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    b_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_EQ(::connect(b_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    a_ = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    ::close(listener);
    ASSERT_GE(a_, 0);
    const int one = 1;
    ASSERT_EQ(::setsockopt(b_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)), 0);
    ASSERT_TRUE(SetNonBlocking(a_, true).ok());
  }
  void TearDown() override {
    ::close(a_);
    ::close(b_);
  }
  int LowWater() const {
    int value = -1;
    socklen_t len = sizeof(value);
    EXPECT_EQ(::getsockopt(a_, SOL_SOCKET, SO_RCVLOWAT, &value, &len), 0);
    return value;
  }
  // Waits (bounded) until `bytes` are queued on the read side.
  void WaitQueued(int bytes) const {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    int queued = -1;
    while ((::ioctl(a_, FIONREAD, &queued) != 0 || queued < bytes) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_GE(queued, bytes);
  }
  bool Readable() const {
    pollfd entry{a_, POLLIN, 0};
    return ::poll(&entry, 1, 0) == 1;
  }
  void Send(size_t bytes, std::byte value) {
    std::vector<std::byte> data(bytes, value);
    ASSERT_TRUE(SendAll(b_, data.data(), data.size()).ok());
  }
  int a_ = -1;  // read side, non-blocking as on the I/O pool
  int b_ = -1;  // write side
};

// Mid-payload the reader asks to be woken only once the rest of the payload (at most
// kLowWaterBytes of it, and at most a quarter of the receive buffer) is there, not for every
// segment; before waiting for a header it asks for any byte again, and a blocking read never
// inherits the raised mark.
TEST_F(TcpPair, ReaderWakesOncePerPieceOfPayloadNotPerSegment) {
  constexpr size_t kHeader = 8;
  int buffer = 0;
  socklen_t len = sizeof(buffer);
  ASSERT_EQ(::getsockopt(a_, SOL_SOCKET, SO_RCVBUF, &buffer, &len), 0);
  const size_t mark = std::min(HeaderReader::kLowWaterBytes, static_cast<size_t>(buffer) / 4);
  ASSERT_GT(mark, 4096u);
  const size_t payload = 1000 + mark + mark / 2;
  HeaderReader reader(a_, kHeader, nullptr);
  Send(kHeader, std::byte{1});
  WaitQueued(kHeader);
  absl::StatusOr<const std::byte*> header = reader.TryNext();
  ASSERT_TRUE(header.ok() && *header != nullptr) << header.status();
  ASSERT_TRUE(reader.Expect(payload, 0).ok());
  EXPECT_EQ(LowWater(), 1);

  std::vector<std::byte> dest(payload, std::byte{0xEE});
  size_t done = 0;
  Send(1000, std::byte{0x5A});
  WaitQueued(1000);
  absl::StatusOr<bool> finished = reader.TryReadTrailing(dest.data(), payload, &done);
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_FALSE(*finished);
  EXPECT_EQ(done, 1000u);
  EXPECT_EQ(LowWater(), static_cast<int>(mark));
  // Less than the mark: not readable, so epoll would not wake the I/O thread.
  Send(mark / 2, std::byte{0x5A});
  WaitQueued(static_cast<int>(mark / 2));
  EXPECT_FALSE(Readable());
  Send(mark - mark / 2, std::byte{0x5A});
  WaitQueued(static_cast<int>(mark));
  EXPECT_TRUE(Readable());
  finished = reader.TryReadTrailing(dest.data(), payload, &done);
  ASSERT_TRUE(finished.ok() && !*finished);
  // The rest of the payload is less than the mark: the mark comes down to it, never above
  // what the peer owes (it may send nothing more until it is answered).
  const size_t left = payload - done;
  ASSERT_EQ(left, mark / 2);
  EXPECT_EQ(LowWater(), static_cast<int>(left));
  Send(left - 1, std::byte{0x5A});
  WaitQueued(static_cast<int>(left - 1));
  EXPECT_FALSE(Readable());
  Send(1, std::byte{0x5A});
  WaitQueued(static_cast<int>(left));
  EXPECT_TRUE(Readable());
  finished = reader.TryReadTrailing(dest.data(), payload, &done);
  ASSERT_TRUE(finished.ok() && *finished);
  for (size_t i = 0; i < payload; ++i) ASSERT_EQ(dest[i], std::byte{0x5A}) << i;

  // The mark is still up. A waiting read of a payload smaller than it (a cancellable
  // ReadTrailing polls the non-blocking socket, as the staged GPU paths do) must not wait for
  // the mark: poll() would never say readable.
  EXPECT_EQ(LowWater(), static_cast<int>(left));
  constexpr size_t kSmall = 100;
  ASSERT_LT(kSmall, left);
  ASSERT_TRUE(reader.Expect(kSmall, 0).ok());
  Send(kSmall, std::byte{0x77});
  std::atomic<bool> give_up{false};
  std::vector<std::byte> small(kSmall);
  std::future<absl::Status> read = std::async(
      std::launch::async, [&] { return reader.ReadTrailing(small.data(), kSmall, &give_up); });
  const bool returned = read.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  give_up.store(true);  // ends a read that waits for the mark (it then drops the bytes)
  const absl::Status small_read = read.get();
  ASSERT_TRUE(returned) << "a waiting read of " << kSmall << " bytes waited for the mark";
  ASSERT_TRUE(small_read.ok()) << small_read;
  EXPECT_EQ(small, std::vector<std::byte>(kSmall, std::byte{0x77}));
  EXPECT_EQ(LowWater(), 1);

  // And the non-blocking header read brings it down too.
  ASSERT_TRUE(reader.Expect(payload, 0).ok());
  done = 0;
  finished = reader.TryReadTrailing(dest.data(), payload, &done);
  ASSERT_TRUE(finished.ok() && !*finished);
  EXPECT_EQ(LowWater(), static_cast<int>(mark));
  Send(payload, std::byte{0x33});
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!*finished && absl::Now() < deadline) {
    finished = reader.TryReadTrailing(dest.data(), payload, &done);
    ASSERT_TRUE(finished.ok()) << finished.status();
  }
  ASSERT_TRUE(*finished);
  header = reader.TryNext();
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(*header, nullptr);  // nothing sent yet
  EXPECT_EQ(LowWater(), 1);
}

TEST(TcpSocketTest, ParsesEndpoints) {
  std::string host;
  uint16_t port = 0;
  ASSERT_TRUE(ParseEndpoint("127.0.0.1:80", &host, &port).ok());
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 80);
  ASSERT_TRUE(ParseEndpoint("[::1]:9000", &host, &port).ok());
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 9000);
  EXPECT_EQ(FormatEndpoint("::1", 9000), "[::1]:9000");
  EXPECT_FALSE(ParseEndpoint("127.0.0.1", &host, &port).ok());
  EXPECT_FALSE(ParseEndpoint("127.0.0.1:0", &host, &port).ok());
  EXPECT_FALSE(ParseEndpoint("127.0.0.1:70000", &host, &port).ok());
  EXPECT_FALSE(ParseEndpoint(":80", &host, &port).ok());
}

}  // namespace
}  // namespace kvwire::transport
