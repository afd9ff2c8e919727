#include "tests/rdma/fake/fake_verbs.h"

#include <sys/eventfd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <unistd.h>

#include <infiniband/verbs.h>

#include "absl/container/flat_hash_map.h"

#include "transport/rdma/verbs.h"

namespace kvwire::testing {
namespace {

// The fake's objects extend the libibverbs structs (the transport reads their public fields:
// qp_num, cqe, fd, async_fd, lkey, rkey), so a pointer converts back with static_cast.
struct FakeChannel : ibv_comp_channel {
  ibv_cq* cq = nullptr;
};
struct FakeCq : ibv_cq {
  std::mutex mu;
  std::deque<ibv_wc> wcs;
  bool armed = false;
};
struct FakeQp : ibv_qp {
  bool signal_all = false;
  uint32_t dest = 0;
  std::mutex mu;
  std::deque<uint64_t> recvs;
};

struct State {
  FakeVerbsOptions options;
  FakeVerbsCounters counters;
  ibv_device device{};
  ibv_device* list[2] = {&device, nullptr};
  std::mutex mu;
  uint32_t next_qpn = 0x11;
  uint32_t next_key = 0x100;
  absl::flat_hash_map<uint32_t, FakeQp*> qps_by_number;
  // Owners of everything handed out (creation and destruction are off the posting path).
  absl::flat_hash_map<void*, std::unique_ptr<ibv_context>> contexts;
  absl::flat_hash_map<void*, std::unique_ptr<ibv_pd>> pds;
  absl::flat_hash_map<void*, std::unique_ptr<ibv_mr>> mrs;
  absl::flat_hash_map<void*, std::unique_ptr<FakeChannel>> channels;
  absl::flat_hash_map<void*, std::unique_ptr<FakeCq>> cqs;
  absl::flat_hash_map<void*, std::unique_ptr<FakeQp>> qps;
};
std::unique_ptr<State> owned;  // the installed fake's state (one ScopedFakeVerbs at a time)
State* state = nullptr;

template <typename T>
T* Keep(absl::flat_hash_map<void*, std::unique_ptr<T>>& owners, std::unique_ptr<T> object) {
  T* raw = object.get();
  std::lock_guard<std::mutex> lock(state->mu);
  owners[raw] = std::move(object);
  return raw;
}

template <typename T>
int Drop(absl::flat_hash_map<void*, std::unique_ptr<T>>& owners, void* object) {
  std::unique_ptr<T> gone;
  std::lock_guard<std::mutex> lock(state->mu);
  auto it = owners.find(object);
  if (it == owners.end()) return EINVAL;
  gone = std::move(it->second);
  owners.erase(it);
  return 0;
}

void Wake(int fd) {
  const uint64_t one = 1;
  (void)!write(fd, &one, sizeof(one));
}

void Complete(ibv_cq* to, const ibv_wc& wc) {
  FakeCq* cq = static_cast<FakeCq*>(to);
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(cq->mu);
    cq->wcs.push_back(wc);
    wake = cq->armed;
    cq->armed = false;
  }
  if (wake && cq->channel != nullptr) Wake(cq->channel->fd);
}

ibv_gid MappedGid() {
  ibv_gid gid{};
  gid.raw[10] = 0xff;
  gid.raw[11] = 0xff;
  gid.raw[12] = 127;
  gid.raw[15] = 1;
  return gid;
}

void Copy(const ibv_send_wr& wr) {
  uint64_t remote = wr.wr.rdma.remote_addr;
  for (int i = 0; i < wr.num_sge; ++i) {
    void* local = reinterpret_cast<void*>(wr.sg_list[i].addr);
    void* far = reinterpret_cast<void*>(remote);
    if (wr.opcode == IBV_WR_RDMA_READ) {
      std::memcpy(local, far, wr.sg_list[i].length);
    } else {
      std::memcpy(far, local, wr.sg_list[i].length);
    }
    remote += wr.sg_list[i].length;
  }
}

int PostSend(ibv_qp* to, ibv_send_wr* wr, ibv_send_wr** bad) {
  FakeQp* qp = static_cast<FakeQp*>(to);
  FakeVerbsCounters& c = state->counters;
  c.post_send_calls.fetch_add(1, std::memory_order_relaxed);
  if (qp->state != IBV_QPS_RTS) {
    *bad = wr;
    return EINVAL;
  }
  for (; wr != nullptr; wr = wr->next) {
    uint64_t bytes = 0;
    for (int i = 0; i < wr->num_sge; ++i) bytes += wr->sg_list[i].length;
    c.send_wrs.fetch_add(1, std::memory_order_relaxed);
    c.bytes.fetch_add(bytes, std::memory_order_relaxed);
    const bool rdma = wr->opcode == IBV_WR_RDMA_READ || wr->opcode == IBV_WR_RDMA_WRITE ||
                      wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
    if (state->options.move_data && rdma) Copy(*wr);
    if (wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM || wr->opcode == IBV_WR_SEND_WITH_IMM) {
      c.immediates.fetch_add(1, std::memory_order_relaxed);
      FakeQp* peer = nullptr;
      {
        std::lock_guard<std::mutex> lock(state->mu);
        auto it = state->qps_by_number.find(qp->dest);
        if (it != state->qps_by_number.end()) peer = it->second;
      }
      uint64_t recv_id = 0;
      bool have = false;
      if (peer != nullptr) {
        std::lock_guard<std::mutex> lock(peer->mu);
        if (!peer->recvs.empty()) {
          recv_id = peer->recvs.front();
          peer->recvs.pop_front();
          have = true;
        }
      }
      if (!have) {
        c.missed_recvs.fetch_add(1, std::memory_order_relaxed);
      } else {
        ibv_wc wc{};
        wc.wr_id = recv_id;
        wc.status = IBV_WC_SUCCESS;
        wc.opcode = wr->opcode == IBV_WR_SEND_WITH_IMM ? IBV_WC_RECV : IBV_WC_RECV_RDMA_WITH_IMM;
        wc.byte_len = static_cast<uint32_t>(bytes);
        wc.imm_data = wr->imm_data;
        wc.wc_flags = IBV_WC_WITH_IMM;
        wc.qp_num = peer->qp_num;
        wc.src_qp = qp->qp_num;
        Complete(peer->recv_cq, wc);
      }
    }
    if ((wr->send_flags & IBV_SEND_SIGNALED) != 0 || qp->signal_all) {
      c.signalled.fetch_add(1, std::memory_order_relaxed);
      ibv_wc wc{};
      wc.wr_id = wr->wr_id;
      wc.status = IBV_WC_SUCCESS;
      wc.opcode = wr->opcode == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ
                  : rdma                         ? IBV_WC_RDMA_WRITE
                                                 : IBV_WC_SEND;
      wc.byte_len = static_cast<uint32_t>(bytes);
      wc.qp_num = qp->qp_num;
      Complete(qp->send_cq, wc);
    }
  }
  return 0;
}

int PostRecv(ibv_qp* to, ibv_recv_wr* wr, ibv_recv_wr** /*bad*/) {
  FakeQp* qp = static_cast<FakeQp*>(to);
  std::lock_guard<std::mutex> lock(qp->mu);
  for (; wr != nullptr; wr = wr->next) {
    state->counters.post_recv_wrs.fetch_add(1, std::memory_order_relaxed);
    qp->recvs.push_back(wr->wr_id);
  }
  return 0;
}

int PollCq(ibv_cq* from, int entries, ibv_wc* out) {
  FakeCq* cq = static_cast<FakeCq*>(from);
  std::lock_guard<std::mutex> lock(cq->mu);
  int n = 0;
  while (n < entries && !cq->wcs.empty()) {
    out[n++] = cq->wcs.front();
    cq->wcs.pop_front();
  }
  return n;
}

int NotifyCq(ibv_cq* on, int /*solicited_only*/) {
  FakeCq* cq = static_cast<FakeCq*>(on);
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(cq->mu);
    cq->armed = cq->wcs.empty();
    wake = !cq->armed;  // completions already waiting: the event is due now
  }
  if (wake && cq->channel != nullptr) Wake(cq->channel->fd);
  return 0;
}

