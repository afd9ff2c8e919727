#include "transport/rdma/rdma_transport.h"

#include <arpa/inet.h>
#include <sys/eventfd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <poll.h>
#include <random>
#include <thread>
#include <unistd.h>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "proto/kvwire.pb.h"
#include "src/util/log.h"
#include "src/util/mutex.h"
#include "src/util/task_runner.h"
#include "transport/rdma/rdma_address.h"
#include "transport/rdma/rdma_device.h"
#include "transport/rdma/rdma_gpu_mr.h"
#include "transport/rdma/rdma_grants.h"
#include "transport/rdma/rdma_plan.h"

namespace kvwire::transport {
namespace rdma {
namespace {

constexpr uint64_t kSeqMask = (1ull << 48) - 1;

uint32_t RandomPsn() {
  static thread_local std::mt19937 rng(std::random_device{}());
  return rng() & 0xffffff;
}

absl::StatusCode CodeForWc(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
      return absl::StatusCode::kPermissionDenied;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_WR_FLUSH_ERR:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

const char* WcHint(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_REM_ACCESS_ERR:
      return " (remote access error: the remote range or rkey is outside the peer's "
             "registration, or the region does not allow this access)";
    case IBV_WC_RETRY_EXC_ERR:
      return " (no acknowledgement from the peer: dead, unreachable or wedged)";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return " (the peer had no receive posted)";
    default:
      return "";
  }
}

absl::Status ModifyError(const char* state, const std::string& where, uint32_t qpn, int rc) {
  return absl::InternalError(absl::StrCat("ibv_modify_qp to ", state, " failed on ", where, " QP ",
                                          qpn, ": ", std::strerror(rc)));
}

absl::Status ToInit(ibv_qp* qp, const DevicePort& dev, int access) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = dev.port;
  a.qp_access_flags = access;
  const int rc =
      ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  return rc == 0 ? absl::OkStatus() : ModifyError("INIT", dev.Describe(), qp->qp_num, rc);
}

absl::Status ToRtr(ibv_qp* qp, const DevicePort& dev, const pb::RdmaDevice& remote,
                   uint32_t remote_qpn, uint32_t remote_psn, uint8_t max_dest_rd_atomic) {
  auto ah = RemoteAddress(dev.Address(), remote);
  if (!ah.ok()) return ah.status();
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = PathMtu(dev.port_attr.active_mtu, remote.mtu());
  a.dest_qp_num = remote_qpn;
  a.rq_psn = remote_psn;
  a.max_dest_rd_atomic = std::max<uint8_t>(1, max_dest_rd_atomic);
  a.min_rnr_timer = 12;  // 0.64 ms
  a.ah_attr = *ah;
  const int rc =
      ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  return rc == 0 ? absl::OkStatus() : ModifyError("RTR", dev.Describe(), qp->qp_num, rc);
}

absl::Status ToRts(ibv_qp* qp, const DevicePort& dev, uint32_t psn, const RdmaTransportOptions& o,
                   uint8_t max_rd_atomic) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = psn;
  a.timeout = o.qp_timeout;
  a.retry_cnt = o.retry_count;
  a.rnr_retry = o.rnr_retry;
  a.max_rd_atomic = std::max<uint8_t>(1, max_rd_atomic);
  const int rc = ibv_modify_qp(qp, &a,
                               IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                   IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
  return rc == 0 ? absl::OkStatus() : ModifyError("RTS", dev.Describe(), qp->qp_num, rc);
}

}  // namespace

class RdmaTransportImpl;
class ClientQp;

// A registered region: one MR per device in the device's PD, for this engine's own WRs only
// (local access: no peer can use its rkey). Peers reach the region through the MRs of
// PeerMr. A GPU region registered through a dma-buf keeps the dma-buf's fd open until its
// MRs are gone (declared first: destroyed last).
struct LocalMr {
  RegionId id = 0;
  uint64_t base = 0;
  uint64_t length = 0;
  int remote_access = 0;  // the ibv access flags a peer's MR of this region gets
  bool gpu = false;
  bool peer_memory = false;  // gpu: some device took the peer-memory path
  ExportedDmaBuf dmabuf;
  DmaBufMrArgs dmabuf_args;     // gpu: what ibv_reg_dmabuf_mr took
  std::vector<GpuMrPath> path;  // gpu: by device, the path its registration took
  std::vector<Mr> mrs;
};

// One peer's protection domain on one device. The peer's target QPs (and their slot tables)
// and the MRs of the regions exported to it live there and nowhere else: a QP reaches only
// MRs of its own PD, so an rkey of another peer's region, even the real one, fails on this
// peer's QPs with a remote access error (and an rkey of this PD fails on every other's).
struct PeerPd {
  std::shared_ptr<DevicePort> dev;  // the device context outlives the PD
  Pd pd;
};
using PeerDomain = std::vector<std::shared_ptr<PeerPd>>;  // by device index

// A region exported to one peer: its MRs in that peer's PDs, one per device. Deregistered
// when the export is withdrawn, the region deregistered or the peer dropped.
struct PeerMr {
  std::shared_ptr<const LocalMr> region;  // a GPU region's dma-buf outlives these MRs
  PeerDomain domain;                      // the PDs outlive their MRs
  std::vector<Mr> mrs;
  std::string key;  // the rkeys, by device: what the peer is given
};

// Counters of the posting path (EngineStats::rdma and the per-1000-ops figures).
struct PostCounters {
  std::atomic<uint64_t> post_calls{0};
  std::atomic<uint64_t> wrs{0};
  std::atomic<uint64_t> signalled{0};
  std::atomic<uint64_t> pieces{0};
  std::atomic<uint64_t> inline_wrs{0};
  std::atomic<uint64_t> queued_wrs{0};
  std::atomic<uint64_t> completion_errors{0};
  std::atomic<uint64_t> async_events{0};
  std::atomic<uint64_t> qp_reconnects{0};
};

// The target end of one QP: receives the immediates of counted WRITE lanes.
class ServerQp {
 public:
  // `pd`: the peer's PD on `dev`; its QP and slot table are reachable from that peer only.
  ServerQp(std::shared_ptr<DevicePort> dev, std::shared_ptr<PeerPd> pd, PeerId peer,
           uint64_t channel, uint32_t index)
      : dev_(std::move(dev)),
        pd_(std::move(pd)),
        peer_(peer),
        channel_(channel),
        index_(index),
        table_(kSlotsPerQp + 8, 0) {}
  ~ServerQp() {
    qp_.reset();
    table_mr_.reset();
    if (reserved_ != 0) dev_->ReleaseCq(reserved_);
  }

  absl::StatusOr<pb::RdmaQpInfo> Create(const pb::RdmaQpInfo& remote,
                                        const pb::RdmaDevice& remote_dev,
                                        const RdmaTransportOptions& o) {
    const std::string where = dev_->Describe();
    const uint32_t depth = std::min<uint32_t>(o.recv_queue_depth, dev_->attr.max_qp_wr);
    if (absl::Status s = dev_->ReserveCq(depth + 1); !s.ok()) return s;
    reserved_ = depth + 1;
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    table_mr_.reset(
        ibv_reg_mr(pd_->pd.get(), table_.data(), table_.size() * sizeof(uint64_t), access));
    if (!table_mr_) {
      return absl::InternalError(
          absl::StrCat("ibv_reg_mr of the slot table on ", where, ": ", std::strerror(errno)));
    }
    ibv_qp_init_attr init{};
    init.send_cq = dev_->cq.get();
    init.recv_cq = dev_->cq.get();
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = 1;
    init.cap.max_recv_wr = depth;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    qp_.reset(ibv_create_qp(pd_->pd.get(), &init));
    if (!qp_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("ibv_create_qp (target) on ", where, ": ", std::strerror(errno)));
    }
    if (absl::Status s =
            ToInit(qp_.get(), *dev_,
                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
        !s.ok()) {
      return s;
    }
    for (uint32_t i = 0; i < depth; ++i) {
      if (absl::Status s = PostRecv(); !s.ok()) return s;
    }
    const uint8_t rd = static_cast<uint8_t>(std::min(dev_->attr.max_qp_rd_atom, 16));
    if (absl::Status s = ToRtr(qp_.get(), *dev_, remote_dev, remote.qpn(), remote.psn(), rd);
        !s.ok()) {
      return s;
    }
    const uint32_t psn = RandomPsn();
    if (absl::Status s = ToRts(qp_.get(), *dev_, psn, o, 1); !s.ok()) return s;
    pb::RdmaQpInfo info;
    info.set_index(index_);
    info.set_qpn(qp_->qp_num);
    info.set_psn(psn);
    info.set_slot_table_addr(reinterpret_cast<uint64_t>(table_.data()));
    info.set_slot_table_rkey(table_mr_->rkey);
    info.set_max_rd_atomic(rd);
    return info;
  }

