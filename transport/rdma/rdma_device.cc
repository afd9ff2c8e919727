#include "transport/rdma/rdma_device.h"

#include <arpa/inet.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

#include <net/if.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvwire::transport::rdma {
namespace {

// GID entries scanned for an IPv4-mapped RoCE v2 address. Each query is a sysfs read in
// some providers, slow under emulation: the mapped GIDs sit near the start of the table.
constexpr int kGidScan = 16;

bool IsIpv4Mapped(const ibv_gid& gid) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(gid.raw, prefix, sizeof(prefix)) == 0;
}

// Allowed port of `name` per the allow-list: 0 = any port, -1 = device not allowed.
int AllowedPort(const std::vector<std::string>& allow, const std::string& name) {
  if (allow.empty()) return 0;
  for (const std::string& entry : allow) {
    const size_t colon = entry.find(':');
    if (entry.substr(0, colon) != name) continue;
    if (colon == std::string::npos) return 0;
    int port = 0;
    if (absl::SimpleAtoi(entry.substr(colon + 1), &port) && port > 0) return port;
  }
  return -1;
}

// The network interface behind a RoCE GID (its link state shows a port going down before
// the port state and the async event do).
std::string NetdevOf(const DevicePort& d) {
  ibv_gid_entry entry{};
  if (verbs().query_gid_ex(d.ctx.get(), d.port, d.gid_index, &entry, 0) != 0) return "";
  char name[IF_NAMESIZE] = {0};
  return if_indextoname(entry.ndev_ifindex, name) != nullptr ? name : "";
}

absl::Status ChooseGid(DevicePort& d, int wanted, std::string* why) {
  if (!d.ethernet) {
    // InfiniBand addresses by LID; GID 0 (subnet prefix + GUID) tells routed peers apart.
    if (verbs().query_gid(d.ctx.get(), d.port, 0, &d.gid) != 0) std::memset(d.gid.raw, 0, 16);
    d.gid_index = 0;
    return absl::OkStatus();
  }
  if (wanted >= 0) {
    if (verbs().query_gid(d.ctx.get(), d.port, wanted, &d.gid) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("GID index ", wanted, " of ", d.Describe(),
                                                     " cannot be read: ", std::strerror(errno)));
    }
    d.gid_index = wanted;
    return absl::OkStatus();
  }
  const int limit = std::min<int>(kGidScan, d.port_attr.gid_tbl_len);
  for (int i = 0; i < limit; ++i) {
    ibv_gid_entry entry{};
    if (verbs().query_gid_ex(d.ctx.get(), d.port, i, &entry, 0) != 0) continue;
    ibv_gid gid;
    std::memcpy(gid.raw, entry.gid.raw, sizeof(gid.raw));
    if (entry.gid_type == IBV_GID_TYPE_ROCE_V2 && IsIpv4Mapped(gid)) {
      d.gid = gid;
      d.gid_index = i;
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(absl::StrCat("no IPv4-mapped RoCE v2 GID among the first ", limit,
                                          " entries of ", d.Describe(),
                                          " (give the GID index explicitly)"));
}

}  // namespace

std::string DevicePort::Describe() const { return absl::StrCat(name, ":", port); }

pb::RdmaDevice DevicePort::ToProto() const {
  pb::RdmaDevice p;
  p.set_name(name);
  p.set_port(port);
  p.set_ethernet(ethernet);
  p.set_gid(std::string(reinterpret_cast<const char*>(gid.raw), sizeof(gid.raw)));
  p.set_lid(port_attr.lid);
  p.set_mtu(port_attr.active_mtu);
  return p;
}

PortAddress DevicePort::Address() const {
  PortAddress a;
  a.where = Describe();
  a.port = port;
  a.ethernet = ethernet;
  a.gid_index = gid_index;
  a.gid = gid;
  a.lid = port_attr.lid;
  a.active_mtu = port_attr.active_mtu;
  return a;
}

absl::Status DevicePort::Usable() const {
  if (usable_.load(std::memory_order_acquire)) return absl::OkStatus();
  MutexLock lock(&state_mu_);
  return absl::UnavailableError(absl::StrCat(Describe(), " is unusable: ", down_reason_));
}

std::string DevicePort::PortProblem() const {
  ibv_port_attr now{};
  if (verbs().query_port(ctx.get(), port, &now) != 0) {
    return absl::StrCat("unknown (ibv_query_port: ", std::strerror(errno), ")");
  }
  if (now.state != IBV_PORT_ACTIVE) return ibv_port_state_str(now.state);
  if (netdev.empty()) return "";
  // IFF_RUNNING drops as soon as the interface stops, before the port state follows.
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  ifreq req{};
  std::strncpy(req.ifr_name, netdev.c_str(), IF_NAMESIZE - 1);
  const bool running = ioctl(fd, SIOCGIFFLAGS, &req) != 0 || (req.ifr_flags & IFF_RUNNING) != 0;
  close(fd);
  return running ? "" : absl::StrCat("going down (netdev ", netdev, " is not running)");
}

void DevicePort::MarkDown(const std::string& why, bool for_good) {
  MutexLock lock(&state_mu_);
  dead_ = dead_ || for_good;
  down_reason_ = why;
  usable_.store(false, std::memory_order_release);
}

void DevicePort::MarkUp() {
  MutexLock lock(&state_mu_);
  if (!dead_) usable_.store(true, std::memory_order_release);
}

