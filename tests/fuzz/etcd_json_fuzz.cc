// etcd's JSON gateway answers (src/discovery/etcd_json.cc) and the instance records read from
// etcd (src/discovery/instance.cc): what a wrong endpoint, a proxy, or another writer under
// the prefix could hand the discovery client. Byte 0 picks the parser; the rest is the body.
#include <cstddef>
#include <cstdint>
#include <string>

#include "src/discovery/etcd_json.h"
#include "src/discovery/instance.h"
#include "tests/fuzz/fuzz_util.h"

using namespace kvwire::discovery;

namespace {

void CheckKv(const EtcdKv& kv) {
  KVWIRE_FUZZ_CHECK(!kv.key.empty() && kv.key.size() <= kEtcdMaxKeyBytes);
  KVWIRE_FUZZ_CHECK(kv.value.size() <= kEtcdMaxValueBytes);
  KVWIRE_FUZZ_CHECK(kv.mod_revision >= 0 && kv.create_revision >= 0 && kv.lease >= 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 6) {
    case 0: {
      absl::StatusOr<EtcdRange> r = ParseRangeResponse(body);
      if (r.ok()) {
        KVWIRE_FUZZ_CHECK(r->kvs.size() <= kEtcdMaxKvs && r->revision >= 0);
        for (const EtcdKv& kv : r->kvs) CheckKv(kv);
      }
      break;
    }
    case 1: {
      int64_t deleted = -1;
      absl::StatusOr<int64_t> r = ParseHeaderRevision(body, &deleted);
      if (r.ok()) KVWIRE_FUZZ_CHECK(*r >= 0 && deleted >= 0);
      break;
    }
    case 2: {
      absl::StatusOr<EtcdLease> g = ParseLeaseGrantResponse(body);
      if (g.ok()) KVWIRE_FUZZ_CHECK(g->id > 0 && g->ttl > 0);
      absl::StatusOr<EtcdLease> k = ParseKeepAliveResponse(body);
      if (k.ok()) KVWIRE_FUZZ_CHECK(k->ttl >= 0);
      absl::StatusOr<std::string> t = ParseAuthenticateResponse(body);  // the auth token
      if (t.ok()) KVWIRE_FUZZ_CHECK(!t->empty() && t->size() <= 4096);
      break;
    }
    case 3: {
      absl::StatusOr<EtcdWatchMessage> m = ParseWatchMessage(body);
      if (m.ok()) {
        KVWIRE_FUZZ_CHECK(m->events.size() <= kEtcdMaxKvs && m->compact_revision >= 0);
        for (const EtcdWatchEvent& e : m->events) CheckKv(e.kv);
      }
      break;
    }
    case 4: {
      absl::Status s = EtcdError(200, body);
      (void)EtcdError(404, body);
      KVWIRE_FUZZ_CHECK(s.ok() || s.message().size() < 2000);
      break;
    }
    case 5: {
      absl::StatusOr<InstanceRecord> r = InstanceRecord::FromJson(body);
      if (r.ok()) {
        KVWIRE_FUZZ_CHECK(CheckName("name", r->name).ok());
        absl::StatusOr<InstanceRecord> again = InstanceRecord::FromJson(r->ToJson());
        KVWIRE_FUZZ_CHECK(again.ok());
        KVWIRE_FUZZ_CHECK(again->ToJson() == r->ToJson());
      }
      break;
    }
  }
  return 0;
}
