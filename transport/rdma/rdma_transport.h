// The rdma transport: one-sided RDMA READ and WRITE over libibverbs RC queue pairs.
//
// Design
// - Devices: ibv_get_device_list, filtered by RdmaTransportOptions::devices (like perftest
//   -d); a port that is not ACTIVE is skipped with a logged reason. RoCE ports use the
//   IPv4-mapped RoCE v2 GID (a handful of GID entries are queried, never the whole table) or
//   a configured index; InfiniBand ports use the LID. One PD and one CQ (with its completion
//   channel) per device; one event thread per device waits on the completion channel and on
//   the async-event fd.
// - Memory: RegisterRegion registers an MR on every device at once, in the device's PD, for
//   this engine's own WRs: local access only, so its rkey opens nothing to anyone. GPU regions
//   (kGpu, with options.gpu_runtime set): ibv_reg_dmabuf_mr on a dma-buf the runtime exports, else
//   ibv_reg_mr on the device pointer (peer memory); the path taken and why is logged and in
//   EngineStats::gpu (rdma_gpu_mr.h). The posting path does not care which.
// - Peer isolation: every peer gets a PD of its own on each device. Its target QPs (and their
//   slot tables) are created there, and ExportKey registers each region exported to it there
//   (remote read/write as the region allows, never remote atomics; the same path as the
//   region's own MR, dma-buf or peer memory); those rkeys go out in
//   RegionDescriptor.transport_keys. A QP reaches only MRs of its own PD, so a peer's QPs
//   reach exactly what was exported to it: another peer's rkey, even the real one, or a
//   guessed one (rxe's are an index and 8 random bits) is a remote access error that breaks
//   the attacker's QP and nothing else. RevokeExport (export withdrawn), DeregisterRegion and
//   DropPeer (peer closed) deregister the peer's MRs before they return, so its keys stop
//   working at once. Cost: one more registration per device for each (peer, exported
//   region): the pages are already pinned (their pin count goes up, no memory is added), but
//   the NIC's translation entries for the region are made again for each peer, and the
//   registration time, which grows with the region's size in pages, is paid on the export
//   path (AddPeer for regions exported to all, Export, RegisterMemory) once per peer.
//   Type-2 memory windows (rxe has 2B) were the alternative: their rkeys are bound to one QP,
//   so a peer with n QPs needs n keys per region, every QP re-creation needs a bind round
//   trip, and EFA and some other providers have no windows at all.
// - Connection: Endpoint() is a serialized pb::RdmaEndpoint (the device ports). Channel
//   creation (Connect) creates qps_per_device RC QPs on every local device and sends one
//   pb::RdmaConnectRequest (QPN, PSN, GID/LID, MTU per QP) to the peer on the engine's
//   control channel (PeerLink::send_control; the channel already authenticated the peer).
//   The target creates its ends and answers with a pb::RdmaConnectReply (QPNs, PSNs,
//   read-atomic limit, per-QP slot table) that the engine hands back through
//   OnControlMessage. A broken QP is re-created the same way (one QP) on its next use, on a
//   background thread. Address vectors: rdma_address.h (RoCE GRH, InfiniBand LID).
// - Posting: each engine lane maps to one QP (LaneToQp). Ops are merged and gathered into
//   WRs (PlanWrs), a lane's WRs are chained with those of other queued lanes into one
//   ibv_post_send as far as the send window allows (SendWindow: never past the depth; the
//   rest waits in the QP's queue), only chain ends (and every signal_interval-th WR) are
//   signalled, and payloads up to the QP's max_inline_data go inline.
// - Arrivals: a counted WRITE lane binds its transfer id to a slot of the target's table and
//   ends with RDMA WRITE WITH IMMEDIATE (slot, pieces); see rdma_plan.h. The target keeps
//   its receive queues full (one receive per immediate, re-posted as it is consumed), so RNR
//   cannot last; rnr_retry is an option.
// - Failure: an error completion fails its lane with device, port, QPN, transfer id and the
//   verbs status, fails the other lanes of that QP, and marks the QP for re-creation. Async
//   events (QP fatal, CQ error, port error, device fatal) fail every affected lane at once;
//   after a port error the device refuses new lanes (naming the event) until the port is
//   ACTIVE again, then QPs are re-created on next use. A failed QP is moved to ERROR first,
//   so nothing touches local memory once its lanes are reported. Counters: AddStats
//   (RdmaTransportStats).
//   Close and DropPeer (peer dead by lease) destroy the QPs.
//
// - QP budget: each device holds at most max_qps_per_device QPs (initiator and target ends of
//   every peer together; 0 = the device's max_qp). A QP past it is never created: the channel
//   set-up that needs it fails with ResourceExhausted naming the device, the budget and the
//   engine option, on whichever side ran out (the target answers the QP exchange with it), so
//   the peer is refused and the peers already connected keep their QPs. QPs are not shared
//   between peers: a QP's PD is its peer's (isolation, above), so sharing would mean
//   giving up per-peer keys.
// - Verbs: every ibv_* call goes through verbs() (verbs.h), a table of function pointers that
//   a test or benchmark can replace (tests/rdma/fake/fake_verbs.h runs the whole path without a
//   device).
//
// Files: rdma_transport_impl.h (the Transport; its methods in rdma_transport.cc, lifetime and
// peers; rdma_regions.cc, registration and exports; rdma_qp_exchange.cc, channel set-up),
// rdma_channel (Post: ops to WRs), rdma_client_qp (initiator QP: posting, completions,
// re-creation), rdma_server_qp (target QP: immediates), rdma_device_loop (event thread per
// device), rdma_qp_state (ibv_modify_qp transitions), rdma_regions.h (MRs and peer PDs),
// rdma_device, rdma_address, rdma_plan, rdma_grants, rdma_gpu_mr.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_TRANSPORT_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_TRANSPORT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "src/gpu/runtime.h"
#include "transport/transport.h"

