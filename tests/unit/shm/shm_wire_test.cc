// The shm transport's endpoint string, host id and fd-request messages.
#include <string>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/shm/fd_protocol.h"
#include "transport/shm/shm_endpoint.h"
#include "transport/shm/shm_transport.h"

namespace kvwire::transport::shm {
namespace {

using ::testing::HasSubstr;

TEST(ShmEndpointTest, RoundTripsAnyBytes) {
  ShmEndpoint endpoint;
  endpoint.host_id = std::string("boot id with spaces=;%\n\0x", 25);
  endpoint.socket_name = "kvwire-shm.engine.12.abc";
  endpoint.pid = 4242;
  endpoint.probe_address = 0x7ffd12345678;
  endpoint.probe_value = 0xfedcba9876543210;
  const std::string text = EncodeEndpoint(endpoint);
  EXPECT_EQ(text.find('\n'), std::string::npos);
  EXPECT_EQ(text.find('\0'), std::string::npos);
  absl::StatusOr<ShmEndpoint> parsed = ParseEndpoint(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->host_id, endpoint.host_id);
  EXPECT_EQ(parsed->socket_name, endpoint.socket_name);
  EXPECT_EQ(parsed->pid, endpoint.pid);
  EXPECT_EQ(parsed->probe_address, endpoint.probe_address);
  EXPECT_EQ(parsed->probe_value, endpoint.probe_value);
}

TEST(ShmEndpointTest, IgnoresUnknownFields) {
  absl::StatusOr<ShmEndpoint> parsed =
      ParseEndpoint("kvwire-shm/1 host=h socket=s pid=1 probe=10 nonce=ff future=x");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->probe_address, 0x10u);
  EXPECT_EQ(parsed->probe_value, 0xffu);
}

TEST(ShmEndpointTest, RejectsMalformed) {
  for (const char* text : {"", "tcp 127.0.0.1:5", "kvwire-shm/1 host=h socket=s pid=1 probe=1",
                           "kvwire-shm/1 host=h socket=s pid=x probe=1 nonce=1",
                           "kvwire-shm/1 host=%4 socket=s pid=1 probe=1 nonce=1",
                           "kvwire-shm/1 host=%zz socket=s pid=1 probe=1 nonce=1",
                           "kvwire-shm/1 host socket=s pid=1 probe=1 nonce=1",
                           "kvwire-shm/1 host=h socket= pid=1 probe=1 nonce=1"}) {
    absl::StatusOr<ShmEndpoint> parsed = ParseEndpoint(text);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
}

TEST(HostIdTest, NamesBootAndNamespaces) {
  const std::string id = LocalHostId();
  EXPECT_NE(id.find("ipc:["), std::string::npos) << id;
  EXPECT_NE(id.find("mnt:["), std::string::npos) << id;
  EXPECT_NE(id.find("net:["), std::string::npos) << id;
  EXPECT_EQ(id, LocalHostId());
  EXPECT_GE(id.size(), 36u + 3 * 5) << "boot id (a UUID) and three namespaces: " << id;
}

TEST(FdProtocolTest, RequestRoundTrip) {
  FdRequest request;
  request.kind = FdRequestKind::kFetch;
  request.region = 77;
  request.token = std::string("tok\0en", 6);
  absl::StatusOr<FdRequest> decoded = DecodeRequest(EncodeRequest(request));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->kind, FdRequestKind::kFetch);
  EXPECT_EQ(decoded->region, 77u);
  EXPECT_EQ(decoded->token, request.token);
}

TEST(FdProtocolTest, ReplyRoundTrip) {
  FdReply reply;
  reply.code = absl::StatusCode::kPermissionDenied;
  reply.message = "region 5 not exported to peer 2";
  reply.region = 5;
  reply.memfd_offset = 4196;
  reply.length = 1 << 20;
  reply.access = 3;
  reply.epoch_slot = 65535;
  reply.epoch = uint64_t{1} << 40;
  absl::StatusOr<FdReply> decoded = DecodeReply(EncodeReply(reply));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->code, reply.code);
  EXPECT_EQ(decoded->message, reply.message);
  EXPECT_EQ(decoded->region, 5u);
  EXPECT_EQ(decoded->memfd_offset, 4196u);
  EXPECT_EQ(decoded->length, uint64_t{1} << 20);
  EXPECT_EQ(decoded->access, 3u);
  EXPECT_EQ(decoded->epoch_slot, 65535u);
  EXPECT_EQ(decoded->epoch, uint64_t{1} << 40);
}

