#include "src/util/spin_gate.h"

#include <algorithm>
#include <sched.h>
#include <time.h>

#include "src/util/clock.h"

namespace kvwire {
namespace {

int64_t WallNs() { return ClockNanos(CLOCK_MONOTONIC); }
int64_t ThreadCpuNs() { return ClockNanos(CLOCK_THREAD_CPUTIME_ID); }

}  // namespace

SpinClocks SpinClocks::Real() { return SpinClocks{&WallNs, &ThreadCpuNs}; }

int SpinGate::DefaultMaxSpinners() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cores = 1;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  return std::max(1, cores - 1);
}

SpinGate::SpinGate() : SpinGate(Options()) {}

SpinGate::SpinGate(Options options, SpinClocks clocks)
    : options_(options),
      clocks_(clocks),
      max_spinners_(options.max_spinners > 0 ? options.max_spinners : DefaultMaxSpinners()) {}

SpinGate::Spin SpinGate::Begin() {
  Spin spin;
  const int64_t now = clocks_.wall_ns();
  if (now < backoff_until_.load(std::memory_order_relaxed)) {
    refused_backoff_.fetch_add(1, std::memory_order_relaxed);
    return spin;
  }
  if (spinners_.fetch_add(1, std::memory_order_acq_rel) >= max_spinners_) {
    spinners_.fetch_sub(1, std::memory_order_acq_rel);
    refused_spinners_.fetch_add(1, std::memory_order_relaxed);
    return spin;
  }
  admitted_.fetch_add(1, std::memory_order_relaxed);
  spin.gate_ = this;
  spin.wall0_ = now;
  spin.cpu0_ = clocks_.thread_cpu_ns();
  return spin;
}

void SpinGate::BackOff(int64_t now) {
  const int64_t last = backoff_ns_.load(std::memory_order_relaxed);
  const int64_t next = last == 0
                           ? options_.min_backoff_ns
                           : std::min(options_.max_backoff_ns, std::max(last * 2, int64_t{1}));
  backoff_ns_.store(next, std::memory_order_relaxed);
  backoff_until_.store(now + next, std::memory_order_relaxed);
}

void SpinGate::Release(Spin& spin) {
  if (spin.contended_) {
    // Backed off already (StillOurs).
  } else if (spin.paid_) {
    wasted_.store(0, std::memory_order_relaxed);
    const int64_t half = backoff_ns_.load(std::memory_order_relaxed) / 2;
    backoff_ns_.store(half < options_.min_backoff_ns ? 0 : half, std::memory_order_relaxed);
  } else if (wasted_.fetch_add(1, std::memory_order_relaxed) + 1 >= options_.wasted_streak) {
    wasted_.store(0, std::memory_order_relaxed);
    BackOff(clocks_.wall_ns());
  }
  spinners_.fetch_sub(1, std::memory_order_acq_rel);
}

SpinGate::Spin& SpinGate::Spin::operator=(Spin&& other) noexcept {
  if (this != &other) {
    End();
    gate_ = other.gate_;
    wall0_ = other.wall0_;
    cpu0_ = other.cpu0_;
    paid_ = other.paid_;
    contended_ = other.contended_;
    other.gate_ = nullptr;
  }
  return *this;
}

bool SpinGate::Spin::StillOurs(int64_t wall_now) {
  if (gate_ == nullptr || contended_) return false;
  const int64_t cpu = gate_->clocks_.thread_cpu_ns() - cpu0_;
  const int64_t lost = (wall_now - wall0_) - cpu;
  if (lost < gate_->options_.lost_ns) return true;
  contended_ = true;
  gate_->contended_.fetch_add(1, std::memory_order_relaxed);
  gate_->BackOff(wall_now);
  return false;
}

void SpinGate::Spin::End() {
  if (gate_ == nullptr) return;
  gate_->Release(*this);
  gate_ = nullptr;
}

SpinGate::Counters SpinGate::counters() const {
  Counters c;
  c.admitted = admitted_.load(std::memory_order_relaxed);
  c.refused_backoff = refused_backoff_.load(std::memory_order_relaxed);
  c.refused_spinners = refused_spinners_.load(std::memory_order_relaxed);
  c.contended = contended_.load(std::memory_order_relaxed);
  return c;
}

}  // namespace kvwire
