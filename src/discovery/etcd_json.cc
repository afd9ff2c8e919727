#include "src/discovery/etcd_json.h"

#include <limits>

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "src/util/json_fields.h"

namespace kvwire::discovery {

using nlohmann::json;

namespace {

const JsonLimits kLimits{.max_bytes = kEtcdMaxBodyBytes, .max_depth = 8, .max_values = 200000};

// grpc-gateway writes int64 and uint64 fields as decimal strings; a plain number is taken too.
int64_t I64(JsonFields& f, const json& object, const char* field, int64_t lo = 0,
            int64_t hi = std::numeric_limits<int64_t>::max()) {
  if (!f.ok()) return 0;
  const auto it = object.find(field);
  if (it == object.end() || it->is_null()) return 0;
  if (it->is_string()) {
    const std::string& s = it->get_ref<const std::string&>();
    int64_t v = 0;
    if (s.size() > 20 || !absl::SimpleAtoi(s, &v) || v < lo || v > hi) {
      f.Fail(field, absl::StrCat("must be an integer in [", lo, ", ", hi, "]"), *it);
      return 0;
    }
    return v;
  }
  return f.OptInt(field, lo, hi, 0);
}

std::string Bytes(JsonFields& f, const char* field, size_t max_bytes, bool required) {
  // base64 is 4/3 of the bytes, rounded up to a whole quantum.
  const std::string b64 = required ? f.String(field, (max_bytes + 2) / 3 * 4)
                                   : f.OptString(field, "", (max_bytes + 2) / 3 * 4);
  std::string out;
  if (f.ok() && !absl::Base64Unescape(b64, &out)) f.Fail(field, "is not base64");
  if (f.ok() && required && out.empty()) f.Fail(field, "is empty");
  return out;
}

EtcdKv ReadKv(JsonFields& f) {
  EtcdKv kv;
  kv.key = Bytes(f, "key", kEtcdMaxKeyBytes, /*required=*/true);
  kv.value = Bytes(f, "value", kEtcdMaxValueBytes, /*required=*/false);
  return kv;
}

void ReadKvNumbers(JsonFields& f, const json& object, EtcdKv* kv) {
  kv->create_revision = I64(f, object, "create_revision");
  kv->mod_revision = I64(f, object, "mod_revision");
  kv->version = I64(f, object, "version");
  kv->lease = I64(f, object, "lease");
}

int64_t HeaderRevision(JsonFields& f, const json& root) {
  const json* header = f.Object("header", /*required=*/true);
  if (header == nullptr) return 0;
  JsonFields h = f.Nested("header", /*required=*/true);
  return I64(h, *header, "revision");
}

absl::StatusOr<json> Parse(absl::string_view body, const char* what) {
  if (absl::Status e = EtcdError(200, body); !e.ok()) return e;
  return ParseJsonObject(body, what, kLimits);
}

}  // namespace

absl::Status EtcdError(int http_status, absl::string_view body) {
  absl::StatusOr<json> j = ParseJsonObject(body, "etcd's answer", kLimits);
  if (!j.ok()) {
    if (http_status != 200) {
      return absl::UnavailableError(
          absl::StrCat("etcd answered HTTP ", http_status, ": ", body.substr(0, 200)));
    }
    return absl::OkStatus();  // not an error document: the caller's parser says what is wrong
  }
  const auto err = j->find("error");
  if (err == j->end() || err->is_null()) {
    if (http_status == 200) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("etcd answered HTTP ", http_status));
  }
  // Unary calls: {"error": "text", "message": "text", "code": N}; streams: {"error":
  // {"grpc_code": N, "message": "text", ...}}.
  JsonFields f(*j, "etcd's error");
  std::string message;
  int64_t code = 2;  // UNKNOWN
  if (err->is_object()) {
    JsonFields e = f.Nested("error", /*required=*/true);
    message = e.OptString("message", "", 1024);
    code = e.OptInt("grpc_code", 0, 16, 2);
  } else {
    message = f.OptString("message", "", 1024);
    if (message.empty()) message = f.OptString("error", "", 1024);
    code = f.OptInt("code", 0, 16, 2);
  }
  if (!f.ok()) return absl::UnknownError(absl::StrCat("etcd error: ", f.status().message()));
  if (code == 0) code = 2;
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::StrCat("etcd: ", message.empty() ? "(no message)" : message));
}

absl::StatusOr<EtcdRange> ParseRangeResponse(absl::string_view body) {
  absl::StatusOr<json> j = Parse(body, "etcd range");
  if (!j.ok()) return j.status();
  EtcdRange r;
  JsonFields f(*j, "etcd range");
  r.revision = HeaderRevision(f, *j);
  r.more = f.OptBool("more", false);
  const json* kvs = f.Array("kvs", /*required=*/false, kEtcdMaxKvs);
  for (size_t i = 0; kvs != nullptr && i < kvs->size() && f.ok(); ++i) {
    JsonFields k = f.Item((*kvs)[i], absl::StrCat("kvs[", i, "]"));
    EtcdKv kv = ReadKv(k);
    ReadKvNumbers(k, (*kvs)[i], &kv);
    if (f.ok()) r.kvs.push_back(std::move(kv));
  }
  if (!f.ok()) return f.status();
  return r;
}

