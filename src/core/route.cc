#include "src/core/route.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace kvwire::core {

std::vector<size_t> RankOrder(absl::Span<const transport::Capabilities* const> caps) {
  std::vector<size_t> order(caps.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return caps[a]->rank < caps[b]->rank; });
  return order;
}

ChannelChoice::ChannelChoice(std::vector<const transport::Capabilities*> caps, std::string forced)
    : caps_(std::move(caps)),
      order_(RankOrder(caps_)),
      forced_name_(std::move(forced)),
      state_(caps_.size(), State::kUntried),
      reason_(caps_.size()) {
  for (size_t i = 0; i < caps_.size() && !forced_name_.empty(); ++i) {
    if (caps_[i]->name == forced_name_) forced_ = i;
  }
}

std::optional<size_t> ChannelChoice::Next() const {
  if (!forced_name_.empty()) {
    if (forced_ && state_[*forced_] == State::kUntried) return forced_;
    if (!forced_ || state_[*forced_] != State::kConnected ||
        (caps_[*forced_]->checks_grants && caps_[*forced_]->reaches_every_region)) {
      return std::nullopt;
    }
    // The forced transport's target cannot check read grants, or may refuse a grant-guarded
    // region (shm: GPU memory, checksums): also the best-ranked other one that checks them for
    // every region, used only for grant-guarded regions (GrantFallback).
    const auto fallback = [&](size_t i) {
      return i != *forced_ && caps_[i]->checks_grants && caps_[i]->reaches_every_region;
    };
    for (size_t i : order_) {
      if (fallback(i) && state_[i] == State::kConnected) return std::nullopt;
    }
    for (size_t i : order_) {
      if (fallback(i) && state_[i] == State::kUntried) return i;
    }
    return std::nullopt;
  }
  bool partial_connected = false;
  for (size_t i : order_) {
    if (state_[i] != State::kConnected) continue;
    // A transport that reaches every region completes the set.
    if (caps_[i]->reaches_every_region) return std::nullopt;
    partial_connected = true;
  }
  for (size_t i : order_) {
    if (state_[i] != State::kUntried) continue;
    // One transport that reaches only some regions is enough; more would cost registrations
    // (rdma keys per peer) and never be chosen over the first.
    if (partial_connected && !caps_[i]->reaches_every_region) continue;
    return i;
  }
  return std::nullopt;
}

void ChannelChoice::Connected(size_t index) { state_[index] = State::kConnected; }

void ChannelChoice::Unusable(size_t index, std::string reason) {
  state_[index] = State::kUnusable;
  reason_[index] = std::move(reason);
}

std::optional<size_t> ChannelChoice::GrantFallback() const {
  if (!forced_ || state_[*forced_] != State::kConnected) return std::nullopt;
  for (size_t i : order_) {
    if (i != *forced_ && state_[i] == State::kConnected) return i;
  }
  return std::nullopt;
}

std::vector<size_t> ChannelChoice::connected() const {
  std::vector<size_t> out;
  for (size_t i : order_) {
    if (state_[i] == State::kConnected) out.push_back(i);
  }
  return out;
}

absl::Status ChannelChoice::Result(const std::string& peer_name) const {
  if (!forced_name_.empty()) {
    if (forced_ && state_[*forced_] == State::kConnected) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("transport ", forced_name_, " required but peer ", peer_name,
                     " is not reachable over ", forced_name_, ": ",
                     forced_ ? reason_[*forced_]
                             : absl::StrCat("this engine has no ", forced_name_, " transport")));
  }
  if (!connected().empty()) return absl::OkStatus();
  std::string reasons;
  for (size_t i : order_) {
    absl::StrAppend(&reasons, reasons.empty() ? "" : "; ", caps_[i]->name, ": ",
                    state_[i] == State::kUntried ? "not tried" : reason_[i]);
  }
  return absl::UnavailableError(
      absl::StrCat("no transport reaches peer ", peer_name, ": ", reasons));
}

std::string ChannelChoice::Reason() const {
  if (!forced_name_.empty()) return "forced by configuration";
  const std::vector<size_t> chosen = connected();
  if (chosen.empty()) return std::string();
  // A same-host-only transport that reaches the peer says the most with "same host".
  const transport::Capabilities& primary = *caps_[chosen[0]];
  std::string reason = primary.same_host_only
                           ? std::string("same host")
                           : absl::StrCat(primary.name, " ranks first of the usable transports");
  for (size_t i : order_) {
    if (i == chosen[0]) break;
    if (state_[i] == State::kUnusable) {
      absl::StrAppend(&reason, "; ", caps_[i]->name, " not usable: ", reason_[i]);
    }
  }
  return reason;
}

std::string ChannelChoice::Describe(const std::vector<std::string>& describe) const {
  const std::vector<size_t> chosen = connected();
  if (chosen.empty()) return std::string();
  std::string desc = describe[chosen[0]];
  if (forced_) {
    // Forced: the forced transport first, whatever its rank; a grant fallback after it.
    desc = describe[*forced_];
    if (std::optional<size_t> g = GrantFallback()) {
      absl::StrAppend(&desc, "; ", describe[*g], " for grant-guarded regions only");
    }
    return desc;
  }
  for (size_t k = 1; k < chosen.size(); ++k) {
    absl::StrAppend(&desc, "; ", describe[chosen[k]], " for regions ", caps_[chosen[0]]->name,
                    " cannot reach");
  }
  return desc;
}

absl::StatusOr<size_t> PickTransport(absl::Span<const transport::Capabilities* const> caps,
                                     TransportMask connected, const TransferNeeds& needs,
                                     const std::string& peer_name) {
  return PickTransport(caps, RankOrder(caps), connected, needs, peer_name);
}

absl::StatusOr<size_t> PickTransport(absl::Span<const transport::Capabilities* const> caps,
                                     absl::Span<const size_t> rank_order, TransportMask connected,
                                     const TransferNeeds& needs, const std::string& peer_name) {
  std::string reasons;
  for (size_t i : rank_order) {
    if ((connected & (TransportMask{1} << i)) == 0) continue;
    const transport::Capabilities& c = *caps[i];
    const char* why = nullptr;
    if ((needs.guarded_only & (TransportMask{1} << i)) != 0 && !needs.guarded) {
      why = "is connected only for grant-guarded regions (another transport is forced)";
    } else if (!c.reaches_every_region && (needs.reaches & (TransportMask{1} << i)) == 0) {
      why = "does not reach every remote region of this transfer";
    } else if (needs.kind == OpKind::kRead ? !c.one_sided_read : !c.one_sided_write) {
      why = needs.kind == OpKind::kRead ? "does not carry READ" : "does not carry WRITE";
    } else if (needs.grant_reads && !c.checks_grants) {
      why = "does not check read grants (a remote region is readable only under a grant)";
    } else if (needs.local_gpu && !c.gpu_memory) {
      why = "cannot move GPU memory (a local region is GPU memory)";
    } else if (needs.local_host && !c.host_memory) {
      why = "cannot move host memory (a local region is host memory)";
    }
    if (why == nullptr) return i;
    absl::StrAppend(&reasons, reasons.empty() ? "" : "; ", c.name, " ", why);
  }
  if (reasons.empty()) reasons = "no data path is open";
  return absl::FailedPreconditionError(
      absl::StrCat("transfer: no transport to peer ", peer_name, " can carry it: ", reasons));
}

}  // namespace kvwire::core
