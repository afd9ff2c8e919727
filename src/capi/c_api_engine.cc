// The C API (include/kvwire/kvwire.h) over kvwire::Engine: the engine, memory registration,
// peers, transfers, notifications, messages and stats (its options: c_api_engine_options.cc). Every
// entry point catches; every pointer and length a caller passes is checked before it is used.
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "kvwire/kvwire.h"
#include "src/capi/c_api_internal.h"
#include "src/util/json_escape.h"

struct kvw_region_options_t {
  kvwire::RegionOptions rep;
};
struct kvw_connect_options_t {
  kvwire::ConnectOptions rep;
};
struct kvw_transfer_options_t {
  kvwire::TransferOptions rep;
};
struct kvw_notifications_t {
  std::vector<kvwire::Notification> rep;
};
struct kvw_inbox_t {
  std::unique_ptr<kvwire::Inbox> rep;
};
struct kvw_inbox_events_t {
  std::vector<kvwire::InboxEvent> rep;
};

namespace {

using kvwire::capi::CopyString;
using kvwire::capi::Guard;
using kvwire::capi::GuardMake;
using kvwire::capi::NoThrow;
using kvwire::capi::Require;
using kvwire::capi::RequireArray;
using kvwire::capi::RequireRange;
using kvwire::capi::Str;

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMsPerDay = int64_t{24} * 3600 * 1000;
constexpr size_t kMaxOpsPerTransfer = size_t{1} << 20;

// A timeout the caller waits for: 0 .. 24 h.
absl::Status WaitTimeout(const char* call, int64_t ms, absl::Duration* out) {
  if (absl::Status s = RequireRange(call, ms, 0, kMsPerDay); !s.ok()) return s;
  *out = absl::Milliseconds(ms);
  return absl::OkStatus();
}

absl::Status RegionList(const char* call, const uint64_t* regions, size_t count,
                        std::vector<kvwire::RegionId>* out) {
  if (absl::Status s = RequireArray(call, "regions", regions, count); !s.ok()) return s;
  if (absl::Status s = RequireRange(
          call, static_cast<int64_t>(std::min<size_t>(count, std::numeric_limits<int64_t>::max())),
          0, int64_t{1} << 20);
      !s.ok()) {
    return s;
  }
  out->assign(regions, regions + count);
  return absl::OkStatus();
}

template <typename T>
const T* At(const std::vector<T>* v, size_t i) {
  return v != nullptr && i < v->size() ? &(*v)[i] : nullptr;
}

std::string PeersJson(const std::vector<kvwire::PeerInfo>& peers) {
  std::string out = "[";
  for (size_t i = 0; i < peers.size(); ++i) {
    const kvwire::PeerInfo& p = peers[i];
    absl::StrAppend(&out, i == 0 ? "" : ",", "{\"id\":", p.id, ",\"name\":\"",
                    kvwire::JsonEscape(p.name), "\",\"address\":\"", kvwire::JsonEscape(p.address),
                    "\",\"transport\":\"", kvwire::JsonEscape(p.transport),
                    "\",\"alive\":", p.alive ? "true" : "false", ",\"close_reason\":\"",
                    kvwire::JsonEscape(p.close_reason), "\"}");
  }
  out += "]";
  return out;
}

}  // namespace

