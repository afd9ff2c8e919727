#include "transport/shm/served_copy.h"

#include <sys/mman.h>

#include <array>
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
  if (request.ops.size() > kMaxCopyOps) {
    *refused = absl::InvalidArgumentError(
        absl::StrCat(request.ops.size(), " ops in one copy request (at most ", kMaxCopyOps, ")"));
    return Failed(request, 0, *refused);
  }
  std::byte* const slot = staging.slot(request.slot);
  // The ops fit the slot, one after another (checked before anything is resolved: a request
  // that overruns it is refused whole).
  uint64_t total = 0;
  for (size_t i = 0; i < request.ops.size(); ++i) {
    if (request.ops[i].length > kCopySlotBytes - total) {
      *refused = absl::InvalidArgumentError(
          absl::StrCat("the ops overrun the staging slot (", kCopySlotBytes, " bytes)"));
      return Failed(request, i, *refused);
    }
    total += request.ops[i].length;
  }
  // One run for the whole request: the engine checks it with one trip through each of its
  // locks, and its pin (the served-ops record of every op) is released after the copies.
  std::array<IncomingMemory, kMaxCopyOps> memory;
  IncomingRun run = hooks.ResolveIncomingRun(peer, request.ops, request.copy_kind, request.grant,
                                             absl::MakeSpan(memory.data(), request.ops.size()));
  absl::Status problem = run.status;
  size_t done = run.resolved;
  for (size_t i = 0; i < run.resolved; ++i) {
    if (memory[i].gpu_device >= 0) {
      problem = absl::FailedPreconditionError(absl::StrCat(
          "region ", request.ops[i].region, " is GPU memory; served copies move host memory"));
      done = i;
      break;
    }
  }
  uint64_t at = 0;  // where the next op's bytes lie in the slot
  for (size_t i = 0; i < done; ++i) {
    const CopyOp& op = request.ops[i];
    if (op.length == 0) continue;  // the engine refuses one; hooks that do not, copy nothing
    if (request.copy_kind == OpKind::kRead) {
      std::memcpy(slot + at, memory[i].data, op.length);
    } else {
      std::memcpy(memory[i].data, slot + at, op.length);
    }
    at += op.length;
  }
  run.pin.reset();
  if (!problem.ok()) {
    FdReply reply = Failed(request, done, problem);
    if (IsRegionMoving(problem)) {
      reply.flags |= kCopyRegionMoving;
    } else if (!absl::IsFailedPrecondition(problem)) {
      *refused = problem;
    }
    return reply;
  }
  FdReply reply;
  reply.region = request.region;
  reply.length = request.ops.size();
  return reply;
}

}  // namespace kvwire::transport::shm