namespace kvwire::transport {

struct RdmaTransportOptions {
  // The runtime of kGpu regions (the engine's); null: GPU memory is refused.
  gpu::Runtime* gpu_runtime = nullptr;
  // Device allow-list, "name" or "name:port" entries; empty = every device.
  std::vector<std::string> devices;
  // GID index for RoCE; -1 = the first IPv4-mapped RoCE v2 GID among the first 16.
  int gid_index = -1;
  // RC QPs per peer and device; lanes = devices * qps_per_device.
  uint32_t qps_per_device = 4;
  // Send-queue depth (WRs) of each QP, and receive-queue depth of each target QP.
  uint32_t send_queue_depth = 256;
  uint32_t recv_queue_depth = 512;
  // Every n-th WR of a long chain is signalled (besides the chain's last).
  uint32_t signal_interval = 64;
  // Largest payload sent inline (capped by what the QP grants).
  uint32_t max_inline = 128;
  // RC retransmission: local ACK timeout exponent (4.096 us * 2^timeout), retries (6: rxe
  // reads 7 as forever, see include/kvwire/rdma_options.h), and RNR retries (7 = forever).
  uint8_t qp_timeout = 14;
  uint8_t retry_count = 6;
  uint8_t rnr_retry = 7;
  // QP budget per device: initiator and target QPs of every peer together; 0 = the device's
  // max_qp. Beyond it a peer's QPs are refused (ResourceExhausted naming the device and the
  // budget), never created: the QPs of the peers already connected are untouched.
  uint32_t max_qps_per_device = 0;
  uint64_t max_op_bytes = 1ull << 30;
};

// The statistics the rdma transport reports (groups "rdma" and "gpu"), at zero.
std::vector<TransportStat> RdmaTransportStats();

// A transport over every usable device, or NotFound (with the reasons) when there is none.
absl::StatusOr<std::unique_ptr<Transport>> CreateRdmaTransport(const RdmaTransportOptions& options,
                                                               TargetHooks* hooks);

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_TRANSPORT_H_
