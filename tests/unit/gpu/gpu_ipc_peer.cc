// The other process of the GPU IPC test:
//   gpu_ipc_peer BACKEND DEVICE HANDLE_HEX BYTES SEED_IN SEED_OUT
// maps the handle, checks that the memory holds Pattern(SEED_IN), overwrites it with
// Pattern(SEED_OUT) and exits 0; any failure is printed on one line and exits 1.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"

#include "tests/unit/gpu/gpu_test_util.h"

namespace kvwire::gpu::testing {
namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "gpu_ipc_peer: %s\n", what.c_str());
  return 1;
}

int Run(int argc, char** argv) {
  if (argc != 7) return Fail("usage: BACKEND DEVICE HANDLE_HEX BYTES SEED_IN SEED_OUT");
  Runtime* rt = RuntimeByName(argv[1]);
  if (rt == nullptr) return Fail(std::string("backend not in this build: ") + argv[1]);
  int device = 0;
  uint64_t bytes = 0;
  uint32_t seed_in = 0, seed_out = 0;
  if (!absl::SimpleAtoi(argv[2], &device) || !absl::SimpleAtoi(argv[4], &bytes) ||
      !absl::SimpleAtoi(argv[5], &seed_in) || !absl::SimpleAtoi(argv[6], &seed_out)) {
    return Fail("bad number");
  }
  const std::string hex = argv[3];
  IpcHandle handle;
  handle.backend = rt->backend();
  if (hex.size() != 2 * kIpcHandleBytes) return Fail("handle must be 128 hex digits");
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < kIpcHandleBytes; ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return Fail("handle must be lower-case hex");
    handle.bytes[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  absl::StatusOr<IpcMapping> mapping = IpcMapping::Open(*rt, device, handle);
  if (!mapping.ok()) return Fail(std::string(mapping.status().message()));
  absl::StatusOr<Stream> stream = Stream::Create(*rt, device);
  if (!stream.ok()) return Fail(std::string(stream.status().message()));
  std::vector<uint8_t> got(bytes);
  if (absl::Status s = stream->Copy(got.data(), mapping->data(), bytes); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  if (got != Pattern(bytes, seed_in)) return Fail("mapped memory does not hold the pattern");
  const std::vector<uint8_t> out = Pattern(bytes, seed_out);
  if (absl::Status s = stream->Copy(mapping->data(), out.data(), bytes); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  return 0;
}

}  // namespace
}  // namespace kvwire::gpu::testing

int main(int argc, char** argv) { return kvwire::gpu::testing::Run(argc, argv); }
