#include "transport/shm/gpu_imports.h"

#include "absl/strings/str_cat.h"

#include "src/util/log.h"

namespace kvwire::transport::shm {

GpuPeerAllocation::~GpuPeerAllocation() {
  if (ipc_opened_) runtime_->CloseIpc(device_, base_);
}

absl::StatusOr<int> GpuImports::LocalDevice(const GpuRegionKey& key) {
  absl::StatusOr<int> count = runtime_->DeviceCount();
  if (!count.ok()) return count.status();
  if (!devices_listed_) {
    for (int d = 0; d < *count; ++d) {
      absl::StatusOr<gpu::DeviceInfo> info = runtime_->GetDeviceInfo(d);
      if (!info.ok()) continue;
      const uint32_t pci = PackPciBusId(info->pci_bus_id);
      if (pci != kUnknownPciBusId) device_by_pci_.emplace(pci, d);
    }
    devices_listed_ = true;
  }
  if (key.pci_bus_id != kUnknownPciBusId) {
    auto it = device_by_pci_.find(key.pci_bus_id);
    if (it != device_by_pci_.end()) return it->second;
  }
  if (key.device < *count) return key.device;
  return absl::FailedPreconditionError(
      absl::StrCat("the peer's device ", key.device, " (PCI 0x", absl::Hex(key.pci_bus_id),
                   ") is not among this process's ", *count, " devices"));
}

absl::StatusOr<std::shared_ptr<const GpuPeerAllocation>> GpuImports::Open(const GpuRegionKey& key,
                                                                          uint64_t address) {
  if (key.process_nonce == ShmProcessNonce()) {
    // Our own allocation (two engines in one process): the region's address is valid here.
    if (address == 0 || address < key.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPU region of this process described at address 0x", absl::Hex(address)));
    }
    return std::make_shared<const GpuPeerAllocation>(
        runtime_, key.device, reinterpret_cast<std::byte*>(address - key.offset),
        key.allocation_size, /*ipc_opened=*/false);
  }
  std::string name(1, static_cast<char>(key.backend));
  name.append(reinterpret_cast<const char*>(key.handle.bytes.data()), key.handle.bytes.size());
  MutexLock lock(&mu_);
  auto it = open_.find(name);
  if (it != open_.end()) {
    if (std::shared_ptr<const GpuPeerAllocation> live = it->second.lock()) {
      if (live->size() != key.allocation_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("the IPC handle was described with an allocation of ", live->size(),
                         " B before and of ", key.allocation_size, " B now"));
      }
      return live;
    }
  }
  absl::erase_if(open_, [](const auto& entry) { return entry.second.expired(); });
  absl::StatusOr<int> device = LocalDevice(key);
  if (!device.ok()) return device.status();
  absl::StatusOr<void*> mapped = runtime_->OpenIpc(*device, key.handle);
  if (!mapped.ok()) {
    return absl::Status(mapped.status().code(),
                        absl::StrCat("opening the peer's IPC handle on device ", *device, ": ",
                                     mapped.status().message()));
  }
  auto allocation = std::make_shared<const GpuPeerAllocation>(
      runtime_, *device, static_cast<std::byte*>(*mapped), key.allocation_size,
      /*ipc_opened=*/true);
  // Where the runtime can tell, the mapping must be as large as the peer claims: copies are
  // bounded by the claimed size only.
  if (absl::StatusOr<gpu::PointerInfo> info = runtime_->QueryPointer(*mapped);
      info.ok() && info->allocation_size != 0 && info->allocation_size < key.allocation_size) {
    return absl::InvalidArgumentError(absl::StrCat("the peer describes its allocation as ",
                                                   key.allocation_size, " B; the mapping has ",
                                                   info->allocation_size, " B"));
  }
  counters_->ipc_opens.fetch_add(1, std::memory_order_relaxed);
  open_[name] = allocation;
  KVW_LOG(kDebug, "shm") << "opened peer GPU allocation" << Kv("device", *device)
                         << Kv("bytes", key.allocation_size);
  return allocation;
}

}  // namespace kvwire::transport::shm