  absl::Status PostRecv() {
    ibv_sge sge{reinterpret_cast<uint64_t>(&table_[kSlotsPerQp]), 8, table_mr_->lkey};
    ibv_recv_wr wr{};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    const int rc = ibv_post_recv(qp_.get(), &wr, &bad);
    if (rc != 0) {
      return absl::InternalError(absl::StrCat("ibv_post_recv on ", dev_->Describe(), " QP ",
                                              qp_->qp_num, ": ", std::strerror(rc)));
    }
    return absl::OkStatus();
  }

  // Event thread only.
  void OnCompletion(const ibv_wc& wc, TargetHooks* hooks) {
    if (wc.status != IBV_WC_SUCCESS) {
      if (wc.status != IBV_WC_WR_FLUSH_ERR) {
        KVW_LOG(kWarning, "rdma") << "target QP error" << Kv("device", dev_->Describe())
                                  << Kv("qpn", wc.qp_num) << Kv("peer", peer_)
                                  << Kv("channel", channel_) << Kv("index", index_)
                                  << Kv("status", ibv_wc_status_str(wc.status));
      }
      return;
    }
    if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM) return;
    uint32_t slot = 0, count = 0;
    DecodeImm(ntohl(wc.imm_data), &slot, &count);
    const TransferId id = __atomic_load_n(&table_[slot], __ATOMIC_ACQUIRE);
    for (uint32_t i = 0; i < count; ++i) hooks->OnWriteArrived(peer_, id);
    if (absl::Status s = PostRecv(); !s.ok()) {
      KVW_LOG(kError, "rdma") << "receive not replenished" << Kv("error", s.message());
    }
  }

  uint32_t qpn() const { return qp_ ? qp_->qp_num : 0; }
  PeerId peer() const { return peer_; }

 private:
  std::shared_ptr<DevicePort> dev_;
  std::shared_ptr<PeerPd> pd_;  // outlives table_mr_ and qp_
  PeerId peer_;
  uint64_t channel_;
  uint32_t index_;
  std::vector<uint64_t> table_;  // kSlotsPerQp transfer ids, then the receive scratch
  Mr table_mr_;
  Qp qp_;
  uint32_t reserved_ = 0;
};

// Per-device event thread: completions (initiator and target QPs share the device's CQ) and
// async events.
class DeviceLoop {
 public:
  DeviceLoop(std::shared_ptr<DevicePort> dev, TargetHooks* hooks, PostCounters* counters)
      : dev_(std::move(dev)),
        hooks_(hooks),
        counters_(counters),
        wake_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~DeviceLoop() { Stop(); }

  void Stop() {
    const uint64_t one = 1;
    if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
    if (thread_.joinable()) thread_.join();
    if (wake_fd_ >= 0) close(wake_fd_);
    wake_fd_ = -1;
  }

  void AddClient(uint32_t qpn, std::weak_ptr<ClientQp> qp) {
    MutexLock lock(&mu_);
    clients_[qpn] = std::move(qp);
  }
  void AddServer(uint32_t qpn, std::shared_ptr<ServerQp> qp) {
    MutexLock lock(&mu_);
    servers_[qpn] = std::move(qp);
  }
  void Remove(uint32_t qpn) {
    MutexLock lock(&mu_);
    clients_.erase(qpn);
    servers_.erase(qpn);
  }
  const std::shared_ptr<DevicePort>& device() const { return dev_; }

 private:
  void Run();
  void Drain();
  void Dispatch(const ibv_wc& wc);
  void OnAsyncEvent(const ibv_async_event& event);

  std::shared_ptr<DevicePort> dev_;
  TargetHooks* hooks_;
  PostCounters* counters_;
  int wake_fd_;
  std::thread thread_;
  Mutex mu_;
  absl::flat_hash_map<uint32_t, std::weak_ptr<ClientQp>> clients_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint32_t, std::shared_ptr<ServerQp>> servers_ ABSL_GUARDED_BY(mu_);
};

// What every QP of a channel needs to re-create itself.
struct ChannelCore {
  RdmaTransportImpl* transport = nullptr;
  PeerId peer = 0;
  std::string peer_name;
  ControlSender send;  // the engine's control channel to the peer
  uint64_t channel_id = 0;
  pb::RdmaEndpoint remote;
};

struct Lane {
  PostRequest request;
  DoneCallback done;
  WrPlan plan;
  ibv_wr_opcode opcode = IBV_WR_RDMA_WRITE;
  bool counted = false;
  // Some local piece is device memory: never inline (the CPU would read the payload).
  bool local_gpu = false;
  uint32_t pieces = 0;
  size_t next_wr = 0;
  std::optional<uint32_t> slot;
  uint64_t last_seq = 0;
};

struct Finished {
  DoneCallback done;
  absl::Status status;
};

void RunFinished(std::vector<Finished>& finished) {
  for (Finished& f : finished) f.done(std::move(f.status));
  finished.clear();
}

// The initiator end of one RC QP of a channel.
class ClientQp : public std::enable_shared_from_this<ClientQp> {
 public:
  enum class State { kConnecting, kReady, kBroken, kClosed };

  ClientQp(std::shared_ptr<ChannelCore> core, DeviceLoop* loop, uint32_t index,
           uint32_t remote_device, const RdmaTransportOptions& options, PostCounters* counters)
      : core_(std::move(core)),
        loop_(loop),
        dev_(loop->device()),
        index_(index),
        remote_device_(remote_device),
        options_(options),
        counters_(counters),
        window_(1),
        bind_src_(kSlotsPerQp, 0) {}
  ~ClientQp() {
    MutexLock lock(&mu_);
    DestroyLocked();
  }

  uint32_t index() const { return index_; }
  uint32_t remote_device() const { return remote_device_; }
  const ChannelCore& core() const { return *core_; }
  const std::shared_ptr<DevicePort>& device() const { return dev_; }