extern "C" {
// --- engine ---

kvw_engine_t* kvw_engine_create(const kvw_engine_options_t* o, char** errptr) {
  return GuardMake(errptr, [&]() -> absl::StatusOr<std::unique_ptr<kvw_engine_t>> {
    kvwire::EngineOptions options = o == nullptr ? kvwire::EngineOptions() : o->rep;
    absl::StatusOr<std::unique_ptr<kvwire::Engine>> e = kvwire::Engine::Create(std::move(options));
    if (!e.ok()) return e.status();
    auto handle = std::make_unique<kvw_engine_t>();
    handle->owned = std::move(*e);
    handle->rep = handle->owned.get();
    return handle;
  });
}
void kvw_engine_destroy(kvw_engine_t* e) {
  // A connector's engine (kvw_connector_engine) belongs to the connector.
  if (e != nullptr && e->owned != nullptr) delete e;
}
const char* kvw_engine_name(const kvw_engine_t* e) {
  return e == nullptr ? nullptr : e->rep->name().c_str();
}
char* kvw_engine_address(const kvw_engine_t* e) {
  return NoThrow<char*>(
      nullptr, [&]() -> char* { return e == nullptr ? nullptr : CopyString(e->rep->address()); });
}

// --- regions ---

kvw_region_options_t* kvw_region_options_create(void) {
  return NoThrow<kvw_region_options_t*>(nullptr, [] { return new kvw_region_options_t(); });
}
void kvw_region_options_destroy(kvw_region_options_t* o) { delete o; }
int kvw_region_options_set_access(kvw_region_options_t* o, int access, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_region_options_set_access";
    if (absl::Status s = Require(kCall, {{"options", o}}); !s.ok()) return s;
    if (absl::Status s = RequireRange(kCall, access, KVW_ACCESS_NONE, KVW_ACCESS_REMOTE_READ_WRITE);
        !s.ok()) {
      return s;
    }
    o->rep.access = static_cast<uint32_t>(access);
    return absl::OkStatus();
  });
}
int kvw_region_options_set_kind(kvw_region_options_t* o, int kind, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_region_options_set_kind";
    if (absl::Status s = Require(kCall, {{"options", o}}); !s.ok()) return s;
    if (absl::Status s = RequireRange(kCall, kind, KVW_MEMORY_HOST, KVW_MEMORY_GPU); !s.ok()) {
      return s;
    }
    o->rep.kind = kind == KVW_MEMORY_GPU ? kvwire::MemoryKind::kGpu : kvwire::MemoryKind::kHost;
    return absl::OkStatus();
  });
}
int kvw_region_options_set_gpu_device(kvw_region_options_t* o, int device, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_region_options_set_gpu_device";
    if (absl::Status s = Require(kCall, {{"options", o}}); !s.ok()) return s;
    if (absl::Status s = RequireRange(kCall, device, -1, 1023); !s.ok()) return s;
    o->rep.gpu_device = device;
    return absl::OkStatus();
  });
}
int kvw_region_options_set_export_to_all_peers(kvw_region_options_t* o, int on, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_region_options_set_export_to_all_peers";
    if (absl::Status s = Require(kCall, {{"options", o}}); !s.ok()) return s;
    if (absl::Status s = RequireRange(kCall, on, 0, 1); !s.ok()) return s;
    o->rep.export_to_all_peers = on != 0;
    return absl::OkStatus();
  });
}

int kvw_engine_register_memory(kvw_engine_t* e, void* ptr, size_t length,
                               const kvw_region_options_t* o, uint64_t* region, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_engine_register_memory";
    if (absl::Status s = Require(kCall, {{"engine", e}, {"ptr", ptr}, {"region", region}});
        !s.ok()) {
      return s;
    }
    if (length == 0) return absl::InvalidArgumentError(absl::StrCat(kCall, ": length is 0"));
    absl::StatusOr<kvwire::RegionId> id =
        e->rep->RegisterMemory(ptr, length, o == nullptr ? kvwire::RegionOptions() : o->rep);
    if (!id.ok()) return id.status();
    *region = *id;
    return absl::OkStatus();
  });
}
int kvw_engine_deregister_memory(kvw_engine_t* e, uint64_t region, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_engine_deregister_memory", {{"engine", e}}); !s.ok()) {
      return s;
    }
    return e->rep->DeregisterMemory(region);
  });
}

// --- peers ---

