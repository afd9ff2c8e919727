// Helpers shm_channel.cc and shm_channel_copy.cc share: the error an op fails with, and the
// read of a region's epoch word (shareable_registry.h: it changes when the owner moves the
// buffer onto a fresh memfd).
#ifndef KVWIRE_TRANSPORT_SHM_SHM_CHANNEL_INTERNAL_H_
#define KVWIRE_TRANSPORT_SHM_SHM_CHANNEL_INTERNAL_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#include "transport/transport.h"

namespace kvwire::transport::shm {

inline const char* KindName(OpKind kind) { return kind == OpKind::kWrite ? "WRITE" : "READ"; }

// "shm transfer 7 op 3 (WRITE region 5 offset 4096 length 65536): <why>"
inline absl::Status OpError(const PostRequest& request, size_t index, absl::StatusCode code,
                            absl::string_view why) {
  const WireOp& op = request.ops[index];
  return absl::Status(code,
                      absl::StrCat("shm transfer ", request.transfer_id, " op ", index, " (",
                                   KindName(request.kind), " region ", op.remote_region, " offset ",
                                   op.remote_offset, " length ", op.length, "): ", why));
}

inline uint64_t LoadEpoch(const uint64_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_SHM_CHANNEL_INTERNAL_H_
