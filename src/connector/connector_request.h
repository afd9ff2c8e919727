// The connector's request and peer records (Connector::Impl's request table and peer sessions
// hold them; every field is guarded by Connector::Impl::mu_).
#ifndef KVWIRE_CONNECTOR_CONNECTOR_REQUEST_H_
#define KVWIRE_CONNECTOR_CONNECTOR_REQUEST_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"

#include "kvwire/connector.h"
#include "kvwire/engine.h"
#include "kvwire/layout.h"
#include "src/connector/connector_metrics.h"
#include "src/connector/peer_message.h"
#include "src/connector/request_machine.h"

namespace kvwire {
namespace connector_internal {

struct Request {
  std::string id;
  bool decode = false;  // role of this side for the request
  RequestState state = RequestState::kMatched;
  // The request's row in the transition table (request_machine.h), stepped by every handler
  // that takes an event of it (Connector::Impl::StepLocked). `state` is what the handlers
  // branch on; where the two part, the request ends other than its machine did, which is
  // counted (machine_diverged) and logged at its end.
  RequestMachine machine;
  KvTransferParams params;
  KvMode mode = KvMode::kAuto;
  BlockTable blocks;
  uint64_t num_tokens = 0;
  uint64_t num_cached = 0;  // decode: tokens already present locally
  absl::Time deadline = absl::InfiniteFuture();
  absl::Time t_queued = absl::InfinitePast(), t_first = absl::InfinitePast(),
             t_last = absl::InfinitePast();
  std::optional<PeerId> peer;
  // Decode read mode: further prefill ranks read from (peer, their transfer id).
  std::vector<std::pair<PeerId, std::string>> tp_sources;
  // In flight, touching the blocks: each transfer's ticket and the layer it moves
  // (layer-wise progress), and transfers left per layer. Hash maps: an erase frees nothing, so
  // a request's transfers (one or more per layer) allocate only as the tables first grow.
  absl::flat_hash_map<TransferId, int> transfers;
  absl::flat_hash_map<int, int> layer_transfers_left;
  // Decode: layers not yet in place (WaitForLayerLoad waits on them).
  std::set<int> layers_pending;
  std::optional<TransferPlan> plan;
  // Prefill: the rows of its blocks it did not fill were zeroed (before the first grant,
  // or the first WRITE in write mode; ScrubUnfilledLocked).
  bool scrubbed = false;
  // Prefill, read mode: the engines reading the held blocks, one per decode rank: a decode
  // with tensor parallelism N reads (or releases) each prefill rank's hand-off from all N
  // of its engines, each its own slice of the heads or the whole replicated page. Each
  // reader is bound by its first read_start or release and gets an engine grant of its
  // own (read_start), revoked when the request retires. How many come is the decode's
  // tensor-parallel size, from the first reader's layout (readers_expected); the blocks go
  // back once each of them released or died, once one said that the decode will not read
  // and none is reading, or at the lease.
  struct Reader {
    PeerId peer = 0;
    int rank = 0;  // its tensor-parallel rank (its layout's)
    GrantId grant = 0;
    bool done = false;  // released, or died
    // Bytes it says it read under its grant (its release's read_bytes): the grant is revoked
    // only once the engine served them (Connector::Impl::AwaitServedLocked).
    std::optional<uint64_t> read_bytes;
    bool granting = false;  // its Engine::Grant is queued (made outside the lock): read_ok follows
  };
  std::vector<Reader> readers;
  int readers_expected = 0;    // 0: no reader yet
  bool unread = false;         // a reader said the decode will not read
  bool read = false;           // a reader released after reading
  std::string reader_failure;  // the first reader's failure (a failed release, its death)
  Reader* FindReader(PeerId p) {
    for (Reader& x : readers) {
      if (x.peer == p) return &x;
    }
    return nullptr;
  }
  // Decode, read mode: what each prefill source moves, per layer, and the grant it gave
  // (read_ok); the READs start once every source granted.
  struct ReadSource {
    PeerId peer = 0;
    std::string transfer_id;
    std::map<int, std::vector<Op>> layer_ops;
    std::optional<GrantId> grant;
  };
  std::vector<ReadSource> read_sources;
  // Decode, read mode: bytes submitted to READ from each source under its grant (told in the
  // release, read_bytes).
  std::vector<std::pair<PeerId, uint64_t>> bytes_read;
  // Prefill, read mode (kReleasing): each reader's grant waiting for the engine's word that
  // what the reader read was served (a watch ticket), and how the request ends then.
  struct Serving {
    TransferId ticket = 0;
    PeerId peer = 0;
    GrantId grant = 0;
  };
  std::vector<Serving> serving;
  struct End {
    enum Kind { kComplete, kFail, kUnread } kind = kComplete;
    PeerId reader = 0;   // kUnread: the reader that said so
    std::string reason;  // kUnread
  };
  std::optional<End> pending_end;
  // kReleasing past its deadline: the grants were revoked without waiting for the readers'
  // counts; the blocks go once the engine says no op under them is served (or at a second
  // deadline, loudly), never while a grant could still be presented.
  bool revoke_forced = false;
  // Prefill read: a second deadline found ops under the revoked grants still served and
  // closed their readers (CloseServedReadersLocked); the third frees the blocks anyway.
  bool readers_closed = false;
  // Prefill, write mode.
  bool have_remote = false;
  BlockTable remote_blocks;
  uint64_t remote_cached = 0;
  std::set<int> layers_final, layers_sent;
  bool finished_by_scheduler = false;  // RequestFinished was called
  // Decode write mode: abort sent, waiting for prefill to stop.
  bool abort_sent = false;
  // Decode: not a load, only the news that this engine will not read the prefill's blocks
  // (ReleaseUnread); StartLoad connects, tells the prefill ranks and forgets it.
  bool release_only = false;
  std::string fail_reason;       // set once a request fails
  std::string transfer_id_json;  // params.transfer_id as a json string (TellLayerDone)
  std::map<std::string, GroupCounters> groups;
  double cpu_us = 0;  // connector CPU on the request path (planning, ops), not transport
};

// Prefill write mode: a plan is made and every layer it moves was sent. Walks the plan's
// groups in place (TransferPlan::Layers builds a set): it runs at each transfer end.
inline bool AllLayersSent(const Request& r) {
  if (!r.plan) return false;
  for (const GroupPlan& g : r.plan->groups) {
    for (int layer : g.layers) {
      if (r.layers_sent.count(layer) == 0) return false;
    }
  }
  return true;
}

// Connector::Impl's pending hellos, and messages that came before their request.
struct PendingHello {
  PeerId peer = 0;
  std::string name;
  PeerMessage msg;
  absl::Time deadline;
};

struct EarlyWrite {
  PeerId peer = 0;
  BlockTable blocks;
  uint64_t num_cached = 0;
  absl::Time expires;
};
// A read_start for a transfer id not held (yet): a scheduler in another process may hand
// the id out before its worker holds the blocks (RequestFinished with a given id).
struct EarlyRead {
  PeerId peer = 0;
  std::string name;                 // the peer's
  std::pair<int, int> place{1, 0};  // ReaderPlaceLocked when it asked
  absl::Time expires;
};
struct EarlyRelease {
  PeerId peer = 0;
  std::pair<int, int> place{1, 0};  // read mode: ReaderPlaceLocked when it released
  bool ok = true;
  bool unread = false;
  std::string reason;
};

// Engine::Grant of `request`'s blocks to a reader, made outside the connector's lock
// (FlushOutbox); the result goes to Connector::Impl::OnGrantedLocked.
struct OutGrant {
  std::string request;
  std::vector<GrantRange> ranges;
};

// Engine::RevokeWhenServed of a reader's grant, made outside the connector's lock
// (FlushOutbox); its word comes back under `ticket` (0: nobody waits for it).
struct OutRevoke {
  TransferId ticket = 0;
  GrantId grant = 0;
  uint64_t bytes = 0;
};

// A peer whose inbox events wait, in arrival order, for the ops it had this engine serve, until
// the engine's word under `ticket` (Engine::WhenServedOps) or `deadline`.
struct ParkedPeer {
  std::vector<InboxEvent> events;
  // How many of `events` (the first) came before the ticket's mark: the later ones may
  // follow ops that began after it, and wait for a watch of their own.
  size_t covered = 0;
  TransferId ticket = 0;
  absl::Time deadline;
  bool served = false;
};

struct Peer {
  PeerId id = 0;
  std::string engine_id;
  std::string address;
  Layout layout;
  std::vector<RegionSpan> regions;
  KvMode prefill_mode = KvMode::kAuto, decode_mode = KvMode::kAuto;
  bool ready = false;
  std::string error;
};

}  // namespace connector_internal
}  // namespace kvwire

#endif  // KVWIRE_CONNECTOR_CONNECTOR_REQUEST_H_