kvw_connect_options_t* kvw_connect_options_create(void) {
  return NoThrow<kvw_connect_options_t*>(nullptr, [] { return new kvw_connect_options_t(); });
}
void kvw_connect_options_destroy(kvw_connect_options_t* o) { delete o; }
int kvw_connect_options_set_exports(kvw_connect_options_t* o, const uint64_t* regions, size_t count,
                                    char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_connect_options_set_exports";
    if (absl::Status s = Require(kCall, {{"options", o}}); !s.ok()) return s;
    return RegionList(kCall, regions, count, &o->rep.exports);
  });
}
int kvw_connect_options_set_transport(kvw_connect_options_t* o, const char* transport,
                                      char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_connect_options_set_transport";
    if (absl::Status s = Require(kCall, {{"options", o}, {"transport", transport}}); !s.ok()) {
      return s;
    }
    o->rep.transport = std::string(transport);
    return absl::OkStatus();
  });
}
int kvw_engine_connect(kvw_engine_t* e, const char* address, const kvw_connect_options_t* o,
                       uint64_t* peer, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s =
            Require("kvw_engine_connect", {{"engine", e}, {"address", address}, {"peer", peer}});
        !s.ok()) {
      return s;
    }
    absl::StatusOr<kvwire::PeerId> id =
        e->rep->Connect(address, o == nullptr ? kvwire::ConnectOptions() : o->rep);
    if (!id.ok()) return id.status();
    *peer = *id;
    return absl::OkStatus();
  });
}
int kvw_engine_export(kvw_engine_t* e, uint64_t peer, const uint64_t* regions, size_t count,
                      char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_engine_export";
    if (absl::Status s = Require(kCall, {{"engine", e}}); !s.ok()) return s;
    std::vector<kvwire::RegionId> ids;
    if (absl::Status s = RegionList(kCall, regions, count, &ids); !s.ok()) return s;
    return e->rep->Export(peer, ids);
  });
}
int kvw_engine_unexport(kvw_engine_t* e, uint64_t peer, const uint64_t* regions, size_t count,
                        char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_engine_unexport";
    if (absl::Status s = Require(kCall, {{"engine", e}}); !s.ok()) return s;
    std::vector<kvwire::RegionId> ids;
    if (absl::Status s = RegionList(kCall, regions, count, &ids); !s.ok()) return s;
    return e->rep->Unexport(peer, ids);
  });
}
int kvw_engine_disconnect(kvw_engine_t* e, uint64_t peer, const char* reason, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_engine_disconnect", {{"engine", e}}); !s.ok()) return s;
    if (reason == nullptr) return e->rep->Disconnect(peer);
    return e->rep->Disconnect(peer, absl::AbortedError(reason));
  });
}
char* kvw_engine_peers_json(const kvw_engine_t* e) {
  return NoThrow<char*>(nullptr, [&]() -> char* {
    return e == nullptr ? nullptr : CopyString(PeersJson(e->rep->Peers()));
  });
}
int kvw_engine_find_peer(const kvw_engine_t* e, const char* name, uint64_t* peer, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s =
            Require("kvw_engine_find_peer", {{"engine", e}, {"name", name}, {"peer", peer}});
        !s.ok()) {
      return s;
    }
    absl::StatusOr<kvwire::PeerId> id = e->rep->FindPeer(name);
    if (!id.ok()) return id.status();
    *peer = *id;
    return absl::OkStatus();
  });
}
int kvw_engine_wait_for_peer(kvw_engine_t* e, const char* name, int64_t timeout_ms, uint64_t* peer,
                             char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_engine_wait_for_peer";
    if (absl::Status s = Require(kCall, {{"engine", e}, {"name", name}, {"peer", peer}}); !s.ok()) {
      return s;
    }
    absl::Duration timeout;
    if (absl::Status s = WaitTimeout(kCall, timeout_ms, &timeout); !s.ok()) return s;
    absl::StatusOr<kvwire::PeerId> id = e->rep->WaitForPeer(name, timeout);
    if (!id.ok()) return id.status();
    *peer = *id;
    return absl::OkStatus();
  });
}
int kvw_engine_remote_regions(const kvw_engine_t* e, uint64_t peer, uint64_t* ids,
                              uint64_t* lengths, uint32_t* access, int* kinds, size_t capacity,
                              size_t* count, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_engine_remote_regions", {{"engine", e}, {"count", count}});
        !s.ok()) {
      return s;
    }
    absl::StatusOr<std::vector<kvwire::RemoteRegion>> regions = e->rep->RemoteRegions(peer);
    if (!regions.ok()) return regions.status();
    *count = regions->size();
    for (size_t i = 0; i < regions->size() && i < capacity; ++i) {
      const kvwire::RemoteRegion& r = (*regions)[i];
      if (ids != nullptr) ids[i] = r.id;
      if (lengths != nullptr) lengths[i] = r.length;
      if (access != nullptr) access[i] = r.access;
      if (kinds != nullptr)
        kinds[i] = r.kind == kvwire::MemoryKind::kGpu ? KVW_MEMORY_GPU : KVW_MEMORY_HOST;
    }
    return absl::OkStatus();
  });
}
int kvw_engine_wait_for_remote_region(kvw_engine_t* e, uint64_t peer, uint64_t region,
                                      int64_t timeout_ms, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_engine_wait_for_remote_region";
    if (absl::Status s = Require(kCall, {{"engine", e}}); !s.ok()) return s;
    absl::Duration timeout;
    if (absl::Status s = WaitTimeout(kCall, timeout_ms, &timeout); !s.ok()) return s;
    return e->rep->WaitForRemoteRegion(peer, region, timeout);
  });
}

