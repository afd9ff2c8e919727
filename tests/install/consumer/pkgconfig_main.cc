// Built by tests/install/run.sh with `pkg-config --cflags --libs kvwire` alone: proves that
// kvwire.pc names everything needed to compile against the public headers and link.
#include <cstdio>

#include "kvwire/engine.h"
#include "kvwire/memory.h"

int main() {
  // The buffer outlives the engine that registers it.
  auto buffer = kvwire::ShareableBuffer::Create(4096);
  if (!buffer.ok()) {
    std::fprintf(stderr, "pkg-config consumer: %s\n", buffer.status().ToString().c_str());
    return 1;
  }
  auto engine = kvwire::Engine::Create(kvwire::EngineOptions());
  if (!engine.ok()) {
    std::fprintf(stderr, "pkg-config consumer: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  auto region = (*engine)->RegisterMemory(buffer->data(), buffer->size());
  if (!region.ok()) {
    std::fprintf(stderr, "pkg-config consumer: %s\n", region.status().ToString().c_str());
    return 1;
  }
  std::printf("pkg-config consumer ok (%s listening on %s)\n", (*engine)->name().c_str(),
              (*engine)->address().c_str());
  return 0;
}
