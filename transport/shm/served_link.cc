#include "transport/shm/served_link.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <fcntl.h>
#include <utility>

#include "absl/strings/str_cat.h"

#include "transport/shm/fd_client.h"
#include "transport/shm/fd_protocol.h"
#include "transport/shm/seqpacket.h"
#include "transport/shm/shm_channel_internal.h"

namespace kvwire::transport::shm {
namespace {

// Requests are not cut smaller than this (each costs a round trip through both processes),
// nor larger than a slot.
constexpr uint64_t kMinCopyRequestBytes = uint64_t{256} << 10;
// How long to wait before asking again for ops on a region the peer is moving.
constexpr absl::Duration kMovingRetry = absl::Milliseconds(1);

}  // namespace

absl::StatusOr<std::shared_ptr<ServedLink>> ServedLink::Open(
    const std::string& socket_name, const std::string& token, absl::Duration request_timeout,
    bool populate, absl::Time deadline, std::shared_ptr<ServedCopyCounters> counters) {
  absl::StatusOr<UniqueFd> socket = ConnectSeqpacket(socket_name, deadline);
  if (!socket.ok()) return socket.status();
  FdRequest ask;
  ask.kind = FdRequestKind::kStaging;
  ask.token = token;
  absl::StatusOr<FdResponse> called = CallFdServer(socket->get(), ask, deadline);
  if (!called.ok()) return called.status();
  const FdReply& reply = called->reply;
  if (reply.code != absl::StatusCode::kOk) {
    return absl::Status(reply.code, absl::StrCat("the peer refused: ", reply.message));
  }
  if (reply.length != kCopySlotBytes || reply.flags != kCopySlots) {
    return absl::FailedPreconditionError(
        absl::StrCat("the peer's staging has ", reply.flags, " slots of ", reply.length,
                     " bytes, this build's ", kCopySlots, " of ", kCopySlotBytes));
  }
  const int fd = called->fd.get();
  struct stat info;
  const int seals = fd >= 0 ? ::fcntl(fd, F_GET_SEALS) : -1;
  // Mapping a file that can shrink would let the peer SIGBUS this process.
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0 || ::fstat(fd, &info) != 0 ||
      static_cast<uint64_t>(info.st_size) < kCopySlots * kCopySlotBytes) {
    return absl::FailedPreconditionError("the staging memfd is not a sealed memfd of its size");
  }
  absl::StatusOr<Mapping> staging =
      Mapping::Create(fd, 0, kCopySlots * kCopySlotBytes, PROT_READ | PROT_WRITE, populate);
  if (!staging.ok()) return staging.status();
  return std::make_shared<ServedLink>(PassKey(), *std::move(socket), *std::move(staging), token,
                                      request_timeout, std::move(counters));
}

ServedLink::ServedLink(PassKey, UniqueFd socket, Mapping staging, std::string token,
                       absl::Duration request_timeout, std::shared_ptr<ServedCopyCounters> counters)
    : socket_(std::move(socket)),
      staging_(std::move(staging)),
      token_(std::move(token)),
      request_timeout_(request_timeout),
      counters_(std::move(counters)),
      received_(kMaxFdMessageBytes + 1) {
  ask_.kind = FdRequestKind::kCopy;
  ask_.token = token_;
  ask_.ops.reserve(kMaxCopyOps);
}

void ServedLink::SetWake(std::function<void()> wake) {
  MutexLock lock(&mu_);
  wake_ = std::move(wake);
}

std::shared_ptr<ServedLink::Job> ServedLink::MakeJob(PostRequest request,
                                                     std::vector<size_t> indices, DoneCallback done,
                                                     bool waited) {
  auto job = std::make_shared<Job>();
  uint64_t total = 0;
  for (size_t i : indices) total += request.ops[i].length;
  // A job that fits one slot is still cut in two (down to kMinCopyRequestBytes), so that the
  // peer fills one slot while this side empties the other.
  job->request_bytes =
      std::clamp<uint64_t>(total / kCopySlots, kMinCopyRequestBytes, kCopySlotBytes);
  job->request = std::move(request);
  job->indices = std::move(indices);
  job->done = std::move(done);
  job->waited = waited;
  return job;
}