absl::StatusOr<int64_t> ParseHeaderRevision(absl::string_view body, int64_t* deleted) {
  absl::StatusOr<json> j = Parse(body, "etcd answer");
  if (!j.ok()) return j.status();
  JsonFields f(*j, "etcd answer");
  const int64_t revision = HeaderRevision(f, *j);
  const int64_t n = I64(f, *j, "deleted");
  if (!f.ok()) return f.status();
  if (deleted != nullptr) *deleted = n;
  return revision;
}

absl::StatusOr<EtcdLease> ParseLeaseGrantResponse(absl::string_view body) {
  absl::StatusOr<json> j = Parse(body, "etcd lease grant");
  if (!j.ok()) return j.status();
  JsonFields f(*j, "etcd lease grant");
  EtcdLease l;
  (void)HeaderRevision(f, *j);
  l.id = I64(f, *j, "ID");
  l.ttl = I64(f, *j, "TTL", 0, 1 << 30);
  const std::string error = f.OptString("error", "", 1024);  // LeaseGrantResponse.error
  if (!f.ok()) return f.status();
  if (!error.empty()) return absl::UnavailableError(absl::StrCat("etcd lease grant: ", error));
  if (l.id <= 0 || l.ttl <= 0) {
    return absl::InvalidArgumentError("etcd lease grant: answer has no lease ID or TTL");
  }
  return l;
}

absl::StatusOr<std::string> ParseAuthenticateResponse(absl::string_view body) {
  absl::StatusOr<json> j = Parse(body, "etcd authenticate");
  if (!j.ok()) return j.status();
  JsonFields f(*j, "etcd authenticate");
  (void)HeaderRevision(f, *j);
  const std::string token = f.OptString("token", "", 4096);
  if (!f.ok()) return f.status();
  if (token.empty()) {
    return absl::InvalidArgumentError(
        "etcd authenticate: the answer has no token (is authentication enabled?)");
  }
  return token;
}

absl::StatusOr<EtcdLease> ParseKeepAliveResponse(absl::string_view body) {
  absl::StatusOr<json> j = Parse(body, "etcd lease keep-alive");
  if (!j.ok()) return j.status();
  JsonFields f(*j, "etcd lease keep-alive");
  const json* result = f.Object("result", /*required=*/true);
  EtcdLease l;
  if (result != nullptr) {
    JsonFields r = f.Nested("result", /*required=*/true);
    (void)HeaderRevision(r, *result);
    l.id = I64(r, *result, "ID");
    l.ttl = I64(r, *result, "TTL", 0, 1 << 30);
  }
  if (!f.ok()) return f.status();
  return l;
}

absl::StatusOr<EtcdWatchMessage> ParseWatchMessage(absl::string_view line) {
  absl::StatusOr<json> j = Parse(line, "etcd watch message");
  if (!j.ok()) return j.status();
  JsonFields f(*j, "etcd watch message");
  const json* result = f.Object("result", /*required=*/true);
  EtcdWatchMessage m;
  if (result != nullptr) {
    JsonFields r = f.Nested("result", /*required=*/true);
    m.revision = HeaderRevision(r, *result);
    m.watch_id = I64(r, *result, "watch_id");
    m.created = r.OptBool("created", false);
    m.canceled = r.OptBool("canceled", false);
    m.compact_revision = I64(r, *result, "compact_revision");
    m.cancel_reason = r.OptString("cancel_reason", "", 1024);
    const json* events = r.Array("events", /*required=*/false, kEtcdMaxKvs);
    for (size_t i = 0; events != nullptr && i < events->size() && f.ok(); ++i) {
      const json& ev = (*events)[i];
      JsonFields e = r.Item(ev, absl::StrCat("events[", i, "]"));
      EtcdWatchEvent event;
      const std::string type = e.OptString("type", "PUT", 16);
      if (f.ok() && type != "PUT" && type != "DELETE") e.Fail("type", "must be PUT or DELETE");
      event.deleted = type == "DELETE";
      const json* kv = e.Object("kv", /*required=*/true);
      if (kv != nullptr) {
        JsonFields k = e.Nested("kv", /*required=*/true);
        event.kv = ReadKv(k);
        ReadKvNumbers(k, *kv, &event.kv);
      }
      if (f.ok()) m.events.push_back(std::move(event));
    }
  }
  if (!f.ok()) return f.status();
  return m;
}

std::string PrefixRangeEnd(absl::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    unsigned char& last = reinterpret_cast<unsigned char&>(end.back());
    if (last < 0xff) {
      ++last;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key (etcd's convention for "to the end")
}

}  // namespace kvwire::discovery
