// TcpConnection: the Connection of an established control channel. One async read chain
// feeds a FrameDecoder; a send queue keeps one async_write in flight; two timers send
// heartbeats and enforce the lease.
//
// Threading: every operation on the socket and timers is issued under `mu_`, so Send and
// Close may be called from any thread and completion handlers may run on any io_context
// thread. Handlers hold shared_from_this(), so a started connection lives until it is closed
// and its pending operations have finished (or the io_context is destroyed, which destroys
// them). Connections must be released before their io_context is destroyed.
#ifndef KVWIRE_CONTROL_CONNECTION_H_
#define KVWIRE_CONTROL_CONNECTION_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

#include "proto/kvwire.pb.h"
#include "src/control/control.h"
#include "src/control/frame.h"
#include "src/util/mutex.h"

namespace kvwire::control {

class TcpConnection final : public Connection {
 public:
  // After a local Close, how long the Goodbye (and anything queued before it) may take to
  // drain before the socket is closed regardless.
  static constexpr absl::Duration kGoodbyeLinger = absl::Seconds(2);

  // Takes a connected socket whose handshake is complete. `decoder` holds whatever the
  // handshake read past its last message; those envelopes are delivered first after Start
  // (its frame limit is raised to `max_frame_bytes`). At most `max_send_queue_bytes` may wait
  // for a peer that does not read. `slot` is released when the socket closes (the listener
  // counts its open connections with it).
  static std::shared_ptr<TcpConnection> Create(boost::asio::ip::tcp::socket socket,
                                               FrameDecoder decoder, uint32_t max_frame_bytes,
                                               uint64_t max_send_queue_bytes,
                                               std::shared_ptr<const void> slot = nullptr);

  ~TcpConnection() override = default;

  // A zero or infinite `heartbeat_interval` sends no heartbeats; a zero or infinite `lease`
  // never declares the peer dead. If the connection closed before Start, `on_close` runs
  // at once on the calling thread.
  void Start(MessageHandler on_message, CloseHandler on_close, absl::Duration heartbeat_interval,
             absl::Duration lease) override;
  absl::Status Send(const pb::Envelope& message) override;
  // Runs the close handler on the calling thread before returning (unless the connection
  // was already closed). `reason` is passed to it unchanged and sent to the peer in Goodbye.
  void Close(const absl::Status& reason) override;
  std::string remote_address() const override { return remote_address_; }

 private:
  struct PrivateTag {};

 public:
  TcpConnection(PrivateTag, boost::asio::ip::tcp::socket socket, FrameDecoder decoder,
                std::string remote_address, uint64_t max_send_queue_bytes,
                std::shared_ptr<const void> slot);

 private:
  using Clock = std::chrono::steady_clock;

  std::shared_ptr<TcpConnection> Self() {
    return std::static_pointer_cast<TcpConnection>(shared_from_this());
  }

  // Marks the connection closed with `status` (first caller wins), stops the timers, sends
  // Goodbye if asked, and runs the close handler outside the lock.
  void CloseWith(const absl::Status& status, bool send_goodbye) ABSL_LOCKS_EXCLUDED(mu_);

  // Read chain (one read in flight at most, so these never run concurrently).
  void OnStart();
  void OnRead(const boost::system::error_code& error, size_t bytes);
  // Hands decoded envelopes to the handler until the queue is empty or the connection
  // closed; consumes Heartbeat, Goodbye and Reject itself.
  void DeliverDecoded();
  void ContinueReading() ABSL_LOCKS_EXCLUDED(mu_);

  void StartReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnWrite(const boost::system::error_code& error);
  void ArmHeartbeatLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnHeartbeat(const boost::system::error_code& error);
  void ArmLeaseLocked(Clock::time_point expiry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnLease(const boost::system::error_code& error);
  void OnLinger(const boost::system::error_code& error);
  void CloseSocketLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string remote_address_;
  const uint32_t max_frame_bytes_;
  const uint64_t max_send_queue_bytes_;

  // Owned by the read chain: written by Start before the chain begins, then only touched
  // by the chain's handlers.
  FrameDecoder decoder_;
  MessageHandler on_message_;
  std::array<char, 64 << 10> read_buffer_;

  mutable Mutex mu_;
  boost::asio::ip::tcp::socket socket_ ABSL_GUARDED_BY(mu_);
  boost::asio::steady_timer heartbeat_timer_ ABSL_GUARDED_BY(mu_);
  boost::asio::steady_timer lease_timer_ ABSL_GUARDED_BY(mu_);
  boost::asio::steady_timer linger_timer_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status close_status_ ABSL_GUARDED_BY(mu_);
  CloseHandler on_close_ ABSL_GUARDED_BY(mu_);
  Clock::duration heartbeat_interval_ ABSL_GUARDED_BY(mu_){};
  Clock::duration lease_ ABSL_GUARDED_BY(mu_){};
  absl::Duration lease_duration_ ABSL_GUARDED_BY(mu_);
  Clock::time_point last_receive_ ABSL_GUARDED_BY(mu_);
  uint64_t heartbeat_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // Frames waiting for the writer, and the batch the in-flight async_write is sending.
  std::deque<std::string> send_queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> in_flight_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  // Bytes in send_queue_ and in_flight_ together.
  uint64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const void> slot_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::control

#endif  // KVWIRE_CONTROL_CONNECTION_H_
