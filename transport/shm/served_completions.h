// ServedCompletions: the one thread per shm transport that handles the replies of every
// ServedLink (served_link.h): it waits on their sockets (epoll) and on their deadlines, and
// runs ServedLink::Progress, which copies a READ's bytes out of its staging slot and reports
// the requests that are done. Started at the first link, so an engine that never reads a
// peer's grant-guarded region over shm has no such thread; never more than one, whatever the
// number of peers.
#ifndef KVWIRE_TRANSPORT_SHM_SERVED_COMPLETIONS_H_
#define KVWIRE_TRANSPORT_SHM_SERVED_COMPLETIONS_H_

#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "src/util/mutex.h"
#include "transport/shm/served_link.h"
#include "transport/shm/unique_fd.h"

namespace kvwire::transport::shm {

class ServedCompletions : public std::enable_shared_from_this<ServedCompletions> {
 public:
  // Held by shared_ptr; its thread holds one too until Shutdown, which the owner must call.
  static absl::StatusOr<std::shared_ptr<ServedCompletions>> Start();
  // For Start only (std::make_unique needs a public constructor).
  class PassKey {
    friend class ServedCompletions;
    PassKey() = default;
  };
  ServedCompletions(PassKey, UniqueFd epoll, UniqueFd wake);
  ~ServedCompletions();
  ServedCompletions(const ServedCompletions&) = delete;
  ServedCompletions& operator=(const ServedCompletions&) = delete;

  absl::Status Add(const std::shared_ptr<ServedLink>& link);
  // After it returns the thread no longer calls into `link` (a Progress running now ends
  // first, unless this is called from that Progress: a callback it ran). The link is not
  // failed here: its owner does that.
  void Remove(const ServedLink* link);
  // Stops and joins the thread (detaches it when called on it). Idempotent.
  void Shutdown();

 private:
  void Wake();
  void Run();

  const UniqueFd epoll_;
  const UniqueFd wake_;  // eventfd: Add, Remove and Shutdown interrupt the wait

  Mutex mu_;
  CondVar idle_cv_;  // Remove waits here for a Progress on its link to end
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<ServedLink>> links_ ABSL_GUARDED_BY(mu_);
  const ServedLink* running_ ABSL_GUARDED_BY(mu_) = nullptr;  // whose Progress runs now

  Mutex join_mu_;  // one joiner at a time
  std::thread thread_ ABSL_GUARDED_BY(join_mu_);
  std::thread::id thread_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_SERVED_COMPLETIONS_H_
