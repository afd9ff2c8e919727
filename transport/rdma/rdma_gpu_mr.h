// GPU memory registration of the rdma transport: which of the two ways a NIC can reach device
// memory a region takes, kept free of verbs so that the choice is unit-tested anywhere.
//
// 1. dma-buf: the GPU runtime exports the allocation around the region as a dma-buf and
//    ibv_reg_dmabuf_mr registers the region's bytes of it ([offset, offset + length) of the
//    dma-buf) at iova = the region's virtual address, the address that local SGEs and the
//    peers' WRs use. Needs an exporting runtime (CUDA >= 11.7, ROCm with dma-buf export) and a
//    NIC driver that imports dma-bufs (mlx5, irdma, efa, bnxt_re; not rxe).
// 2. peer memory: ibv_reg_mr on the device pointer; the kernel's peer-memory client
//    (nvidia_peermem, amdgpu's) resolves the device pages.
// dma-buf comes first: it needs no out-of-tree kernel module and is what the vendors keep up.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_GPU_MR_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_GPU_MR_H_

#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "src/gpu/runtime.h"

namespace kvwire::transport::rdma {

enum class GpuMrPath : uint8_t { kDmaBuf, kPeerMemory };
const char* GpuMrPathName(GpuMrPath path);  // "dma-buf", "peer-memory"

// The dma-buf exported for one region; its fd is closed through the runtime on destruction.
// Kept as long as the MRs registered on it. Uses only the runtime's virtual calls (not
// gpu::DmaBuf) so that the rdma layer links without a GPU backend.
class ExportedDmaBuf {
 public:
  // The allocation around [ptr, ptr + length) of `device`, as the runtime exports it.
  static absl::StatusOr<ExportedDmaBuf> Export(gpu::Runtime& runtime, int device, const void* ptr,
                                               uint64_t length);
  ExportedDmaBuf() = default;
  ExportedDmaBuf(ExportedDmaBuf&& other) noexcept;
  ExportedDmaBuf& operator=(ExportedDmaBuf&& other) noexcept;
  ExportedDmaBuf(const ExportedDmaBuf&) = delete;
  ExportedDmaBuf& operator=(const ExportedDmaBuf&) = delete;
  ~ExportedDmaBuf() { Reset(); }

  bool valid() const { return range_.fd >= 0; }
  const gpu::DmaBufRange& range() const { return range_; }
  void Reset();

 private:
  ExportedDmaBuf(gpu::Runtime* runtime, gpu::DmaBufRange range)
      : runtime_(runtime), range_(range) {}
  gpu::Runtime* runtime_ = nullptr;
  gpu::DmaBufRange range_;
};

// Arguments of ibv_reg_dmabuf_mr for the region [base, base + length).
struct DmaBufMrArgs {
  int fd = -1;
  uint64_t offset = 0;  // of `base` within the dma-buf
  uint64_t length = 0;
  uint64_t iova = 0;  // == base: peers address the region by its virtual address
};
// `range` is the export of [base, base + length) (range.offset is where `base` lies in it).
// The runtimes export from the page-aligned allocation start, so offset and iova agree modulo
// the page size, as NICs that map dma-bufs by pages need.
// InvalidArgument when the region does not fit in the exported range (a runtime fault).
absl::StatusOr<DmaBufMrArgs> DmaBufArgsFor(const gpu::DmaBufRange& range, const void* base,
                                           uint64_t length);

struct GpuMrChoice {
  GpuMrPath path = GpuMrPath::kDmaBuf;
  std::string reason;  // why this path, i.e. why not the other one
};

// Registers a region on one device: dma-buf first, peer memory when there is no dma-buf
// (`exported` is the export's failure) or the device refuses it. Each attempt registers and
// returns OK, or says why not ("ibv_reg_dmabuf_mr: Operation not supported"); reg_dmabuf is
// not called without a dma-buf, reg_peer_memory not after the dma-buf worked. When both fail:
// FailedPrecondition naming both paths and both reasons.
absl::StatusOr<GpuMrChoice> ChooseGpuMr(const absl::Status& exported,
                                        absl::FunctionRef<absl::Status()> reg_dmabuf,
                                        absl::FunctionRef<absl::Status()> reg_peer_memory);

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_GPU_MR_H_