// --- transfers ---

kvw_transfer_options_t* kvw_transfer_options_create(void) {
  return NoThrow<kvw_transfer_options_t*>(nullptr, [] { return new kvw_transfer_options_t(); });
}
void kvw_transfer_options_destroy(kvw_transfer_options_t* o) { delete o; }
int kvw_transfer_options_set_notification(kvw_transfer_options_t* o, const char* data,
                                          size_t length, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_transfer_options_set_notification";
    if (absl::Status s = Require(kCall, {{"options", o}}); !s.ok()) return s;
    if (absl::Status s = RequireArray(kCall, "data", data, length); !s.ok()) return s;
    if (length > static_cast<size_t>(kGiB)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": a ", length, "-byte notification is over 1 GiB"));
    }
    o->rep.notification = std::string(length == 0 ? "" : data, length);
    return absl::OkStatus();
  });
}
int kvw_transfer_options_set_timeout(kvw_transfer_options_t* o, int64_t ms, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_transfer_options_set_timeout";
    if (absl::Status s = Require(kCall, {{"options", o}}); !s.ok()) return s;
    if (absl::Status s = RequireRange(kCall, ms, 1, kMsPerDay); !s.ok()) return s;
    o->rep.timeout = absl::Milliseconds(ms);
    return absl::OkStatus();
  });
}
int kvw_engine_transfer(kvw_engine_t* e, uint64_t peer, int kind, const kvw_op_t* ops, size_t count,
                        const kvw_transfer_options_t* o, uint64_t* id, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_engine_transfer";
    if (absl::Status s = Require(kCall, {{"engine", e}, {"ops", ops}, {"id", id}}); !s.ok()) {
      return s;
    }
    if (kind != KVW_OP_READ && kind != KVW_OP_WRITE) {
      return absl::InvalidArgumentError(absl::StrCat(kCall, ": kind ", kind,
                                                     " is neither KVW_OP_READ (0) nor "
                                                     "KVW_OP_WRITE (1)"));
    }
    if (count == 0 || count > kMaxOpsPerTransfer) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": ", count, " ops is out of range (1..", kMaxOpsPerTransfer, ")"));
    }
    std::vector<kvwire::Op> v(count);
    for (size_t i = 0; i < count; ++i) {
      v[i] = {ops[i].local_region, ops[i].local_offset, ops[i].remote_region, ops[i].remote_offset,
              ops[i].length};
    }
    absl::StatusOr<kvwire::TransferId> t = e->rep->Transfer(
        peer, kind == KVW_OP_WRITE ? kvwire::OpKind::kWrite : kvwire::OpKind::kRead, v,
        o == nullptr ? kvwire::TransferOptions() : o->rep);
    if (!t.ok()) return t.status();
    *id = *t;
    return absl::OkStatus();
  });
}
int kvw_engine_poll(kvw_engine_t* e, uint64_t id, int* state, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_engine_poll", {{"engine", e}, {"state", state}}); !s.ok()) {
      return s;
    }
    absl::Status status;
    switch (e->rep->Poll(id, &status)) {
      case kvwire::TransferState::kPending:
        *state = KVW_TRANSFER_PENDING;
        return absl::OkStatus();
      case kvwire::TransferState::kSucceeded:
        *state = KVW_TRANSFER_SUCCEEDED;
        return absl::OkStatus();
      case kvwire::TransferState::kFailed:
        *state = KVW_TRANSFER_FAILED;
        return status.ok() ? absl::UnknownError("transfer failed") : status;
    }
    return absl::InternalError("kvw_engine_poll: unknown transfer state");
  });
}
int kvw_engine_wait(kvw_engine_t* e, uint64_t id, int64_t timeout_ms, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_engine_wait";
    if (absl::Status s = Require(kCall, {{"engine", e}}); !s.ok()) return s;
    absl::Duration timeout;
    if (absl::Status s = WaitTimeout(kCall, timeout_ms, &timeout); !s.ok()) return s;
    return e->rep->Wait(id, timeout);
  });
}