absl::Status DevicePort::ReserveCq(uint32_t entries) {
  uint32_t used = cq_reserved.load();
  do {
    if (used + entries > cq_size) {
      return absl::ResourceExhaustedError(
          absl::StrCat("completion queue of ", Describe(), " is full (", used, " of ", cq_size,
                       " entries promised to QPs; ", entries, " more needed)"));
    }
  } while (!cq_reserved.compare_exchange_weak(used, used + entries));
  return absl::OkStatus();
}

absl::Status DevicePort::ReserveQp(const std::string& peer) {
  uint32_t used = qps_in_use.load();
  do {
    if (used >= qp_budget) {
      return absl::ResourceExhaustedError(
          absl::StrCat("QP budget of ", Describe(), " reached: ", used, " of ", qp_budget,
                       " QPs in use (rdma.max_qps_per_device, device max_qp ", attr.max_qp,
                       "); peer ", peer, " refused a QP"));
    }
  } while (!qps_in_use.compare_exchange_weak(used, used + 1));
  return absl::OkStatus();
}

std::string GidToString(const ibv_gid& gid) {
  char text[INET6_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET6, gid.raw, text, sizeof(text));
  return text;
}

const char* MtuName(ibv_mtu mtu) {
  switch (mtu) {
    case IBV_MTU_256:
      return "256";
    case IBV_MTU_512:
      return "512";
    case IBV_MTU_1024:
      return "1024";
    case IBV_MTU_2048:
      return "2048";
    case IBV_MTU_4096:
      return "4096";
  }
  return "?";
}

absl::StatusOr<std::vector<std::shared_ptr<DevicePort>>> OpenDevices(
    const RdmaTransportOptions& options, std::vector<std::string>* skipped) {
  int count = 0;
  DeviceList list(verbs().get_device_list(&count));
  if (!list || count == 0) {
    return absl::NotFoundError(absl::StrCat(
        "no RDMA devices (ibv_get_device_list: ", list ? "empty" : std::strerror(errno), ")"));
  }
  std::vector<std::shared_ptr<DevicePort>> out;
  for (int i = 0; i < count; ++i) {
    ibv_device* dev = list.get()[i];
    const std::string name = verbs().get_device_name(dev);
    const int allowed = AllowedPort(options.devices, name);
    if (allowed < 0) {
      skipped->push_back(absl::StrCat(name, ": not in the device allow-list (",
                                      absl::StrJoin(options.devices, ","), ")"));
      continue;
    }
    Context ctx(verbs().open_device(dev));
    if (!ctx) {
      skipped->push_back(absl::StrCat(name, ": ibv_open_device: ", std::strerror(errno)));
      continue;
    }
    ibv_device_attr attr{};
    if (verbs().query_device(ctx.get(), &attr) != 0) {
      skipped->push_back(absl::StrCat(name, ": ibv_query_device: ", std::strerror(errno)));
      continue;
    }
    // The first ACTIVE port (or the allowed one) of the device.
    for (uint8_t port = 1; port <= attr.phys_port_cnt; ++port) {
      if (allowed > 0 && port != allowed) continue;
      auto d = std::make_shared<DevicePort>();
      d->name = name;
      d->port = port;
      d->attr = attr;
      const uint32_t device_max = static_cast<uint32_t>(std::max(attr.max_qp, 0));
      d->qp_budget = options.max_qps_per_device == 0
                         ? device_max
                         : std::min(options.max_qps_per_device, device_max);
      if (verbs().query_port(ctx.get(), port, &d->port_attr) != 0) {
        skipped->push_back(absl::StrCat(d->Describe(), ": ibv_query_port: ", std::strerror(errno)));
        continue;
      }
      if (d->port_attr.state != IBV_PORT_ACTIVE) {
        skipped->push_back(absl::StrCat(d->Describe(), ": port state is ",
                                        ibv_port_state_str(d->port_attr.state), ", not ACTIVE"));
        continue;
      }
      d->ethernet = d->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
      d->ctx = std::move(ctx);
      std::string why;
      if (absl::Status s = ChooseGid(*d, options.gid_index, &why); !s.ok()) {
        skipped->push_back(std::string(s.message()));
        ctx = std::move(d->ctx);
        continue;
      }
      if (d->ethernet) d->netdev = NetdevOf(*d);
      d->pd.reset(verbs().alloc_pd(d->ctx.get()));
      if (!d->pd) {
        skipped->push_back(absl::StrCat(d->Describe(), ": ibv_alloc_pd: ", std::strerror(errno)));
        break;
      }
      d->channel.reset(verbs().create_comp_channel(d->ctx.get()));
      if (!d->channel) {
        skipped->push_back(
            absl::StrCat(d->Describe(), ": ibv_create_comp_channel: ", std::strerror(errno)));
        break;
      }
      d->cq_size = static_cast<uint32_t>(std::min(attr.max_cqe, 32767));
      d->cq.reset(verbs().create_cq(d->ctx.get(), static_cast<int>(d->cq_size), nullptr,
                                    d->channel.get(), 0));
      if (!d->cq) {
        skipped->push_back(absl::StrCat(d->Describe(), ": ibv_create_cq(", d->cq_size,
                                        "): ", std::strerror(errno)));
        break;
      }
      d->cq_size = static_cast<uint32_t>(d->cq->cqe);
      if (verbs().req_notify_cq(d->cq.get(), 0) != 0) {
        skipped->push_back(absl::StrCat(d->Describe(), ": ibv_req_notify_cq failed"));
        break;
      }
      for (int fd : {d->channel->fd, d->ctx->async_fd}) {
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
      }
      out.push_back(std::move(d));
      break;  // one port per device
    }
  }
  if (out.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no usable RDMA device port: ", absl::StrJoin(*skipped, "; ")));
  }
  return out;
}

}  // namespace kvwire::transport::rdma
