// A live connector for the connector fuzz targets: a "both"-role Connector with a small MHA
// layout registered on shareable memory, created once per process (engine, listener and
// progress thread are far too slow to create per input).
#ifndef KVWIRE_TESTS_FUZZ_CONNECTOR_FIXTURE_H_
#define KVWIRE_TESTS_FUZZ_CONNECTOR_FIXTURE_H_

#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "kvwire/connector.h"
#include "kvwire/layout.h"
#include "kvwire/memory.h"
#include "tests/fuzz/fuzz_util.h"

namespace kvwire::fuzz {

struct ConnectorFixture {
  ShareableBuffer memory;
  Layout layout;
  std::unique_ptr<Connector> connector;
};

// The layout of both the victim and a well-behaved peer: 2 layers, 1 KV head of 16 bytes,
// 16 tokens per block, 16 blocks.
inline Layout FixtureLayout(uint64_t base) {
  MhaOptions mha;
  mha.layers = 2;
  mha.kv_heads = 1;
  mha.head_dim = 8;
  mha.tokens_per_block = 16;
  Layout layout = MhaLayout(mha);
  layout.model = "fuzz-mha";
  AssignBacking(&layout, base, 16);
  return layout;
}

inline ConnectorFixture& Victim() {
  static ConnectorFixture* fixture = [] {
    auto* f = new ConnectorFixture;
    f->layout = FixtureLayout(0);
    const uint64_t need = AssignBacking(&f->layout, 0, 16);
    absl::StatusOr<ShareableBuffer> memory = ShareableBuffer::Create(need, "kvwire-fuzz-kv");
    KVWIRE_FUZZ_CHECK(memory.ok());
    f->memory = *std::move(memory);
    f->layout = FixtureLayout(reinterpret_cast<uint64_t>(f->memory.data()));
    ConnectorOptions o;
    o.role = "both";
    o.engine.name = "victim";
    o.engine.transport = "tcp";
    o.engine.tcp().connections = 1;
    o.request_timeout = absl::Seconds(2);
    o.handshake_timeout = absl::Milliseconds(200);
    absl::StatusOr<std::unique_ptr<Connector>> c = Connector::Create(o);
    KVWIRE_FUZZ_CHECK(c.ok());
    f->connector = *std::move(c);
    KVWIRE_FUZZ_CHECK(
        f->connector->RegisterKvCaches(f->layout, {KvMemory{f->memory.data(), f->memory.size()}})
            .ok());
    return f;
  }();
  return *fixture;
}

}  // namespace kvwire::fuzz

#endif  // KVWIRE_TESTS_FUZZ_CONNECTOR_FIXTURE_H_
