// The shm transport's GPU region key (transport/shm/gpu_region_key.cc): a peer sends it for
// each GPU region it exports, and the importer opens the IPC handle it names at the offset and
// length it states. A key that parses must describe a range inside its allocation and encode
// back to the same bytes; PCI bus ids (the same key's provenance) are parsed as well.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "tests/fuzz/fuzz_util.h"
#include "transport/shm/gpu_region_key.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvwire::transport::shm;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<GpuRegionKey> key = ParseGpuRegionKey(bytes);
  if (key.ok()) {
    KVWIRE_FUZZ_CHECK(key->device >= 0 && key->allocation_size > 0);
    KVWIRE_FUZZ_CHECK(key->offset <= key->allocation_size &&
                      key->length <= key->allocation_size - key->offset);
    KVWIRE_FUZZ_CHECK(key->handle.backend == key->backend);
    (void)GpuBackendWord(key->backend);
    // Reserved bytes 5..7 are not checked on input; everything else must round-trip.
    std::string expected(bytes);
    expected[5] = expected[6] = expected[7] = '\0';
    KVWIRE_FUZZ_CHECK(EncodeGpuRegionKey(*key) == expected);
  } else {
    KVWIRE_FUZZ_CHECK(key.status().code() == absl::StatusCode::kInvalidArgument);
  }
  (void)PackPciBusId(bytes.substr(0, 64));
  return 0;
}