void ServedLink::Submit(PostRequest request, std::vector<size_t> indices, DoneCallback done) {
  Enqueue(MakeJob(std::move(request), std::move(indices), std::move(done), /*waited=*/false));
}

void ServedLink::Enqueue(std::shared_ptr<Job> job) {
  Ended ended;
  std::function<void()> wake;
  {
    MutexLock lock(&mu_);
    const bool idle = IdleLocked();
    jobs_.push_back(std::move(job));
    if (!broken_.ok()) {
      BreakLocked(broken_, &ended);
    } else {
      PumpLocked(&ended);
    }
    if (idle && !IdleLocked()) wake = wake_;
  }
  if (wake) wake();
  Report(ended);
}

void ServedLink::Run(PostRequest request, std::vector<size_t> indices, DoneCallback done) {
  std::shared_ptr<Job> job =
      MakeJob(std::move(request), std::move(indices), nullptr, /*waited=*/true);
  Enqueue(job);
  absl::Status status;
  // The completions thread ends the job (a reply, or its request overdue); this bound only
  // guards against that thread being gone.
  const absl::Time limit = absl::Now() + request_timeout_ * 2 + absl::Seconds(1);
  // The caller's own deadline comes first: a peer that does not answer holds this thread up to
  // it, not up to request_timeout.
  const absl::Time deadline = job->request.deadline;
  while (true) {
    Ended others;
    {
      MutexLock lock(&mu_);
      if (job->ended) {
        status = job->status;
        break;
      }
      if (!ended_cv_.WaitUntil(&mu_, std::min(limit, deadline)) && !job->ended) {
        // Judged by which bound the wait had, not by reading the clock again (a clock read
        // just short of the deadline would break the whole link as "no progress").
        if (deadline < limit) {
          // Failed now, it stays queued until its requests in flight are answered or overdue;
          // a failed job's answers are dropped, and it is asked for nothing more.
          FailJobLocked(
              *job, OpError(job->request, job->indices.front(), absl::StatusCode::kDeadlineExceeded,
                            "the transfer's deadline passed before the peer copied "
                            "(served copies)"));
          status = job->status;
          break;
        }
        BreakLocked(absl::DeadlineExceededError("served copies: no progress"), &others);
      }
    }
    Report(others);
  }
  // Unpinned before reporting, as ShmChannel::Post does.
  job->request.pins.clear();
  job->request.cancelled.reset();
  done(std::move(status));
}

bool ServedLink::IdleLocked() const {
  return std::none_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.busy; });
}

