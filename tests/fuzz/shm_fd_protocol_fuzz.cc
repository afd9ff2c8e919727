// The shm transport's fd-socket messages (transport/shm/fd_protocol.cc): a request is what a
// same-host peer sends the fd server before it proved anything, a reply is what the client
// takes from the server. Byte 0 bit 0 picks which one the rest of the input is; whatever
// decodes must encode back to the same bytes, also when decoded into (and encoded from) storage
// an earlier input used.
#include <cstddef>
#include <cstdint>
#include <string>

#include "tests/fuzz/fuzz_util.h"
#include "transport/shm/fd_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvwire::transport::shm;
  if (size == 0) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((data[0] & 1) == 0) {
    absl::StatusOr<FdRequest> request = DecodeRequest(bytes);
    // The server decodes into one request kept from message to message (and the link encodes
    // into one string): whatever the last input left there, the answer is the fresh one's.
    static FdRequest reused;
    static std::string reencoded;
    const absl::Status into = DecodeRequestInto(bytes, &reused);
    KVWIRE_FUZZ_CHECK(into.ok() == request.ok());
    if (!request.ok()) return 0;
    EncodeRequestTo(reused, &reencoded);
    KVWIRE_FUZZ_CHECK(reencoded == bytes);
    KVWIRE_FUZZ_CHECK(request->token.size() <= kMaxTokenBytes);
    KVWIRE_FUZZ_CHECK(
        request->kind == FdRequestKind::kHello || request->kind == FdRequestKind::kFetch ||
        request->kind == FdRequestKind::kStaging || request->kind == FdRequestKind::kCopy);
    KVWIRE_FUZZ_CHECK(request->ops.size() <= kMaxCopyOps);
    KVWIRE_FUZZ_CHECK(request->kind == FdRequestKind::kCopy || request->ops.empty());
    KVWIRE_FUZZ_CHECK(EncodeRequest(*request) == bytes);
  } else {
    absl::StatusOr<FdReply> reply = DecodeReply(bytes);
    if (!reply.ok()) return 0;
    KVWIRE_FUZZ_CHECK(reply->message.size() <= kMaxFdMessageBytes);
    // Codes outside absl's range read as kUnknown, so only a valid code round-trips exactly.
    absl::StatusOr<FdReply> again = DecodeReply(EncodeReply(*reply));
    KVWIRE_FUZZ_CHECK(again.ok() && again->code == reply->code && again->region == reply->region &&
                      again->memfd_offset == reply->memfd_offset &&
                      again->length == reply->length && again->access == reply->access &&
                      again->epoch_slot == reply->epoch_slot && again->epoch == reply->epoch &&
                      again->flags == reply->flags);
  }
  return 0;
}
