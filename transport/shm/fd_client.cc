#include "transport/shm/fd_client.h"

#include "absl/strings/str_cat.h"

#include "transport/shm/seqpacket.h"

namespace kvwire::transport::shm {

absl::StatusOr<FdResponse> CallFdServer(int socket, const FdRequest& request, absl::Time deadline) {
  absl::Status sent = SendMessage(socket, EncodeRequest(request), -1, deadline);
  if (!sent.ok()) return sent;
  absl::StatusOr<ReceivedMessage> message = ReceiveMessage(socket, kMaxFdMessageBytes, deadline);
  if (!message.ok()) return message.status();
  if (message->eof) return absl::UnavailableError("the peer closed the shm socket");
  absl::StatusOr<FdReply> reply = DecodeReply(message->bytes);
  if (!reply.ok()) return reply.status();
  if (reply->region != request.region) {
    return absl::InternalError(absl::StrCat("shm: reply for region ", reply->region,
                                            " to a request for region ", request.region));
  }
  FdResponse response;
  response.reply = *std::move(reply);
  response.fd = std::move(message->fd);
  return response;
}

}  // namespace kvwire::transport::shm
