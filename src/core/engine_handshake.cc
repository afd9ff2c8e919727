// Engine::Impl, the handshake on both sides (src/control/handshake.h runs it): this engine's
// Hello and the settled transport preference, the session tokens it issues to authenticated
// peers, accepting a dialer and dialing a peer (Connect), up to a published Peer.
#include <optional>
#include <unistd.h>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/core/engine_impl.h"
#include "src/util/log.h"

namespace kvwire {
namespace {

// The transport the peer forces, by name ("auto" when none or when the name is not one a
// transport could have: the peer's bytes are not trusted to be short or printable).
std::string PreferenceOf(const pb::Hello& hello) {
  const std::string& name = hello.transport_preference();
  constexpr size_t kMaxNameBytes = 64;
  if (name.empty() || name.size() > kMaxNameBytes) return "auto";
  for (char c : name) {
    if (!(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) {
      return "auto";
    }
  }
  return name;
}

// Both sides may force a transport; they must agree.
absl::StatusOr<std::string> SettlePreference(const std::string& local,
                                             const std::string& local_name,
                                             const std::string& remote,
                                             const std::string& remote_name) {
  if (local != "auto" && remote != "auto" && local != remote) {
    return absl::InvalidArgumentError(absl::StrCat("transport conflict: engine ", local_name,
                                                   " requires ", local, ", peer ", remote_name,
                                                   " requires ", remote));
  }
  return local != "auto" ? local : remote;
}

}  // namespace

pb::Hello Engine::Impl::LocalHello(const std::string& preference) const {
  pb::Hello hello;
  hello.set_engine_name(name_);
  hello.set_pid(static_cast<uint32_t>(getpid()));
  hello.set_transport_preference(preference);
  hello.set_verify_checksums(options_.verify_checksums);
  for (const auto& t : transports_) {
    pb::TransportEndpoint* endpoint = hello.add_transports();
    endpoint->set_kind(t->caps().name);
    endpoint->set_endpoint(t->Endpoint());
  }
  return hello;
}

absl::StatusOr<std::string> Engine::Impl::IssueToken() {
  if (stopping_) return absl::UnavailableError(absl::StrCat("engine ", name_, " is stopping"));
  absl::StatusOr<std::string> token = NewToken();
  if (!token.ok()) return token.status();
  const PeerId id = next_peer_id_++;
  MutexLock lock(&peers_mu_);
  if (!tokens_.try_emplace(*token, id).second) {
    return absl::InternalError("the CSPRNG repeated a session token");
  }
  return token;
}

void Engine::Impl::RevokeToken(const std::string& token) {
  PeerId id = 0;
  {
    MutexLock lock(&peers_mu_);
    auto it = tokens_.find(token);
    if (it == tokens_.end()) return;
    id = it->second;
    tokens_.erase(it);
    // A published peer is closed by ClosePeer, which drops it from every transport.
    if (peers_.contains(id)) return;
  }
  // The token was live while its handshake ran (the other side had proven the secret, or none
  // is set), so data connections may have been opened with it: a handshake that then failed
  // must not leave them serving a peer that never was.
  for (const auto& t : transports_) t->DropPeer(id);
}

PeerId Engine::Impl::TokenPeer(const std::string& token) const {
  MutexLock lock(&peers_mu_);
  auto it = tokens_.find(token);
  return it == tokens_.end() ? 0 : it->second;
}

absl::StatusOr<pb::Hello> Engine::Impl::RespondToHello(const pb::Hello& remote) {
  // Runs before the dialer has proven anything: decides, holds no state, issues no token.
  if (stopping_) return absl::UnavailableError(absl::StrCat("engine ", name_, " is stopping"));
  auto preference =
      SettlePreference(options_.transport, name_, PreferenceOf(remote), remote.engine_name());
  if (!preference.ok()) return preference.status();
  return LocalHello(options_.transport);
}

void Engine::Impl::OnAccepted(control::Accepted accepted) {
  const PeerId id = TokenPeer(accepted.local_token);
  if (id == 0 || stopping_) {
    // Revoked meanwhile (the engine is stopping): the dialer learns it from the Goodbye.
    RevokeToken(accepted.local_token);
    accepted.connection->Close(
        absl::UnavailableError(absl::StrCat("engine ", name_, " is stopping")));
    return;
  }
  auto preference = SettlePreference(options_.transport, name_, PreferenceOf(accepted.remote_hello),
                                     accepted.remote_hello.engine_name());
  const std::string address = accepted.connection->remote_address();
  std::shared_ptr<Peer> peer =
      AddPeer(id, address, std::move(accepted), preference.value_or("auto"));
  worker_->Post([this, peer] {
    if (absl::Status s = SetupChannels(peer); !s.ok()) ClosePeer(peer, s);
  });
}

std::shared_ptr<Peer> Engine::Impl::AddPeer(PeerId id, const std::string& address,
                                            control::Accepted accepted, std::string preference) {
  auto peer = std::make_shared<Peer>();
  peer->id = id;
  peer->name = accepted.remote_hello.engine_name();
  peer->address = address;
  peer->hello = std::move(accepted.remote_hello);
  peer->preference = preference;
  peer->conn = std::move(accepted.connection);
  {
    MutexLock lock(&peers_mu_);
    peers_[id] = peer;
    PeersChangedLocked();
  }
  std::weak_ptr<Peer> weak = peer;
  peer->conn->Start(
      [this, weak](const pb::Envelope& message) {
        if (auto p = weak.lock()) OnMessage(p, message);
      },
      [this, weak](const absl::Status& status) {
        auto p = weak.lock();
        if (!p || stopping_) return;
        // The worker may be blocked in this peer's channel set-up, waiting for a reply that
        // cannot come now: fail that wait here, with the reason the peer gave (a refusal).
        // Only while the peer is alive: ClosePeer's DropPeer, which forgets what AbortPending
        // records, then comes after (it marks the peer dead under the same lock first); a
        // peer ClosePeer already dropped would be remembered by the transport for ever.
        {
          MutexLock lock(&p->mu);
          if (p->alive) {
            for (const auto& t : transports_) t->AbortPending(p->id, status);
          }
        }
        // Teardown joins transport threads: never on the I/O thread that noticed it.
        worker_->Post([this, p, status] { ClosePeer(p, status); });
      },
      options_.heartbeat_interval, options_.peer_lease);
  (void)SendExports(*peer, regions_.ExportedToAll());
  KVW_LOG(kInfo, "engine") << "peer connected" << Kv("engine", name_) << Kv("peer", id)
                           << Kv("name", peer->name) << Kv("address", address)
                           << Kv("preference", preference);
  return peer;
}

absl::StatusOr<PeerId> Engine::Impl::Connect(const std::string& address,
                                             const ConnectOptions& options) {
  if (stopping_) return absl::UnavailableError(absl::StrCat("engine ", name_, " is stopping"));
  const std::string preference = options.transport.value_or(options_.transport);
  // The handshake issues this side's token only once the listener is authenticated, and
  // revokes it itself if the handshake fails.
  auto accepted = control::Dial(io_, address, LocalHello(preference), handshake_);
  if (!accepted.ok()) {
    return absl::Status(accepted.status().code(),
                        absl::StrCat("connect to ", address, ": ", accepted.status().message()));
  }
  const std::string token = accepted->local_token;
  auto forget_token = [&] { RevokeToken(token); };
  const PeerId id = TokenPeer(token);
  if (id == 0) {
    const absl::Status stopping = absl::UnavailableError(
        absl::StrCat("connect to ", address, ": engine ", name_, " is stopping"));
    accepted->connection->Close(stopping);
    return stopping;
  }
  auto settled = SettlePreference(preference, name_, PreferenceOf(accepted->remote_hello),
                                  accepted->remote_hello.engine_name());
  if (!settled.ok()) {
    accepted->connection->Close(settled.status());
    forget_token();
    return settled.status();
  }
  std::vector<transport::LocalRegion> exports;
  if (!options.exports.empty()) {
    auto exported = regions_.ExportTo(id, options.exports);
    if (!exported.ok()) {
      accepted->connection->Close(exported.status());
      forget_token();
      return exported.status();
    }
    exports = std::move(*exported);
  }
  std::shared_ptr<Peer> peer = AddPeer(id, address, std::move(*accepted), *settled);
  (void)SendExports(*peer, exports);
  // Channel setup runs on the worker, like every other change to a peer's data path.
  auto done = std::make_shared<std::pair<Mutex, std::optional<absl::Status>>>();
  auto cv = std::make_shared<CondVar>();
  worker_->Post([this, peer, done, cv] {
    absl::Status s = SetupChannels(peer);
    MutexLock lock(&done->first);
    done->second = s;
    cv->SignalAll();
  });
  absl::Status setup = absl::DeadlineExceededError(
      absl::StrCat("connect to ", address, ": data path not ready within ",
                   absl::FormatDuration(options_.connect_timeout)));
  {
    const absl::Time deadline = absl::Now() + options_.connect_timeout + absl::Seconds(1);
    MutexLock lock(&done->first);
    while (!done->second.has_value() && absl::Now() < deadline) {
      cv->WaitUntil(&done->first, deadline);
    }
    if (done->second.has_value()) setup = *done->second;
  }
  if (!setup.ok()) {
    ClosePeer(peer, setup);
    return setup;
  }
  return id;
}

}  // namespace kvwire
