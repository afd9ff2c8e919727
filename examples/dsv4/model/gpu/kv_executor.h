// Where the reference engine's KV-cache work runs when its cache is not plain host memory
// (KvDevice::kGpu, kHostKernels in kv_cache.h): the record encode (the KV-cache write) and the
// attention kernels, plus the memory and copies their arguments need. Two implementations:
//  - the device executor: a GPU of libkvwire's runtime (gpu::Runtime), one stream, the
//    kernels of src/gpu/kernels (encode) and attention_decode.cu (attention);
//  - the host executor: the same kernels' code run by their host drivers over host memory
//    (gpu::EncodeKvRecordsCpu, host_driver.h), for machines without a device and for tests.
// Every call completes before it returns (copies and kernels alike), so callers never track
// streams; thread-safe (the device executor's stream orders each caller's work, and every
// caller allocates its own argument memory).
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_GPU_KV_EXECUTOR_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_GPU_KV_EXECUTOR_H_

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "examples/dsv4/model/gpu/attention_math.h"
#include "src/gpu/kv_record.h"
#include "src/gpu/runtime.h"

namespace dsv4::gpu {

class KvExecutor {
 public:
  // Memory of the executor's kind (device memory for a GPU), freed on destruction.
  class Buffer {
   public:
    virtual ~Buffer() = default;
    virtual void* data() const = 0;
  };

  virtual ~KvExecutor() = default;
  // "host", or the runtime's name ("cuda", "hip").
  virtual const char* name() const = 0;
  // The device ordinal; -1 for the host executor.
  virtual int device() const = 0;

  virtual absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) = 0;
  // Host memory to executor memory and back.
  virtual absl::Status Upload(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status Download(void* dst, const void* src, size_t bytes) = 0;
  // The paged fp8 record encode (src/gpu/kv_record.h); every pointer in executor memory.
  virtual absl::Status EncodeKvRecords(const kvwire::gpu::KvEncodeArgs& args) = 0;
  // Steps 1 and 3 of attention_math.h; every pointer in executor memory.
  virtual absl::Status AttentionLogits(const AttentionArgs& args) = 0;
  virtual absl::Status AttentionOutput(const AttentionArgs& args) = 0;
};

std::unique_ptr<KvExecutor> MakeHostExecutor();
// A GPU of `runtime`: Unavailable with the runtime's one-line reason when it has no device,
// InvalidArgument when `device` is not one of its devices, Unimplemented when the runtime is
// not the backend the attention kernels were linked for (libkvwire's, see CMakeLists.txt).
absl::StatusOr<std::unique_ptr<KvExecutor>> MakeDeviceExecutor(kvwire::gpu::Runtime& runtime,
                                                               int device);

}  // namespace dsv4::gpu

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_GPU_KV_EXECUTOR_H_
