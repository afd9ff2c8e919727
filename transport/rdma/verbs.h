// The libibverbs calls of the rdma transport, behind one table of function pointers, and RAII
// owners of the verbs objects.
//
// Why a table: every ibv_* call of transport/rdma goes through verbs(), so a test or a
// benchmark can install another table (tests/rdma/fake_verbs.h: accepts posts, produces
// completions) and run the whole engine's rdma path without a device, e.g. to count the CPU of
// a Transfer. The real table (RealVerbs) calls libibverbs. A function pointer per call costs
// what the inline ibv_post_send / ibv_poll_cq already cost (they call through the provider's
// ops table); the installed table is read with one relaxed atomic load.
//
// The owners are unique_ptrs whose deleters call the matching destroy / dereg / close through
// verbs(); destruction order is the owner's member order. Install a table before the objects
// it makes are created and keep it until they are gone (a fake's objects are not libibverbs').
#ifndef KVWIRE_TRANSPORT_RDMA_VERBS_H_
#define KVWIRE_TRANSPORT_RDMA_VERBS_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include <infiniband/verbs.h>

namespace kvwire::transport::rdma {

struct Verbs {
  ibv_device** (*get_device_list)(int* count);
  void (*free_device_list)(ibv_device** list);
  const char* (*get_device_name)(ibv_device* device);
  ibv_context* (*open_device)(ibv_device* device);
  int (*close_device)(ibv_context* context);
  int (*query_device)(ibv_context* context, ibv_device_attr* attr);
  int (*query_port)(ibv_context* context, uint8_t port, ibv_port_attr* attr);
  int (*query_gid)(ibv_context* context, uint8_t port, int index, ibv_gid* gid);
  int (*query_gid_ex)(ibv_context* context, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                      uint32_t flags);
  ibv_pd* (*alloc_pd)(ibv_context* context);
  int (*dealloc_pd)(ibv_pd* pd);
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, size_t length, int access);
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                           int access);
  int (*dereg_mr)(ibv_mr* mr);
  ibv_comp_channel* (*create_comp_channel)(ibv_context* context);
  int (*destroy_comp_channel)(ibv_comp_channel* channel);
  ibv_cq* (*create_cq)(ibv_context* context, int entries, void* cq_context,
                       ibv_comp_channel* channel, int comp_vector);
  int (*destroy_cq)(ibv_cq* cq);
  int (*req_notify_cq)(ibv_cq* cq, int solicited_only);
  int (*get_cq_event)(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context);
  void (*ack_cq_events)(ibv_cq* cq, unsigned int events);
  int (*poll_cq)(ibv_cq* cq, int entries, ibv_wc* wc);
  ibv_qp* (*create_qp)(ibv_pd* pd, ibv_qp_init_attr* attr);
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int mask);
  int (*destroy_qp)(ibv_qp* qp);
  int (*post_send)(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad);
  int (*post_recv)(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad);
  int (*get_async_event)(ibv_context* context, ibv_async_event* event);
  void (*ack_async_event)(ibv_async_event* event);
};

// The table that calls libibverbs.
const Verbs& RealVerbs();
// The installed table (RealVerbs unless a test installed another).
const Verbs& verbs();
// Installs `table` (null: RealVerbs again) for every rdma transport created afterwards; the
// caller keeps it alive and restores the old one once those transports are gone.
void SetVerbs(const Verbs* table);

struct DeviceListDeleter {
  void operator()(ibv_device** list) const { verbs().free_device_list(list); }
};
struct ContextDeleter {
  void operator()(ibv_context* c) const { verbs().close_device(c); }
};
struct PdDeleter {
  void operator()(ibv_pd* pd) const { verbs().dealloc_pd(pd); }
};
struct MrDeleter {
  void operator()(ibv_mr* mr) const { verbs().dereg_mr(mr); }
};
struct CompChannelDeleter {
  void operator()(ibv_comp_channel* c) const { verbs().destroy_comp_channel(c); }
};
struct CqDeleter {
  void operator()(ibv_cq* cq) const { verbs().destroy_cq(cq); }
};
struct QpDeleter {
  void operator()(ibv_qp* qp) const { verbs().destroy_qp(qp); }
};

using DeviceList = std::unique_ptr<ibv_device*, DeviceListDeleter>;
using Context = std::unique_ptr<ibv_context, ContextDeleter>;
using Pd = std::unique_ptr<ibv_pd, PdDeleter>;
using Mr = std::unique_ptr<ibv_mr, MrDeleter>;
using CompChannel = std::unique_ptr<ibv_comp_channel, CompChannelDeleter>;
using Cq = std::unique_ptr<ibv_cq, CqDeleter>;
using Qp = std::unique_ptr<ibv_qp, QpDeleter>;

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_VERBS_H_
