#include "transport/shm/gpu_exports.h"

#include "absl/strings/str_cat.h"

#include "src/util/log.h"
#include "transport/shm/gpu_region_key.h"

namespace kvwire::transport::shm {

absl::Status GpuExportTable::Add(const LocalRegion& region) {
  const std::string who = absl::StrCat("shm: GPU region ", region.id);
  if (runtime_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(who, ": this engine has no GPU runtime"));
  }
  if (region.gpu_device < 0 || region.gpu_allocation_base == nullptr ||
      region.base < region.gpu_allocation_base ||
      static_cast<uint64_t>(region.base - region.gpu_allocation_base) >
          region.gpu_allocation_size ||
      region.length > region.gpu_allocation_size -
                          static_cast<uint64_t>(region.base - region.gpu_allocation_base)) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": not described as a range of a device allocation (device ",
                     region.gpu_device, ", allocation size ", region.gpu_allocation_size, ")"));
  }
  const std::pair<int, std::byte*> where(region.gpu_device, region.gpu_allocation_base);
  MutexLock lock(&mu_);
  if (regions_.contains(region.id)) {
    return absl::AlreadyExistsError(absl::StrCat(who, " is already registered"));
  }
  auto it = allocations_.find(where);
  if (it != allocations_.end() && it->second.size != region.gpu_allocation_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": its allocation at the same address was ", it->second.size, " B and is now ",
        region.gpu_allocation_size, " B (memory freed while still registered?)"));
  }
  if (it == allocations_.end()) {
    absl::StatusOr<gpu::IpcHandle> handle =
        runtime_->ExportIpc(region.gpu_device, region.gpu_allocation_base);
    if (!handle.ok()) {
      return absl::Status(handle.status().code(),
                          absl::StrCat(who, ": exporting the IPC handle of its allocation: ",
                                       handle.status().message()));
    }
    auto pci = pci_.find(region.gpu_device);
    if (pci == pci_.end()) {
      absl::StatusOr<gpu::DeviceInfo> info = runtime_->GetDeviceInfo(region.gpu_device);
      pci = pci_.emplace(region.gpu_device,
                         info.ok() ? PackPciBusId(info->pci_bus_id) : kUnknownPciBusId)
                .first;
    }
    Allocation allocation;
    allocation.handle = *handle;
    allocation.size = region.gpu_allocation_size;
    allocation.pci_bus_id = pci->second;
    it = allocations_.emplace(where, allocation).first;
    KVW_LOG(kDebug, "shm") << "exported GPU allocation" << Kv("device", region.gpu_device)
                           << Kv("bytes", region.gpu_allocation_size);
  }
  GpuRegionKey key;
  key.backend = runtime_->backend();
  key.device = region.gpu_device;
  key.pci_bus_id = it->second.pci_bus_id;
  key.process_nonce = ShmProcessNonce();
  key.handle = it->second.handle;
  key.offset = static_cast<uint64_t>(region.base - region.gpu_allocation_base);
  key.allocation_size = region.gpu_allocation_size;
  key.length = region.length;
  ++it->second.regions;
  regions_.emplace(region.id, Region{EncodeGpuRegionKey(key), where});
  return absl::OkStatus();
}

void GpuExportTable::Remove(RegionId id) {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return;
  auto alloc = allocations_.find(it->second.allocation);
  // An exported IPC handle has no release call: forgetting it is all there is to do.
  if (alloc != allocations_.end() && --alloc->second.regions == 0) allocations_.erase(alloc);
  regions_.erase(it);
}

void GpuExportTable::Clear() {
  MutexLock lock(&mu_);
  regions_.clear();
  allocations_.clear();
}

std::string GpuExportTable::Key(RegionId id) const {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  return it == regions_.end() ? std::string() : it->second.key;
}

size_t GpuExportTable::allocations() const {
  MutexLock lock(&mu_);
  return allocations_.size();
}

}  // namespace kvwire::transport::shm
