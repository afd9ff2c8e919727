// The life of one connector request as one transition table: (role, mode, state, event,
// guards) -> (next state, actions). Pure: no engine, no locks, no I/O, no allocation on a
// step. Connector::Impl keeps a RequestMachine per request (Request::machine); its handlers
// step it under the connector's lock with every event of the request (StepLocked), and count
// and log an event the table refuses and a request that ends other than its machine did. The
// handlers still carry out their own actions (engine calls, messages, reports); the rows'
// actions say what they must be. docs/ARCHITECTURE.md draws the same table
// (TransitionTableMarkdown; request_machine_test checks that the two agree).
//
// Roles and modes: a prefill request is a write-mode save (GetNumNewMatchedTokens with
// do_remote_decode and mode write) or a read-mode hand-off (RequestFinished holds its
// blocks); a decode request's mode is undecided until its prefill answered the handshake
// (kConnectedRead / kConnectedWrite settle it).
//
// Guards are facts about the request that the table does not track (transfers in flight,
// readers heard from, grants received): the caller states them in RequestFacts, the row
// checks them. An event no row takes is refused with a status naming the role, mode, state and
// event; the machine is left as it was (nothing is lost: the caller decides what a refused
// event means, e.g. closing the peer that sent it).
#ifndef KVWIRE_CONNECTOR_REQUEST_MACHINE_H_
#define KVWIRE_CONNECTOR_REQUEST_MACHINE_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "kvwire/connector.h"

