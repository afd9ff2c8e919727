#include "transport/rdma/rdma_address.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvwire::transport::rdma {
namespace {

// Unicast LIDs are 0x0001..0xBFFF; 0 means the subnet manager has not assigned one.
constexpr uint32_t kMaxUnicastLid = 0xBFFF;
constexpr uint8_t kHopLimit = 64;

bool IsZero(const std::string& bytes) {
  return std::all_of(bytes.begin(), bytes.end(), [](char c) { return c == 0; });
}

std::string RemoteName(const pb::RdmaDevice& remote) {
  return absl::StrCat(remote.name(), ":", remote.port());
}

void SetGrh(const PortAddress& local, const std::string& dgid, ibv_ah_attr* ah) {
  ah->is_global = 1;
  std::memcpy(ah->grh.dgid.raw, dgid.data(), 16);
  ah->grh.sgid_index = static_cast<uint8_t>(local.gid_index);
  ah->grh.hop_limit = kHopLimit;
}

}  // namespace

absl::StatusOr<ibv_ah_attr> RemoteAddress(const PortAddress& local, const pb::RdmaDevice& remote) {
  if (remote.ethernet() != local.ethernet) {
    return absl::FailedPreconditionError(absl::StrCat(
        "link layer mismatch: local ", local.where, " is ", local.ethernet ? "RoCE" : "InfiniBand",
        ", peer ", RemoteName(remote), " is ", remote.ethernet() ? "RoCE" : "InfiniBand"));
  }
  ibv_ah_attr ah{};
  ah.port_num = local.port;
  ah.sl = 0;
  ah.src_path_bits = 0;
  const bool has_gid = remote.gid().size() == 16 && !IsZero(remote.gid());
  if (local.ethernet) {
    if (!has_gid) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer RoCE port ", RemoteName(remote), " sent no GID (RoCE needs one)"));
    }
    SetGrh(local, remote.gid(), &ah);
    return ah;
  }
  if (remote.lid() == 0 || remote.lid() > kMaxUnicastLid) {
    return absl::InvalidArgumentError(absl::StrCat("peer InfiniBand port ", RemoteName(remote),
                                                   " has no unicast LID (LID ", remote.lid(),
                                                   "; is a subnet manager running?)"));
  }
  ah.dlid = static_cast<uint16_t>(remote.lid());
  // Same subnet (equal 64-bit prefixes, or a GID unknown on either side): LID routing only.
  const std::string local_gid(reinterpret_cast<const char*>(local.gid.raw), 16);
  if (has_gid && !IsZero(local_gid) && std::memcmp(remote.gid().data(), local.gid.raw, 8) != 0) {
    SetGrh(local, remote.gid(), &ah);
  }
  return ah;
}

ibv_mtu PathMtu(ibv_mtu local, uint32_t remote) {
  const uint32_t r = std::clamp<uint32_t>(remote, IBV_MTU_256, IBV_MTU_4096);
  return static_cast<ibv_mtu>(std::min<uint32_t>(local, r));
}

}  // namespace kvwire::transport::rdma
