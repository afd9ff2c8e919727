// The target side of the shm transport: a thread answering peers' requests for region memfds,
// and their served copies of grant-guarded regions (served_copy.h), on an abstract Unix socket.
// Every request carries the session token; the engine's hooks decide which peer it is and
// whether the region is exported to it (and, for a copy, whether each op is allowed).
#ifndef KVWIRE_TRANSPORT_SHM_FD_SERVER_H_
#define KVWIRE_TRANSPORT_SHM_FD_SERVER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/util/mutex.h"
#include "src/util/recent_set.h"
#include "transport/shm/fd_protocol.h"
#include "transport/shm/local_regions.h"
#include "transport/shm/served_copy.h"
#include "transport/shm/unique_fd.h"
#include "transport/transport.h"

namespace kvwire::transport::shm {

// The socket is in the abstract namespace: any local process, of any uid, can connect. These
// bound what one that never presents a valid token can hold (see ShmTransportOptions).
struct FdServerLimits {
  size_t max_connections = 256;
  // Connections without a valid token yet, per uid (SO_PEERCRED): one uid cannot take every
  // slot even for the time `auth_timeout` lets it hold them.
  size_t max_unauthenticated_per_uid = 16;
  // A connection that has not presented a valid token (of a peer whose handshake pid is known
  // and matches) by then is closed.
  absl::Duration auth_timeout = absl::Seconds(5);
  // Staging memfds (served copies, kCopySlots x kCopySlotBytes each) held at once by the
  // connections of one process (SO_PEERCRED pid): one per peer already, but a process may
  // handshake as many peers as it likes, each with its own token.
  size_t max_stagings_per_process = 64;
};

class FdServer {
 public:
  // Listens on `socket_name` and serves from one thread until Shutdown. `hooks` and `regions`
  // must outlive the server.
  // `counters` (null: not counted) get the copy requests it answers and refuses.
  static absl::StatusOr<std::unique_ptr<FdServer>> Start(
      const std::string& socket_name, TargetHooks* hooks, LocalRegionTable* regions,
      const FdServerLimits& limits, std::shared_ptr<ServedCopyCounters> counters = nullptr);
  // For Start only (std::make_unique needs a public constructor).
  class PassKey {
    friend class FdServer;
    PassKey() = default;
  };
  FdServer(PassKey, TargetHooks* hooks, LocalRegionTable* regions, const FdServerLimits& limits,
           UniqueFd listener, UniqueFd wake, std::shared_ptr<ServedCopyCounters> counters);
  ~FdServer();
  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;

  // Closes the peer's connections and refuses it from now on (peer ids are never reused).
  void DropPeer(PeerId peer);
  // Closes the listener and every connection, and joins the thread. Idempotent. Must not be
  // called from a TargetHooks callback (those run on the server thread).
  void Shutdown();

 private:
  struct Connection;

  void Wake();
  void Run();
  // Answers one message; false when the connection must be closed. `all` is every live
  // connection (`connection` among them): a peer's staging memfds are counted across them.
  bool Serve(Connection& connection, const std::vector<Connection>& all);
  // Answers a decoded request, or parks it in `connection.waiting` while the token's peer has
  // no known handshake pid yet; false when the connection must be closed.
  bool Handle(Connection& connection, const FdRequest& request, const std::vector<Connection>& all);
  // Accepts every pending connection within the limits.
  void AcceptAll(std::vector<Connection>& connections);
  bool IsDropped(PeerId peer);

  TargetHooks* const hooks_;
  LocalRegionTable* const regions_;
  const FdServerLimits limits_;
  const UniqueFd listener_;
  const UniqueFd wake_;  // eventfd: DropPeer and Shutdown interrupt the thread's poll
  const std::shared_ptr<ServedCopyCounters> counters_;  // may be null
  // The server thread's alone, kept from one message to the next (a served copy is one
  // request and one reply per piece: none allocates once these have grown).
  std::vector<char> received_ = std::vector<char>(kMaxFdMessageBytes + 1);
  FdRequest request_;

  Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Bounded: the engine revokes a peer's token before dropping it, so an old id is refused by
  // the token check already (peer ids are never reused).
  RecentSet<PeerId> dropped_ ABSL_GUARDED_BY(mu_){kClosedPeersRemembered};

  Mutex join_mu_;  // one joiner at a time
  std::thread thread_ ABSL_GUARDED_BY(join_mu_);
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_FD_SERVER_H_
