// How an RC QP addresses its remote end (the address vector of the RTR transition), kept
// apart from the verbs calls so that it is unit-tested with synthetic port attributes:
// - RoCE (Ethernet link layer): always a GRH: is_global, the peer's GID, our GID index.
// - InfiniBand: the peer's LID; a GRH as well only when the peer sits in another subnet (its
//   GID's subnet prefix differs from ours), as routed IB requires.
// The path MTU is the smaller of both ports' active MTUs.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_ADDRESS_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_ADDRESS_H_

#include <cstdint>
#include <string>

#include <infiniband/verbs.h>

#include "absl/status/statusor.h"

#include "transport/rdma/rdma.pb.h"

namespace kvwire::transport::rdma {

// What the local port knows of itself.
struct PortAddress {
  std::string where;  // "rxe0:1", for errors
  uint8_t port = 1;
  bool ethernet = false;
  int gid_index = 0;  // RoCE: the chosen GID; InfiniBand: 0 (subnet prefix + port GUID)
  ibv_gid gid{};
  uint16_t lid = 0;
  ibv_mtu active_mtu = IBV_MTU_1024;
};

// The address vector that reaches `remote` from `local`, or an error naming both ports
// (link-layer mismatch, no GID, no unicast LID).
absl::StatusOr<ibv_ah_attr> RemoteAddress(const PortAddress& local, const pb::RdmaDevice& remote);

// min(local, remote), where `remote` is the ibv_mtu value a peer sent (out-of-range values
// are clamped to 256..4096).
ibv_mtu PathMtu(ibv_mtu local, uint32_t remote);

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_ADDRESS_H_
