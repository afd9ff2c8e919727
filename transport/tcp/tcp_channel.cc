#include "transport/tcp/tcp_channel.h"

#include <array>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::transport {
namespace {

namespace wire = tcp_wire;

// The same status with `context` in front of its message.
absl::Status Prefixed(const absl::Status& s, const std::string& context) {
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

}  // namespace

absl::StatusOr<std::shared_ptr<ClientConnection>> OpenLane(const PeerLink& link, uint32_t lane,
                                                           int socket_buffer_bytes,
                                                           const GpuStaging& staging,
                                                           const std::shared_ptr<IoPool>& pool) {
  const std::string context = absl::StrCat("tcp data connection to ", link.remote_endpoint,
                                           " (lane ", lane, " of ", link.lanes, ")");
  if (link.token.size() > wire::kMaxTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": session token of ",
                                                   link.token.size(), " bytes exceeds ",
                                                   wire::kMaxTokenBytes));
  }
  absl::StatusOr<std::unique_ptr<Socket>> socket =
      Dial(link.remote_endpoint, link.deadline, socket_buffer_bytes);
  if (!socket.ok()) {
    return absl::Status(socket.status().code(), absl::StrCat(socket.status().message(), " (lane ",
                                                             lane, " of ", link.lanes, ")"));
  }
  const int fd = (*socket)->fd();

  // The hello exchange is bounded by the same deadline as the dial.
  const absl::Duration left = link.deadline - absl::Now();
  if (left <= absl::ZeroDuration()) {
    return absl::DeadlineExceededError(absl::StrCat(context, ": deadline passed before hello"));
  }
  if (absl::Status s = SetIoTimeout(fd, left); !s.ok()) return Prefixed(s, context);

  wire::Hello hello;
  hello.token_len = static_cast<uint32_t>(link.token.size());
  hello.lane = lane;
  std::array<std::byte, wire::kHelloBytes> out;
  wire::EncodeHello(hello, out.data());
  iovec iov[2] = {{out.data(), out.size()},
                  {const_cast<char*>(link.token.data()), link.token.size()}};
  absl::Status s = SendAll(fd, iov, 2);
  std::array<std::byte, wire::kHelloReplyBytes> in;
  if (s.ok()) s = RecvExact(fd, in.data(), in.size());
  if (!s.ok()) {
    if (absl::IsDeadlineExceeded(s)) {
      return absl::DeadlineExceededError(absl::StrCat(context, ": hello timed out"));
    }
    return absl::UnavailableError(absl::StrCat(context, ": hello failed: ", s.message()));
  }
  wire::HelloReply reply;
  if (s = wire::DecodeHelloReply(in.data(), &reply); !s.ok()) return Prefixed(s, context);
  std::string message(reply.message_len, '\0');
  if (s = RecvExact(fd, message.data(), message.size()); !s.ok()) {
    return absl::UnavailableError(absl::StrCat(context, ": hello reply: ", s.message()));
  }
  if (reply.code != 0) {
    return absl::Status(wire::CodeFromWire(reply.code),
                        absl::StrCat(context, ": refused by the target: ", message));
  }
  if (reply.version != wire::kVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(context, ": target speaks wire protocol version ", reply.version,
                     ", this side ", wire::kVersion));
  }
  if (s = SetIoTimeout(fd, absl::ZeroDuration()); !s.ok()) return Prefixed(s, context);

  auto connection = std::make_shared<ClientConnection>(std::move(*socket), link.remote_endpoint,
                                                       lane, reply.max_op_bytes, staging, pool);
  connection->SetVerifyChecksums(link.verify_checksums, link.peer_name);
  if (s = connection->Start(); !s.ok()) {
    connection->Close(s);
    connection->Join();
    return Prefixed(s, context);
  }
  return connection;
}

TcpChannel::TcpChannel(std::string endpoint,
                       std::vector<std::shared_ptr<ClientConnection>> connections,
                       bool verify_checksums)
    : endpoint_(std::move(endpoint)),
      connections_(std::move(connections)),
      verify_checksums_(verify_checksums) {}

TcpChannel::~TcpChannel() {
  Close(absl::CancelledError(absl::StrCat("tcp channel to ", endpoint_, " destroyed")));
  for (const std::shared_ptr<ClientConnection>& connection : connections_) connection->Join();
}

void TcpChannel::Post(PostRequest request, DoneCallback done) {
  const size_t lane = request.lane % connections_.size();
  connections_[lane]->Post(std::move(request), std::move(done));
}

void TcpChannel::Close(const absl::Status& reason) {
  for (const std::shared_ptr<ClientConnection>& connection : connections_) {
    connection->Close(reason);
  }
}

std::string TcpChannel::Describe() const {
  return absl::StrCat("tcp x", connections_.size(), " ", endpoint_,
                      verify_checksums_ ? " +crc32c" : "");
}

}  // namespace kvwire::transport
