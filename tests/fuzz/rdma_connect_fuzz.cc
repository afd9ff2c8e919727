// What an rdma peer sends before any QP exists, and what the transport derives from it
// without a device (transport/rdma/rdma_address.cc, rdma_plan.cc): its RdmaEndpoint (in the
// control Hello), its RdmaConnectRequest (target side, HandleConnect) or RdmaConnectReply
// (initiator side, Establish), each QP's address vector and path MTU from the device port it
// names, and the immediate data of its WRITE_WITH_IMM. The checks before each call are those
// of rdma_transport.cc, against a host with one RoCE and one InfiniBand port.
//
// Input: byte 0 picks the message (0 endpoint, 1 request, 2 reply, 3 a list of immediates);
// the rest is the serialized message.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"
#include "transport/rdma/rdma.pb.h"
#include "transport/rdma/rdma_address.h"
#include "transport/rdma/rdma_plan.h"

namespace kvwire::transport::rdma {
namespace {

std::vector<PortAddress> LocalPorts() {
  PortAddress roce;
  roce.where = "rxe0:1";
  roce.ethernet = true;
  roce.gid_index = 1;
  roce.gid.raw[10] = roce.gid.raw[11] = 0xff;
  roce.gid.raw[12] = 192;
  roce.gid.raw[15] = 1;
  roce.active_mtu = IBV_MTU_1024;
  PortAddress ib;
  ib.where = "mlx5_0:1";
  ib.lid = 7;
  ib.gid.raw[0] = 0xfe;
  ib.gid.raw[1] = 0x80;
  ib.gid.raw[15] = 7;
  ib.active_mtu = IBV_MTU_4096;
  return {roce, ib};
}

// One QP's address vector as ToRtr computes it; what comes back must be what the peer named.
void Address(const PortAddress& local, const pb::RdmaDevice& remote) {
  absl::StatusOr<ibv_ah_attr> ah = RemoteAddress(local, remote);
  if (ah.ok()) {
    KVWIRE_FUZZ_CHECK(ah->port_num == local.port);
    if (local.ethernet) KVWIRE_FUZZ_CHECK(ah->is_global == 1);
    if (ah->is_global)
      KVWIRE_FUZZ_CHECK(std::memcmp(ah->grh.dgid.raw, remote.gid().data(), 16) == 0);
    if (!local.ethernet) KVWIRE_FUZZ_CHECK(ah->dlid == remote.lid() && ah->dlid != 0);
  }
  const ibv_mtu mtu = PathMtu(local.active_mtu, remote.mtu());
  KVWIRE_FUZZ_CHECK(mtu >= IBV_MTU_256 && mtu <= local.active_mtu);
}

}  // namespace
}  // namespace kvwire::transport::rdma

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvwire::transport::rdma;
  namespace pb = kvwire::pb;
  if (size == 0) return 0;
  static const std::vector<PortAddress> ports = LocalPorts();
  const uint8_t* body = data + 1;
  const int length = static_cast<int>(size - 1);
  switch (data[0] % 4) {
    case 0: {  // CanReach / Connect: the peer's endpoint, paired device by device
      pb::RdmaEndpoint remote;
      if (!remote.ParseFromArray(body, length) || remote.devices_size() == 0) return 0;
      for (const PortAddress& local : ports) {
        for (const pb::RdmaDevice& device : remote.devices()) Address(local, device);
      }
      break;
    }
    case 1: {  // HandleConnect
      pb::RdmaConnectRequest request;
      if (!request.ParseFromArray(body, length)) return 0;
      if (request.qps_size() != request.remote_device_size() ||
          request.qps_size() != request.local_device_size()) {
        return 0;  // "malformed rdma connect request"
      }
      for (int i = 0; i < request.qps_size(); ++i) {
        const uint32_t dev = request.remote_device(i);
        if (dev >= ports.size()) return 0;  // "no local device"
        Address(ports[dev], request.local_device(i));
      }
      break;
    }
    case 2: {  // Establish: the reply's QPs, against the peer's endpoint devices
      pb::RdmaConnectReply reply;
      if (!reply.ParseFromArray(body, length)) return 0;
      if (reply.code() != 0) {
        (void)absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.error());
        return 0;
      }
      for (const pb::RdmaQpInfo& qp : reply.qps()) {
        pb::RdmaDevice device;
        device.set_ethernet(qp.index() % 2 == 0);
        device.set_lid(qp.qpn() & 0xffff);
        device.set_mtu(qp.max_rd_atomic());
        device.set_gid(std::string(16, static_cast<char>(qp.psn())));
        Address(ports[qp.index() % 2], device);
      }
      break;
    }
    case 3: {  // OnCompletion: immediates of a peer's WRITE_WITH_IMM
      for (int at = 0; at + 4 <= length; at += 4) {
        uint32_t imm = 0;
        std::memcpy(&imm, body + at, 4);
        uint32_t slot = 0, count = 0;
        DecodeImm(imm, &slot, &count);
        KVWIRE_FUZZ_CHECK(slot < kSlotsPerQp);  // indexes the target's slot table
        KVWIRE_FUZZ_CHECK(count <= kMaxCountPerImm);
      }
      break;
    }
  }
  return 0;
}