// --- notifications ---

kvw_notifications_t* kvw_engine_take_notifications(kvw_engine_t* e, char** errptr) {
  return GuardMake(errptr, [&]() -> absl::StatusOr<std::unique_ptr<kvw_notifications_t>> {
    if (absl::Status s = Require("kvw_engine_take_notifications", {{"engine", e}}); !s.ok()) {
      return s;
    }
    auto out = std::make_unique<kvw_notifications_t>();
    out->rep = e->rep->TakeNotifications();
    return out;
  });
}
kvw_notifications_t* kvw_engine_wait_notification(kvw_engine_t* e, int64_t timeout_ms,
                                                  char** errptr) {
  return GuardMake(errptr, [&]() -> absl::StatusOr<std::unique_ptr<kvw_notifications_t>> {
    constexpr char kCall[] = "kvw_engine_wait_notification";
    if (absl::Status s = Require(kCall, {{"engine", e}}); !s.ok()) return s;
    absl::Duration timeout;
    if (absl::Status s = WaitTimeout(kCall, timeout_ms, &timeout); !s.ok()) return s;
    absl::StatusOr<kvwire::Notification> n = e->rep->WaitNotification(timeout);
    if (!n.ok()) return n.status();
    auto out = std::make_unique<kvw_notifications_t>();
    out->rep.push_back(std::move(*n));
    return out;
  });
}
size_t kvw_notifications_count(const kvw_notifications_t* n) {
  return n == nullptr ? 0 : n->rep.size();
}
uint64_t kvw_notifications_peer(const kvw_notifications_t* n, size_t i) {
  const kvwire::Notification* x = At(n == nullptr ? nullptr : &n->rep, i);
  return x == nullptr ? 0 : x->peer;
}
const char* kvw_notifications_peer_name(const kvw_notifications_t* n, size_t i) {
  const kvwire::Notification* x = At(n == nullptr ? nullptr : &n->rep, i);
  return x == nullptr ? nullptr : x->peer_name.c_str();
}
uint64_t kvw_notifications_transfer_id(const kvw_notifications_t* n, size_t i) {
  const kvwire::Notification* x = At(n == nullptr ? nullptr : &n->rep, i);
  return x == nullptr ? 0 : x->transfer_id;
}
const char* kvw_notifications_payload(const kvw_notifications_t* n, size_t i, size_t* length) {
  const kvwire::Notification* x = At(n == nullptr ? nullptr : &n->rep, i);
  if (length != nullptr) *length = x == nullptr ? 0 : x->payload.size();
  return x == nullptr ? nullptr : x->payload.c_str();
}
void kvw_notifications_destroy(kvw_notifications_t* n) { delete n; }

// --- messages ---

