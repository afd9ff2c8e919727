// The rdma Channel: a peer's QPs on every device and the rkeys of its regions; Post resolves a
// lane's ops into work requests and queues them on the lane's QP.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_CHANNEL_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

#include "src/util/mutex.h"
#include "transport/rdma/rdma_client_qp.h"
#include "transport/rdma/rdma_transport_impl.h"
#include "transport/transport.h"

namespace kvwire::transport::rdma {

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
    return absl::StrCat("rdma x", qps_.size(), " ", transport_->summary(),
                        core_->verify_checksums ? " +crc32c" : "");
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

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_CHANNEL_H_