int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  uint64_t events = 0;
  if (read(channel->fd, &events, sizeof(events)) != sizeof(events)) return -1;
  *cq = static_cast<FakeChannel*>(channel)->cq;
  *cq_context = *cq != nullptr ? (*cq)->cq_context : nullptr;
  return 0;
}

ibv_context* OpenDevice(ibv_device* device) {
  auto ctx = std::make_unique<ibv_context>();
  ctx->device = device;
  ctx->cmd_fd = -1;
  ctx->async_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);  // never written: no async events
  ctx->num_comp_vectors = 1;
  return Keep(state->contexts, std::move(ctx));
}

int CloseDevice(ibv_context* ctx) {
  close(ctx->async_fd);
  return Drop(state->contexts, ctx);
}

int QueryDevice(ibv_context* /*ctx*/, ibv_device_attr* attr) {
  *attr = ibv_device_attr{};
  std::strncpy(attr->fw_ver, "fake", sizeof(attr->fw_ver) - 1);
  attr->max_mr_size = ~uint64_t{0};
  attr->max_qp = state->options.max_qp;
  attr->max_qp_wr = 16384;
  attr->max_sge = 32;
  attr->max_cq = 1 << 16;
  attr->max_cqe = 1 << 20;
  attr->max_mr = 1 << 20;
  attr->max_pd = 1 << 16;
  attr->max_qp_rd_atom = 16;
  attr->max_qp_init_rd_atom = 16;
  attr->phys_port_cnt = 1;
  return 0;
}