namespace kvwire {
namespace connector_internal {

enum class RequestState : uint8_t {
  kNew,        // not in the request table yet
  kMatched,    // scheduler knows it; blocks not yet allocated
  kPending,    // blocks allocated, waiting for the worker (decode load)
  kLoading,    // decode: connecting, READs in flight, or waiting for prefill's WRITEs
  kSaving,     // prefill write mode: layers going out
  kHeld,       // prefill read mode: blocks held for the readers (lease)
  kDraining,   // aborted or failed: waiting for transfers (or the prefill) to stop
  kReleasing,  // prefill read mode: every reader done (or the lease over); the blocks go once
               // the engine served what each reader read and revoked its grant
  // Ends (the request leaves the table).
  kCompleted,  // every byte in place (decode) / delivered and acknowledged (prefill)
  kFailed,     // reported as failed (decode: failed_loads; prefill: blocks freed)
  kReleased,   // prefill: the decode will not read; blocks freed, nothing moved
  kWithdrawn,  // never started: the scheduler took it back, or a release-only decode told
               // its prefill; nothing is reported
};
inline constexpr int kRequestStates = 12;

enum class RequestEvent : uint8_t {
  // API calls.
  kMatch,              // GetNumNewMatchedTokens took it (decode load, prefill write save)
  kBindMeta,           // BindConnectorMeta: a load matched by a scheduler in another process
  kReleaseOnly,        // ReleaseUnread: a decode that will only tell the prefill to free
  kHandOff,            // RequestFinished of a prefill read-mode request: hold its blocks
  kAlloc,              // UpdateStateAfterAlloc with tokens to move
  kAllocNone,          // UpdateStateAfterAlloc: decode chose to load nothing
  kStartLoad,          // StartLoadKv
  kLayerSaved,         // SaveKvLayer (or its GPU event completed)
  kSchedulerFinished,  // RequestFinished of a request the connector knows
  kAbort,              // Abort, RequestFinished(aborted)
  // Connection (decode).
  kConnectedRead,   // prefill(s) reachable, mode settled to read
  kConnectedWrite,  // prefill reachable, mode settled to write
  kConnectFailed,   // resolve, handshake, mode conflict or planning failed
  // Peer messages.
  kWriteReq,     // prefill write: decode's block ids
  kReadStart,    // prefill read: a reader asks for its grant
  kGrantFailed,  // prefill read: the engine refused the grant
  kReadOk,       // decode read: a source granted its blocks
  kRelease,      // prefill read: a reader is done (read, unread, failed, or died)
  kPeerLayer,    // decode write: a layer is in place
  kPeerDone,     // decode write: every layer is in place
  kPeerFail,     // the other side failed or aborted the transfer
  kPeerUnread,   // prefill write: decode will not load (before it sent block ids)
  kPeerGone,     // the peer bound to the request died (lease, Goodbye, I/O error)
  // Transfers and time.
  kTransferOk,      // one of its transfers ended well
  kTransferFailed,  // one of its transfers failed
  kDeadline,        // request deadline, drain deadline or read lease passed
  kServed,          // prefill read: the engine served what every reader read, grants revoked
};
inline constexpr int kRequestEvents = 27;

enum class RequestAction : uint8_t {
  kNone,
  kQueueLoad,         // decode: the load goes into the next connector metadata
  kQueueSave,         // prefill write: the save goes into the next connector metadata
  kConnect,           // decode: resolve and handshake the prefill(s) (outside the lock)
  kSendWriteReq,      // decode write: "write_req" with the block ids
  kSendReadStart,     // decode read: "read_start" to every source
  kSubmitReads,       // decode read: one READ transfer per layer and source
  kMarkLayer,         // decode: a layer is in place (WaitForLayerLoad)
  kSendLayers,        // prefill write: plan, then WRITE every final layer not yet sent
  kTellLayer,         // prefill write: "layer" for a layer whose transfers ended
  kSendDone,          // prefill write: "done"
  kGrant,             // prefill read: Engine::Grant to the reader, "read_ok"
  kRevoke,            // prefill read: revoke each reader's grant once the engine served what
                      // it read (Engine::RevokeWhenServed, outside the lock): an event, no wait
  kSendRelease,       // decode read: "release" to every source (ok or failed)
  kSendFail,          // "fail" to the peer bound to the request
  kSendUnread,        // release-only decode: "release"/"fail" unread to every source
  kArmDrainDeadline,  // decode write: wait for prefill's answer until handshake_timeout
  kCountLease,        // prefill read: a lease expired (metrics)
  kPublishMemory,     // prefill read: the blocks' writes before the readers' ops
  kReportLoaded,      // decode: finished_recving
  kReportLoadFailed,  // decode: failed_loads
  kFreeBlocks,        // prefill: finished_sending (or at RequestFinished, if it comes later)
  kCloseReaders,      // prefill read: close the peers whose ops under a revoked grant are still
                      // served (their data connections go, and with them those ops)
};
inline constexpr int kRequestActions = 23;

// Which requests a row is for.
enum class Role : uint8_t { kPrefill, kDecode };
enum class ModeIs : uint8_t { kAny, kUndecided, kRead, kWrite };

enum class Guard : uint8_t {
  kAlways,
  kInFlight,    // transfers touching the blocks are still in flight (after this event)
  kIdle,        // none are
  kAllGranted,  // decode read: every source granted (after this read_ok)
  kNotAllGranted,
  kAllSent,  // prefill write: every layer sent
  kNotAllSent,
  kReadersLeft,    // prefill read: a reader is still to be heard from
  kReadersRead,    // every reader heard from, none failed, one read
  kReadersFailed,  // every reader heard from (or one said unread), one failed
  kReadersUnread,  // every reader heard from (or one said unread), none failed, none read
  kFailing,        // a failure reason is set already (e.g. aborted while connecting)
  kNotFailing,
  kPeerAlive,  // the peer bound to the request is alive
  kPeerDead,
  kReleaseOnly,    // decode: a release-only request (ReleaseUnread)
  kLoad,           // decode: a real load
  kNothingToMove,  // decode read: the plan moves no layer
  kSomethingToMove,
  kGranted,  // prefill read: a reader holds an engine grant (its READs may be served)
  kNotGranted,
  kReadersOpen,    // prefill read, releasing: the readers still served were not closed yet
  kReadersClosed,  // they were (a deadline closed them)
};

// What the caller knows about the request beyond its state (see Guard).
struct RequestFacts {
  bool in_flight = false;
  bool all_granted = false;
  bool all_sent = false;
  bool readers_left = false;
  bool reader_failed = false;
  bool reader_read = false;
  bool failing = false;
  bool peer_alive = true;
  bool release_only = false;
  bool nothing_to_move = false;
  bool granted = false;
  bool readers_closed = false;
};

struct Transition {
  Role role;
  ModeIs mode;
  RequestState from;
  RequestEvent event;
  Guard guard;
  Guard guard2;
  RequestState to;
  std::array<RequestAction, 3> actions;  // in order; kNone pads
  const char* why;
};

// The whole table, in the order rows are tried (the first whose guards hold wins).
absl::Span<const Transition> TransitionTable();

// The row that takes `event` for a request in `state`, or nullptr.
const Transition* FindTransition(Role role, KvMode mode, RequestState state, RequestEvent event,
                                 const RequestFacts& facts);
bool GuardHolds(Guard g, const RequestFacts& f);

// One request's machine. Step moves it along a row, or refuses the event and stays.
class RequestMachine {
 public:
  RequestMachine() = default;
  RequestMachine(Role role, KvMode mode) : role_(role), mode_(mode) {}

  Role role() const { return role_; }
  KvMode mode() const { return mode_; }
  RequestState state() const { return state_; }
  bool ended() const { return state_ >= RequestState::kCompleted; }

  // FailedPrecondition naming role, mode, state and event when no row takes it; the machine
  // is unchanged then. On success the row (its actions, in order, are the caller's to run).
  absl::StatusOr<const Transition*> Step(RequestEvent event, const RequestFacts& facts = {});

 private:
  Role role_ = Role::kDecode;
  KvMode mode_ = KvMode::kAuto;  // kAuto: undecided (decode before its handshake)
  RequestState state_ = RequestState::kNew;
};

const char* RequestStateName(RequestState s);
const char* RequestEventName(RequestEvent e);
const char* RequestActionName(RequestAction a);
const char* GuardName(Guard g);
const char* RoleName(Role r);
const char* ModeIsName(ModeIs m);

// The table as Markdown (docs/ARCHITECTURE.md carries it verbatim).
std::string TransitionTableMarkdown();

}  // namespace connector_internal
}  // namespace kvwire

#endif  // KVWIRE_CONNECTOR_REQUEST_MACHINE_H_
