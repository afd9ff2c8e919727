// The rdma transport's memory registrations: a region's own MRs (LocalMr), a peer's protection
// domains (PeerPd), and a region's MRs in them (PeerMr). See rdma_transport.h, Peer isolation.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_REGIONS_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_REGIONS_H_

#include <memory>
#include <string>
#include <vector>

#include "src/util/pinned_ranges.h"
#include "transport/rdma/rdma_device.h"
#include "transport/rdma/rdma_gpu_mr.h"
#include "transport/transport.h"

namespace kvwire::transport::rdma {

// A registered region: one MR per device in the device's PD, for this engine's own WRs only
// (local access: no peer can use its rkey). Peers reach the region through the MRs of
// PeerMr. A GPU region registered through a dma-buf keeps the dma-buf's fd open until its
// MRs are gone (declared first: destroyed last).
struct LocalMr {
  // Host memory: its pages are pinned by the MRs below (first member: released last), so the
  // shm transport does not move the range under them (src/util/pinned_ranges.h).
  PinnedRange pinned;
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

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_REGIONS_H_
