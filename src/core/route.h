// Routing: which transports the engine connects to a peer, and which one carries each transfer,
// decided only from what every transport declares (transport::Capabilities), never from its
// name. Pure functions over declarations and state, so that they are unit-tested alone
// (tests/unit/core/route_test.cc); the engine calls them from SetupChannels and Transfer.
#ifndef KVWIRE_CORE_ROUTE_H_
#define KVWIRE_CORE_ROUTE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "kvwire/engine.h"
#include "transport/transport.h"

namespace kvwire::core {

// At most this many transports per engine (routes carry one bit per transport).
inline constexpr size_t kMaxTransports = 32;
using TransportMask = uint32_t;

// The order routing tries transports in: lowest Capabilities::rank first; equal ranks keep
// their registration order.
std::vector<size_t> RankOrder(absl::Span<const transport::Capabilities* const> caps);

// Which channels to open to one peer. Auto: the best-ranked transport that reaches the peer;
// when it does not reach every region (reaches_every_region), also the best-ranked reachable
// one that does, for the regions the first cannot reach. Forced: that transport (and a grant
// fallback, below), or an error, plus, when the forced transport cannot check read grants, the best
// one that can (for grant-guarded regions only: GrantFallback). The engine asks Next(), tries to
// connect it, and reports Connected / Unusable.
class ChannelChoice {
 public:
  // `caps` in registration order; `forced` is a transport name, empty for auto.
  ChannelChoice(std::vector<const transport::Capabilities*> caps, std::string forced);

  // The next transport to try (index into caps), or nullopt when the choice is complete.
  std::optional<size_t> Next() const;
  void Connected(size_t index);
  // Not offered by the peer, CanReach refused, or Connect failed: `reason` says which.
  void Unusable(size_t index, std::string reason);

  // OK when a usable set of channels is connected; else the error names every reason
  // (FailedPrecondition for a forced transport, Unavailable for auto).
  absl::Status Result(const std::string& peer_name) const;
  // The connected transports, best first (the first is the primary route).
  std::vector<size_t> connected() const;
  // Forced to a transport whose target cannot check read grants (Capabilities::checks_grants):
  // the best-ranked one that can, connected too but routed only for grant-guarded regions
  // (TransferNeeds::guarded_only); nullopt otherwise.
  std::optional<size_t> GrantFallback() const;
  // Why the primary was chosen, for logs and Peers()/Stats(): "forced by configuration", or
  // "same host" (a same_host_only transport) / "<name> ranks first of the usable transports",
  // then every better-ranked one's reason for not being usable.
  std::string Reason() const;
  // "<primary's Describe()>" plus, with a fallback, "; <its Describe()> for regions <primary>
  // cannot reach". `describe` is indexed like caps.
  std::string Describe(const std::vector<std::string>& describe) const;

 private:
  enum class State { kUntried, kConnected, kUnusable };
  std::vector<const transport::Capabilities*> caps_;
  std::vector<size_t> order_;
  std::optional<size_t> forced_;  // index; set when the name matched a transport
  std::string forced_name_;
  std::vector<State> state_;
  std::vector<std::string> reason_;
};

// What one transfer asks of its transport.
struct TransferNeeds {
  OpKind kind = OpKind::kWrite;
  bool local_host = false;  // some op's local memory is a host region
  bool local_gpu = false;   // some op's local memory is a GPU region
  // Bit i: transport i's channel accepted every remote region of the transfer
  // (AddRemoteRegions); transports with reaches_every_region need no bit.
  TransportMask reaches = 0;
  // A READ of a region the peer guards with grants: only checks_grants transports carry it.
  bool grant_reads = false;
  // Some remote region of the transfer is grant-guarded (RemoteRegionDesc::reads_need_grant),
  // and the channels connected only for such regions (ChannelChoice::GrantFallback).
  bool guarded = false;
  TransportMask guarded_only = 0;
};

// The transport that carries one transfer to one peer: the best-ranked connected one
// (bit i of `connected`) that reaches every remote region, carries the op kind, and moves
// every kind of local memory involved. FailedPrecondition naming each connected transport's
// reason when none does.
inline bool SameNeeds(const TransferNeeds& a, const TransferNeeds& b) {
  return a.kind == b.kind && a.local_host == b.local_host && a.local_gpu == b.local_gpu &&
         a.reaches == b.reaches && a.grant_reads == b.grant_reads && a.guarded == b.guarded &&
         a.guarded_only == b.guarded_only;
}

// A peer's last successful PickTransport (with the same caps and rank order, the same needs
// and connected channels pick the same transport).
struct RouteMemo {
  bool valid = false;
  TransferNeeds needs;
  TransportMask connected = 0;
  size_t route = 0;
};

absl::StatusOr<size_t> PickTransport(absl::Span<const transport::Capabilities* const> caps,
                                     TransportMask connected, const TransferNeeds& needs,
                                     const std::string& peer_name);
// The same with `rank_order` = RankOrder(caps) computed once (the engine's per-transfer path:
// no allocation, no sort).
absl::StatusOr<size_t> PickTransport(absl::Span<const transport::Capabilities* const> caps,
                                     absl::Span<const size_t> rank_order, TransportMask connected,
                                     const TransferNeeds& needs, const std::string& peer_name);

}  // namespace kvwire::core

#endif  // KVWIRE_CORE_ROUTE_H_
