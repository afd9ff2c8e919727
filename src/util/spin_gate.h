// A contention-aware spin: who may spin instead of sleeping, and for how long it still pays.
//
// Sleeping on a futex or in epoll_wait and being woken costs an idle vCPU tens of microseconds
// (the halt and the wake-up interrupt; one 4 KiB tcp op on a quiet 2-core VM: 70-90 us p50
// sleeping, 11-13 us spinning). But a spin only pays while its core is its own: when other
// runnable threads share the cores, a spinner holds a core that the thread it waits for needs,
// and giving it away with sched_yield hands it to a CPU-bound neighbour for a whole slice
// (milliseconds). So a spinner watches for the sign that the core is not its own: the thread's
// CPU time (CLOCK_THREAD_CPUTIME_ID) falling behind the wall clock means it was preempted. Then
// it stops and sleeps, and the gate remembers it: no thread of the gate spins until a backoff
// has passed, doubled on every contended spin (so a loaded box stops spinning at once and
// probes rarely), halved by every spin that paid off. A spin that found nothing before its
// budget ran out (the awaited work takes longer than a spin, or needed the core the spinner
// held) backs off the same way: that CPU is better left to the threads doing the work. And
// at most `max_spinners` threads of a gate spin at once (default: the cores this process may
// use, less one, at least 1).
//
// The clocks are injectable so that the policy is tested without timing (spin_gate_test.cc).
#ifndef KVWIRE_SRC_UTIL_SPIN_GATE_H_
#define KVWIRE_SRC_UTIL_SPIN_GATE_H_

#include <atomic>
#include <cstdint>

namespace kvwire {

struct SpinClocks {
  int64_t (*wall_ns)();        // monotonic wall time (CLOCK_MONOTONIC: a vDSO call)
  int64_t (*thread_cpu_ns)();  // the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID)
  static SpinClocks Real();
};

// A spinning waiter's pause: lets a sibling hyper-thread run and saves power.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class SpinGate {
 public:
  struct Options {
    int max_spinners = 0;  // 0: DefaultMaxSpinners()
    // A spin that lost at least this much wall time to other threads was preempted: the
    // core is contended. More than an interrupt or a short wake-up of a sibling thread,
    // far less than a scheduler slice (milliseconds).
    int64_t lost_ns = 50'000;
    int64_t min_backoff_ns = 1'000'000;      // first backoff
    int64_t max_backoff_ns = 1'000'000'000;  // at most this long without a probe
    // This many spins in a row that found nothing back off as one contended spin. One: a
    // spinner that is not preempted can still hold the core the awaited thread needs, and
    // then its spin is wasted; 4 KiB op p99 under a compile load (load 8-11, 2 cores) with
    // 1, 2 and 4: 22-34, 36-50 and 65-67 us.
    int wasted_streak = 1;
  };
  struct Counters {
    uint64_t admitted = 0;
    uint64_t refused_backoff = 0;   // backing off after contention or waste
    uint64_t refused_spinners = 0;  // max_spinners already spinning
    uint64_t contended = 0;         // spins stopped because the thread lost its core
  };

  // The cores this process may run on (its affinity mask), less one, at least 1.
  static int DefaultMaxSpinners();

  SpinGate();  // default options, real clocks
  explicit SpinGate(Options options, SpinClocks clocks = SpinClocks::Real());
  SpinGate(const SpinGate&) = delete;
  SpinGate& operator=(const SpinGate&) = delete;

  // One thread's spin. Admitted (true) or not (then the caller sleeps at once). The owner
  // calls StillOurs every so often (a few microseconds: it reads two clocks, one of them a
  // system call), Paid when what it waited for came, and lets it go (destructor or End)
  // before it sleeps.
  class Spin {
   public:
    Spin() = default;
    Spin(Spin&& other) noexcept { *this = static_cast<Spin&&>(other); }
    Spin& operator=(Spin&& other) noexcept;
    ~Spin() { End(); }
    explicit operator bool() const { return gate_ != nullptr; }
    // False when the thread lost its core since the spin began (the gate backs off; the
    // caller must stop spinning and sleep). `wall_now`: the caller's latest wall clock read.
    bool StillOurs(int64_t wall_now);
    bool StillOurs() { return gate_ != nullptr && StillOurs(gate_->clocks_.wall_ns()); }
    // What the spin waited for came while it spun.
    void Paid() { paid_ = true; }
    // Ends the spin (idempotent): a spin that paid off shortens the backoff, one that was
    // wasted counts towards a backoff.
    void End();

   private:
    friend class SpinGate;
    SpinGate* gate_ = nullptr;
    int64_t wall0_ = 0;
    int64_t cpu0_ = 0;
    bool paid_ = false;
    bool contended_ = false;
  };

  // A spin when the gate is not backing off and fewer than max_spinners spin.
  Spin Begin();

  // The gate's wall clock (ns), the one StillOurs(wall_now) takes.
  int64_t Now() const { return clocks_.wall_ns(); }
  int max_spinners() const { return max_spinners_; }
  // The backoff in force (0: none) and until when (wall_ns), for tests and stats.
  int64_t backoff_ns() const { return backoff_ns_.load(std::memory_order_relaxed); }
  int64_t backoff_until_ns() const { return backoff_until_.load(std::memory_order_relaxed); }
  Counters counters() const;

 private:
  void BackOff(int64_t now);
  void Release(Spin& spin);

  const Options options_;
  const SpinClocks clocks_;
  const int max_spinners_;
  std::atomic<int> spinners_{0};
  std::atomic<int64_t> backoff_ns_{0};
  std::atomic<int64_t> backoff_until_{0};
  std::atomic<int> wasted_{0};  // spins in a row that found nothing
  std::atomic<uint64_t> admitted_{0};
  std::atomic<uint64_t> refused_backoff_{0};
  std::atomic<uint64_t> refused_spinners_{0};
  std::atomic<uint64_t> contended_{0};
};

}  // namespace kvwire

#endif  // KVWIRE_SRC_UTIL_SPIN_GATE_H_
