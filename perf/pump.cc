#include "perf/pump.h"

#include <sys/resource.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/strings/str_format.h"

namespace kvwire::perf {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

struct Inflight {
  TransferId id = 0;
  Clock::time_point start;
  Clock::time_point end;
  double post_us = 0;
  uint64_t bytes = 0;
  uint64_t ops = 0;
  bool done = false;
};

struct Shared {
  std::atomic<uint64_t> bytes{0};
  std::atomic<int> finished{0};
  std::mutex mu;
  absl::Status error;  // first error wins
  void Fail(absl::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    if (error.ok()) error = std::move(s);
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mu);
    return !error.ok();
  }
};

class Worker {
 public:
  Worker(Engine& engine, PeerId peer, const PumpSpec& spec, int thread, Shared* shared)
      : engine_(engine), peer_(peer), spec_(spec), thread_(thread), shared_(shared) {}

  // Runs `count` transfers (or until `until`), recording them when `record`.
  absl::Status Run(uint64_t count, Clock::time_point until, bool record) {
    uint64_t issued = 0;
    while (true) {
      const bool more = count > 0 ? issued < count : Clock::now() < until;
      if (more && static_cast<int>(queue_.size()) < spec_.outstanding) {
        if (absl::Status s = Submit(); !s.ok()) return s;
        ++issued;
        continue;
      }
      if (queue_.empty()) return absl::OkStatus();
      if (absl::Status s = CompleteFront(record); !s.ok()) return s;
    }
  }

  std::vector<TransferSample> TakeSamples() { return std::move(samples_); }
  uint64_t transfers() const { return next_index_; }
  Clock::time_point t0;  // start of the measurement, shared by all threads

 private:
  absl::Status Submit() {
    ops_.clear();
    const uint64_t index = next_index_++;
    spec_.make_ops(thread_, index, &ops_);
    OpKind kind = spec_.kind;
    if (spec_.bidirectional && index % 2 == 1) {
      kind = kind == OpKind::kWrite ? OpKind::kRead : OpKind::kWrite;
    }
    Inflight f;
    for (const Op& op : ops_) f.bytes += op.length;
    f.ops = ops_.size();
    f.start = Clock::now();
    absl::StatusOr<TransferId> id = engine_.Transfer(peer_, kind, ops_);
    const Clock::time_point posted = Clock::now();
    if (!id.ok()) return id.status();
    f.id = *id;
    f.post_us = std::chrono::duration<double, std::micro>(posted - f.start).count();
    queue_.push_back(f);
    return absl::OkStatus();
  }

  absl::Status CompleteFront(bool record) {
    Inflight& front = queue_.front();
    if (!front.done) {
      if (absl::Status s = engine_.Wait(front.id, absl::Seconds(120)); !s.ok()) return s;
      front.end = Clock::now();
      front.done = true;
    }
    // Later transfers may have ended meanwhile: timestamp them now, not when reached.
    for (size_t i = 1; i < queue_.size(); ++i) {
      Inflight& f = queue_[i];
      if (f.done) continue;
      absl::Status status;
      const TransferState state = engine_.Poll(f.id, &status);
      if (state == TransferState::kPending) continue;
      if (state == TransferState::kFailed) return status;
      f.end = Clock::now();
      f.done = true;
    }
    shared_->bytes.fetch_add(front.bytes, std::memory_order_relaxed);
    if (record) {
      samples_.push_back(TransferSample{SecondsSince(t0, front.start), SecondsSince(t0, front.end),
                                        front.post_us, front.bytes, front.ops});
    }
    queue_.pop_front();
    return absl::OkStatus();
  }

  Engine& engine_;
  PeerId peer_;
  const PumpSpec& spec_;
  int thread_;
  Shared* shared_;
  uint64_t next_index_ = 0;
  std::deque<Inflight> queue_;
  std::vector<Op> ops_;
  std::vector<TransferSample> samples_;
};

}  // namespace

absl::StatusOr<PumpResult> Pump(Engine& engine, PeerId peer, const PumpSpec& spec,
                                ProgressLine* progress) {
  Shared shared;
  std::vector<std::unique_ptr<Worker>> workers;
  for (int t = 0; t < spec.threads; ++t) {
    workers.push_back(std::make_unique<Worker>(engine, peer, spec, t, &shared));
  }
  Clock::time_point t0;
  Clock::time_point until;
  std::atomic<int64_t> t0_ns{0};  // read by the progress line
  rusage at_start{};
  // After the warm-up, one thread stamps the common start of the measurement.
  std::barrier sync(spec.threads, [&]() noexcept {
    t0 = Clock::now();
    until = t0 + std::chrono::duration_cast<Clock::duration>(
                     std::chrono::duration<double>(spec.duration_s));
    for (auto& w : workers) w->t0 = t0;
    shared.bytes.store(0);
    getrusage(RUSAGE_SELF, &at_start);
    t0_ns.store(t0.time_since_epoch().count());
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < spec.threads; ++t) {
    threads.emplace_back([&, t] {
      Worker& w = *workers[t];
      absl::Status s = w.Run(spec.warmup_transfers, Clock::now(), false);
      if (!s.ok()) shared.Fail(s);
      sync.arrive_and_wait();
      if (s.ok() && !shared.failed()) {
        s = w.Run(spec.transfers, until, true);
        if (!s.ok()) shared.Fail(s);
      }
      shared.finished.fetch_add(1);
    });
  }
  const Clock::time_point started = Clock::now();
  while (shared.finished.load() < spec.threads) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const double elapsed = SecondsSince(started, Clock::now());
    if (progress != nullptr && elapsed > 2) {
      const int64_t start_ns = t0_ns.load();
      const double measured =
          start_ns == 0 ? 0
                        : SecondsSince(Clock::time_point(Clock::duration(start_ns)), Clock::now());
      progress->Show(absl::StrFormat(
          "  %s: %.1f s, %.2f GB/s so far", spec.label, elapsed,
          measured > 0 ? static_cast<double>(shared.bytes.load()) / measured / 1e9 : 0.0));
    }
  }
  for (std::thread& t : threads) t.join();
  rusage at_end{};
  getrusage(RUSAGE_SELF, &at_end);
  if (progress != nullptr) progress->Clear();
  if (!shared.error.ok()) return shared.error;

  PumpResult result;
  double last = 0;
  for (auto& w : workers) {
    std::vector<TransferSample> samples = w->TakeSamples();
    for (const TransferSample& s : samples) last = std::max(last, s.end_s);
    result.samples.insert(result.samples.end(), samples.begin(), samples.end());
    result.transfers_per_thread.push_back(w->transfers());
  }
  result.seconds = last;
  result.minor_faults = at_end.ru_minflt - at_start.ru_minflt;
  result.major_faults = at_end.ru_majflt - at_start.ru_majflt;
  return result;
}

}  // namespace kvwire::perf