void ServedLink::PumpLocked(Ended* ended) {
  const absl::Time now = absl::Now();
  for (size_t s = 0; s < slots_.size() && now >= paused_until_; ++s) {
    Slot& slot = slots_[s];
    if (slot.busy) continue;
    // The oldest job with something left to ask for.
    std::shared_ptr<Job> job;
    for (const std::shared_ptr<Job>& candidate : jobs_) {
      if (!candidate->status.ok()) continue;
      if (candidate->todo.empty() && candidate->next == candidate->indices.size()) continue;
      const std::atomic<bool>* cancelled = candidate->request.cancelled.get();
      if (cancelled != nullptr && cancelled->load(std::memory_order_acquire)) {
        // The transfer already ended: for a READ, local memory must not change any more.
        FailJobLocked(*candidate, OpError(candidate->request, candidate->indices.front(),
                                          absl::StatusCode::kCancelled, "transfer cancelled"));
        continue;
      }
      job = candidate;
      break;
    }
    if (job == nullptr) break;
    FdRequest& ask = ask_;
    ask.ops.clear();
    ask.region = next_sequence_++;
    ask.copy_kind = job->request.kind;
    ask.grant = job->request.grant;
    ask.slot = static_cast<uint32_t>(s);
    std::byte* const data = staging_.data() + s * kCopySlotBytes;
    const bool write = job->request.kind == OpKind::kWrite;
    slot.pieces.clear();
    uint64_t used = 0;
    while (ask.ops.size() < kMaxCopyOps && used < job->request_bytes) {
      // Pieces put back (a remainder, or ops to ask again) come first, then the next op; only
      // what does not fit whole goes through `todo` (no allocation per op).
      Piece piece;
      const bool from_todo = !job->todo.empty();
      if (from_todo) {
        piece = job->todo.front();
      } else if (job->next < job->indices.size()) {
        const size_t index = job->indices[job->next++];
        const WireOp& op = job->request.ops[index];
        piece = Piece{index, op.local, op.remote_region, op.remote_offset, op.length};
      } else {
        break;
      }
      const uint64_t whole = piece.length;
      piece.length = std::min(whole, job->request_bytes - used);
      if (from_todo) job->todo.pop_front();
      if (piece.length < whole) {
        job->todo.push_front(Piece{piece.op_index, piece.local + piece.length, piece.region,
                                   piece.offset + piece.length, whole - piece.length});
      }
      if (write) std::memcpy(data + used, piece.local, piece.length);
      ask.ops.push_back(CopyOp{piece.region, piece.offset, piece.length});
      slot.pieces.push_back(piece);
      used += piece.length;
    }
    EncodeRequestTo(ask, &encoded_);
    if (absl::Status sent = SendMessage(socket_.get(), encoded_, -1, now + request_timeout_);
        !sent.ok()) {
      BreakLocked(absl::Status(sent.code(), absl::StrCat("served copies: the connection to the "
                                                         "peer was lost: ",
                                                         sent.message())),
                  ended);
      return;
    }
    if (counters_ != nullptr) {
      counters_->requests.fetch_add(1, std::memory_order_relaxed);
      counters_->bytes.fetch_add(used, std::memory_order_relaxed);
    }
    slot.busy = true;
    slot.sequence = ask.region;
    slot.due = now + request_timeout_;
    slot.job = std::move(job);
    ++slot.job->outstanding;
  }
  CollectLocked(ended);
}

void ServedLink::Progress() {
  Ended ended;
  {
    MutexLock lock(&mu_);
    if (!broken_.ok()) return;
    while (true) {
      absl::StatusOr<ReceivedView> message =
          ReceiveMessageInto(socket_.get(), absl::MakeSpan(received_), absl::InfinitePast());
      if (absl::IsDeadlineExceeded(message.status())) break;  // nothing more there
      if (!message.ok() || message->eof) {
        BreakLocked(message.ok() ? absl::UnavailableError("served copies: the peer closed "
                                                          "the connection")
                                 : absl::Status(message.status().code(),
                                                absl::StrCat("served copies: the connection to "
                                                             "the peer was lost: ",
                                                             message.status().message())),
                    &ended);
        break;
      }
      HandleReplyLocked(message->bytes, &ended);
      if (!broken_.ok()) break;
    }
    if (broken_.ok()) {
      const absl::Time now = absl::Now();
      for (const Slot& slot : slots_) {
        if (slot.busy && slot.due <= now) {
          BreakLocked(absl::DeadlineExceededError(absl::StrCat(
                          "served copies: the peer did not answer copy request ", slot.sequence,
                          " within ", absl::FormatDuration(request_timeout_))),
                      &ended);
          break;
        }
      }
    }
    if (broken_.ok()) PumpLocked(&ended);
  }
  Report(ended);
}

