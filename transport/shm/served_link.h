// ServedLink: the initiator's side of served copies (served_copy.h) to one peer. A connection
// of its own to the peer's fd server (the channel's first connection stays a plain
// request-reply one), the peer's staging memfd mapped, and the requests of every op on the
// peer's grant-guarded regions, kept in flight in the staging slots. Replies are handled by
// the engine's one ServedCompletions thread (served_completions.h), which copies a READ's
// bytes out of its slot, asks for more, and reports each request when its last op is done.
#ifndef KVWIRE_TRANSPORT_SHM_SERVED_LINK_H_
#define KVWIRE_TRANSPORT_SHM_SERVED_LINK_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/util/mutex.h"
#include "transport/shm/mapping.h"
#include "transport/shm/served_copy.h"
#include "transport/shm/unique_fd.h"
#include "transport/transport.h"

namespace kvwire::transport::shm {

class ServedLink {
 public:
  // Connects to the peer's fd server at `socket_name`, proves `token` and maps the staging
  // memfd the peer makes for this connection, all before `deadline`. `request_timeout`
  // bounds each copy request's answer afterwards.
  // `counters` (null: not counted) get the requests it sends and their bytes.
  static absl::StatusOr<std::shared_ptr<ServedLink>> Open(
      const std::string& socket_name, const std::string& token, absl::Duration request_timeout,
      bool populate, absl::Time deadline, std::shared_ptr<ServedCopyCounters> counters = nullptr);

  // For Open only (std::make_shared needs a public constructor).
  class PassKey {
    friend class ServedLink;
    PassKey() = default;
  };
  ServedLink(PassKey, UniqueFd socket, Mapping staging, std::string token,
             absl::Duration request_timeout, std::shared_ptr<ServedCopyCounters> counters);
  ServedLink(const ServedLink&) = delete;
  ServedLink& operator=(const ServedLink&) = delete;

  // Queues the ops of `request` at `indices` (on grant-guarded regions of the peer, local
  // host memory); `done` runs once, on the completions thread (or in Fail's caller).
  void Submit(PostRequest request, std::vector<size_t> indices, DoneCallback done);
  // The same, but waits for the end and calls `done` in this thread before returning
  // (Capabilities::ends_host_ops_inline), at the latest at `request.deadline`: then the
  // request fails with DeadlineExceeded, and what the peer answers later is dropped (nothing
  // of it reaches local memory).
  void Run(PostRequest request, std::vector<size_t> indices, DoneCallback done);

  // The completions thread: handles every reply that has arrived, fails the requests whose
  // answer is overdue, and asks for more. Never waits.
  void Progress();
  // When Progress must run even if no reply arrives: the first answer due, or the end of a
  // pause while the peer moves a region.
  absl::Time NextWake();
  int socket() const { return socket_.get(); }
  // Failed (Fail, the peer gone, an overdue answer): nothing more is read from the socket.
  bool broken();
  // Called (not under the link's lock) when a request goes out while none was in flight, so
  // that the completions thread watches its deadline; set once by ServedCompletions::Add.
  void SetWake(std::function<void()> wake);

  // Fails everything queued or in flight with `reason` and shuts the connection down; later
  // replies are not read. Idempotent.
  void Fail(const absl::Status& reason);

 private:
  struct Piece {
    size_t op_index = 0;  // in the request
    std::byte* local = nullptr;
    RegionId region = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  struct Job {
    PostRequest request;
    std::vector<size_t> indices;
    DoneCallback done;
    uint64_t request_bytes = 0;  // the size of each copy request cut from it
    size_t next = 0;             // into `indices`: ops not yet cut into `todo`
    std::deque<Piece> todo;      // cut, not yet asked for
    size_t outstanding = 0;      // copy requests in flight
    absl::Status status;         // the first failure
    bool waited = false;         // Run: its caller reports it
    bool ended = false;
  };
  struct Slot {
    bool busy = false;
    uint64_t sequence = 0;
    absl::Time due;
    std::shared_ptr<Job> job;
    std::vector<Piece> pieces;
  };
  using Ended = std::vector<std::shared_ptr<Job>>;

  std::shared_ptr<Job> MakeJob(PostRequest request, std::vector<size_t> indices, DoneCallback done,
                               bool waited);
  // Queues `job`, asks for what the free slots take, and wakes the completions thread when
  // the link was idle.
  void Enqueue(std::shared_ptr<Job> job);
  // Asks for the next pieces while a slot is free; ends the jobs that are done.
  void PumpLocked(Ended* ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleReplyLocked(absl::string_view bytes, Ended* ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailJobLocked(Job& job, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void BreakLocked(const absl::Status& reason, Ended* ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the jobs that have nothing left in flight or to ask for into `ended`.
  void CollectLocked(Ended* ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IdleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reports the ended jobs (outside the lock): their callbacks, or their waiting callers.
  void Report(Ended& ended);

  const UniqueFd socket_;
  const Mapping staging_;
  const std::string token_;
  const absl::Duration request_timeout_;
  const std::shared_ptr<ServedCopyCounters> counters_;  // may be null

  Mutex mu_;
  CondVar ended_cv_;  // Run's callers wait for their job here
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  std::array<Slot, kCopySlots> slots_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // While the peer moves a region: nothing is asked for before then.
  absl::Time paused_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::function<void()> wake_ ABSL_GUARDED_BY(mu_);
  // Kept from one copy request to the next, so that asking and answering allocate nothing:
  // the request being built (its token set once), its encoding, and the reply's bytes.
  FdRequest ask_ ABSL_GUARDED_BY(mu_);
  std::string encoded_ ABSL_GUARDED_BY(mu_);
  std::vector<char> received_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_SERVED_LINK_H_