TEST(FdProtocolTest, RejectsMalformedRequests) {
  FdRequest request;
  request.token = "t";
  const std::string good = EncodeRequest(request);
  EXPECT_FALSE(DecodeRequest("").ok());
  EXPECT_FALSE(DecodeRequest(good.substr(0, good.size() - 1)).ok()) << "truncated";
  EXPECT_FALSE(DecodeRequest(good + "x").ok()) << "trailing bytes";
  std::string bad_magic = good;
  bad_magic[0] ^= 1;
  EXPECT_FALSE(DecodeRequest(bad_magic).ok());
  std::string bad_kind = good;
  bad_kind[4] = 9;
  EXPECT_FALSE(DecodeRequest(bad_kind).ok());
  request.token = std::string(kMaxTokenBytes + 1, 'x');
  EXPECT_FALSE(DecodeRequest(EncodeRequest(request)).ok()) << "token too long";
}

TEST(FdProtocolTest, CopyRequestRoundTrip) {
  FdRequest request;
  request.kind = FdRequestKind::kCopy;
  request.region = 12;  // the sequence number
  request.token = "tok";
  request.copy_kind = OpKind::kWrite;
  request.grant = uint64_t{0xfeedface} << 20;
  request.slot = 3;
  for (size_t i = 0; i < kMaxCopyOps; ++i) request.ops.push_back(CopyOp{i + 1, i * 4096, 4096});
  const std::string bytes = EncodeRequest(request);
  EXPECT_LE(bytes.size() + kMaxTokenBytes - request.token.size(), kMaxFdMessageBytes)
      << "a copy request with the longest token must fit one message";
  absl::StatusOr<FdRequest> decoded = DecodeRequest(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->kind, FdRequestKind::kCopy);
  EXPECT_EQ(decoded->region, 12u);
  EXPECT_EQ(decoded->copy_kind, OpKind::kWrite);
  EXPECT_EQ(decoded->grant, request.grant);
  EXPECT_EQ(decoded->slot, 3u);
  ASSERT_EQ(decoded->ops.size(), kMaxCopyOps);
  EXPECT_EQ(decoded->ops[5].region, 6u);
  EXPECT_EQ(decoded->ops[5].offset, 5u * 4096);
  EXPECT_EQ(decoded->ops[5].length, 4096u);
  EXPECT_EQ(EncodeRequest(*decoded), bytes);

  FdRequest staging;
  staging.kind = FdRequestKind::kStaging;
  staging.token = "tok";
  decoded = DecodeRequest(EncodeRequest(staging));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->kind, FdRequestKind::kStaging);
  EXPECT_TRUE(decoded->ops.empty());
}

TEST(FdProtocolTest, RejectsMalformedCopyRequests) {
  FdRequest request;
  request.kind = FdRequestKind::kCopy;
  request.token = "t";
  request.ops.push_back(CopyOp{1, 0, 64});
  const std::string good = EncodeRequest(request);
  ASSERT_TRUE(DecodeRequest(good).ok());
  EXPECT_FALSE(DecodeRequest(good.substr(0, good.size() - 1)).ok()) << "truncated op";
  EXPECT_FALSE(DecodeRequest(good + "x").ok()) << "trailing bytes";
  FdRequest none = request;
  none.ops.clear();
  EXPECT_THAT(DecodeRequest(EncodeRequest(none)).status().message(), HasSubstr("0 copy ops"));
  FdRequest many = request;
  many.ops.assign(kMaxCopyOps + 1, CopyOp{1, 0, 64});
  EXPECT_FALSE(DecodeRequest(EncodeRequest(many)).ok()) << "more ops than kMaxCopyOps";
  // The copy kind byte follows magic, kind, sequence and the token (4 + 1 + 8 + 4 + 1).
  std::string bad_kind = good;
  bad_kind[18] = 7;
  EXPECT_THAT(DecodeRequest(bad_kind).status().message(), HasSubstr("unknown copy kind"));
}

TEST(FdProtocolTest, ReplyFlagsRoundTrip) {
  FdReply reply;
  reply.flags = 0x80000001u;
  absl::StatusOr<FdReply> decoded = DecodeReply(EncodeReply(reply));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->flags, 0x80000001u);
}

}  // namespace
}  // namespace kvwire::transport::shm
