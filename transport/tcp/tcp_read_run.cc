#include "transport/tcp/tcp_read_run.h"

#include <utility>

#include "transport/region_moving.h"

namespace kvwire::transport {

bool ReadRun::Covers(TargetHooks& hooks, const tcp_wire::RequestHeader& h) const {
  const bool resolved = next_ < end_ && pin_ != nullptr;
  const bool refused = next_ == end_ && !refused_.ok();
  if ((!resolved && !refused) || h.sequence != next_sequence_ || h.grant != grant_ ||
      h.kind != tcp_wire::kKindRead) {
    return false;
  }
  const IncomingOp& op = ops_[next_];
  return op.region == h.region && op.offset == h.offset && op.length == h.length &&
         hooks.AccessEpoch() == epoch_;
}

void ReadRun::Clear() {
  pin_.reset();
  next_ = end_ = 0;
  refused_ = absl::OkStatus();
}

absl::StatusOr<IncomingAccess> ReadRun::Resolve(TargetHooks& hooks, PeerId peer,
                                                const tcp_wire::RequestHeader& h,
                                                absl::Span<const std::byte> ahead,
                                                uint64_t max_op_bytes) {
  if (Covers(hooks, h)) {
    if (next_ == end_) {
      absl::Status refused = std::move(refused_);
      Clear();
      return refused;
    }
    const IncomingMemory& memory = memory_[next_];
    ++next_;
    ++next_sequence_;
    // The last op of the run takes the run's own pin.
    std::shared_ptr<const void> pin = next_ == end_ ? std::move(pin_) : pin_;
    return IncomingAccess{memory.data, memory.gpu_device, std::move(pin)};
  }
  Clear();
  // Read before the checks: a change of access after it shows as a new value.
  epoch_ = hooks.AccessEpoch();
  ops_[0] = IncomingOp{h.region, h.offset, h.length};
  size_t count = 1;
  // Only headers that decode cleanly join; whatever stops the run is met again when its
  // header is accepted.
  for (size_t at = 0; count < kMaxRunOps && at + tcp_wire::kRequestBytes <= ahead.size();
       at += tcp_wire::kRequestBytes) {
    tcp_wire::RequestHeader next;
    if (!tcp_wire::DecodeRequest(ahead.data() + at, max_op_bytes, &next).ok() ||
        next.kind != tcp_wire::kKindRead || next.sequence != h.sequence + count ||
        next.grant != h.grant) {
      break;
    }
    ops_[count++] = IncomingOp{next.region, next.offset, next.length};
  }
  if (count == 1) {
    return hooks.ResolveIncoming(peer, h.region, h.offset, h.length, OpKind::kRead, h.grant);
  }
  IncomingRun run =
      hooks.ResolveIncomingRun(peer, absl::MakeConstSpan(ops_.data(), count), OpKind::kRead,
                               h.grant, absl::MakeSpan(memory_.data(), count));
  if (run.resolved == 0) return run.status;
  next_ = 1;
  end_ = run.resolved;
  next_sequence_ = h.sequence + 1;
  grant_ = h.grant;
  // A region being moved is no refusal: that op is resolved again when it comes (it waits
  // for the move then).
  if (!run.status.ok() && !IsRegionMoving(run.status)) refused_ = run.status;
  if (end_ > 1) pin_ = run.pin;
  return IncomingAccess{memory_[0].data, memory_[0].gpu_device, std::move(run.pin)};
}

}  // namespace kvwire::transport
