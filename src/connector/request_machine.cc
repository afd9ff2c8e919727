// The request transition table (request_machine.h). Rows are tried in order; the first whose
// role, mode, state, event and both guards match wins. Sends skip a dead peer.
#include "src/connector/request_machine.h"

#include "absl/strings/str_cat.h"

namespace kvwire {
namespace connector_internal {

namespace {

using S = RequestState;
using E = RequestEvent;
using A = RequestAction;
using G = Guard;
constexpr Role P = Role::kPrefill;
constexpr Role D = Role::kDecode;
constexpr ModeIs Und = ModeIs::kUndecided;
constexpr ModeIs Rd = ModeIs::kRead;
constexpr ModeIs Wr = ModeIs::kWrite;
constexpr G Al = G::kAlways;

// clang-format off
constexpr Transition kTable[] = {
  // --- decode, before its mode is settled -------------------------------------------------
  {D, Und, S::kNew, E::kMatch, Al, Al, S::kMatched, {}, "scheduler matched a prefill's tokens"},
  {D, Und, S::kNew, E::kBindMeta, Al, Al, S::kPending, {}, "worker rebuilds a load matched by a scheduler elsewhere"},
  {D, Und, S::kNew, E::kReleaseOnly, Al, Al, S::kPending, {}, "ReleaseUnread: only tells the prefill to free"},
  {D, Und, S::kMatched, E::kAlloc, Al, Al, S::kPending, {A::kQueueLoad}, "blocks allocated"},
  {D, Und, S::kMatched, E::kAllocNone, Al, Al, S::kWithdrawn, {}, "the scheduler loads nothing"},
  {D, Und, S::kMatched, E::kSchedulerFinished, Al, Al, S::kWithdrawn, {}, "finished before its load"},
  {D, Und, S::kPending, E::kSchedulerFinished, Al, Al, S::kWithdrawn, {}, "finished before its load"},
  {D, Und, S::kMatched, E::kAbort, Al, Al, S::kFailed, {A::kReportLoadFailed}, "nothing moved"},
  {D, Und, S::kPending, E::kAbort, Al, Al, S::kFailed, {A::kReportLoadFailed}, "nothing moved"},
  {D, Und, S::kMatched, E::kDeadline, Al, Al, S::kMatched, {}, "not started: the scheduler owns it"},
  {D, Und, S::kPending, E::kDeadline, Al, Al, S::kPending, {}, "not started: the worker owns it"},
  {D, Und, S::kPending, E::kStartLoad, Al, Al, S::kLoading, {A::kConnect}, "connect outside the lock"},
  {D, Und, S::kLoading, E::kConnectedRead, G::kReleaseOnly, Al, S::kWithdrawn, {A::kSendUnread}, "told; never started"},
  {D, Und, S::kLoading, E::kConnectedWrite, G::kReleaseOnly, Al, S::kWithdrawn, {A::kSendUnread}, "told; never started"},
  {D, Und, S::kLoading, E::kConnectFailed, G::kReleaseOnly, Al, S::kWithdrawn, {A::kSendUnread}, "the sources it reached are told; the lease frees the rest"},
  {D, Und, S::kLoading, E::kConnectedRead, G::kFailing, Al, S::kFailed, {A::kReportLoadFailed}, "aborted while connecting"},
  {D, Und, S::kLoading, E::kConnectedWrite, G::kFailing, Al, S::kFailed, {A::kReportLoadFailed}, "aborted while connecting"},
  {D, Und, S::kLoading, E::kConnectFailed, G::kLoad, Al, S::kFailed, {A::kReportLoadFailed}, "unreachable, mode conflict or bad plan"},
  {D, Und, S::kLoading, E::kConnectedRead, G::kNothingToMove, Al, S::kCompleted, {A::kSendRelease, A::kReportLoaded}, "every token is local"},
  {D, Und, S::kLoading, E::kConnectedRead, G::kSomethingToMove, Al, S::kLoading, {A::kSendReadStart}, "READs wait for every source's grant"},
  {D, Und, S::kLoading, E::kConnectedWrite, Al, Al, S::kLoading, {A::kSendWriteReq}, "prefill WRITEs as layers are saved"},
  {D, Und, S::kLoading, E::kAbort, Al, Al, S::kLoading, {}, "noted: the connection's end fails it"},
  {D, Und, S::kLoading, E::kSchedulerFinished, Al, Al, S::kLoading, {}, "noted: the connection's end fails it"},
  {D, Und, S::kLoading, E::kDeadline, Al, Al, S::kFailed, {A::kReportLoadFailed}, "handshake took too long"},

  // --- decode, read mode ------------------------------------------------------------------
  {D, Rd, S::kLoading, E::kReadOk, G::kAllGranted, Al, S::kLoading, {A::kSubmitReads}, "the last source granted"},
  {D, Rd, S::kLoading, E::kReadOk, G::kNotAllGranted, Al, S::kLoading, {}, "other sources still to grant"},
  {D, Rd, S::kLoading, E::kTransferOk, G::kInFlight, Al, S::kLoading, {A::kMarkLayer}, "a layer may be in place"},
  {D, Rd, S::kLoading, E::kTransferOk, G::kIdle, Al, S::kCompleted, {A::kMarkLayer, A::kSendRelease, A::kReportLoaded}, "every READ ended well"},
  {D, Rd, S::kLoading, E::kTransferFailed, G::kInFlight, Al, S::kDraining, {}, "others still touch the blocks"},
  {D, Rd, S::kLoading, E::kTransferFailed, G::kIdle, Al, S::kFailed, {A::kSendRelease, A::kReportLoadFailed}, "release the sources' blocks"},
  {D, Rd, S::kLoading, E::kPeerFail, G::kInFlight, Al, S::kLoading, {}, "the READs fail on their own"},
  {D, Rd, S::kLoading, E::kPeerFail, G::kIdle, Al, S::kFailed, {A::kSendRelease, A::kReportLoadFailed}, "a source refused the read_start"},
  {D, Rd, S::kLoading, E::kAbort, G::kInFlight, Al, S::kDraining, {}, "wait for the READs"},
  {D, Rd, S::kLoading, E::kAbort, G::kIdle, Al, S::kFailed, {A::kSendRelease, A::kReportLoadFailed}, ""},
  {D, Rd, S::kLoading, E::kSchedulerFinished, G::kInFlight, Al, S::kDraining, {}, "wait for the READs"},
  {D, Rd, S::kLoading, E::kSchedulerFinished, G::kIdle, Al, S::kFailed, {A::kSendRelease, A::kReportLoadFailed}, ""},
  {D, Rd, S::kLoading, E::kPeerGone, G::kInFlight, Al, S::kDraining, {}, "wait for the READs"},
  {D, Rd, S::kLoading, E::kPeerGone, G::kIdle, Al, S::kFailed, {A::kSendRelease, A::kReportLoadFailed}, "the other sources are released"},
  {D, Rd, S::kLoading, E::kDeadline, G::kInFlight, Al, S::kLoading, {}, "each transfer has its own engine timeout"},
  {D, Rd, S::kLoading, E::kDeadline, G::kIdle, Al, S::kFailed, {A::kSendRelease, A::kReportLoadFailed}, "no grant in time"},
  {D, Rd, S::kDraining, E::kTransferOk, G::kInFlight, Al, S::kDraining, {}, ""},
  {D, Rd, S::kDraining, E::kTransferOk, G::kIdle, Al, S::kFailed, {A::kSendRelease, A::kReportLoadFailed}, "drained"},
  {D, Rd, S::kDraining, E::kTransferFailed, G::kInFlight, Al, S::kDraining, {}, ""},
  {D, Rd, S::kDraining, E::kTransferFailed, G::kIdle, Al, S::kFailed, {A::kSendRelease, A::kReportLoadFailed}, "drained"},
  {D, Rd, S::kDraining, E::kReadOk, Al, Al, S::kDraining, {}, "a late grant: nothing more is read"},
  {D, Rd, S::kDraining, E::kPeerFail, Al, Al, S::kDraining, {}, "the READs end on their own"},
  {D, Rd, S::kDraining, E::kPeerGone, Al, Al, S::kDraining, {}, "the READs end on their own"},
  {D, Rd, S::kDraining, E::kAbort, Al, Al, S::kDraining, {}, "failing already"},
  {D, Rd, S::kDraining, E::kSchedulerFinished, Al, Al, S::kDraining, {}, "failing already"},
  {D, Rd, S::kDraining, E::kDeadline, G::kInFlight, Al, S::kDraining, {}, "each transfer has its own engine timeout"},

  // --- decode, write mode -----------------------------------------------------------------
  {D, Wr, S::kLoading, E::kPeerLayer, Al, Al, S::kLoading, {A::kMarkLayer}, "WaitForLayerLoad returns"},
  {D, Wr, S::kLoading, E::kPeerDone, G::kNotFailing, Al, S::kCompleted, {A::kReportLoaded}, "every byte acknowledged"},
  {D, Wr, S::kLoading, E::kPeerFail, Al, Al, S::kFailed, {A::kReportLoadFailed}, "prefill writes nothing more"},
  {D, Wr, S::kLoading, E::kPeerGone, Al, Al, S::kFailed, {A::kReportLoadFailed}, "prefill writes nothing more"},
  {D, Wr, S::kLoading, E::kAbort, G::kPeerAlive, Al, S::kDraining, {A::kSendFail, A::kArmDrainDeadline}, "prefill may still write: ask it to stop"},
  {D, Wr, S::kLoading, E::kAbort, G::kPeerDead, Al, S::kFailed, {A::kReportLoadFailed}, ""},
  {D, Wr, S::kLoading, E::kSchedulerFinished, G::kPeerAlive, Al, S::kDraining, {A::kSendFail, A::kArmDrainDeadline}, "prefill may still write: ask it to stop"},
  {D, Wr, S::kLoading, E::kSchedulerFinished, G::kPeerDead, Al, S::kFailed, {A::kReportLoadFailed}, ""},
  {D, Wr, S::kLoading, E::kDeadline, G::kPeerAlive, Al, S::kDraining, {A::kSendFail, A::kArmDrainDeadline}, "prefill may still write: ask it to stop"},
  {D, Wr, S::kLoading, E::kDeadline, G::kPeerDead, Al, S::kFailed, {A::kReportLoadFailed}, ""},
  {D, Wr, S::kDraining, E::kPeerLayer, Al, Al, S::kDraining, {A::kMarkLayer}, "harmless"},
  {D, Wr, S::kDraining, E::kPeerDone, Al, Al, S::kFailed, {A::kReportLoadFailed}, "prefill stopped"},
  {D, Wr, S::kDraining, E::kPeerFail, Al, Al, S::kFailed, {A::kReportLoadFailed}, "prefill stopped"},
  {D, Wr, S::kDraining, E::kPeerGone, Al, Al, S::kFailed, {A::kReportLoadFailed}, "prefill stopped"},
  {D, Wr, S::kDraining, E::kDeadline, Al, Al, S::kFailed, {A::kReportLoadFailed}, "prefill did not answer"},
  {D, Wr, S::kDraining, E::kAbort, Al, Al, S::kDraining, {}, "failing already"},
  {D, Wr, S::kDraining, E::kSchedulerFinished, Al, Al, S::kDraining, {}, "failing already"},

  // --- prefill, write mode ----------------------------------------------------------------
  {P, Wr, S::kNew, E::kMatch, Al, Al, S::kMatched, {}, "a save to push to a decode"},
  {P, Wr, S::kMatched, E::kAlloc, Al, Al, S::kSaving, {A::kQueueSave, A::kSendLayers}, "blocks allocated"},
  {P, Wr, S::kMatched, E::kWriteReq, Al, Al, S::kMatched, {}, "decode's blocks kept for the first send"},
  {P, Wr, S::kMatched, E::kPeerUnread, Al, Al, S::kReleased, {A::kFreeBlocks}, "decode will not load"},
  {P, Wr, S::kMatched, E::kPeerFail, Al, Al, S::kFailed, {A::kSendFail, A::kFreeBlocks}, "aborted by decode"},
  {P, Wr, S::kMatched, E::kPeerGone, Al, Al, S::kFailed, {A::kFreeBlocks}, ""},
  {P, Wr, S::kMatched, E::kAbort, Al, Al, S::kFailed, {A::kSendFail, A::kFreeBlocks}, ""},
  {P, Wr, S::kMatched, E::kSchedulerFinished, Al, Al, S::kMatched, {}, "blocks freed when it ends"},
  {P, Wr, S::kMatched, E::kDeadline, Al, Al, S::kMatched, {}, "not started: the scheduler owns it"},
  {P, Wr, S::kSaving, E::kWriteReq, Al, Al, S::kSaving, {A::kSendLayers}, "decode's blocks known"},
  {P, Wr, S::kSaving, E::kLayerSaved, Al, Al, S::kSaving, {A::kSendLayers}, "a layer is final"},
  {P, Wr, S::kSaving, E::kTransferOk, G::kInFlight, Al, S::kSaving, {A::kTellLayer}, ""},
  {P, Wr, S::kSaving, E::kTransferOk, G::kIdle, G::kAllSent, S::kCompleted, {A::kTellLayer, A::kSendDone, A::kFreeBlocks}, "every layer acknowledged"},
  {P, Wr, S::kSaving, E::kTransferOk, G::kIdle, G::kNotAllSent, S::kSaving, {A::kTellLayer}, "layers still to be saved"},
  {P, Wr, S::kSaving, E::kTransferFailed, G::kInFlight, Al, S::kDraining, {}, "others still touch the blocks"},
  {P, Wr, S::kSaving, E::kTransferFailed, G::kIdle, Al, S::kFailed, {A::kSendFail, A::kFreeBlocks}, ""},
  {P, Wr, S::kSaving, E::kPeerFail, G::kInFlight, Al, S::kDraining, {}, "aborted by decode"},
  {P, Wr, S::kSaving, E::kPeerFail, G::kIdle, Al, S::kFailed, {A::kSendFail, A::kFreeBlocks}, "aborted by decode: answered"},
  {P, Wr, S::kSaving, E::kPeerUnread, G::kInFlight, Al, S::kDraining, {}, "data moved after all"},
  {P, Wr, S::kSaving, E::kPeerUnread, G::kIdle, Al, S::kReleased, {A::kFreeBlocks}, "decode will not load"},
  {P, Wr, S::kSaving, E::kPeerGone, G::kInFlight, Al, S::kDraining, {}, ""},
  {P, Wr, S::kSaving, E::kPeerGone, G::kIdle, Al, S::kFailed, {A::kFreeBlocks}, ""},
  {P, Wr, S::kSaving, E::kAbort, G::kInFlight, Al, S::kDraining, {}, ""},
  {P, Wr, S::kSaving, E::kAbort, G::kIdle, Al, S::kFailed, {A::kSendFail, A::kFreeBlocks}, ""},
  {P, Wr, S::kSaving, E::kSchedulerFinished, Al, Al, S::kSaving, {}, "blocks freed when it ends"},
  {P, Wr, S::kSaving, E::kDeadline, G::kInFlight, Al, S::kSaving, {}, "each transfer has its own engine timeout"},
  {P, Wr, S::kSaving, E::kDeadline, G::kIdle, Al, S::kFailed, {A::kSendFail, A::kFreeBlocks}, "no write request or save in time"},
  {P, Wr, S::kDraining, E::kTransferOk, G::kInFlight, Al, S::kDraining, {}, ""},
  {P, Wr, S::kDraining, E::kTransferOk, G::kIdle, Al, S::kFailed, {A::kSendFail, A::kFreeBlocks}, "drained"},
  {P, Wr, S::kDraining, E::kTransferFailed, G::kInFlight, Al, S::kDraining, {}, ""},
  {P, Wr, S::kDraining, E::kTransferFailed, G::kIdle, Al, S::kFailed, {A::kSendFail, A::kFreeBlocks}, "drained"},
  {P, Wr, S::kDraining, E::kWriteReq, Al, Al, S::kDraining, {}, "nothing more is sent"},
  {P, Wr, S::kDraining, E::kLayerSaved, Al, Al, S::kDraining, {}, "nothing more is sent"},
  {P, Wr, S::kDraining, E::kPeerFail, Al, Al, S::kDraining, {}, "failing already"},
  {P, Wr, S::kDraining, E::kPeerUnread, Al, Al, S::kDraining, {}, "failing already"},
  {P, Wr, S::kDraining, E::kPeerGone, Al, Al, S::kDraining, {}, "failing already"},
  {P, Wr, S::kDraining, E::kAbort, Al, Al, S::kDraining, {}, "failing already"},
  {P, Wr, S::kDraining, E::kSchedulerFinished, Al, Al, S::kDraining, {}, "failing already"},
  {P, Wr, S::kDraining, E::kDeadline, G::kInFlight, Al, S::kDraining, {}, "each transfer has its own engine timeout"},

  // --- prefill, read mode -----------------------------------------------------------------
  {P, Rd, S::kNew, E::kHandOff, Al, Al, S::kHeld, {A::kPublishMemory}, "blocks held under a 128-bit transfer id"},
  {P, Rd, S::kHeld, E::kReadStart, Al, Al, S::kHeld, {A::kGrant}, "a reader bound, granted, read_ok"},
  {P, Rd, S::kHeld, E::kGrantFailed, G::kGranted, Al, S::kReleasing, {A::kSendFail, A::kRevoke}, "other readers' ops drain first"},
  {P, Rd, S::kHeld, E::kGrantFailed, G::kNotGranted, Al, S::kFailed, {A::kSendFail, A::kFreeBlocks}, ""},
  {P, Rd, S::kHeld, E::kRelease, G::kReadersLeft, Al, S::kHeld, {}, "other readers may still read"},
  {P, Rd, S::kHeld, E::kRelease, G::kReadersFailed, G::kGranted, S::kReleasing, {A::kRevoke}, "a reader failed or died: its ops drain first"},
  {P, Rd, S::kHeld, E::kRelease, G::kReadersFailed, G::kNotGranted, S::kFailed, {A::kFreeBlocks}, "a reader failed or died"},
  {P, Rd, S::kHeld, E::kRelease, G::kReadersRead, G::kGranted, S::kReleasing, {A::kRevoke}, "read: freed once what each reader read was served"},
  {P, Rd, S::kHeld, E::kRelease, G::kReadersRead, G::kNotGranted, S::kCompleted, {A::kFreeBlocks}, "read"},
  {P, Rd, S::kHeld, E::kRelease, G::kReadersUnread, G::kGranted, S::kReleasing, {A::kRevoke}, "decode will not read: ops drain first"},
  {P, Rd, S::kHeld, E::kRelease, G::kReadersUnread, G::kNotGranted, S::kReleased, {A::kFreeBlocks}, "decode will not read"},
  {P, Rd, S::kHeld, E::kPeerFail, Al, Al, S::kHeld, {}, "readers release; a fail changes nothing"},
  {P, Rd, S::kHeld, E::kAbort, Al, Al, S::kHeld, {}, "a reader may be reading: the lease governs"},
  {P, Rd, S::kHeld, E::kSchedulerFinished, Al, Al, S::kHeld, {}, ""},
  {P, Rd, S::kHeld, E::kDeadline, G::kGranted, Al, S::kReleasing, {A::kCountLease, A::kRevoke}, "lease expired: ops under the grants drain first"},
  {P, Rd, S::kHeld, E::kDeadline, G::kNotGranted, Al, S::kFailed, {A::kCountLease, A::kFreeBlocks}, "lease expired"},
  {P, Rd, S::kReleasing, E::kServed, G::kFailing, Al, S::kFailed, {A::kFreeBlocks}, "served and revoked"},
  {P, Rd, S::kReleasing, E::kServed, G::kReadersRead, G::kNotFailing, S::kCompleted, {A::kFreeBlocks}, "every byte read was served"},
  {P, Rd, S::kReleasing, E::kServed, G::kReadersUnread, G::kNotFailing, S::kReleased, {A::kFreeBlocks}, "served and revoked"},
  {P, Rd, S::kReleasing, E::kDeadline, G::kGranted, Al, S::kReleasing, {A::kRevoke}, "ops still served or a count not reached: revoked now, freed once served"},
  {P, Rd, S::kReleasing, E::kDeadline, G::kNotGranted, G::kReadersOpen, S::kReleasing, {A::kCloseReaders}, "revoked and still served a handshake_timeout later: the readers still served are closed, their ops end with their connections; freed once served"},
  {P, Rd, S::kReleasing, E::kDeadline, G::kNotGranted, G::kReadersClosed, S::kFailed, {A::kFreeBlocks}, "closed and still served a handshake_timeout later: freed anyway, loudly"},
  {P, Rd, S::kReleasing, E::kRelease, Al, Al, S::kReleasing, {}, "every reader was heard from already"},
  {P, Rd, S::kReleasing, E::kPeerFail, Al, Al, S::kReleasing, {}, "the release governs"},
  {P, Rd, S::kReleasing, E::kAbort, Al, Al, S::kReleasing, {}, "the release governs"},
  {P, Rd, S::kReleasing, E::kSchedulerFinished, Al, Al, S::kReleasing, {}, "blocks freed when it ends"},
};
// clang-format on

bool ModeMatches(ModeIs m, KvMode mode) {
  switch (m) {
    case ModeIs::kAny:
      return true;
    case ModeIs::kUndecided:
      return mode == KvMode::kAuto;
    case ModeIs::kRead:
      return mode == KvMode::kRead;
    case ModeIs::kWrite:
      return mode == KvMode::kWrite;
  }
  return false;
}

const char* ModeName(KvMode m) {
  return m == KvMode::kAuto ? "undecided" : m == KvMode::kRead ? "read" : "write";
}

}  // namespace

absl::Span<const Transition> TransitionTable() { return kTable; }

bool GuardHolds(Guard g, const RequestFacts& f) {
  switch (g) {
    case G::kAlways:
      return true;
    case G::kInFlight:
      return f.in_flight;
    case G::kIdle:
      return !f.in_flight;
    case G::kAllGranted:
      return f.all_granted;
    case G::kNotAllGranted:
      return !f.all_granted;
    case G::kAllSent:
      return f.all_sent;
    case G::kNotAllSent:
      return !f.all_sent;
    case G::kReadersLeft:
      return f.readers_left;
    case G::kReadersRead:
      return !f.readers_left && !f.reader_failed && f.reader_read;
    case G::kReadersFailed:
      return !f.readers_left && f.reader_failed;
    case G::kReadersUnread:
      return !f.readers_left && !f.reader_failed && !f.reader_read;
    case G::kFailing:
      return f.failing;
    case G::kNotFailing:
      return !f.failing;
    case G::kPeerAlive:
      return f.peer_alive;
    case G::kPeerDead:
      return !f.peer_alive;
    case G::kReleaseOnly:
      return f.release_only;
    case G::kLoad:
      return !f.release_only;
    case G::kNothingToMove:
      return f.nothing_to_move;
    case G::kSomethingToMove:
      return !f.nothing_to_move;
    case G::kGranted:
      return f.granted;
    case G::kNotGranted:
      return !f.granted;
    case G::kReadersOpen:
      return !f.readers_closed;
    case G::kReadersClosed:
      return f.readers_closed;
  }
  return false;
}

namespace {

// The rows for each (role, state, event), in table order: a step looks at its few candidate
// rows (at most 4 today) instead of scanning all of them. Built once, at compile time.
constexpr int kTableRows = sizeof(kTable) / sizeof(kTable[0]);
constexpr int kBuckets = 2 * kRequestStates * kRequestEvents;
constexpr int Bucket(Role role, RequestState state, RequestEvent event) {
  return (static_cast<int>(role) * kRequestStates + static_cast<int>(state)) * kRequestEvents +
         static_cast<int>(event);
}
struct TableIndex {
  std::array<uint16_t, kBuckets + 1> begin{};  // rows of bucket b: row[begin[b] .. begin[b+1])
  std::array<uint16_t, kTableRows> row{};
};
constexpr TableIndex BuildIndex() {
  TableIndex x;
  for (const Transition& t : kTable) ++x.begin[Bucket(t.role, t.from, t.event) + 1];
  for (int b = 0; b < kBuckets; ++b) x.begin[b + 1] += x.begin[b];
  std::array<uint16_t, kBuckets> next{};
  for (int b = 0; b < kBuckets; ++b) next[b] = x.begin[b];
  for (int i = 0; i < kTableRows; ++i) {
    x.row[next[Bucket(kTable[i].role, kTable[i].from, kTable[i].event)]++] =
        static_cast<uint16_t>(i);
  }
  return x;
}
constexpr TableIndex kIndex = BuildIndex();

}  // namespace

const Transition* FindTransition(Role role, KvMode mode, RequestState state, RequestEvent event,
                                 const RequestFacts& facts) {
  const int b = Bucket(role, state, event);
  if (b < 0 || b >= kBuckets) return nullptr;
  for (int k = kIndex.begin[b]; k < kIndex.begin[b + 1]; ++k) {
    const Transition& t = kTable[kIndex.row[k]];
    if (ModeMatches(t.mode, mode) && GuardHolds(t.guard, facts) && GuardHolds(t.guard2, facts)) {
      return &t;
    }
  }
  return nullptr;
}

absl::StatusOr<const Transition*> RequestMachine::Step(RequestEvent event,
                                                       const RequestFacts& facts) {
  const Transition* t = FindTransition(role_, mode_, state_, event, facts);
  if (t == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("request machine: event '", RequestEventName(event),
                     "' has no transition for a ", RoleName(role_), " request in ", ModeName(mode_),
                     " mode in state '", RequestStateName(state_), "'"));
  }
  if (event == E::kConnectedRead) mode_ = KvMode::kRead;
  if (event == E::kConnectedWrite) mode_ = KvMode::kWrite;
  state_ = t->to;
  return t;
}

const char* RequestStateName(RequestState s) {
  static constexpr const char* kNames[kRequestStates] = {
      "new",      "matched",   "pending",   "loading", "saving",   "held",
      "draining", "releasing", "completed", "failed",  "released", "withdrawn"};
  const int i = static_cast<int>(s);
  return i < kRequestStates ? kNames[i] : "?";
}

const char* RequestEventName(RequestEvent e) {
  static constexpr const char* kNames[kRequestEvents] = {
      "match",          "bind_meta",       "release_only",   "hand_off",       "alloc",
      "alloc_none",     "start_load",      "layer_saved",    "sched_finished", "abort",
      "connected_read", "connected_write", "connect_failed", "write_req",      "read_start",
      "grant_failed",   "read_ok",         "release",        "peer_layer",     "peer_done",
      "peer_fail",      "peer_unread",     "peer_gone",      "transfer_ok",    "transfer_failed",
      "deadline",       "served"};
  const int i = static_cast<int>(e);
  return i < kRequestEvents ? kNames[i] : "?";
}

const char* RequestActionName(RequestAction a) {
  static constexpr const char* kNames[kRequestActions] = {"",
                                                          "queue_load",
                                                          "queue_save",
                                                          "connect",
                                                          "send_write_req",
                                                          "send_read_start",
                                                          "submit_reads",
                                                          "mark_layer",
                                                          "send_layers",
                                                          "tell_layer",
                                                          "send_done",
                                                          "grant",
                                                          "revoke",
                                                          "send_release",
                                                          "send_fail",
                                                          "send_unread",
                                                          "arm_drain_deadline",
                                                          "count_lease",
                                                          "publish_memory",
                                                          "report_loaded",
                                                          "report_load_failed",
                                                          "free_blocks",
                                                          "close_readers"};
  const int i = static_cast<int>(a);
  return i < kRequestActions ? kNames[i] : "?";
}

const char* GuardName(Guard g) {
  static constexpr const char* kNames[] = {"",
                                           "in_flight",
                                           "idle",
                                           "all_granted",
                                           "not_all_granted",
                                           "all_sent",
                                           "not_all_sent",
                                           "readers_left",
                                           "readers_read",
                                           "readers_failed",
                                           "readers_unread",
                                           "failing",
                                           "not_failing",
                                           "peer_alive",
                                           "peer_dead",
                                           "release_only",
                                           "load",
                                           "nothing_to_move",
                                           "something_to_move",
                                           "granted",
                                           "not_granted",
                                           "readers_open",
                                           "readers_closed"};
  const size_t i = static_cast<size_t>(g);
  return i < sizeof(kNames) / sizeof(kNames[0]) ? kNames[i] : "?";
}

const char* RoleName(Role r) { return r == Role::kPrefill ? "prefill" : "decode"; }

const char* ModeIsName(ModeIs m) {
  switch (m) {
    case ModeIs::kAny:
      return "any";
    case ModeIs::kUndecided:
      return "undecided";
    case ModeIs::kRead:
      return "read";
    case ModeIs::kWrite:
      return "write";
  }
  return "?";
}

std::string TransitionTableMarkdown() {
  std::string out =
      "| role | mode | state | event | guard | next | actions | why |\n"
      "|---|---|---|---|---|---|---|---|\n";
  for (const Transition& t : kTable) {
    std::string guard = GuardName(t.guard);
    if (t.guard2 != G::kAlways) absl::StrAppend(&guard, ", ", GuardName(t.guard2));
    std::string actions;
    for (RequestAction a : t.actions) {
      if (a == A::kNone) continue;
      absl::StrAppend(&actions, actions.empty() ? "" : ", ", RequestActionName(a));
    }
    absl::StrAppend(&out, "| ", RoleName(t.role), " | ", ModeIsName(t.mode), " | ",
                    RequestStateName(t.from), " | ", RequestEventName(t.event), " | ", guard, " | ",
                    RequestStateName(t.to), " | ", actions, " | ", t.why, " |\n");
  }
  return out;
}

}  // namespace connector_internal
}  // namespace kvwire
