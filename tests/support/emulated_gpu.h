// An emulated GPU runtime for tests on machines without a GPU: host memory stands in for device
// memory, so that the engine's GPU paths (registration, shm IPC, tcp staging, layer events)
// run for real in CI. It is a test double with the semantics that matter, never a backend of
// libkvwire:
//
// - Device memory is a memfd per allocation, mapped twice: the address handed out is mapped
//   PROT_NONE (guarded: any CPU access to "device memory" faults, as it would on a real GPU;
//   only the runtime's copies and kernels touch it, through a private alias). With
//   Options::host_accessible the handed-out address is readable and writable, which is what
//   the rdma tests need (peer-memory registration: ibv_reg_mr on the device pointer).
// - Streams are FIFO queues, each run by its own thread, so copies are really asynchronous: a
//   caller that forgets to synchronize reads stale bytes. Options::copy_delay slows every
//   queued copy to make such bugs visible.
// - Events are markers in a stream's queue; StreamWaitEvent makes a stream's later work wait
//   for the marker's stream to pass it.
// - IPC handles name the exporting process and the allocation's memfd; OpenIpc opens it through
//   /proc/<pid>/fd/<n> (same user) and maps it twice like an allocation.
// - ExportDmaBuf returns a duplicate of the allocation's memfd: not a dma-buf, so the kernel's
//   ibv_reg_dmabuf_mr refuses it (EOPNOTSUPP on rxe, which has no dma-buf support) and the
//   engine's fallback path runs. Options::dma_buf = false makes it Unimplemented instead.
//
// Usage, before any engine is created (engines keep the runtime they were created with):
//   kvwire::testing::EmulatedGpu emulated({.devices = 2});
//   kvwire::gpu::SetDefaultRuntime(&emulated.runtime());
#ifndef KVWIRE_TESTS_SUPPORT_EMULATED_GPU_H_
#define KVWIRE_TESTS_SUPPORT_EMULATED_GPU_H_

#include <cstddef>
#include <memory>

#include "absl/time/time.h"

#include "src/gpu/runtime.h"

namespace kvwire::testing {

struct EmulatedGpuOptions {
  int devices = 1;
  // The handed-out device addresses are readable/writable by the CPU (peer-memory emulation).
  bool host_accessible = false;
  // ExportDmaBuf hands out a memfd duplicate (true) or says Unimplemented (false).
  bool dma_buf = true;
  // ExportIpc works (true) or says Unimplemented (false), as for stream-ordered pool memory.
  bool ipc = true;
  // Added to every queued copy before it runs (exposes missing synchronization).
  absl::Duration copy_delay = absl::ZeroDuration();
};

class EmulatedGpu {
 public:
  explicit EmulatedGpu(EmulatedGpuOptions options = {});
  ~EmulatedGpu();
  EmulatedGpu(const EmulatedGpu&) = delete;
  EmulatedGpu& operator=(const EmulatedGpu&) = delete;

  gpu::Runtime& runtime();

  // Test access to device memory without a stream (synchronous, through the private alias):
  // fills or reads `bytes` at a device address of any live allocation or IPC mapping.
  absl::Status WriteDevice(void* device_ptr, const void* src, size_t bytes);
  absl::Status ReadDevice(void* dst, const void* device_ptr, size_t bytes);

  // Counters for assertions: copies run, IPC opens, events recorded.
  struct Counters {
    uint64_t copies = 0;
    uint64_t copy_bytes = 0;
    uint64_t ipc_opens = 0;
    uint64_t events_recorded = 0;
  };
  Counters counters() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_EMULATED_GPU_H_