int kvw_engine_send_message(kvw_engine_t* e, uint64_t peer, const char* topic, const char* payload,
                            size_t length, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_engine_send_message";
    if (absl::Status s = Require(kCall, {{"engine", e}, {"topic", topic}}); !s.ok()) return s;
    if (absl::Status s = RequireArray(kCall, "payload", payload, length); !s.ok()) return s;
    // The engine refuses payloads over max_message_bytes (at most 1 GiB) itself; this bound
    // only keeps the copy below from being asked for more than any engine would take.
    if (length > static_cast<size_t>(kGiB)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": a ", length, "-byte payload is over 1 GiB"));
    }
    return e->rep->SendMessage(peer, topic, std::string(length == 0 ? "" : payload, length));
  });
}
kvw_inbox_t* kvw_engine_open_inbox(kvw_engine_t* e, const char* topic, uint64_t max_queued_bytes,
                                   int peer_events, char** errptr) {
  return GuardMake(errptr, [&]() -> absl::StatusOr<std::unique_ptr<kvw_inbox_t>> {
    if (absl::Status s = Require("kvw_engine_open_inbox", {{"engine", e}, {"topic", topic}});
        !s.ok()) {
      return s;
    }
    kvwire::InboxOptions options;
    if (max_queued_bytes != 0) options.max_queued_bytes = max_queued_bytes;
    options.peer_events = peer_events != 0;
    absl::StatusOr<std::unique_ptr<kvwire::Inbox>> inbox = e->rep->OpenInbox(topic, options);
    if (!inbox.ok()) return inbox.status();
    auto out = std::make_unique<kvw_inbox_t>();
    out->rep = std::move(*inbox);
    return out;
  });
}
const char* kvw_inbox_topic(const kvw_inbox_t* inbox) {
  return inbox == nullptr ? nullptr : inbox->rep->topic().c_str();
}
kvw_inbox_events_t* kvw_inbox_take(kvw_inbox_t* inbox, char** errptr) {
  return GuardMake(errptr, [&]() -> absl::StatusOr<std::unique_ptr<kvw_inbox_events_t>> {
    if (absl::Status s = Require("kvw_inbox_take", {{"inbox", inbox}}); !s.ok()) return s;
    auto out = std::make_unique<kvw_inbox_events_t>();
    out->rep = inbox->rep->Take();
    return out;
  });
}
kvw_inbox_events_t* kvw_inbox_wait(kvw_inbox_t* inbox, int64_t timeout_ms, char** errptr) {
  return GuardMake(errptr, [&]() -> absl::StatusOr<std::unique_ptr<kvw_inbox_events_t>> {
    constexpr char kCall[] = "kvw_inbox_wait";
    if (absl::Status s = Require(kCall, {{"inbox", inbox}}); !s.ok()) return s;
    absl::Duration timeout;
    if (absl::Status s = WaitTimeout(kCall, timeout_ms, &timeout); !s.ok()) return s;
    auto out = std::make_unique<kvw_inbox_events_t>();
    out->rep = inbox->rep->Wait(timeout);
    return out;
  });
}
void kvw_inbox_destroy(kvw_inbox_t* inbox) { delete inbox; }
size_t kvw_inbox_events_count(const kvw_inbox_events_t* ev) {
  return ev == nullptr ? 0 : ev->rep.size();
}
int kvw_inbox_events_kind(const kvw_inbox_events_t* ev, size_t i) {
  const kvwire::InboxEvent* x = At(ev == nullptr ? nullptr : &ev->rep, i);
  if (x == nullptr) return -1;
  return x->kind == kvwire::InboxEvent::Kind::kPeerClosed ? KVW_INBOX_PEER_CLOSED
                                                          : KVW_INBOX_MESSAGE;
}
uint64_t kvw_inbox_events_peer(const kvw_inbox_events_t* ev, size_t i) {
  const kvwire::InboxEvent* x = At(ev == nullptr ? nullptr : &ev->rep, i);
  return x == nullptr ? 0 : x->peer;
}
const char* kvw_inbox_events_peer_name(const kvw_inbox_events_t* ev, size_t i) {
  const kvwire::InboxEvent* x = At(ev == nullptr ? nullptr : &ev->rep, i);
  return x == nullptr ? nullptr : x->peer_name.c_str();
}
const char* kvw_inbox_events_payload(const kvw_inbox_events_t* ev, size_t i, size_t* length) {
  const kvwire::InboxEvent* x = At(ev == nullptr ? nullptr : &ev->rep, i);
  if (length != nullptr) *length = x == nullptr ? 0 : x->payload.size();
  return x == nullptr ? nullptr : x->payload.c_str();
}
void kvw_inbox_events_destroy(kvw_inbox_events_t* ev) { delete ev; }

// --- stats ---

char* kvw_engine_stats_json(const kvw_engine_t* e) {
  return NoThrow<char*>(nullptr, [&]() -> char* {
    return e == nullptr ? nullptr : CopyString(e->rep->Stats().ToJson());
  });
}
char* kvw_engine_stats_prometheus(const kvw_engine_t* e) {
  return NoThrow<char*>(nullptr, [&]() -> char* {
    return e == nullptr ? nullptr : CopyString(e->rep->Stats().ToPrometheus(e->rep->name()));
  });
}

}  // extern "C"