int QueryPort(ibv_context* /*ctx*/, uint8_t /*port*/, ibv_port_attr* attr) {
  *attr = ibv_port_attr{};
  attr->state = IBV_PORT_ACTIVE;
  attr->max_mtu = IBV_MTU_4096;
  attr->active_mtu = IBV_MTU_4096;
  attr->gid_tbl_len = 16;
  attr->max_msg_sz = 1u << 31;
  attr->link_layer = IBV_LINK_LAYER_ETHERNET;
  return 0;
}

int QueryGidEx(ibv_context* /*ctx*/, uint32_t port, uint32_t index, ibv_gid_entry* entry,
               uint32_t /*flags*/) {
  *entry = ibv_gid_entry{};
  const ibv_gid gid = MappedGid();
  std::memcpy(entry->gid.raw, gid.raw, sizeof(gid.raw));
  entry->gid_index = index;
  entry->port_num = port;
  entry->gid_type = IBV_GID_TYPE_ROCE_V2;
  return 0;
}

ibv_pd* AllocPd(ibv_context* ctx) {
  auto pd = std::make_unique<ibv_pd>();
  pd->context = ctx;
  return Keep(state->pds, std::move(pd));
}

ibv_mr* RegMr(ibv_pd* pd, void* addr, size_t length, int /*access*/) {
  auto mr = std::make_unique<ibv_mr>();
  mr->context = pd->context;
  mr->pd = pd;
  mr->addr = addr;
  mr->length = length;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    mr->lkey = mr->rkey = state->next_key++;
  }
  return Keep(state->mrs, std::move(mr));
}

ibv_comp_channel* CreateChannel(ibv_context* ctx) {
  auto channel = std::make_unique<FakeChannel>();
  channel->context = ctx;
  channel->fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  return Keep(state->channels, std::move(channel));
}

int DestroyChannel(ibv_comp_channel* channel) {
  close(channel->fd);
  return Drop(state->channels, channel);
}

ibv_cq* CreateCq(ibv_context* ctx, int entries, void* cq_context, ibv_comp_channel* channel,
                 int /*comp_vector*/) {
  auto cq = std::make_unique<FakeCq>();
  cq->context = ctx;
  cq->channel = channel;
  cq->cq_context = cq_context;
  cq->cqe = entries;
  if (channel != nullptr) static_cast<FakeChannel*>(channel)->cq = cq.get();
  return Keep(state->cqs, std::move(cq));
}

