#include "transport/rdma/rdma_gpu_mr.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvwire::transport::rdma {

const char* GpuMrPathName(GpuMrPath path) {
  return path == GpuMrPath::kDmaBuf ? "dma-buf" : "peer-memory";
}

absl::StatusOr<ExportedDmaBuf> ExportedDmaBuf::Export(gpu::Runtime& runtime, int device,
                                                      const void* ptr, uint64_t length) {
  absl::StatusOr<gpu::DmaBufRange> range = runtime.ExportDmaBuf(device, ptr, length);
  if (!range.ok()) return range.status();
  if (range->fd < 0) {
    return absl::InternalError(absl::StrCat("the GPU runtime exported no fd (", range->fd, ")"));
  }
  return ExportedDmaBuf(&runtime, *range);
}

ExportedDmaBuf::ExportedDmaBuf(ExportedDmaBuf&& other) noexcept
    : runtime_(std::exchange(other.runtime_, nullptr)), range_(std::exchange(other.range_, {})) {}

ExportedDmaBuf& ExportedDmaBuf::operator=(ExportedDmaBuf&& other) noexcept {
  if (this != &other) {
    Reset();
    runtime_ = std::exchange(other.runtime_, nullptr);
    range_ = std::exchange(other.range_, {});
  }
  return *this;
}

void ExportedDmaBuf::Reset() {
  if (range_.fd >= 0 && runtime_ != nullptr) runtime_->CloseDmaBuf(range_.fd);
  range_ = {};
  runtime_ = nullptr;
}

absl::StatusOr<DmaBufMrArgs> DmaBufArgsFor(const gpu::DmaBufRange& range, const void* base,
                                           uint64_t length) {
  if (range.offset > range.size || length > range.size - range.offset) {
    return absl::InvalidArgumentError(absl::StrCat("the exported dma-buf (", range.size,
                                                   " B) does not hold the region (", length,
                                                   " B at offset ", range.offset, ")"));
  }
  DmaBufMrArgs args;
  args.fd = range.fd;
  args.offset = range.offset;
  args.length = length;
  args.iova = reinterpret_cast<uint64_t>(base);
  return args;
}

absl::StatusOr<GpuMrChoice> ChooseGpuMr(const absl::Status& exported,
                                        absl::FunctionRef<absl::Status()> reg_dmabuf,
                                        absl::FunctionRef<absl::Status()> reg_peer_memory) {
  std::string why_not_dmabuf;
  if (!exported.ok()) {
    why_not_dmabuf = absl::StrCat("no dma-buf from the GPU runtime: ", exported.message());
  } else if (absl::Status s = reg_dmabuf(); s.ok()) {
    return GpuMrChoice{GpuMrPath::kDmaBuf,
                       "ibv_reg_dmabuf_mr on the runtime's dma-buf worked; peer memory not needed"};
  } else {
    why_not_dmabuf = absl::StrCat("dma-buf refused: ", s.message());
  }
  absl::Status peer = reg_peer_memory();
  if (peer.ok()) return GpuMrChoice{GpuMrPath::kPeerMemory, why_not_dmabuf};
  return absl::FailedPreconditionError(absl::StrCat(
      "neither path registers this GPU memory: dma-buf path: ", why_not_dmabuf,
      "; peer-memory path (needs nvidia_peermem or amdgpu peer memory): ", peer.message()));
}

}  // namespace kvwire::transport::rdma