  // Creates a fresh ibv QP in INIT; returns what the target needs.
  absl::StatusOr<pb::RdmaQpInfo> Prepare() ABSL_LOCKS_EXCLUDED(mu_);
  // Brings the QP to RTS against the target's answer and starts posting.
  absl::Status Finish(const pb::RdmaQpInfo& remote) ABSL_LOCKS_EXCLUDED(mu_);
  // A (re-)connection attempt failed: fail what waits and stay broken.
  void SetupFailed(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  void Enqueue(std::unique_ptr<Lane> lane) ABSL_LOCKS_EXCLUDED(mu_);
  void OnCompletion(const ibv_wc& wc) ABSL_LOCKS_EXCLUDED(mu_);
  // Async event or transport error: fail every lane, re-create on next use.
  void Break(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  void Close(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t qpn() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return qp_ ? qp_->qp_num : 0;
  }

 private:
  void PumpLocked(std::vector<Finished>* finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void BreakLocked(const absl::Status& status, const Lane* culprit, std::vector<Finished>* finished)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishLaneLocked(std::unique_ptr<Lane> lane, absl::Status status,
                        std::vector<Finished>* finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DestroyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ScheduleReconnectLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<ChannelCore> core_;
  DeviceLoop* const loop_;
  const std::shared_ptr<DevicePort> dev_;
  const uint32_t index_;
  const uint32_t remote_device_;
  const RdmaTransportOptions options_;
  PostCounters* const counters_;

  Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kConnecting;
  bool reconnecting_ ABSL_GUARDED_BY(mu_) = false;
  Qp qp_ ABSL_GUARDED_BY(mu_);
  uint32_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t psn_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tag_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t max_inline_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t max_sge_ ABSL_GUARDED_BY(mu_) = 1;
  SendWindow window_ ABSL_GUARDED_BY(mu_);
  SlotPool slots_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> bind_src_ ABSL_GUARDED_BY(mu_);  // transfer ids, by slot
  Mr bind_mr_ ABSL_GUARDED_BY(mu_);
  uint64_t remote_table_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t remote_table_rkey_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::unique_ptr<Lane>> queued_ ABSL_GUARDED_BY(mu_);  // not fully posted
  std::deque<std::unique_ptr<Lane>> posted_ ABSL_GUARDED_BY(mu_);  // fully posted
  std::vector<ibv_send_wr> scratch_ ABSL_GUARDED_BY(mu_);

 public:
  uint32_t max_sge() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return max_sge_;
  }
};

class RdmaChannel;

class RdmaTransportImpl final : public Transport {
 public:
  RdmaTransportImpl(const RdmaTransportOptions& options, TargetHooks* hooks,
                    std::vector<std::shared_ptr<DevicePort>> devices)
      : options_(options), hooks_(hooks), devices_(std::move(devices)) {
    caps_.name = "rdma";
    caps_.counts_arrivals = true;
    caps_.gpu_memory = options_.gpu_runtime != nullptr;
    caps_.max_op_bytes = options_.max_op_bytes;
    for (const auto& d : devices_) {
      caps_.max_op_bytes = std::min<uint64_t>(caps_.max_op_bytes, d->port_attr.max_msg_sz);
    }
    caps_.max_lanes =
        static_cast<uint32_t>(devices_.size()) * std::max(1u, options_.qps_per_device);
    for (const auto& d : devices_) {
      loops_.push_back(std::make_unique<DeviceLoop>(d, hooks_, &counters_));
    }
  }
  ~RdmaTransportImpl() override { Shutdown(); }

  absl::Status Start() {
    pb::RdmaEndpoint ep;
    std::vector<std::string> names;
    for (const auto& d : devices_) {
      *ep.add_devices() = d->ToProto();
      names.push_back(absl::StrCat(d->Describe(), d->ethernet ? " gid[" : " lid ",
                                   d->ethernet
                                       ? absl::StrCat(d->gid_index, "]=", GidToString(d->gid))
                                       : absl::StrCat(d->port_attr.lid),
                                   " mtu ", MtuName(d->port_attr.active_mtu)));
    }
    endpoint_ = ep.SerializeAsString();
    summary_ = absl::StrJoin(names, ", ");
    KVW_LOG(kInfo, "rdma") << "transport ready" << Kv("devices", summary_)
                           << Kv("qps_per_device", options_.qps_per_device);
    return absl::OkStatus();
  }

  const Capabilities& caps() const override { return caps_; }
  std::string Endpoint() const override { return endpoint_; }
  absl::Status RegisterRegion(const LocalRegion& region) override;
  void DeregisterRegion(RegionId id) override;
  absl::StatusOr<std::string> ExportKey(PeerId peer, RegionId id) override;
  void RevokeExport(PeerId peer, RegionId id) override;
  absl::Status CanReach(const std::string& remote_endpoint) const override;
  absl::StatusOr<std::unique_ptr<Channel>> Connect(const PeerLink& link) override;
  void DropPeer(PeerId peer) override;
  void Shutdown() override;
  void OnControlMessage(PeerId peer, const pb::Envelope& message,
                        const ControlSender& reply) override;
  void AddStats(EngineStats* stats) const override;

  // Fails the QP exchanges in flight for `core` (its channel closed).
  void AbortCalls(const ChannelCore* core, const absl::Status& status);
  // Creates the target ends for `qps` and brings them up; deadline-bound, blocking.
  absl::Status Establish(const ChannelCore& core, const std::vector<std::shared_ptr<ClientQp>>& qps,
                         absl::Time deadline);
  void ScheduleReconnect(std::shared_ptr<ClientQp> qp);
  // lkey of [addr, addr+length) on `device`, or NotFound.
  absl::StatusOr<uint32_t> LocalKey(uint64_t addr, uint64_t length, uint32_t device) const;
  uint32_t DeviceIndex(const DevicePort* dev) const {
    for (size_t i = 0; i < devices_.size(); ++i)
      if (devices_[i].get() == dev) return static_cast<uint32_t>(i);
    return 0;
  }
  DeviceLoop* loop(uint32_t device) { return loops_[device].get(); }
  size_t devices() const { return devices_.size(); }
  const RdmaTransportOptions& options() const { return options_; }
  PostCounters* counters() { return &counters_; }
  const std::string& summary() const { return summary_; }

 private:
  // One QP exchange in flight: the request went out on the control channel, the reply (or
  // an abort) fills `reply` / `status`.
  struct PendingCall {
    PeerId peer = 0;
    const ChannelCore* core = nullptr;
    bool done = false;
    absl::Status status;
    pb::RdmaConnectReply reply;
  };
  // Sends `request` on core's control channel and waits for the reply until `deadline`.
  absl::StatusOr<pb::RdmaConnectReply> Exchange(const ChannelCore& core,
                                                pb::RdmaConnectRequest request,
                                                absl::Time deadline);
  // Target side: creates the QP ends a peer asks for.
  pb::RdmaConnectReply HandleConnect(PeerId peer, const pb::RdmaConnectRequest& request);
  // A kGpu region's MRs on every device (rdma_gpu_mr.h); `reason` gets the path per device.
  absl::Status RegisterGpuRegion(const LocalRegion& region, int access, LocalMr& mr,
                                 std::string* reason);
  // The peer's PDs, made on first use (an export to it or its first QPs).
  absl::StatusOr<PeerDomain> DomainOf(PeerId peer);
  // Registers `region` in `domain`'s PDs, the way its own MRs were registered.
  absl::Status RegisterFor(const LocalMr& region, PeerMr& out);

  const RdmaTransportOptions options_;
  TargetHooks* const hooks_;
  const std::vector<std::shared_ptr<DevicePort>> devices_;
  Capabilities caps_;
  std::string endpoint_;
  std::string summary_;
  std::vector<std::unique_ptr<DeviceLoop>> loops_;
  PostCounters counters_;
  std::atomic<bool> shut_down_{false};

  mutable Mutex mrs_mu_;
  std::map<uint64_t, std::shared_ptr<LocalMr>> mrs_by_addr_ ABSL_GUARDED_BY(mrs_mu_);
  absl::flat_hash_map<RegionId, std::shared_ptr<LocalMr>> mrs_ ABSL_GUARDED_BY(mrs_mu_);
  // GpuStats: GPU regions registered now, by path, and why the newest took its path.
  uint64_t gpu_dmabuf_regions_ ABSL_GUARDED_BY(mrs_mu_) = 0;
  uint64_t gpu_peermem_regions_ ABSL_GUARDED_BY(mrs_mu_) = 0;
  std::string gpu_path_reason_ ABSL_GUARDED_BY(mrs_mu_);

  // The regions exported to each peer, registered in that peer's PDs.
  Mutex grants_mu_;
  PeerGrants<PeerDomain, std::shared_ptr<PeerMr>> grants_ ABSL_GUARDED_BY(grants_mu_);

  Mutex server_mu_;
  // (peer, channel id) -> target QPs by index.
  std::map<std::pair<PeerId, uint64_t>, std::map<uint32_t, std::shared_ptr<ServerQp>>> targets_
      ABSL_GUARDED_BY(server_mu_);

  Mutex calls_mu_;
  CondVar calls_cv_;
  uint64_t next_call_ ABSL_GUARDED_BY(calls_mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<PendingCall>> calls_ ABSL_GUARDED_BY(calls_mu_);

  std::unique_ptr<TaskRunner> runner_ = std::make_unique<TaskRunner>();  // QP re-creation
};

// --- DeviceLoop ------------------------------------------------------------------------------

void DeviceLoop::Run() {
  while (true) {
    pollfd p[3] = {
        {dev_->channel->fd, POLLIN, 0}, {dev_->ctx->async_fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    const int n = poll(p, 3, 100);
    if (n < 0 && errno != EINTR) {
      KVW_LOG(kError, "rdma") << "event thread poll failed" << Kv("device", dev_->Describe())
                              << Kv("error", std::strerror(errno));
      return;
    }
    if (p[2].revents != 0) return;
    if (p[0].revents != 0) {
      ibv_cq* cq = nullptr;
      void* context = nullptr;
      unsigned events = 0;
      while (ibv_get_cq_event(dev_->channel.get(), &cq, &context) == 0) ++events;
      if (events != 0) ibv_ack_cq_events(dev_->cq.get(), events);
      ibv_req_notify_cq(dev_->cq.get(), 0);
    }
    if (p[1].revents != 0) {
      ibv_async_event event;
      while (ibv_get_async_event(dev_->ctx.get(), &event) == 0) {
        OnAsyncEvent(event);
        ibv_ack_async_event(&event);
      }
    }
    Drain();  // also on timeouts: a missed notification never strands completions
  }
}

void DeviceLoop::Drain() {
  ibv_wc wcs[64];
  while (true) {
    const int n = ibv_poll_cq(dev_->cq.get(), 64, wcs);
    if (n <= 0) {
      if (n < 0) {
        KVW_LOG(kError, "rdma") << "ibv_poll_cq failed" << Kv("device", dev_->Describe());
      }
      return;
    }
    for (int i = 0; i < n; ++i) Dispatch(wcs[i]);
  }
}

void DeviceLoop::Dispatch(const ibv_wc& wc) {
  std::shared_ptr<ClientQp> client;
  std::shared_ptr<ServerQp> server;
  {
    MutexLock lock(&mu_);
    if (auto it = clients_.find(wc.qp_num); it != clients_.end()) client = it->second.lock();
    if (auto it = servers_.find(wc.qp_num); it != servers_.end()) server = it->second;
  }
  if (client) client->OnCompletion(wc);
  if (server) server->OnCompletion(wc, hooks_);
}

void DeviceLoop::OnAsyncEvent(const ibv_async_event& event) {
  const char* what = ibv_event_type_str(event.event_type);
  switch (event.event_type) {
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_PATH_MIG_ERR: {
      counters_->async_events.fetch_add(1, std::memory_order_relaxed);
      const uint32_t qpn = event.element.qp->qp_num;
      KVW_LOG(kWarning, "rdma") << "async event" << Kv("device", dev_->Describe())
                                << Kv("event", what) << Kv("qpn", qpn);
      std::shared_ptr<ClientQp> client;
      {
        MutexLock lock(&mu_);
        if (auto it = clients_.find(qpn); it != clients_.end()) client = it->second.lock();
      }
      if (client) {
        client->Break(absl::UnavailableError(
            absl::StrCat("async event ", what, " on ", dev_->Describe(), " QP ", qpn)));
      }
      break;
    }
    case IBV_EVENT_CQ_ERR:
    case IBV_EVENT_PORT_ERR:
    case IBV_EVENT_DEVICE_FATAL: {
      counters_->async_events.fetch_add(1, std::memory_order_relaxed);
      // A port comes back (PORT_ACTIVE); a dead device or a broken CQ does not.
      const bool for_good = event.event_type != IBV_EVENT_PORT_ERR;
      const std::string why = absl::StrCat("async event ", what, " on ", dev_->Describe());
      dev_->MarkDown(why, for_good);
      KVW_LOG(kError, "rdma") << "async event: failing every QP of the device"
                              << Kv("device", dev_->Describe()) << Kv("event", what)
                              << Kv("until", for_good ? "the engine restarts" : "port ACTIVE");
      std::vector<std::shared_ptr<ClientQp>> all;
      {
        MutexLock lock(&mu_);
        for (auto& [qpn, weak] : clients_) {
          if (auto qp = weak.lock()) all.push_back(std::move(qp));
        }
      }
      for (auto& qp : all) qp->Break(absl::UnavailableError(why));
      break;
    }
    case IBV_EVENT_PORT_ACTIVE:
      dev_->MarkUp();
      KVW_LOG(kWarning, "rdma") << "port active again; QPs are re-created on next use"
                                << Kv("device", dev_->Describe());
      break;
    default:
      KVW_LOG(kInfo, "rdma") << "async event" << Kv("device", dev_->Describe())
                             << Kv("event", what);
      break;
  }
}

// --- ClientQp --------------------------------------------------------------------------------

absl::StatusOr<pb::RdmaQpInfo> ClientQp::Prepare() {
  MutexLock lock(&mu_);
  if (state_ == State::kClosed) return absl::CancelledError("rdma channel closed");
  DestroyLocked();
  const std::string where = dev_->Describe();
  const uint32_t depth = std::min<uint32_t>(options_.send_queue_depth, dev_->attr.max_qp_wr);
  if (absl::Status s = dev_->ReserveCq(depth + 1); !s.ok()) return s;
  reserved_ = depth + 1;
  if (!bind_mr_) {
    const int access = IBV_ACCESS_LOCAL_WRITE;
    bind_mr_.reset(
        ibv_reg_mr(dev_->pd.get(), bind_src_.data(), bind_src_.size() * sizeof(uint64_t), access));
    if (!bind_mr_) {
      return absl::InternalError(
          absl::StrCat("ibv_reg_mr of the bind buffer on ", where, ": ", std::strerror(errno)));
    }
  }
  ibv_qp_init_attr init{};
  init.send_cq = dev_->cq.get();
  init.recv_cq = dev_->cq.get();
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;
  init.cap.max_send_wr = depth;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = static_cast<uint32_t>(std::max(1, dev_->attr.max_sge));
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = options_.max_inline;
  qp_.reset(ibv_create_qp(dev_->pd.get(), &init));
  if (!qp_ && options_.max_inline != 0) {  // the device may refuse inline data
    init.cap.max_inline_data = 0;
    qp_.reset(ibv_create_qp(dev_->pd.get(), &init));
  }
  if (!qp_) {
    return absl::ResourceExhaustedError(absl::StrCat("ibv_create_qp on ", where, " for peer ",
                                                     core_->peer_name, ": ", std::strerror(errno)));
  }
  max_inline_ = init.cap.max_inline_data;
  max_sge_ = std::max<uint32_t>(1, init.cap.max_send_sge);
  window_ = SendWindow(depth);
  slots_ = SlotPool(std::min<uint32_t>(kSlotsPerQp, options_.recv_queue_depth));
  scratch_.assign(depth, ibv_send_wr{});
  ++generation_;
  tag_ = (generation_ & 0xffff) << 48;
  psn_ = RandomPsn();
  if (absl::Status s = ToInit(qp_.get(), *dev_, 0); !s.ok()) return s;
  loop_->AddClient(qp_->qp_num, weak_from_this());
  state_ = State::kConnecting;
  pb::RdmaQpInfo info;
  info.set_index(index_);
  info.set_qpn(qp_->qp_num);
  info.set_psn(psn_);
  return info;
}

absl::Status ClientQp::Finish(const pb::RdmaQpInfo& remote) {
  std::vector<Finished> finished;
  absl::Status status;
  {
    MutexLock lock(&mu_);
    if (state_ == State::kClosed || !qp_) {
      return absl::CancelledError("channel closed during QP setup");
    }
    const pb::RdmaDevice& rdev = core_->remote.devices(static_cast<int>(remote_device_));
    status = ToRtr(qp_.get(), *dev_, rdev, remote.qpn(), remote.psn(),
                   static_cast<uint8_t>(std::min(dev_->attr.max_qp_rd_atom, 16)));
    if (status.ok()) {
      const uint8_t rd = static_cast<uint8_t>(std::min<uint32_t>(
          static_cast<uint32_t>(dev_->attr.max_qp_init_rd_atom), remote.max_rd_atomic()));
      status = ToRts(qp_.get(), *dev_, psn_, options_, rd);
    }
    if (status.ok()) {
      remote_table_ = remote.slot_table_addr();
      remote_table_rkey_ = remote.slot_table_rkey();
      state_ = State::kReady;
      reconnecting_ = false;
      PumpLocked(&finished);
    }
  }
  RunFinished(finished);
  return status;
}

void ClientQp::SetupFailed(const absl::Status& status) {
  std::vector<Finished> finished;
  {
    MutexLock lock(&mu_);
    reconnecting_ = false;
    if (state_ == State::kClosed) return;
    state_ = State::kBroken;
    while (!queued_.empty()) {
      auto lane = std::move(queued_.front());
      queued_.pop_front();
      FinishLaneLocked(std::move(lane),
                       absl::Status(status.code(),
                                    absl::StrCat("re-creating QP ", index_, " on ",
                                                 dev_->Describe(), " failed: ", status.message())),
                       &finished);
    }
  }
  RunFinished(finished);
}

void ClientQp::Enqueue(std::unique_ptr<Lane> lane) {
  std::vector<Finished> finished;
  {
    MutexLock lock(&mu_);
    absl::Status usable = dev_->Usable();
    if (state_ == State::kClosed) {
      FinishLaneLocked(
          std::move(lane),
          absl::UnavailableError(absl::StrCat("rdma channel to ", core_->peer_name, " is closed")),
          &finished);
    } else if (!usable.ok()) {
      // Port down or device dead: fail now rather than after the QP's retries.
      FinishLaneLocked(std::move(lane),
                       absl::UnavailableError(
                           absl::StrCat("rdma transfer ", lane->request.transfer_id, " to peer ",
                                        core_->peer_name, " refused: ", usable.message())),
                       &finished);
    } else {
      const Lane* added = lane.get();
      queued_.push_back(std::move(lane));
      const bool ready = state_ == State::kReady;
      if (ready) PumpLocked(&finished);
      if (state_ == State::kBroken) ScheduleReconnectLocked();
      // Admission control: WRs of this lane that found the send queue (or the slots) full.
      if (ready) {
        for (auto it = queued_.rbegin(); it != queued_.rend(); ++it) {
          if (it->get() != added) continue;
          counters_->queued_wrs.fetch_add(added->plan.wrs.size() - added->next_wr,
                                          std::memory_order_relaxed);
          break;
        }
      }
    }
  }
  RunFinished(finished);
}

void ClientQp::ScheduleReconnectLocked() {
  if (reconnecting_ || state_ != State::kBroken) return;
  reconnecting_ = true;
  core_->transport->ScheduleReconnect(shared_from_this());
}

void ClientQp::FinishLaneLocked(std::unique_ptr<Lane> lane, absl::Status status,
                                std::vector<Finished>* finished) {
  if (lane->slot) slots_.Release(*lane->slot);
  finished->push_back(Finished{std::move(lane->done), std::move(status)});
}

void ClientQp::PumpLocked(std::vector<Finished>* finished) {
  if (state_ != State::kReady) return;
  uint32_t n = 0;
  uint32_t signalled = 0;
  uint32_t inlined = 0;
  ibv_send_wr* prev_last = nullptr;
  while (!queued_.empty()) {
    Lane& lane = *queued_.front();
    if (lane.next_wr == 0) {
      if (lane.request.cancelled && lane.request.cancelled->load()) {
        auto done = std::move(queued_.front());
        queued_.pop_front();
        FinishLaneLocked(std::move(done),
                         absl::CancelledError(absl::StrCat("transfer ", lane.request.transfer_id,
                                                           " ended before it was posted")),
                         finished);
        continue;
      }
      if (lane.counted && !lane.slot) {
        std::optional<uint32_t> slot = slots_.Acquire();
        if (!slot) break;  // every slot in flight: wait for completions
        lane.slot = slot;
        bind_src_[*slot] = lane.request.transfer_id;
        lane.plan.wrs[0].remote_addr = remote_table_ + uint64_t{*slot} * sizeof(uint64_t);
        lane.plan.wrs[0].rkey = remote_table_rkey_;
        lane.plan.sges[0].addr = reinterpret_cast<uint64_t>(&bind_src_[*slot]);
        lane.plan.sges[0].lkey = bind_mr_->lkey;
      }
    }
    const uint32_t free = window_.free();
    if (free == 0) break;
    const uint32_t remaining = static_cast<uint32_t>(lane.plan.wrs.size() - lane.next_wr);
    const uint32_t k = std::min(free, remaining);
    const uint64_t seq = window_.Reserve(k);
    signalled +=
        FillChain(lane.plan, lane.next_wr, k, lane.opcode, lane.local_gpu ? 0 : max_inline_,
                  options_.signal_interval, seq, tag_, &scratch_[n]);
    for (uint32_t i = n; i < n + k; ++i) inlined += (scratch_[i].send_flags & IBV_SEND_INLINE) != 0;
    if (prev_last != nullptr) prev_last->next = &scratch_[n];
    prev_last = &scratch_[n + k - 1];
    lane.next_wr += k;
    n += k;
    if (lane.next_wr < lane.plan.wrs.size()) break;  // window full
    if (lane.counted) {
      prev_last->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      prev_last->imm_data = htonl(EncodeImm(*lane.slot, lane.pieces));
    }
    lane.last_seq = seq + k - 1;
    posted_.push_back(std::move(queued_.front()));
    queued_.pop_front();
  }
  if (n == 0) return;
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(qp_.get(), scratch_.data(), &bad);
  counters_->post_calls.fetch_add(1, std::memory_order_relaxed);
  counters_->wrs.fetch_add(n, std::memory_order_relaxed);
  counters_->signalled.fetch_add(signalled, std::memory_order_relaxed);
  counters_->inline_wrs.fetch_add(inlined, std::memory_order_relaxed);
  if (rc != 0) {
    BreakLocked(absl::InternalError(absl::StrCat("ibv_post_send on ", dev_->Describe(), " QP ",
                                                 qp_->qp_num, " failed: ", std::strerror(rc))),
                nullptr, finished);
  }
}

void ClientQp::OnCompletion(const ibv_wc& wc) {
  std::vector<Finished> finished;
  {
    MutexLock lock(&mu_);
    if ((wc.wr_id & ~kSeqMask) != tag_ || state_ == State::kClosed) return;  // stale
    const uint64_t seq = wc.wr_id & kSeqMask;
    if (wc.status == IBV_WC_SUCCESS) {
      if (state_ != State::kReady) return;
      window_.Complete(seq);
      while (!posted_.empty() && posted_.front()->last_seq <= seq) {
        auto lane = std::move(posted_.front());
        posted_.pop_front();
        FinishLaneLocked(std::move(lane), absl::OkStatus(), &finished);
      }
      PumpLocked(&finished);
    } else if (state_ == State::kReady) {
      if (wc.status != IBV_WC_WR_FLUSH_ERR) {
        counters_->completion_errors.fetch_add(1, std::memory_order_relaxed);
      }
      // The first error; the flushes that follow it are ignored (state is broken then).
      const Lane* culprit = nullptr;
      for (const auto& lane : posted_) {
        if (lane->last_seq >= seq) {
          culprit = lane.get();
          break;
        }
      }
      if (culprit == nullptr && !queued_.empty() && queued_.front()->next_wr > 0) {
        culprit = queued_.front().get();
      }
      const TransferId id = culprit ? culprit->request.transfer_id : 0;
      const char* verb = culprit && culprit->opcode == IBV_WR_RDMA_READ ? "READ" : "WRITE";
      std::string message =
          absl::StrCat("rdma ", verb, " of transfer ", id, " failed on ", dev_->Describe(), " QP ",
                       wc.qp_num, " to peer ", core_->peer_name, ": ", ibv_wc_status_str(wc.status),
                       " (vendor error 0x", absl::Hex(wc.vendor_err), ")", WcHint(wc.status));
      absl::StatusCode code = CodeForWc(wc.status);
      // A port going down fails QPs before its async event is read: name the cause now.
      if (std::string port = dev_->PortProblem(); !port.empty()) {
        const std::string why = absl::StrCat("port error: ", dev_->Describe(), " is ", port);
        dev_->MarkDown(why, false);
        absl::StrAppend(&message, "; ", why);
        code = absl::StatusCode::kUnavailable;
      }
      BreakLocked(absl::Status(code, message), culprit, &finished);
    }
  }
  RunFinished(finished);
}

void ClientQp::BreakLocked(const absl::Status& status, const Lane* culprit,
                           std::vector<Finished>* finished) {
  if (state_ == State::kClosed) return;
  state_ = State::kBroken;
  if (qp_) {
    // ERROR flushes what is still queued: no READ response lands in memory whose lane is
    // reported below (the flush completions that follow are ignored).
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    if (const int rc = ibv_modify_qp(qp_.get(), &attr, IBV_QP_STATE); rc != 0) {
      KVW_LOG(kWarning, "rdma") << "QP not moved to ERROR; destroying it" << Kv("qpn", qp_->qp_num)
                                << Kv("error", std::strerror(rc));
      DestroyLocked();
    }
  }
  KVW_LOG(kWarning, "rdma") << "QP failed; it is re-created on next use"
                            << Kv("device", dev_->Describe()) << Kv("qpn", qp_ ? qp_->qp_num : 0)
                            << Kv("peer", core_->peer_name) << Kv("error", status.message());
  // The culprit gets `status`; the other lanes say they were flushed by it.
  std::vector<std::unique_ptr<Lane>> failing;
  while (!posted_.empty()) {
    failing.push_back(std::move(posted_.front()));
    posted_.pop_front();
  }
  // A partly posted lane fails; lanes not posted at all wait for the new QP.
  if (!queued_.empty() && queued_.front()->next_wr > 0) {
    failing.push_back(std::move(queued_.front()));
    queued_.pop_front();
  }
  for (auto& lane : failing) {
    const bool is_culprit = lane.get() == culprit || culprit == nullptr;
    absl::Status s =
        is_culprit
            ? status
            : absl::Status(status.code(), absl::StrCat("rdma transfer ", lane->request.transfer_id,
                                                       " flushed: ", status.message()));
    FinishLaneLocked(std::move(lane), std::move(s), finished);
  }
  if (!queued_.empty()) ScheduleReconnectLocked();
}

void ClientQp::Break(const absl::Status& status) {
  std::vector<Finished> finished;
  {
    MutexLock lock(&mu_);
    if (state_ == State::kReady || state_ == State::kConnecting) {
      BreakLocked(status, nullptr, &finished);
    }
  }
  RunFinished(finished);
}

void ClientQp::Close(const absl::Status& status) {
  std::vector<Finished> finished;
  {
    MutexLock lock(&mu_);
    if (state_ == State::kClosed) return;
    state_ = State::kClosed;
    // Destroy first: nothing touches local memory once the QP is gone.
    DestroyLocked();
    for (auto* list : {&posted_, &queued_}) {
      while (!list->empty()) {
        FinishLaneLocked(std::move(list->front()), status, &finished);
        list->pop_front();
      }
    }
    bind_mr_.reset();
  }
  RunFinished(finished);
}

void ClientQp::DestroyLocked() {
  if (qp_) {
    loop_->Remove(qp_->qp_num);
    qp_.reset();
  }
  if (reserved_ != 0) {
    dev_->ReleaseCq(reserved_);
    reserved_ = 0;
  }
}

// --- RdmaChannel -----------------------------------------------------------------------------

struct RemoteMr {
  uint64_t address = 0;
  uint64_t length = 0;
  std::vector<uint32_t> rkeys;  // by the peer's device index
};

class RdmaChannel final : public Channel {
 public:
  RdmaChannel(RdmaTransportImpl* transport, std::shared_ptr<ChannelCore> core,
              std::vector<std::shared_ptr<ClientQp>> qps, uint32_t devices, uint32_t per_device)
      : transport_(transport),
        core_(std::move(core)),
        qps_(std::move(qps)),
        devices_(devices),
        per_device_(per_device) {}
  ~RdmaChannel() override { Close(absl::CancelledError("rdma channel destroyed")); }

  void Post(PostRequest request, DoneCallback done) override;
  absl::Status AddRemoteRegions(const std::vector<RemoteRegionDesc>& regions) override;
  void RemoveRemoteRegions(const std::vector<RegionId>& ids) override {
    MutexLock lock(&mu_);
    for (RegionId id : ids) remote_.erase(id);
  }
  void Close(const absl::Status& reason) override {
    transport_->AbortCalls(core_.get(), reason);
    for (auto& qp : qps_) qp->Close(reason);
  }
  std::string Describe() const override {
    return absl::StrCat("rdma x", qps_.size(), " ", transport_->summary());
  }

 private:
  RdmaTransportImpl* const transport_;
  const std::shared_ptr<ChannelCore> core_;
  const std::vector<std::shared_ptr<ClientQp>> qps_;
  const uint32_t devices_;
  const uint32_t per_device_;
  Mutex mu_;
  absl::flat_hash_map<RegionId, RemoteMr> remote_ ABSL_GUARDED_BY(mu_);
};

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
  std::vector<ResolvedOp> ops;
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
  // Local keys (consecutive ops mostly share a region: one lookup each time it changes).
  uint64_t cached_lo = 1, cached_hi = 0;
  uint32_t cached_key = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    ResolvedOp& r = ops[i];
    if (r.local_addr < cached_lo || r.local_addr + r.length > cached_hi) {
      auto key = transport_->LocalKey(r.local_addr, r.length, local_dev);
      if (!key.ok()) {
        done(absl::Status(key.status().code(), absl::StrCat("transfer ", request.transfer_id, ": ",
                                                            key.status().message())));
        return;
      }
      cached_key = *key;
      cached_lo = r.local_addr;
      cached_hi = r.local_addr + r.length;
    }
    r.lkey = cached_key;
  }
  WrLimits limits;
  limits.max_sge = qp->max_sge();
  limits.max_wr_bytes = transport_->caps().max_op_bytes;
  if (lane->counted) {
    // The bind comes first, in a WR of its own (a separate PlanWrs call never joins it);
    // its addresses and keys are filled in when a slot is assigned.
    const ResolvedOp bind{0, 0, 0, 0, sizeof(uint64_t)};
    PlanWrs(&bind, 1, limits, &lane->plan);
  }
  PlanWrs(ops.data(), ops.size(), limits, &lane->plan);
  transport_->counters()->pieces.fetch_add(request.ops.size(), std::memory_order_relaxed);
  lane->request = std::move(request);
  lane->done = std::move(done);
  qp->Enqueue(std::move(lane));
}

// --- RdmaTransportImpl -----------------------------------------------------------------------

absl::Status RdmaTransportImpl::RegisterRegion(const LocalRegion& region) {
  auto mr = std::make_shared<LocalMr>();
  mr->id = region.id;
  mr->base = reinterpret_cast<uint64_t>(region.base);
  mr->length = region.length;
  // This engine's own MRs: local access only, so their rkeys reach nothing from any QP.
  // Peers get MRs of their own (ExportKey), with the region's remote access.
  const int access = IBV_ACCESS_LOCAL_WRITE;
  mr->remote_access = IBV_ACCESS_LOCAL_WRITE;  // never remote atomics
  if (region.access & kRemoteRead) mr->remote_access |= IBV_ACCESS_REMOTE_READ;
  if (region.access & kRemoteWrite) mr->remote_access |= IBV_ACCESS_REMOTE_WRITE;
  const absl::Time start = absl::Now();
  std::string gpu_reason;
  if (region.kind == MemoryKind::kGpu) {
    if (absl::Status s = RegisterGpuRegion(region, access, *mr, &gpu_reason); !s.ok()) return s;
  } else {
    for (const auto& d : devices_) {
      Mr m(ibv_reg_mr(d->pd.get(), region.base, region.length, access));
      if (!m) {
        return absl::ResourceExhaustedError(
            absl::StrCat("ibv_reg_mr of region ", region.id, " (", region.length, " bytes) on ",
                         d->Describe(), ": ", std::strerror(errno)));
      }
      mr->mrs.push_back(std::move(m));
    }
  }
  KVW_LOG(kDebug, "rdma") << "registered" << Kv("region", region.id) << Kv("bytes", region.length)
                          << Kv("devices", devices_.size())
                          << Kv("us", absl::ToDoubleMicroseconds(absl::Now() - start));
  MutexLock lock(&mrs_mu_);
  if (mr->gpu) {
    ++(mr->peer_memory ? gpu_peermem_regions_ : gpu_dmabuf_regions_);
    gpu_path_reason_ = std::move(gpu_reason);
  }
  mrs_[region.id] = mr;
  mrs_by_addr_[mr->base] = mr;  // regions may overlap; lookups check the length
  return absl::OkStatus();
}

absl::Status RdmaTransportImpl::RegisterGpuRegion(const LocalRegion& region, int access,
                                                  LocalMr& mr, std::string* reason) {
  const auto describe = [&] {
    return absl::StrCat("GPU region ", region.id, " (", region.length, " bytes at 0x",
                        absl::Hex(reinterpret_cast<uint64_t>(region.base)), " of GPU ",
                        region.gpu_device, ")");
  };
  if (options_.gpu_runtime == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(describe(), ": this rdma transport has no GPU runtime"));
  }
  // One export for every device; each registers its own MR on it (one per PD, as for host
  // memory). Its fd stays open while any MR uses it.
  absl::StatusOr<ExportedDmaBuf> dmabuf =
      ExportedDmaBuf::Export(*options_.gpu_runtime, region.gpu_device, region.base, region.length);
  absl::Status exported = dmabuf.status();
  DmaBufMrArgs args;
  if (dmabuf.ok()) {
    absl::StatusOr<DmaBufMrArgs> a = DmaBufArgsFor(dmabuf->range(), region.base, region.length);
    if (a.ok()) {
      args = *a;
      mr.dmabuf_args = args;
    } else {
      exported = a.status();
    }
    mr.dmabuf = std::move(*dmabuf);  // outlives the MRs, on failure too (LocalMr order)
  }
  mr.gpu = true;
  std::vector<std::string> reasons;
  bool any_dmabuf = false;
  for (const auto& d : devices_) {
    Mr m;
    absl::StatusOr<GpuMrChoice> choice = ChooseGpuMr(
        exported,
        [&] {
          m.reset(
              ibv_reg_dmabuf_mr(d->pd.get(), args.offset, args.length, args.iova, args.fd, access));
          return m ? absl::OkStatus()
                   : absl::UnavailableError(
                         absl::StrCat("ibv_reg_dmabuf_mr: ", std::strerror(errno)));
        },
        [&] {
          m.reset(ibv_reg_mr(d->pd.get(), region.base, region.length, access));
          return m ? absl::OkStatus()
                   : absl::UnavailableError(
                         absl::StrCat("ibv_reg_mr on the device pointer: ", std::strerror(errno)));
        });
    if (!choice.ok()) {
      KVW_LOG(kInfo, "rdma") << "GPU region not registered" << Kv("region", region.id)
                             << Kv("device", d->Describe()) << Kv("gpu", region.gpu_device)
                             << Kv("error", choice.status().message());
      return absl::Status(choice.status().code(), absl::StrCat(describe(), " on ", d->Describe(),
                                                               ": ", choice.status().message()));
    }
    KVW_LOG(kInfo, "rdma") << "GPU region registered" << Kv("region", region.id)
                           << Kv("device", d->Describe()) << Kv("gpu", region.gpu_device)
                           << Kv("path", GpuMrPathName(choice->path))
                           << Kv("reason", choice->reason);
    any_dmabuf = any_dmabuf || choice->path == GpuMrPath::kDmaBuf;
    mr.path.push_back(choice->path);
    mr.peer_memory = mr.peer_memory || choice->path == GpuMrPath::kPeerMemory;
    reasons.push_back(
        absl::StrCat(d->Describe(), " ", GpuMrPathName(choice->path), ": ", choice->reason));
    mr.mrs.push_back(std::move(m));
  }
  if (!any_dmabuf) mr.dmabuf.Reset();  // no MR uses it
  *reason = absl::StrJoin(reasons, "; ");
  return absl::OkStatus();
}

void RdmaTransportImpl::DeregisterRegion(RegionId id) {
  std::shared_ptr<LocalMr> mr;
  std::vector<std::shared_ptr<PeerMr>> granted;
  {
    MutexLock lock(&mrs_mu_);
    auto it = mrs_.find(id);
    if (it == mrs_.end()) return;
    mr = std::move(it->second);
    mrs_.erase(it);
    auto by = mrs_by_addr_.find(mr->base);
    if (by != mrs_by_addr_.end() && by->second == mr) mrs_by_addr_.erase(by);
    if (mr->gpu) --(mr->peer_memory ? gpu_peermem_regions_ : gpu_dmabuf_regions_);
  }
  // After the region left mrs_: an ExportKey racing with us either granted before this (and
  // loses it here) or finds the region gone after its grant (and revokes it itself).
  {
    MutexLock lock(&grants_mu_);
    granted = grants_.RevokeRegion(id);
  }
  // The peers' MRs are deregistered first (their rkeys stop working at once), then ours, then
  // a GPU region's dma-buf fd is closed (LocalMr order).
  granted.clear();
}

absl::StatusOr<PeerDomain> RdmaTransportImpl::DomainOf(PeerId peer) {
  MutexLock lock(&grants_mu_);
  absl::StatusOr<PeerDomain*> domain = grants_.DomainOf(peer, [&]() -> absl::StatusOr<PeerDomain> {
    PeerDomain made;
    for (const auto& d : devices_) {
      auto pd = std::make_shared<PeerPd>();
      pd->dev = d;
      pd->pd.reset(ibv_alloc_pd(d->ctx.get()));
      if (!pd->pd) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "ibv_alloc_pd for peer ", peer, " on ", d->Describe(), ": ", std::strerror(errno)));
      }
      made.push_back(std::move(pd));
    }
    return made;
  });
  if (!domain.ok()) return domain.status();
  return **domain;
}

