// Cross-memory attach (process_vm_readv/writev): copies between this process and another
// without shared memory, when the kernel's ptrace access check allows it.
#ifndef KVWIRE_TRANSPORT_SHM_CMA_H_
#define KVWIRE_TRANSPORT_SHM_CMA_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

#include "kvwire/engine.h"

namespace kvwire::transport::shm {

// OK if this process may access `pid`'s memory: reads the word at `address`, which must hold
// `expected` (so a pid that names another process, e.g. across pid namespaces, is caught).
// Otherwise FailedPrecondition with the reason (errno text and, for EPERM, the Yama setting).
absl::Status ProbeCma(pid_t pid, uint64_t address, uint64_t expected);

// Ops collected into iovec arrays so that one system call moves many of them. Fixed capacity:
// no allocation on the data path.
class CmaBatch {
 public:
  static constexpr size_t kCapacity = 64;

  CmaBatch(pid_t pid, OpKind kind) : pid_(pid), kind_(kind) {}
  CmaBatch(const CmaBatch&) = delete;
  CmaBatch& operator=(const CmaBatch&) = delete;

  bool full() const { return count_ == kCapacity; }
  bool empty() const { return count_ == 0; }
  // `op_index` identifies the op in errors. Requires !full() and length > 0.
  void Add(size_t op_index, std::byte* local, uint64_t remote_address, uint64_t length);
  // Moves every op added, resuming after partial transfers; the batch is empty afterwards.
  // On failure `*failed_op` is the op_index of the op that did not complete.
  absl::Status Flush(size_t* failed_op);
  // Forgets the ops added (cancellation).
  void Clear() { count_ = 0; }

 private:
  const pid_t pid_;
  const OpKind kind_;
  size_t count_ = 0;
  iovec local_[kCapacity];
  iovec remote_[kCapacity];
  size_t op_index_[kCapacity];
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_CMA_H_
