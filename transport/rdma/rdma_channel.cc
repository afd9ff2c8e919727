#include "transport/rdma/rdma_channel.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "src/util/fault_injection.h"
#include "transport/rdma/rdma_plan.h"

namespace kvwire::transport::rdma {
namespace {
// A thread keeps the scratch of its last Post up to this many ops.
constexpr size_t kKeptScratchOps = size_t{1} << 16;

// Out of line: a reference to a thread_local in a shared library is otherwise recomputed
// (__tls_get_addr) at each use in Post's loops (~10 instructions per op).
__attribute__((noinline)) std::vector<ResolvedOp>& ThreadScratch() {
  thread_local std::vector<ResolvedOp> scratch;
  return scratch;
}
}  // namespace

absl::Status RdmaChannel::AddRemoteRegions(const std::vector<RemoteRegionDesc>& regions) {
  std::vector<std::pair<RegionId, RemoteMr>> parsed;
  for (const RemoteRegionDesc& desc : regions) {
    const std::string key(desc.Key());
    if (key.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("peer ", core_->peer_name, " region ", desc.id, " has no rdma key"));
    }
    RemoteMr mr;
    mr.address = desc.address;
    mr.length = desc.length;
    for (absl::string_view part : absl::StrSplit(key, ',')) {
      uint32_t rkey = 0;
      if (!absl::SimpleAtoi(part, &rkey)) {
        return absl::InvalidArgumentError(absl::StrCat("peer ", core_->peer_name, " region ",
                                                       desc.id, ": bad rdma key \"", key, "\""));
      }
      mr.rkeys.push_back(rkey);
    }
    if (mr.rkeys.size() < static_cast<size_t>(core_->remote.devices_size())) {
      return absl::InvalidArgumentError(absl::StrCat("peer ", core_->peer_name, " region ", desc.id,
                                                     ": ", mr.rkeys.size(), " rkeys for ",
                                                     core_->remote.devices_size(), " devices"));
    }
    parsed.emplace_back(desc.id, std::move(mr));
  }
  MutexLock lock(&mu_);
  for (auto& [id, mr] : parsed) remote_[id] = std::move(mr);
  return absl::OkStatus();
}

void RdmaChannel::Post(PostRequest request, DoneCallback done) {
  if (request.ops.empty()) {
    done(absl::OkStatus());
    return;
  }
  const QpAddress where = LaneToQp(request.lane, devices_, per_device_);
  const std::shared_ptr<ClientQp>& qp = qps_[where.device * per_device_ + where.qp];
  const uint32_t local_dev = where.device;
  const uint32_t remote_dev = qp->remote_device();
  auto lane = std::make_unique<Lane>();
  lane->opcode = request.kind == OpKind::kRead ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
  lane->counted = request.kind == OpKind::kWrite && request.count_arrivals;
  lane->pieces = static_cast<uint32_t>(request.ops.size());
  if (lane->counted && request.ops.size() > kMaxCountPerImm) {
    done(absl::InvalidArgumentError(
        absl::StrCat("transfer ", request.transfer_id, ": ", request.ops.size(),
                     " pieces in one lane (at most ", kMaxCountPerImm, ")")));
    return;
  }
  // Resolved into this thread's scratch, kept for its next Post (PlanWrs copies what it
  // needs into the lane's plan): a lane allocates no op array of its own.
  std::vector<ResolvedOp>& ops = ThreadScratch();
  ops.clear();
  ops.reserve(request.ops.size());
  {
    MutexLock lock(&mu_);
    RegionId last_region = 0;
    const RemoteMr* mr = nullptr;
    for (size_t i = 0; i < request.ops.size(); ++i) {
      const WireOp& op = request.ops[i];
      if (mr == nullptr || op.remote_region != last_region) {
        auto it = remote_.find(op.remote_region);
        if (it == remote_.end()) {
          done(absl::NotFoundError(absl::StrCat("transfer ", request.transfer_id,
                                                ": remote region ", op.remote_region,
                                                " has no rdma key from peer ", core_->peer_name)));
          return;
        }
        mr = &it->second;
        last_region = op.remote_region;
      }
      ResolvedOp r;
      r.local_addr = reinterpret_cast<uint64_t>(op.local);
      r.remote_addr = mr->address + op.remote_offset;
      r.rkey = mr->rkeys[remote_dev];
      r.length = op.length;
      ops.push_back(r);
      lane->local_gpu = lane->local_gpu || op.local_gpu_device >= 0;
    }
  }
  // Local keys, by the region each op names (ops[i] is request.ops[i]; consecutive ops mostly
  // share a region: one lookup each time it changes).
  for (size_t i = 0; i < ops.size(); ++i) {
    ResolvedOp& r = ops[i];
    const RegionId region = request.ops[i].local_region;
    if (i > 0 && region == request.ops[i - 1].local_region) {
      r.lkey = ops[i - 1].lkey;
      continue;
    }
    auto key = transport_->LocalKey(region, r.local_addr, r.length, local_dev);
    if (!key.ok()) {
      done(absl::Status(key.status().code(), absl::StrCat("transfer ", request.transfer_id, ": ",
                                                          key.status().message())));
      return;
    }
    r.lkey = *key;
  }
  WrLimits limits;
  limits.max_sge = qp->max_sge();
  limits.max_wr_bytes = transport_->caps().max_op_bytes;
  // At most one WR and one SGE per op (and the bind), unless an op is longer than a WR may
  // be: sized once, not grown by doubling through a request's thousands of ops.
  lane->plan.wrs.reserve(ops.size() + 1);
  lane->plan.sges.reserve(ops.size() + 1);
  if (lane->counted) {
    // The bind comes first, in a WR of its own (a separate PlanWrs call never joins it);
    // its addresses and keys are filled in when a slot is assigned.
    const ResolvedOp bind{0, 0, 0, 0, sizeof(uint64_t)};
    PlanWrs(&bind, 1, limits, &lane->plan);
  }
  PlanWrs(ops.data(), ops.size(), limits, &lane->plan);
  transport_->counters()->pieces.fetch_add(request.ops.size(), std::memory_order_relaxed);
  if (core_->verify_checksums) {
    // After the completion, the end-to-end check (rdma_checksums.cc) completes the lane.
    done = [transport = transport_, core = core_, id = request.transfer_id, kind = request.kind,
            ops = request.ops, done = std::move(done)](absl::Status s) mutable {
      if (!s.ok()) {
        done(std::move(s));
        return;
      }
      transport->VerifyLane(*core, id, kind, std::move(ops), std::move(done));
    };
  } else if (request.kind == OpKind::kRead &&
             fault_injection::PayloadFlipsLeft(fault_injection::Site::kRdma) > 0) {
    // The test hook without verification (one atomic load while unarmed): a byte flipped
    // after the completion lands unnoticed, which is what verify_checksums is for.
    done = [ops = request.ops, done = std::move(done)](absl::Status s) mutable {
      for (const WireOp& op : ops) {
        if (!s.ok() || op.local_gpu_device >= 0) break;
        if (fault_injection::MaybeFlipPayloadByte(fault_injection::Site::kRdma, op.local,
                                                  op.length)) {
          break;
        }
      }
      done(std::move(s));
    };
  }
  lane->request = std::move(request);
  lane->done = std::move(done);
  qp->Enqueue(std::move(lane));
  if (ops.capacity() > kKeptScratchOps) ops = std::vector<ResolvedOp>();  // a huge one
}

}  // namespace kvwire::transport::rdma
