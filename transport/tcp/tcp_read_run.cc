#include "transport/tcp/tcp_read_run.h"

#include <utility>

namespace kvwire::transport {

bool ReadRun::Covers(const tcp_wire::RequestHeader& h) const {
  if (pin_ == nullptr || next_ >= end_ || h.sequence != next_sequence_ || h.grant != grant_ ||
      h.kind != tcp_wire::kKindRead) {
    return false;
  }
  const IncomingOp& op = ops_[next_];
  return op.region == h.region && op.offset == h.offset && op.length == h.length;
}

void ReadRun::Clear() {
  pin_.reset();
  next_ = end_ = 0;
}

absl::StatusOr<IncomingAccess> ReadRun::Resolve(TargetHooks& hooks, PeerId peer,
                                                const tcp_wire::RequestHeader& h,
                                                absl::Span<const std::byte> ahead,
                                                uint64_t max_op_bytes) {
  if (Covers(h)) {
    const IncomingMemory& memory = memory_[next_];
    ++next_;
    ++next_sequence_;
    // The last op of the run takes the run's own pin.
    std::shared_ptr<const void> pin = next_ == end_ ? std::move(pin_) : pin_;
    return IncomingAccess{memory.data, memory.gpu_device, std::move(pin)};
  }
  Clear();
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
  if (run.resolved > 1) {
    pin_ = run.pin;
    next_ = 1;
    end_ = run.resolved;
    next_sequence_ = h.sequence + 1;
    grant_ = h.grant;
  }
  return IncomingAccess{memory_[0].data, memory_[0].gpu_device, std::move(run.pin)};
}

}  // namespace kvwire::transport
