// The connector's request transition table without an engine: every row is reachable and
// does what it says, whole lives per role and mode run through it, events no row takes are
// refused with a status that names them and change nothing, every waiting state has a deadline,
// and docs/ARCHITECTURE.md carries the same table.
#include "src/connector/request_machine.h"

#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

namespace kvwire::connector_internal {
namespace {

using S = RequestState;
using E = RequestEvent;
using A = RequestAction;

KvMode ModeOf(ModeIs m) {
  return m == ModeIs::kRead ? KvMode::kRead : m == ModeIs::kWrite ? KvMode::kWrite : KvMode::kAuto;
}

// Facts under which `g` holds, starting from `f`.
void Satisfy(Guard g, RequestFacts& f) {
  switch (g) {
    case Guard::kAlways:
      break;
    case Guard::kInFlight:
      f.in_flight = true;
      break;
    case Guard::kIdle:
      f.in_flight = false;
      break;
    case Guard::kAllGranted:
      f.all_granted = true;
      break;
    case Guard::kNotAllGranted:
      f.all_granted = false;
      break;
    case Guard::kAllSent:
      f.all_sent = true;
      break;
    case Guard::kNotAllSent:
      f.all_sent = false;
      break;
    case Guard::kReadersLeft:
      f.readers_left = true;
      break;
    case Guard::kReadersRead:
      f.readers_left = false;
      f.reader_failed = false;
      f.reader_read = true;
      break;
    case Guard::kReadersFailed:
      f.readers_left = false;
      f.reader_failed = true;
      break;
    case Guard::kReadersUnread:
      f.readers_left = false;
      f.reader_failed = false;
      f.reader_read = false;
      break;
    case Guard::kFailing:
      f.failing = true;
      break;
    case Guard::kNotFailing:
      f.failing = false;
      break;
    case Guard::kPeerAlive:
      f.peer_alive = true;
      break;
    case Guard::kPeerDead:
      f.peer_alive = false;
      break;
    case Guard::kReleaseOnly:
      f.release_only = true;
      break;
    case Guard::kLoad:
      f.release_only = false;
      break;
    case Guard::kNothingToMove:
      f.nothing_to_move = true;
      break;
    case Guard::kSomethingToMove:
      f.nothing_to_move = false;
      break;
    case Guard::kGranted:
      f.granted = true;
      break;
    case Guard::kNotGranted:
      f.granted = false;
      break;
    case Guard::kReadersOpen:
      f.readers_closed = false;
      break;
    case Guard::kReadersClosed:
      f.readers_closed = true;
      break;
  }
}

RequestFacts FactsFor(const Transition& t) {
  RequestFacts f;
  Satisfy(t.guard, f);
  Satisfy(t.guard2, f);
  return f;
}

// A machine of `role` in `mode` and `state`, reached through the table from kNew by the
// shortest path (so every state a row starts from must be reachable).
struct Key {
  Role role;
  KvMode mode;
  S state;
  bool operator<(const Key& o) const {
    return std::tie(role, mode, state) < std::tie(o.role, o.mode, o.state);
  }
};

// Every (role, mode, state) reachable from kNew, trying each row's own facts.
std::set<Key> Reachable() {
  std::set<Key> seen = {{Role::kDecode, KvMode::kAuto, S::kNew},
                        {Role::kPrefill, KvMode::kWrite, S::kNew},
                        {Role::kPrefill, KvMode::kRead, S::kNew}};
  bool grew = true;
  while (grew) {
    grew = false;
    for (const Key& k : std::set<Key>(seen)) {
      for (const Transition& t : TransitionTable()) {
        const Transition* row = FindTransition(k.role, k.mode, k.state, t.event, FactsFor(t));
        if (row != &t) continue;
        KvMode mode = k.mode;
        if (t.event == E::kConnectedRead) mode = KvMode::kRead;
        if (t.event == E::kConnectedWrite) mode = KvMode::kWrite;
        grew |= seen.insert({k.role, mode, t.to}).second;
      }
    }
  }
  return seen;
}

TEST(RequestMachineTest, EveryRowIsTakenUnderItsOwnGuardsAndEndsInItsState) {
  int rows = 0;
  for (const Transition& t : TransitionTable()) {
    SCOPED_TRACE(::testing::Message()
                 << "row " << rows << ": " << RoleName(t.role) << " " << ModeIsName(t.mode) << " "
                 << RequestStateName(t.from) << " + " << RequestEventName(t.event));
    const RequestFacts f = FactsFor(t);
    EXPECT_EQ(FindTransition(t.role, ModeOf(t.mode), t.from, t.event, f), &t)
        << "an earlier row shadows this one";
    ++rows;
  }
  EXPECT_GT(rows, 100);
}

TEST(RequestMachineTest, EveryRowStartsFromAReachableState) {
  const std::set<Key> reachable = Reachable();
  for (const Transition& t : TransitionTable()) {
    EXPECT_TRUE(reachable.count({t.role, ModeOf(t.mode), t.from}))
        << RoleName(t.role) << " " << ModeIsName(t.mode) << " " << RequestStateName(t.from)
        << " is never reached";
  }
}

TEST(RequestMachineTest, EveryWaitingStateHasADeadline) {
  // A request that waits (on its peer, its scheduler or its transfers) always has a row for
  // its deadline, with transfers in flight and without (a wait without one would hold blocks
  // forever).
  for (const Key& k : Reachable()) {
    if (k.state == S::kNew || k.state >= S::kCompleted) continue;
    // Only a decode read load and a prefill write save have transfers of their own; one
    // draining with none left has ended already.
    const bool moves = (k.role == Role::kDecode && k.mode == KvMode::kRead) ||
                       (k.role == Role::kPrefill && k.mode == KvMode::kWrite);
    const bool moving =
        moves && (k.state == S::kLoading || k.state == S::kSaving || k.state == S::kDraining);
    for (bool in_flight : {false, true}) {
      if (in_flight && !moving) continue;
      if (!in_flight && moving && k.state == S::kDraining) continue;
      RequestFacts f;
      f.in_flight = in_flight;
      EXPECT_NE(FindTransition(k.role, k.mode, k.state, E::kDeadline, f), nullptr)
          << RoleName(k.role) << " " << static_cast<int>(k.mode) << " " << RequestStateName(k.state)
          << " in_flight=" << in_flight;
    }
  }
}

TEST(RequestMachineTest, EndsTakeNoEvent) {
  for (S end : {S::kCompleted, S::kFailed, S::kReleased, S::kWithdrawn}) {
    for (int e = 0; e < kRequestEvents; ++e) {
      for (Role role : {Role::kDecode, Role::kPrefill}) {
        for (KvMode mode : {KvMode::kAuto, KvMode::kRead, KvMode::kWrite}) {
          EXPECT_EQ(FindTransition(role, mode, end, static_cast<E>(e), {}), nullptr);
        }
      }
    }
  }
}

// Runs `events` through a machine and returns the actions, in order.
std::vector<A> Drive(RequestMachine& m, const std::vector<std::pair<E, RequestFacts>>& events) {
  std::vector<A> out;
  for (const auto& [e, f] : events) {
    absl::StatusOr<const Transition*> t = m.Step(e, f);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) break;
    for (A a : (*t)->actions) {
      if (a != A::kNone) out.push_back(a);
    }
  }
  return out;
}

RequestFacts InFlight() {
  RequestFacts f;
  f.in_flight = true;
  return f;
}

TEST(RequestMachineTest, DecodeReadLife) {
  RequestMachine m(Role::kDecode, KvMode::kAuto);
  RequestFacts granted;
  granted.all_granted = true;
  const std::vector<A> actions = Drive(m, {{E::kMatch, {}},
                                           {E::kAlloc, {}},
                                           {E::kStartLoad, {}},
                                           {E::kConnectedRead, {}},
                                           {E::kReadOk, {}},
                                           {E::kReadOk, granted},
                                           {E::kTransferOk, InFlight()},
                                           {E::kTransferOk, {}}});
  EXPECT_EQ(m.state(), S::kCompleted);
  EXPECT_EQ(m.mode(), KvMode::kRead);
  EXPECT_EQ(actions,
            (std::vector<A>{A::kQueueLoad, A::kConnect, A::kSendReadStart, A::kSubmitReads,
                            A::kMarkLayer, A::kMarkLayer, A::kSendRelease, A::kReportLoaded}));
}

TEST(RequestMachineTest, DecodeWriteLife) {
  RequestMachine m(Role::kDecode, KvMode::kAuto);
  const std::vector<A> actions = Drive(m, {{E::kBindMeta, {}},
                                           {E::kStartLoad, {}},
                                           {E::kConnectedWrite, {}},
                                           {E::kPeerLayer, {}},
                                           {E::kPeerDone, {}}});
  EXPECT_EQ(m.state(), S::kCompleted);
  EXPECT_EQ(m.mode(), KvMode::kWrite);
  EXPECT_EQ(actions,
            (std::vector<A>{A::kConnect, A::kSendWriteReq, A::kMarkLayer, A::kReportLoaded}));
}

TEST(RequestMachineTest, DecodeWriteAbortAsksPrefillToStopThenFails) {
  RequestMachine m(Role::kDecode, KvMode::kAuto);
  const std::vector<A> actions = Drive(m, {{E::kMatch, {}},
                                           {E::kAlloc, {}},
                                           {E::kStartLoad, {}},
                                           {E::kConnectedWrite, {}},
                                           {E::kAbort, {}},
                                           {E::kAbort, {}},
                                           {E::kPeerFail, {}}});
  EXPECT_EQ(m.state(), S::kFailed);
  EXPECT_EQ(actions, (std::vector<A>{A::kQueueLoad, A::kConnect, A::kSendWriteReq, A::kSendFail,
                                     A::kArmDrainDeadline, A::kReportLoadFailed}));
}

TEST(RequestMachineTest, DecodeReadFailureDrainsItsReadsFirst) {
  RequestMachine m(Role::kDecode, KvMode::kAuto);
  RequestFacts granted;
  granted.all_granted = true;
  const std::vector<A> actions = Drive(m, {{E::kBindMeta, {}},
                                           {E::kStartLoad, {}},
                                           {E::kConnectedRead, {}},
                                           {E::kReadOk, granted},
                                           {E::kTransferFailed, InFlight()},
                                           {E::kReadOk, {}},
                                           {E::kTransferOk, {}}});
  EXPECT_EQ(m.state(), S::kFailed);
  EXPECT_EQ(actions, (std::vector<A>{A::kConnect, A::kSendReadStart, A::kSubmitReads,
                                     A::kSendRelease, A::kReportLoadFailed}));
}

TEST(RequestMachineTest, AbortWhileConnectingFailsWhenTheConnectionEnds) {
  RequestMachine m(Role::kDecode, KvMode::kAuto);
  RequestFacts failing;
  failing.failing = true;
  const std::vector<A> actions = Drive(
      m, {{E::kBindMeta, {}}, {E::kStartLoad, {}}, {E::kAbort, {}}, {E::kConnectedRead, failing}});
  EXPECT_EQ(m.state(), S::kFailed);
  EXPECT_EQ(actions, (std::vector<A>{A::kConnect, A::kReportLoadFailed}));
}

TEST(RequestMachineTest, ReleaseOnlyTellsThePrefillAndIsNeverStarted) {
  RequestMachine m(Role::kDecode, KvMode::kAuto);
  RequestFacts only;
  only.release_only = true;
  const std::vector<A> actions =
      Drive(m, {{E::kReleaseOnly, only}, {E::kStartLoad, only}, {E::kConnectFailed, only}});
  EXPECT_EQ(m.state(), S::kWithdrawn);
  EXPECT_EQ(actions, (std::vector<A>{A::kConnect, A::kSendUnread}));
}

TEST(RequestMachineTest, PrefillWriteLife) {
  RequestMachine m(Role::kPrefill, KvMode::kWrite);
  RequestFacts all_sent;
  all_sent.all_sent = true;
  const std::vector<A> actions = Drive(m, {{E::kMatch, {}},
                                           {E::kWriteReq, {}},
                                           {E::kAlloc, {}},
                                           {E::kLayerSaved, {}},
                                           {E::kTransferOk, {}},
                                           {E::kSchedulerFinished, {}},
                                           {E::kLayerSaved, {}},
                                           {E::kTransferOk, all_sent}});
  EXPECT_EQ(m.state(), S::kCompleted);
  EXPECT_EQ(actions, (std::vector<A>{A::kQueueSave, A::kSendLayers, A::kSendLayers, A::kTellLayer,
                                     A::kSendLayers, A::kTellLayer, A::kSendDone, A::kFreeBlocks}));
}

TEST(RequestMachineTest, PrefillWriteDecodeSaysUnread) {
  RequestMachine m(Role::kPrefill, KvMode::kWrite);
  EXPECT_EQ(Drive(m, {{E::kMatch, {}}, {E::kAlloc, {}}, {E::kPeerUnread, {}}}),
            (std::vector<A>{A::kQueueSave, A::kSendLayers, A::kFreeBlocks}));
  EXPECT_EQ(m.state(), S::kReleased);
}

TEST(RequestMachineTest, PrefillReadLifeWithTwoReaders) {
  RequestMachine m(Role::kPrefill, KvMode::kRead);
  RequestFacts one_left;
  one_left.readers_left = true;
  one_left.granted = true;
  RequestFacts all_read;
  all_read.reader_read = true;
  all_read.granted = true;
  RequestFacts served;
  served.reader_read = true;
  const std::vector<A> actions = Drive(m, {{E::kHandOff, {}},
                                           {E::kReadStart, {}},
                                           {E::kReadStart, {}},
                                           {E::kAbort, {}},
                                           {E::kRelease, one_left},
                                           {E::kRelease, all_read}});
  // Every reader is done, but their grants are revoked only once the engine served what they
  // read: the blocks wait in kReleasing for that event.
  EXPECT_EQ(m.state(), S::kReleasing);
  EXPECT_EQ(actions, (std::vector<A>{A::kPublishMemory, A::kGrant, A::kGrant, A::kRevoke}));
  EXPECT_EQ(Drive(m, {{E::kServed, served}}), (std::vector<A>{A::kFreeBlocks}));
  EXPECT_EQ(m.state(), S::kCompleted);
}

TEST(RequestMachineTest, PrefillReadWithoutGrantsFreesAtOnce) {
  // No reader holds a grant (none asked, or each said unread first): nothing can be served.
  RequestMachine m(Role::kPrefill, KvMode::kRead);
  RequestFacts all_read;
  all_read.reader_read = true;
  EXPECT_EQ(Drive(m, {{E::kHandOff, {}}, {E::kRelease, all_read}}),
            (std::vector<A>{A::kPublishMemory, A::kFreeBlocks}));
  EXPECT_EQ(m.state(), S::kCompleted);
}

TEST(RequestMachineTest, PrefillReleasingWaitsForTheServedEventAlone) {
  RequestFacts granted_read;
  granted_read.reader_read = true;
  granted_read.granted = true;
  RequestFacts read;
  read.reader_read = true;
  // Late words of the readers, an abort and the scheduler's end change nothing: the blocks
  // go when the engine served what was read.
  RequestMachine m(Role::kPrefill, KvMode::kRead);
  Drive(m, {{E::kHandOff, {}}, {E::kReadStart, {}}, {E::kRelease, granted_read}});
  ASSERT_EQ(m.state(), S::kReleasing);
  EXPECT_TRUE(
      Drive(m,
            {{E::kRelease, read}, {E::kPeerFail, {}}, {E::kAbort, {}}, {E::kSchedulerFinished, {}}})
          .empty());
  EXPECT_EQ(m.state(), S::kReleasing);
  EXPECT_FALSE(m.Step(E::kTransferOk).ok());
  EXPECT_FALSE(m.Step(E::kReadStart).ok());
  EXPECT_EQ(m.state(), S::kReleasing);
  // A count never reached (a lying reader, an op stalled in the socket): the request's own
  // deadline revokes the grants without waiting for the counts; the blocks go only once the
  // engine says nothing under them is served (a reader still holding its grant must not READ
  // blocks handed on)...
  {
    RequestMachine w = m;
    EXPECT_EQ(Drive(w, {{E::kDeadline, granted_read}}), (std::vector<A>{A::kRevoke}));
    EXPECT_EQ(w.state(), S::kReleasing);
    RequestFacts failing;
    failing.failing = true;
    EXPECT_EQ(Drive(w, {{E::kServed, failing}}), (std::vector<A>{A::kFreeBlocks}));
    EXPECT_EQ(w.state(), S::kFailed);
  }
  // ... revoked and still served a second deadline later (a reader that stopped draining
  // its data connection): the readers still served are closed, and the blocks go once their
  // ops ended with the connections...
  EXPECT_EQ(Drive(m, {{E::kDeadline, granted_read}}), (std::vector<A>{A::kRevoke}));
  EXPECT_EQ(Drive(m, {{E::kDeadline, {}}}), (std::vector<A>{A::kCloseReaders}));
  EXPECT_EQ(m.state(), S::kReleasing);
  {
    RequestMachine c = m;
    RequestFacts failing;
    failing.failing = true;
    EXPECT_EQ(Drive(c, {{E::kServed, failing}}), (std::vector<A>{A::kFreeBlocks}));
    EXPECT_EQ(c.state(), S::kFailed);
  }
  // ... or, closed and still served a third deadline later, anyway, loudly.
  RequestFacts closed;
  closed.readers_closed = true;
  EXPECT_EQ(Drive(m, {{E::kDeadline, closed}}), (std::vector<A>{A::kFreeBlocks}));
  EXPECT_EQ(m.state(), S::kFailed);
  {
    // Unread: released, not completed, once served.
    RequestMachine u(Role::kPrefill, KvMode::kRead);
    RequestFacts unread;
    unread.granted = true;
    Drive(u, {{E::kHandOff, {}}, {E::kReadStart, {}}, {E::kRelease, unread}});
    ASSERT_EQ(u.state(), S::kReleasing);
    Drive(u, {{E::kServed, {}}});
    EXPECT_EQ(u.state(), S::kReleased);
  }
  {
    // Failing (a reader failed, died, or the lease ran out): failed once served.
    RequestMachine f(Role::kPrefill, KvMode::kRead);
    RequestFacts failed;
    failed.reader_failed = true;
    failed.granted = true;
    Drive(f, {{E::kHandOff, {}}, {E::kReadStart, {}}, {E::kRelease, failed}});
    ASSERT_EQ(f.state(), S::kReleasing);
    RequestFacts failing;
    failing.failing = true;
    failing.reader_read = true;
    Drive(f, {{E::kServed, failing}});
    EXPECT_EQ(f.state(), S::kFailed);
  }
}

TEST(RequestMachineTest, PrefillReadLeaseAndFailedReader) {
  {
    RequestMachine m(Role::kPrefill, KvMode::kRead);
    EXPECT_EQ(Drive(m, {{E::kHandOff, {}}, {E::kDeadline, {}}}),
              (std::vector<A>{A::kPublishMemory, A::kCountLease, A::kFreeBlocks}));
    EXPECT_EQ(m.state(), S::kFailed);
  }
  {
    // A reader holds a grant when the lease ends: its ops drain before the blocks go.
    RequestMachine m(Role::kPrefill, KvMode::kRead);
    RequestFacts granted;
    granted.granted = true;
    EXPECT_EQ(Drive(m, {{E::kHandOff, {}}, {E::kReadStart, {}}, {E::kDeadline, granted}}),
              (std::vector<A>{A::kPublishMemory, A::kGrant, A::kCountLease, A::kRevoke}));
    EXPECT_EQ(m.state(), S::kReleasing);
    RequestFacts failing;
    failing.failing = true;
    failing.readers_left = true;
    EXPECT_EQ(Drive(m, {{E::kServed, failing}}), (std::vector<A>{A::kFreeBlocks}));
    EXPECT_EQ(m.state(), S::kFailed);
  }
  {
    // The engine refused a grant while another reader holds one.
    RequestMachine m(Role::kPrefill, KvMode::kRead);
    RequestFacts granted;
    granted.granted = true;
    EXPECT_EQ(Drive(m, {{E::kHandOff, {}}, {E::kReadStart, {}}, {E::kGrantFailed, granted}}),
              (std::vector<A>{A::kPublishMemory, A::kGrant, A::kSendFail, A::kRevoke}));
    EXPECT_EQ(m.state(), S::kReleasing);
    RequestMachine n(Role::kPrefill, KvMode::kRead);
    EXPECT_EQ(Drive(n, {{E::kHandOff, {}}, {E::kReadStart, {}}, {E::kGrantFailed, {}}}),
              (std::vector<A>{A::kPublishMemory, A::kGrant, A::kSendFail, A::kFreeBlocks}));
    EXPECT_EQ(n.state(), S::kFailed);
  }
  {
    RequestMachine m(Role::kPrefill, KvMode::kRead);
    RequestFacts failed;
    failed.reader_failed = true;
    failed.reader_read = true;  // another reader read: one failure still fails the hand-off
    Drive(m, {{E::kHandOff, {}}, {E::kReadStart, {}}, {E::kRelease, failed}});
    EXPECT_EQ(m.state(), S::kFailed);
  }
  {
    RequestMachine m(Role::kPrefill, KvMode::kRead);
    Drive(m, {{E::kHandOff, {}}, {E::kRelease, {}}});
    EXPECT_EQ(m.state(), S::kReleased);
  }
}

// Events no row takes: refused with a status naming them; the machine stays where it was
// (state and mode), and takes the right event afterwards.
TEST(RequestMachineTest, IllegalEventsAreRefusedAndChangeNothing) {
  struct Case {
    Role role;
    KvMode mode;
    std::vector<E> before;
    E illegal;
    const char* name;
  };
  const std::vector<Case> cases = {
      {Role::kPrefill, KvMode::kRead, {E::kHandOff}, E::kPeerDone, "peer_done"},
      {Role::kPrefill, KvMode::kRead, {E::kHandOff}, E::kWriteReq, "write_req"},
      {Role::kPrefill, KvMode::kRead, {E::kHandOff}, E::kTransferOk, "transfer_ok"},
      {Role::kPrefill, KvMode::kWrite, {E::kMatch, E::kAlloc}, E::kReadStart, "read_start"},
      {Role::kPrefill, KvMode::kWrite, {E::kMatch, E::kAlloc}, E::kAlloc, "alloc"},
      {Role::kPrefill, KvMode::kWrite, {E::kMatch}, E::kRelease, "release"},
      {Role::kDecode, KvMode::kAuto, {E::kMatch, E::kAlloc}, E::kAlloc, "alloc"},
      {Role::kDecode, KvMode::kAuto, {E::kMatch}, E::kPeerDone, "peer_done"},
      {Role::kDecode, KvMode::kAuto, {E::kMatch}, E::kStartLoad, "start_load"},
      {Role::kDecode,
       KvMode::kAuto,
       {E::kBindMeta, E::kStartLoad, E::kConnectedRead},
       E::kPeerDone,
       "peer_done"},
      {Role::kDecode,
       KvMode::kAuto,
       {E::kBindMeta, E::kStartLoad, E::kConnectedRead},
       E::kPeerLayer,
       "peer_layer"},
      {Role::kDecode,
       KvMode::kAuto,
       {E::kBindMeta, E::kStartLoad, E::kConnectedWrite},
       E::kReadOk,
       "read_ok"},
      {Role::kDecode,
       KvMode::kAuto,
       {E::kBindMeta, E::kStartLoad, E::kConnectedWrite},
       E::kConnectedRead,
       "connected_read"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RequestMachine m(c.role, c.mode);
    for (E e : c.before) ASSERT_TRUE(m.Step(e).ok()) << RequestEventName(e);
    const S state = m.state();
    const KvMode mode = m.mode();
    absl::StatusOr<const Transition*> t = m.Step(c.illegal);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
    const std::string msg(t.status().message());
    EXPECT_NE(msg.find(c.name), std::string::npos) << msg;
    EXPECT_NE(msg.find(RequestStateName(state)), std::string::npos) << msg;
    EXPECT_NE(msg.find(RoleName(c.role)), std::string::npos) << msg;
    EXPECT_EQ(m.state(), state);
    EXPECT_EQ(m.mode(), mode);
    // Nothing lost: the machine still takes its next legal event.
    EXPECT_TRUE(m.Step(E::kDeadline).ok() || m.Step(E::kAbort).ok());
  }
}

TEST(RequestMachineTest, NamesCoverEveryEnumerator) {
  for (int i = 0; i < kRequestStates; ++i) {
    EXPECT_STRNE(RequestStateName(static_cast<S>(i)), "?");
  }
  for (int i = 0; i < kRequestEvents; ++i) {
    EXPECT_STRNE(RequestEventName(static_cast<E>(i)), "?");
  }
  for (int i = 1; i < kRequestActions; ++i) {
    EXPECT_STRNE(RequestActionName(static_cast<A>(i)), "?");
  }
  EXPECT_STREQ(RequestEventName(E::kDeadline), "deadline");
  EXPECT_STREQ(RequestActionName(A::kFreeBlocks), "free_blocks");
  EXPECT_STREQ(GuardName(Guard::kSomethingToMove), "something_to_move");
  EXPECT_STREQ(GuardName(Guard::kNotGranted), "not_granted");
  EXPECT_STREQ(RequestStateName(S::kReleasing), "releasing");
  EXPECT_STREQ(RequestEventName(E::kServed), "served");
}

// docs/ARCHITECTURE.md draws this very table, between its request-machine markers.
TEST(RequestMachineTest, ArchitectureDocCarriesTheTable) {
  std::ifstream in(std::string(KVWIRE_SOURCE_DIR) + "/docs/ARCHITECTURE.md");
  ASSERT_TRUE(in.good());
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string doc = buf.str();
  const std::string begin = "<!-- request-machine:begin -->\n";
  const std::string end = "<!-- request-machine:end -->";
  const size_t b = doc.find(begin);
  const size_t e = doc.find(end);
  ASSERT_NE(b, std::string::npos);
  ASSERT_NE(e, std::string::npos);
  EXPECT_EQ(doc.substr(b + begin.size(), e - b - begin.size()), TransitionTableMarkdown())
      << "regenerate: the table is TransitionTableMarkdown() (request_machine_test prints it "
         "with --gtest_also_run_disabled_tests --gtest_filter=*PrintTable*)";
}

TEST(RequestMachineTest, DISABLED_PrintTable) { std::cout << TransitionTableMarkdown(); }

}  // namespace
}  // namespace kvwire::connector_internal
