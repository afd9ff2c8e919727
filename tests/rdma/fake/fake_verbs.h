// A verbs table without a device (transport/rdma/verbs.h): one RoCE device "fake0" with an
// ACTIVE port, whose QPs accept every post and complete it at once, in the posting thread.
// Installed, it lets the whole engine's rdma path (devices, MRs, the QP exchange over the
// control channel, posting, the event thread, completions) run on any machine: the CPU a
// Transfer costs kvwire can be counted without a NIC (bench_rdma_transfer.cc), and the
// transport's logic tested in every build (fake_verbs_test.cc).
//
// What it does not model: the wire (no timing, no reordering, no retries), errors (every WR
// succeeds), RNR (a WRITE WITH IMMEDIATE finding no receive is counted in `missed_recvs`),
// keys (rkeys are not checked: the NIC's isolation is tested in the VM).
#ifndef KVWIRE_TESTS_RDMA_FAKE_FAKE_VERBS_H_
#define KVWIRE_TESTS_RDMA_FAKE_FAKE_VERBS_H_

#include <atomic>
#include <cstdint>

namespace kvwire::testing {

struct FakeVerbsOptions {
  // Moves the bytes of RDMA READ and WRITE (both ends are in this process, so a remote address
  // is a pointer here). Off: posts complete without touching memory (the benchmark counts the
  // engine's CPU, not a copy that a NIC would do).
  bool move_data = false;
  // ibv_device_attr::max_qp of the device (the transport's QP budget is at most this).
  int max_qp = 1 << 16;
};

struct FakeVerbsCounters {
  std::atomic<uint64_t> post_send_calls{0};
  std::atomic<uint64_t> send_wrs{0};
  std::atomic<uint64_t> signalled{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> post_recv_wrs{0};
  std::atomic<uint64_t> immediates{0};
  std::atomic<uint64_t> missed_recvs{0};
  std::atomic<uint64_t> qps_created{0};
  std::atomic<uint64_t> qps_alive{0};
};

// Installs the fake table for its lifetime (one at a time). Create it before the engines and
// destroy it after them: their verbs objects are the fake's.
class ScopedFakeVerbs {
 public:
  explicit ScopedFakeVerbs(FakeVerbsOptions options = {});
  ~ScopedFakeVerbs();
  ScopedFakeVerbs(const ScopedFakeVerbs&) = delete;
  ScopedFakeVerbs& operator=(const ScopedFakeVerbs&) = delete;

  const FakeVerbsCounters& counters() const;
};

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_RDMA_FAKE_FAKE_VERBS_H_
