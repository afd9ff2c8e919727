#include "transport/shm/served_copy.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <string>
#include <unistd.h>
#include <utility>

#include "absl/strings/str_cat.h"

#include "transport/region_moving.h"
#include "transport/shm/errno_text.h"

namespace kvwire::transport::shm {
namespace {

FdReply Failed(const FdRequest& request, size_t op, const absl::Status& status) {
  FdReply reply;
  reply.code = status.code();
  reply.region = request.region;
  reply.length = op;
  reply.message = absl::StrCat("copy op ", op, ": ", status.message());
  return reply;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CopyStaging>> CopyStaging::Create() {
  UniqueFd fd(::memfd_create("kvwire-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "memfd_create");
  constexpr uint64_t kBytes = kCopySlots * kCopySlotBytes;
  if (::ftruncate(fd.get(), static_cast<off_t>(kBytes)) != 0) {
    return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "ftruncate of staging memfd");
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal, errno, "sealing the staging memfd");
  }
  absl::StatusOr<Mapping> mapping =
      Mapping::Create(fd.get(), 0, kBytes, PROT_READ | PROT_WRITE, /*populate=*/true);
  if (!mapping.ok()) return mapping.status();
  return std::make_unique<CopyStaging>(std::move(fd), *std::move(mapping));
}

FdReply ServeCopy(TargetHooks& hooks, PeerId peer, const CopyStaging& staging,
                  const FdRequest& request, absl::Status* refused) {
  if (request.slot >= kCopySlots) {
    *refused = absl::InvalidArgumentError(
        absl::StrCat("staging slot ", request.slot, " (there are ", kCopySlots, ")"));
    return Failed(request, 0, *refused);
  }
  std::byte* const slot = staging.slot(request.slot);
  uint64_t at = 0;  // where the next op's bytes lie in the slot
  for (size_t i = 0; i < request.ops.size(); ++i) {
    const CopyOp& op = request.ops[i];
    if (op.length > kCopySlotBytes - at) {
      *refused = absl::InvalidArgumentError(
          absl::StrCat("the ops overrun the staging slot (", kCopySlotBytes, " bytes)"));
      return Failed(request, i, *refused);
    }
    if (op.length == 0) continue;
    // The pin (the engine's served-ops record of the op) is released after the copy.
    absl::StatusOr<IncomingAccess> access = hooks.ResolveIncoming(
        peer, op.region, op.offset, op.length, request.copy_kind, request.grant);
    absl::Status problem = access.status();
    if (access.ok() && access->gpu_device >= 0) {
      problem = absl::FailedPreconditionError(
          absl::StrCat("region ", op.region, " is GPU memory; served copies move host memory"));
    }
    if (!problem.ok()) {
      FdReply reply = Failed(request, i, problem);
      if (IsRegionMoving(problem)) {
        reply.flags |= kCopyRegionMoving;
      } else if (!absl::IsFailedPrecondition(problem)) {
        *refused = problem;
      }
      return reply;
    }
    if (request.copy_kind == OpKind::kRead) {
      std::memcpy(slot + at, access->data, op.length);
    } else {
      std::memcpy(access->data, slot + at, op.length);
    }
    at += op.length;
  }
  FdReply reply;
  reply.region = request.region;
  reply.length = request.ops.size();
  return reply;
}

}  // namespace kvwire::transport::shm