void ServedLink::HandleReplyLocked(absl::string_view bytes, Ended* ended) {
  absl::StatusOr<FdReply> reply = DecodeReply(bytes);
  if (!reply.ok()) {
    BreakLocked(absl::Status(reply.status().code(),
                             absl::StrCat("served copies: ", reply.status().message())),
                ended);
    return;
  }
  auto it = std::find_if(slots_.begin(), slots_.end(),
                         [&](const Slot& s) { return s.busy && s.sequence == reply->region; });
  if (it == slots_.end()) {
    BreakLocked(absl::InternalError(absl::StrCat("served copies: a reply for copy request ",
                                                 reply->region, ", which is not in flight")),
                ended);
    return;
  }
  Slot& slot = *it;
  std::shared_ptr<Job> job = std::move(slot.job);
  // Read in place and cleared at the end (the slot keeps its capacity for the next request).
  std::vector<Piece>& pieces = slot.pieces;
  slot.busy = false;
  --job->outstanding;
  const bool ok = reply->code == absl::StatusCode::kOk;
  // The ops the peer finished: all, or those before the one it names (its word: checked).
  const size_t finished = ok ? pieces.size() : std::min<uint64_t>(reply->length, pieces.size() - 1);
  const bool moving = !ok && (reply->flags & kCopyRegionMoving) != 0;
  if (job->status.ok() && job->request.kind == OpKind::kRead && finished > 0) {
    const std::atomic<bool>* cancelled = job->request.cancelled.get();
    if (cancelled != nullptr && cancelled->load(std::memory_order_acquire)) {
      FailJobLocked(*job, OpError(job->request, pieces.front().op_index,
                                  absl::StatusCode::kCancelled, "transfer cancelled"));
    } else {
      const std::byte* from = staging_.data() + (it - slots_.begin()) * kCopySlotBytes;
      for (size_t p = 0; p < finished; ++p) {
        std::memcpy(pieces[p].local, from, pieces[p].length);
        from += pieces[p].length;
      }
    }
  }
  if (!ok && job->status.ok()) {
    if (moving) {
      // Asked again once the move is over (each round is bounded by request_timeout, and a
      // move by its own deadline).
      job->todo.insert(job->todo.begin(), pieces.begin() + finished, pieces.end());
      paused_until_ = absl::Now() + kMovingRetry;
    } else {
      FailJobLocked(*job, OpError(job->request, pieces[finished].op_index, reply->code,
                                  absl::StrCat("the peer refused its copy (served copies): ",
                                               reply->message)));
    }
  }
  pieces.clear();
}

void ServedLink::FailJobLocked(Job& job, absl::Status status) {
  if (job.status.ok()) job.status = std::move(status);
  job.todo.clear();
  job.next = job.indices.size();
}

void ServedLink::BreakLocked(const absl::Status& reason, Ended* ended) {
  if (broken_.ok()) {
    broken_ = reason;
    ::shutdown(socket_.get(), SHUT_RDWR);
  }
  // Nothing in flight is read any more: its slots are free, and nothing of it is copied out.
  for (Slot& slot : slots_) {
    if (!slot.busy) continue;
    --slot.job->outstanding;
    slot.busy = false;
    slot.job.reset();
    slot.pieces.clear();
  }
  for (const std::shared_ptr<Job>& job : jobs_) {
    FailJobLocked(*job,
                  OpError(job->request, job->indices.front(), broken_.code(), broken_.message()));
  }
  CollectLocked(ended);
}

void ServedLink::CollectLocked(Ended* ended) {
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Job& job = **it;
    const bool asked_all = job.todo.empty() && job.next == job.indices.size();
    if (job.outstanding != 0 || !asked_all) {
      ++it;
      continue;
    }
    ended->push_back(std::move(*it));
    it = jobs_.erase(it);
  }
}

void ServedLink::Report(Ended& ended) {
  if (ended.empty()) return;
  bool waited = false;
  {
    MutexLock lock(&mu_);
    for (const std::shared_ptr<Job>& job : ended) {
      job->ended = true;
      waited = waited || job->waited;
    }
  }
  if (waited) ended_cv_.SignalAll();
  for (const std::shared_ptr<Job>& job : ended) {
    if (job->waited) continue;
    // Unpinned before reporting, as ShmChannel::Post does.
    job->request.pins.clear();
    job->request.cancelled.reset();
    DoneCallback done = std::move(job->done);
    done(job->status);
  }
  ended.clear();
}

void ServedLink::Fail(const absl::Status& reason) {
  Ended ended;
  {
    MutexLock lock(&mu_);
    BreakLocked(reason, &ended);
  }
  Report(ended);
}

bool ServedLink::broken() {
  MutexLock lock(&mu_);
  return !broken_.ok();
}

absl::Time ServedLink::NextWake() {
  MutexLock lock(&mu_);
  absl::Time wake = absl::InfiniteFuture();
  for (const Slot& slot : slots_) {
    if (slot.busy) wake = std::min(wake, slot.due);
  }
  if (!jobs_.empty() && paused_until_ > absl::Now()) wake = std::min(wake, paused_until_);
  return wake;
}

}  // namespace kvwire::transport::shm
