// A counting global allocator for the CPU benchmarks of perf/cpu/ (linked into those binaries
// only, never into the library): every operator new / delete of the process is counted, both
// process-wide (all threads: engine, transport and control threads included) and for the
// calling thread alone, so a benchmark can report allocations per transfer or per request in
// steady state. malloc/free called directly (C code, libraries) are not counted.
#ifndef KVWIRE_PERF_CPU_COUNTING_ALLOC_H_
#define KVWIRE_PERF_CPU_COUNTING_ALLOC_H_

#include <cstdint>

namespace kvwire::perf::cpu {

struct AllocCounts {
  uint64_t news = 0;     // successful operator new / new[] calls
  uint64_t deletes = 0;  // operator delete / delete[] calls on a non-null pointer
  uint64_t bytes = 0;    // bytes asked of operator new
};

// Counts of every thread of the process since it started.
AllocCounts ProcessAllocs();
// Counts of the calling thread since it started.
AllocCounts ThreadAllocs();

inline AllocCounts operator-(const AllocCounts& a, const AllocCounts& b) {
  return {a.news - b.news, a.deletes - b.deletes, a.bytes - b.bytes};
}

}  // namespace kvwire::perf::cpu

#endif  // KVWIRE_PERF_CPU_COUNTING_ALLOC_H_