absl::Status RdmaTransportImpl::RegisterFor(const LocalMr& region, PeerMr& out) {
  std::vector<std::string> keys;
  for (size_t i = 0; i < devices_.size(); ++i) {
    ibv_pd* pd = out.domain[i]->pd.get();
    Mr m;
    if (region.gpu && region.path[i] == GpuMrPath::kDmaBuf) {
      const DmaBufMrArgs& a = region.dmabuf_args;
      m.reset(ibv_reg_dmabuf_mr(pd, a.offset, a.length, a.iova, region.dmabuf.range().fd,
                                region.remote_access));
    } else {
      m.reset(ibv_reg_mr(pd, reinterpret_cast<void*>(region.base), region.length,
                         region.remote_access));
    }
    if (!m) {
      return absl::ResourceExhaustedError(
          absl::StrCat("ibv_reg_mr of region ", region.id, " (", region.length, " bytes) on ",
                       devices_[i]->Describe(), " for a peer: ", std::strerror(errno)));
    }
    keys.push_back(absl::StrCat(m->rkey));
    out.mrs.push_back(std::move(m));
  }
  out.key = absl::StrJoin(keys, ",");
  return absl::OkStatus();
}

absl::StatusOr<std::string> RdmaTransportImpl::ExportKey(PeerId peer, RegionId id) {
  std::shared_ptr<const LocalMr> region;
  {
    MutexLock lock(&mrs_mu_);
    auto it = mrs_.find(id);
    if (it == mrs_.end()) return std::string();  // not registered with rdma: no key
    region = it->second;
  }
  {
    MutexLock lock(&grants_mu_);
    if (const auto* granted = grants_.Find(peer, id)) return (*granted)->key;
  }
  absl::StatusOr<PeerDomain> domain = DomainOf(peer);
  if (!domain.ok()) return domain.status();
  // Registration pins and maps the region again (a system call per device): outside the lock.
  const absl::Time start = absl::Now();
  auto mr = std::make_shared<PeerMr>();
  mr->region = region;
  mr->domain = std::move(*domain);
  if (absl::Status s = RegisterFor(*region, *mr); !s.ok()) return s;
  std::optional<std::shared_ptr<PeerMr>> unused;
  std::string key;
  {
    MutexLock lock(&grants_mu_);
    unused = grants_.Add(peer, id, mr);
    const auto* granted = grants_.Find(peer, id);
    if (granted != nullptr) key = (*granted)->key;
  }
  if (key.empty()) {
    // The peer was dropped while we registered: nothing is granted.
    return absl::UnavailableError(
        absl::StrCat("region ", id, " not exported to peer ", peer, " over rdma: the peer closed"));
  }
  bool registered;
  {
    MutexLock lock(&mrs_mu_);
    auto it = mrs_.find(id);
    registered = it != mrs_.end() && it->second == region;
  }
  if (!registered) {
    RevokeExport(peer, id);
    return absl::NotFoundError(
        absl::StrCat("region ", id, " deregistered while being exported to peer ", peer));
  }
  // A concurrent export of the same region won: `unused` is deregistered on return.
  KVW_LOG(kDebug, "rdma") << "region exported" << Kv("region", id) << Kv("peer", peer)
                          << Kv("bytes", region->length)
                          << Kv("us", absl::ToDoubleMicroseconds(absl::Now() - start));
  return key;
}