ibv_qp* CreateQp(ibv_pd* pd, ibv_qp_init_attr* init) {
  auto qp = std::make_unique<FakeQp>();
  qp->context = pd->context;
  qp->pd = pd;
  qp->send_cq = init->send_cq;
  qp->recv_cq = init->recv_cq;
  qp->qp_type = init->qp_type;
  qp->state = IBV_QPS_RESET;
  qp->signal_all = init->sq_sig_all != 0;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    qp->qp_num = state->next_qpn++;
    state->qps_by_number[qp->qp_num] = qp.get();
  }
  state->counters.qps_created.fetch_add(1, std::memory_order_relaxed);
  state->counters.qps_alive.fetch_add(1, std::memory_order_relaxed);
  return Keep(state->qps, std::move(qp));
}

int ModifyQp(ibv_qp* to, ibv_qp_attr* attr, int mask) {
  FakeQp* qp = static_cast<FakeQp*>(to);
  if ((mask & IBV_QP_DEST_QPN) != 0) qp->dest = attr->dest_qp_num;
  if ((mask & IBV_QP_STATE) != 0) qp->state = attr->qp_state;
  return 0;
}

int DestroyQp(ibv_qp* qp) {
  {
    std::lock_guard<std::mutex> lock(state->mu);
    state->qps_by_number.erase(qp->qp_num);
  }
  state->counters.qps_alive.fetch_sub(1, std::memory_order_relaxed);
  return Drop(state->qps, qp);
}

const transport::rdma::Verbs kFake = {
    [](int* count) {
      *count = 1;
      return state->list;
    },
    [](ibv_device** /*list*/) {},
    [](ibv_device* device) -> const char* { return device->name; },
    OpenDevice,
    CloseDevice,
    QueryDevice,
    QueryPort,
    [](ibv_context* /*ctx*/, uint8_t /*port*/, int /*index*/, ibv_gid* gid) {
      *gid = MappedGid();
      return 0;
    },
    QueryGidEx,
    AllocPd,
    [](ibv_pd* pd) { return Drop(state->pds, pd); },
    RegMr,
    [](ibv_pd*, uint64_t, size_t, uint64_t, int, int) -> ibv_mr* {
      errno = EOPNOTSUPP;  // like rxe: host memory only
      return nullptr;
    },
    [](ibv_mr* mr) { return Drop(state->mrs, mr); },
    CreateChannel,
    DestroyChannel,
    CreateCq,
    [](ibv_cq* cq) { return Drop(state->cqs, cq); },
    NotifyCq,
    GetCqEvent,
    [](ibv_cq* /*cq*/, unsigned int /*events*/) {},
    PollCq,
    CreateQp,
    ModifyQp,
    DestroyQp,
    PostSend,
    PostRecv,
    [](ibv_context* /*ctx*/, ibv_async_event* /*event*/) {
      errno = EAGAIN;
      return -1;
    },
    [](ibv_async_event* /*event*/) {},
};

}  // namespace

ScopedFakeVerbs::ScopedFakeVerbs(FakeVerbsOptions options) {
  owned = std::make_unique<State>();
  state = owned.get();
  state->options = options;
  std::strncpy(state->device.name, "fake0", sizeof(state->device.name) - 1);
  std::strncpy(state->device.dev_name, "uverbs-fake0", sizeof(state->device.dev_name) - 1);
  state->device.node_type = IBV_NODE_CA;
  state->device.transport_type = IBV_TRANSPORT_IB;
  transport::rdma::SetVerbs(&kFake);
}

ScopedFakeVerbs::~ScopedFakeVerbs() {
  transport::rdma::SetVerbs(nullptr);
  state = nullptr;
  owned.reset();
}

const FakeVerbsCounters& ScopedFakeVerbs::counters() const { return state->counters; }

}  // namespace kvwire::testing
