#include "transport/rdma/verbs.h"

#include <atomic>

namespace kvwire::transport::rdma {
namespace {

// Lambdas, not the names: several ibv_* are inline functions or macros in rdma-core's header.
const Verbs kReal = {
    [](int* count) { return ibv_get_device_list(count); },
    [](ibv_device** list) { ibv_free_device_list(list); },
    [](ibv_device* device) { return ibv_get_device_name(device); },
    [](ibv_device* device) { return ibv_open_device(device); },
    [](ibv_context* context) { return ibv_close_device(context); },
    [](ibv_context* context, ibv_device_attr* attr) { return ibv_query_device(context, attr); },
    [](ibv_context* context, uint8_t port, ibv_port_attr* attr) {
      return ibv_query_port(context, port, attr);
    },
    [](ibv_context* context, uint8_t port, int index, ibv_gid* gid) {
      return ibv_query_gid(context, port, index, gid);
    },
    [](ibv_context* context, uint32_t port, uint32_t index, ibv_gid_entry* entry, uint32_t flags) {
      return ibv_query_gid_ex(context, port, index, entry, flags);
    },
    [](ibv_context* context) { return ibv_alloc_pd(context); },
    [](ibv_pd* pd) { return ibv_dealloc_pd(pd); },
    [](ibv_pd* pd, void* addr, size_t length, int access) {
      return ibv_reg_mr(pd, addr, length, access);
    },
    [](ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access) {
      return ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access);
    },
    [](ibv_mr* mr) { return ibv_dereg_mr(mr); },
    [](ibv_context* context) { return ibv_create_comp_channel(context); },
    [](ibv_comp_channel* channel) { return ibv_destroy_comp_channel(channel); },
    [](ibv_context* context, int entries, void* cq_context, ibv_comp_channel* channel,
       int comp_vector) {
      return ibv_create_cq(context, entries, cq_context, channel, comp_vector);
    },
    [](ibv_cq* cq) { return ibv_destroy_cq(cq); },
    [](ibv_cq* cq, int solicited_only) { return ibv_req_notify_cq(cq, solicited_only); },
    [](ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
      return ibv_get_cq_event(channel, cq, cq_context);
    },
    [](ibv_cq* cq, unsigned int events) { ibv_ack_cq_events(cq, events); },
    [](ibv_cq* cq, int entries, ibv_wc* wc) { return ibv_poll_cq(cq, entries, wc); },
    [](ibv_pd* pd, ibv_qp_init_attr* attr) { return ibv_create_qp(pd, attr); },
    [](ibv_qp* qp, ibv_qp_attr* attr, int mask) { return ibv_modify_qp(qp, attr, mask); },
    [](ibv_qp* qp) { return ibv_destroy_qp(qp); },
    [](ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) { return ibv_post_send(qp, wr, bad); },
    [](ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) { return ibv_post_recv(qp, wr, bad); },
    [](ibv_context* context, ibv_async_event* event) {
      return ibv_get_async_event(context, event);
    },
    [](ibv_async_event* event) { ibv_ack_async_event(event); },
};

std::atomic<const Verbs*> installed{&kReal};

}  // namespace

const Verbs& RealVerbs() { return kReal; }

const Verbs& verbs() { return *installed.load(std::memory_order_relaxed); }

void SetVerbs(const Verbs* table) {
  installed.store(table != nullptr ? table : &kReal, std::memory_order_release);
}

}  // namespace kvwire::transport::rdma