void RdmaTransportImpl::RevokeExport(PeerId peer, RegionId id) {
  std::optional<std::shared_ptr<PeerMr>> revoked;
  {
    MutexLock lock(&grants_mu_);
    revoked = grants_.Revoke(peer, id);
  }
  // Deregistered here: the peer's rkey stops working before we return.
}

absl::StatusOr<uint32_t> RdmaTransportImpl::LocalKey(uint64_t addr, uint64_t length,
                                                     uint32_t device) const {
  MutexLock lock(&mrs_mu_);
  auto it = mrs_by_addr_.upper_bound(addr);
  while (it != mrs_by_addr_.begin()) {
    --it;
    const LocalMr& mr = *it->second;
    if (addr >= mr.base && addr + length <= mr.base + mr.length) return mr.mrs[device]->lkey;
    if (mr.base + (1ull << 40) < addr) break;
  }
  return absl::NotFoundError(absl::StrCat("local range [0x", absl::Hex(addr), ", +", length,
                                          ") is not registered with the rdma transport"));
}

absl::Status RdmaTransportImpl::CanReach(const std::string& remote_endpoint) const {
  pb::RdmaEndpoint remote;
  if (!remote.ParseFromString(remote_endpoint) || remote.devices_size() == 0) {
    return absl::InvalidArgumentError("peer's rdma endpoint is malformed or lists no device");
  }
  for (const auto& d : devices_) {
    for (const pb::RdmaDevice& r : remote.devices()) {
      if (r.ethernet() == d->ethernet) return absl::OkStatus();
    }
  }
  return absl::FailedPreconditionError(
      "no local device shares a link layer (RoCE / InfiniBand) with the peer's");
}

