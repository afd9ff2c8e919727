// RdmaTransportImpl: end-to-end checksums (EngineOptions::verify_checksums; docs/CHECKSUMS.md).
// The NIC moves the bytes with no CPU on either side, so the check is one more step after a
// lane's completion: the initiator computes the CRC32C of its side of each op (the source of a
// WRITE, the destination of a READ), asks the target on the control channel for the CRC of
// its side (where the WRITE landed, the READ's source), and compares. Cost: one control round
// trip per lane and one CRC pass on each side; the data path is unchanged.
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "src/util/crc32c.h"
#include "src/util/fault_injection.h"
#include "src/util/log.h"
#include "transport/rdma/rdma_transport_impl.h"

namespace kvwire::transport::rdma {

void RdmaTransportImpl::VerifyLane(const ChannelCore& core, TransferId transfer_id, OpKind kind,
                                   WireOps ops, DoneCallback done) {
  PendingCheck check;
  check.peer = core.peer;
  check.core = &core;
  check.peer_name = core.peer_name;
  check.transfer_id = transfer_id;
  check.kind = kind;
  pb::RdmaControl control;
  pb::RdmaChecksumRequest* request = control.mutable_checksum_request();
  request->set_write(kind == OpKind::kWrite);
  for (const WireOp& op : ops) {
    if (op.local_gpu_device >= 0) {
      // Device memory: no CRC without a kernel on the device (not covered, documented).
      done(absl::OkStatus());
      return;
    }
    if (kind == OpKind::kRead) {
      // The test hook: a byte that changed between the NIC and this process.
      fault_injection::MaybeFlipPayloadByte(fault_injection::Site::kRdma, op.local, op.length);
    }
    check.local.push_back(Crc32c(op.local, op.length));
    pb::RdmaChecksumRange* range = request->add_ranges();
    range->set_region(op.remote_region);
    range->set_offset(op.remote_offset);
    range->set_length(op.length);
  }
  check.ops = std::move(ops);
  check.done = std::move(done);
  uint64_t id = 0;
  {
    MutexLock lock(&calls_mu_);
    if (!shut_down_) {
      id = next_call_++;
      request->set_call_id(id);
      checks_.emplace(id, std::move(check));
    }
  }
  if (id == 0) {
    check.done(absl::UnavailableError("rdma transport shut down"));
    return;
  }
  absl::Status sent = core.send ? core.send(control.SerializeAsString())
                                : absl::FailedPreconditionError("no control channel to the peer");
  if (sent.ok()) return;
  // Not sent: the check ends here (unless an abort took it meanwhile).
  DoneCallback d;
  {
    MutexLock lock(&calls_mu_);
    auto it = checks_.find(id);
    if (it == checks_.end()) return;
    d = std::move(it->second.done);
    checks_.erase(it);
  }
  d(absl::Status(sent.code(),
                 absl::StrCat("transfer ", transfer_id,
                              ": end-to-end checksum request not sent: ", sent.message())));
}

pb::RdmaChecksumReply RdmaTransportImpl::HandleChecksum(PeerId peer,
                                                        const pb::RdmaChecksumRequest& request) {
  pb::RdmaChecksumReply reply;
  const OpKind kind = request.write() ? OpKind::kWrite : OpKind::kRead;
  for (const pb::RdmaChecksumRange& range : request.ranges()) {
    // The same check as an op of that kind: the peer may only learn the CRC of what it may
    // access (and the pin keeps the memory registered while it is read).
    absl::StatusOr<IncomingAccess> access =
        hooks_->ResolveIncoming(peer, range.region(), range.offset(), range.length(), kind);
    if (!access.ok()) {
      reply.Clear();
      reply.set_code(static_cast<uint32_t>(access.status().code()));
      reply.set_error(std::string(access.status().message()));
      return reply;
    }
    if (access->gpu_device >= 0 || (access->data == nullptr && range.length() > 0)) {
      reply.add_crcs(0);
      reply.add_unchecked(true);
      continue;
    }
    if (kind == OpKind::kWrite) {
      // The test hook: a byte that changed between the NIC and this memory.
      fault_injection::MaybeFlipPayloadByte(fault_injection::Site::kRdma, access->data,
                                            range.length());
    }
    reply.add_crcs(Crc32c(access->data, range.length()));
    reply.add_unchecked(false);
  }
  return reply;
}

void RdmaTransportImpl::OnChecksumReply(PeerId peer, const pb::RdmaChecksumReply& reply) {
  PendingCheck check;
  {
    MutexLock lock(&calls_mu_);
    auto it = checks_.find(reply.call_id());
    // A reply for a check that was aborted, or from another peer, finds nothing: dropped.
    if (it == checks_.end() || it->second.peer != peer) return;
    check = std::move(it->second);
    checks_.erase(it);
  }
  const size_t n = check.local.size();
  if (reply.code() != 0) {
    check.done(
        absl::Status(static_cast<absl::StatusCode>(reply.code()),
                     absl::StrCat("transfer ", check.transfer_id, ": peer ", check.peer_name,
                                  " refused the end-to-end checksum request: ", reply.error())));
    return;
  }
  if (static_cast<size_t>(reply.crcs_size()) != n ||
      static_cast<size_t>(reply.unchecked_size()) != n) {
    check.done(absl::DataLossError(absl::StrCat("transfer ", check.transfer_id, ": peer ",
                                                check.peer_name, " answered ", reply.crcs_size(),
                                                " checksums for ", n, " ops")));
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    if (reply.unchecked(static_cast<int>(i))) continue;
    const uint32_t remote = reply.crcs(static_cast<int>(i));
    if (remote == check.local[i]) continue;
    const WireOp& op = check.ops[i];
    const bool write = check.kind == OpKind::kWrite;
    KVW_LOG(kWarning, "rdma") << "checksum mismatch" << Kv("transfer", check.transfer_id)
                              << Kv("op", i) << Kv("peer", check.peer_name);
    check.done(absl::DataLossError(absl::StrFormat(
        "transfer %u op %u (%s remote region %u offset %u length %u) with peer %s over rdma: "
        "end-to-end checksum mismatch (CRC32C of the source 0x%08x, of the bytes that landed "
        "0x%08x): the op's bytes were corrupted on the way",
        check.transfer_id, i, write ? "WRITE" : "READ", op.remote_region, op.remote_offset,
        op.length, check.peer_name, write ? check.local[i] : remote,
        write ? remote : check.local[i])));
    return;
  }
  check.done(absl::OkStatus());
}

}  // namespace kvwire::transport::rdma