absl::StatusOr<std::unique_ptr<Channel>> RdmaTransportImpl::Connect(const PeerLink& link) {
  auto core = std::make_shared<ChannelCore>();
  core->transport = this;
  core->peer = link.peer;
  core->peer_name = link.peer_name;
  core->send = link.send_control;
  core->channel_id = (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  if (!core->remote.ParseFromString(link.remote_endpoint) || core->remote.devices_size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer ", link.peer_name, ": malformed rdma endpoint"));
  }
  const uint32_t ndev = static_cast<uint32_t>(devices_.size());
  // The engine asks for `lanes`; spread them over every device, at least one QP each.
  const uint32_t per_device = std::max<uint32_t>(
      1, std::min<uint32_t>(options_.qps_per_device, (link.lanes + ndev - 1) / ndev));
  std::vector<std::shared_ptr<ClientQp>> qps;
  for (uint32_t d = 0; d < ndev; ++d) {
    // Pair local device d with a remote device of the same link layer, round-robin.
    uint32_t remote_dev = d % static_cast<uint32_t>(core->remote.devices_size());
    for (int r = 0; r < core->remote.devices_size(); ++r) {
      const uint32_t candidate = (d + r) % core->remote.devices_size();
      if (core->remote.devices(candidate).ethernet() == devices_[d]->ethernet) {
        remote_dev = candidate;
        break;
      }
    }
    for (uint32_t q = 0; q < per_device; ++q) {
      qps.push_back(std::make_shared<ClientQp>(core, loops_[d].get(), d * per_device + q,
                                               remote_dev, options_, &counters_));
    }
  }
  if (absl::Status s = Establish(*core, qps, link.deadline); !s.ok()) {
    for (auto& qp : qps) qp->Close(s);
    return s;
  }
  KVW_LOG(kInfo, "rdma") << "channel up" << Kv("peer", link.peer_name) << Kv("qps", qps.size())
                         << Kv("devices", ndev);
  return std::make_unique<RdmaChannel>(this, core, std::move(qps), ndev, per_device);
}

absl::Status RdmaTransportImpl::Establish(const ChannelCore& core,
                                          const std::vector<std::shared_ptr<ClientQp>>& qps,
                                          absl::Time deadline) {
  pb::RdmaConnectRequest request;
  request.set_channel_id(core.channel_id);
  for (const auto& qp : qps) {
    if (absl::Status s = qp->device()->Usable(); !s.ok()) return s;
    auto info = qp->Prepare();
    if (!info.ok()) return info.status();
    *request.add_qps() = *info;
    request.add_remote_device(qp->remote_device());
    *request.add_local_device() = qp->device()->ToProto();
  }
  auto reply = Exchange(core, std::move(request), deadline);
  if (!reply.ok()) {
    return absl::Status(reply.status().code(),
                        absl::StrCat("rdma QP exchange with peer ", core.peer_name, ": ",
                                     reply.status().message()));
  }
  if (reply->code() != 0) {
    return absl::Status(
        static_cast<absl::StatusCode>(reply->code()),
        absl::StrCat("peer ", core.peer_name, " refused rdma QPs: ", reply->error()));
  }
  if (reply->qps_size() != static_cast<int>(qps.size())) {
    return absl::InternalError(absl::StrCat("peer ", core.peer_name, " answered ",
                                            reply->qps_size(), " QPs for ", qps.size()));
  }
  for (size_t i = 0; i < qps.size(); ++i) {
    if (absl::Status s = qps[i]->Finish(reply->qps(static_cast<int>(i))); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<pb::RdmaConnectReply> RdmaTransportImpl::Exchange(const ChannelCore& core,
                                                                 pb::RdmaConnectRequest request,
                                                                 absl::Time deadline) {
  if (!core.send) return absl::FailedPreconditionError("no control channel to the peer");
  auto call = std::make_shared<PendingCall>();
  call->peer = core.peer;
  call->core = &core;
  uint64_t id = 0;
  {
    MutexLock lock(&calls_mu_);
    if (shut_down_) return absl::UnavailableError("rdma transport shut down");
    id = next_call_++;
    calls_[id] = call;
  }
  request.set_call_id(id);
  pb::Envelope envelope;
  *envelope.mutable_rdma_connect_request() = std::move(request);
  absl::Status sent = core.send(envelope);
  MutexLock lock(&calls_mu_);
  if (!sent.ok() && !call->done) {
    call->done = true;
    call->status = absl::Status(sent.code(), absl::StrCat("sending the request on the control "
                                                          "channel: ",
                                                          sent.message()));
  }
  while (!call->done && absl::Now() < deadline) calls_cv_.WaitUntil(&calls_mu_, deadline);
  calls_.erase(id);
  if (!call->done) {
    return absl::DeadlineExceededError("no reply on the control channel before the deadline");
  }
  if (!call->status.ok()) return call->status;
  return std::move(call->reply);
}

void RdmaTransportImpl::AbortCalls(const ChannelCore* core, const absl::Status& status) {
  MutexLock lock(&calls_mu_);
  for (auto& [id, call] : calls_) {
    if ((core == nullptr || call->core == core) && !call->done) {
      call->done = true;
      call->status = status;
    }
  }
  calls_cv_.SignalAll();
}

void RdmaTransportImpl::OnControlMessage(PeerId peer, const pb::Envelope& message,
                                         const ControlSender& reply) {
  if (message.has_rdma_connect_request()) {
    pb::Envelope answer;
    *answer.mutable_rdma_connect_reply() = HandleConnect(peer, message.rdma_connect_request());
    answer.mutable_rdma_connect_reply()->set_call_id(message.rdma_connect_request().call_id());
    if (absl::Status s = reply(answer); !s.ok()) {
      KVW_LOG(kWarning, "rdma") << "QP exchange reply not sent" << Kv("peer", peer)
                                << Kv("error", s.message());
    }
    return;
  }
  if (message.has_rdma_connect_reply()) {
    MutexLock lock(&calls_mu_);
    auto it = calls_.find(message.rdma_connect_reply().call_id());
    // A reply after the deadline, or from another peer, finds no call: dropped.
    if (it == calls_.end() || it->second->peer != peer || it->second->done) return;
    it->second->done = true;
    it->second->reply = message.rdma_connect_reply();
    calls_cv_.SignalAll();
  }
}

void RdmaTransportImpl::ScheduleReconnect(std::shared_ptr<ClientQp> qp) {
  counters_.qp_reconnects.fetch_add(1, std::memory_order_relaxed);
  const bool posted = runner_->Post([this, qp] {
    KVW_LOG(kInfo, "rdma") << "re-creating QP" << Kv("device", qp->device()->Describe())
                           << Kv("index", qp->index());
    // The core is shared by all QPs of the channel; re-create just this one.
    absl::Status s = Establish(qp->core(), {qp}, absl::Now() + absl::Seconds(10));
    if (!s.ok()) qp->SetupFailed(s);
  });
  if (!posted) qp->SetupFailed(absl::UnavailableError("rdma transport shut down"));
}

pb::RdmaConnectReply RdmaTransportImpl::HandleConnect(PeerId peer,
                                                      const pb::RdmaConnectRequest& request) {
  pb::RdmaConnectReply reply;
  auto refuse = [&](const absl::Status& s) {
    reply.Clear();
    reply.set_code(static_cast<uint32_t>(s.code()));
    reply.set_error(std::string(s.message()));
    return reply;
  };
  if (shut_down_) return refuse(absl::UnavailableError("rdma transport shutting down"));
  if (request.qps_size() != request.remote_device_size() ||
      request.qps_size() != request.local_device_size()) {
    return refuse(absl::InvalidArgumentError("malformed rdma connect request"));
  }
  // The peer's QPs go into its own PDs: they reach what was exported to it, nothing else.
  absl::StatusOr<PeerDomain> domain = DomainOf(peer);
  if (!domain.ok()) return refuse(domain.status());
  std::vector<std::shared_ptr<ServerQp>> created;
  for (int i = 0; i < request.qps_size(); ++i) {
    const uint32_t dev = request.remote_device(i);
    if (dev >= devices_.size()) {
      return refuse(absl::InvalidArgumentError(absl::StrCat("no local device ", dev)));
    }
    if (absl::Status s = devices_[dev]->Usable(); !s.ok()) return refuse(s);
    auto qp = std::make_shared<ServerQp>(devices_[dev], (*domain)[dev], peer, request.channel_id(),
                                         request.qps(i).index());
    auto info = qp->Create(request.qps(i), request.local_device(i), options_);
    if (!info.ok()) return refuse(info.status());
    *reply.add_qps() = *info;
    created.push_back(std::move(qp));
  }
  MutexLock lock(&server_mu_);
  auto& table = targets_[{peer, request.channel_id()}];
  for (int i = 0; i < request.qps_size(); ++i) {
    const uint32_t index = request.qps(i).index();
    DeviceLoop* loop = loops_[request.remote_device(i)].get();
    if (auto old = table.find(index); old != table.end()) loop->Remove(old->second->qpn());
    loop->AddServer(created[i]->qpn(), created[i]);
    table[index] = created[i];
  }
  return reply;
}

void RdmaTransportImpl::DropPeer(PeerId peer) {
  std::vector<std::shared_ptr<ServerQp>> dropped;
  {
    MutexLock lock(&server_mu_);
    for (auto it = targets_.begin(); it != targets_.end();) {
      if (it->first.first != peer) {
        ++it;
        continue;
      }
      for (auto& [index, qp] : it->second) dropped.push_back(qp);
      it = targets_.erase(it);
    }
  }
  for (auto& qp : dropped) {
    for (auto& loop : loops_) loop->Remove(qp->qpn());
  }
  // Its MRs are deregistered here; its PDs go with the last of its QPs.
  PeerGrants<PeerDomain, std::shared_ptr<PeerMr>>::Dropped grants;
  {
    MutexLock lock(&grants_mu_);
    grants = grants_.DropPeer(peer);
  }
  if (!dropped.empty() || !grants.grants.empty()) {
    KVW_LOG(kInfo, "rdma") << "target QPs and exports of peer torn down" << Kv("peer", peer)
                           << Kv("qps", dropped.size()) << Kv("regions", grants.grants.size());
  }
}

void RdmaTransportImpl::AddStats(EngineStats* stats) const {
  RdmaStats& r = stats->rdma;
  r.work_requests = counters_.wrs.load(std::memory_order_relaxed);
  r.post_calls = counters_.post_calls.load(std::memory_order_relaxed);
  r.signalled = counters_.signalled.load(std::memory_order_relaxed);
  r.inline_wrs = counters_.inline_wrs.load(std::memory_order_relaxed);
  r.queued_wrs = counters_.queued_wrs.load(std::memory_order_relaxed);
  r.completion_errors = counters_.completion_errors.load(std::memory_order_relaxed);
  r.async_events = counters_.async_events.load(std::memory_order_relaxed);
  r.qp_reconnects = counters_.qp_reconnects.load(std::memory_order_relaxed);
  MutexLock lock(&mrs_mu_);
  stats->gpu.rdma_dmabuf_regions = gpu_dmabuf_regions_;
  stats->gpu.rdma_peermem_regions = gpu_peermem_regions_;
  stats->gpu.rdma_path_reason = gpu_path_reason_;
}

void RdmaTransportImpl::Shutdown() {
  {
    MutexLock lock(&calls_mu_);
    if (shut_down_.exchange(true)) return;
  }
  AbortCalls(nullptr, absl::UnavailableError("rdma transport shut down"));
  runner_->Stop();
  {
    MutexLock lock(&server_mu_);
    targets_.clear();
  }
  {
    MutexLock lock(&grants_mu_);
    (void)grants_.Clear();
  }
  for (auto& loop : loops_) loop->Stop();
  KVW_LOG(kInfo, "rdma") << "transport stopped" << Kv("post_calls", counters_.post_calls.load())
                         << Kv("wrs", counters_.wrs.load())
                         << Kv("signalled", counters_.signalled.load())
                         << Kv("pieces", counters_.pieces.load());
}

}  // namespace rdma

absl::StatusOr<std::unique_ptr<Transport>> CreateRdmaTransport(const RdmaTransportOptions& options,
                                                               TargetHooks* hooks) {
  std::vector<std::string> skipped;
  auto devices = rdma::OpenDevices(options, &skipped);
  for (const std::string& line : skipped) {
    KVW_LOG(kInfo, "rdma") << "device skipped" << Kv("reason", line);
  }
  if (!devices.ok()) return devices.status();
  auto transport = std::make_unique<rdma::RdmaTransportImpl>(options, hooks, std::move(*devices));
  if (absl::Status s = transport->Start(); !s.ok()) return s;
  return transport;
}

}  // namespace kvwire::transport
