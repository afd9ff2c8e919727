#include "transport/shm/gpu_region_key.h"

#include <cstring>
#include <unistd.h>

#include "absl/random/random.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvwire::transport::shm {
namespace {

constexpr char kMagic[3] = {'K', 'W', 'G'};

void PutU32(std::string* out, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) (*out)[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
void PutU64(std::string* out, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) (*out)[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t GetU32(std::string_view in, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(in[at + i])} << (8 * i);
  return v;
}
uint64_t GetU64(std::string_view in, size_t at) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(in[at + i])} << (8 * i);
  return v;
}

bool ParseHex(std::string_view text, uint32_t max, uint32_t* out) {
  if (text.empty() || text.size() > 8) return false;
  uint32_t v = 0;
  if (!absl::SimpleHexAtoi(absl::string_view(text.data(), text.size()), &v) || v > max)
    return false;
  *out = v;
  return true;
}

}  // namespace

std::string EncodeGpuRegionKey(const GpuRegionKey& key) {
  std::string out(kGpuRegionKeyBytes, '\0');
  std::memcpy(out.data(), kMagic, sizeof(kMagic));
  out[3] = static_cast<char>(kGpuRegionKeyVersion);
  out[4] = static_cast<char>(key.backend);
  PutU32(&out, 8, static_cast<uint32_t>(key.device));
  PutU32(&out, 12, key.pci_bus_id);
  PutU64(&out, 16, key.process_nonce);
  std::memcpy(out.data() + 24, key.handle.bytes.data(), gpu::kIpcHandleBytes);
  PutU64(&out, 88, key.offset);
  PutU64(&out, 96, key.allocation_size);
  PutU64(&out, 104, key.length);
  return out;
}

absl::StatusOr<GpuRegionKey> ParseGpuRegionKey(std::string_view bytes) {
  if (bytes.size() < 4 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a shm GPU region key (", bytes.size(), " bytes, no \"KWG\" magic)"));
  }
  const uint8_t version = static_cast<uint8_t>(bytes[3]);
  if (version != kGpuRegionKeyVersion) {
    return absl::InvalidArgumentError(absl::StrCat("shm GPU region key version ", version,
                                                   ", this build reads version ",
                                                   kGpuRegionKeyVersion));
  }
  if (bytes.size() != kGpuRegionKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("shm GPU region key is ", bytes.size(),
                                                   " bytes, version 1 has ", kGpuRegionKeyBytes,
                                                   " (truncated or padded)"));
  }
  GpuRegionKey key;
  const uint8_t backend = static_cast<uint8_t>(bytes[4]);
  if (backend != static_cast<uint8_t>(gpu::Backend::kCuda) &&
      backend != static_cast<uint8_t>(gpu::Backend::kHip) &&
      backend != static_cast<uint8_t>(gpu::Backend::kEmulated)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm GPU region key names unknown GPU backend ", backend));
  }
  key.backend = static_cast<gpu::Backend>(backend);
  key.device = static_cast<int32_t>(GetU32(bytes, 8));
  key.pci_bus_id = GetU32(bytes, 12);
  key.process_nonce = GetU64(bytes, 16);
  key.handle.backend = key.backend;
  std::memcpy(key.handle.bytes.data(), bytes.data() + 24, gpu::kIpcHandleBytes);
  key.offset = GetU64(bytes, 88);
  key.allocation_size = GetU64(bytes, 96);
  key.length = GetU64(bytes, 104);
  if (key.device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("shm GPU region key names device ", key.device));
  }
  if (key.allocation_size == 0 || key.offset > key.allocation_size ||
      key.length > key.allocation_size - key.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm GPU region key is inconsistent: ", key.length, " B at offset ", key.offset,
        " do not lie inside the allocation of ", key.allocation_size, " B"));
  }
  return key;
}

const char* GpuBackendWord(gpu::Backend backend) {
  switch (backend) {
    case gpu::Backend::kNone:
      return "none";
    case gpu::Backend::kCuda:
      return "cuda";
    case gpu::Backend::kHip:
      return "hip";
    case gpu::Backend::kEmulated:
      return "emulated";
  }
  return "unknown";
}

uint64_t ShmProcessNonce() {
  static const uint64_t nonce = [] {
    absl::BitGen random;
    return absl::Uniform<uint64_t>(random, 1, UINT64_MAX);
  }();
  // A forked child inherits `nonce`; the pid keeps it from taking its parent's keys as its own.
  return nonce ^ (static_cast<uint64_t>(getpid()) * 0x9E3779B97F4A7C15ull);
}

uint32_t PackPciBusId(std::string_view bus_id) {
  // domain:bus:device.function, as gpu::NormalizePciBusId writes it.
  const size_t c1 = bus_id.find(':');
  const size_t c2 = c1 == std::string_view::npos ? c1 : bus_id.find(':', c1 + 1);
  const size_t dot = c2 == std::string_view::npos ? c2 : bus_id.find('.', c2 + 1);
  if (dot == std::string_view::npos) return kUnknownPciBusId;
  uint32_t domain = 0, bus = 0, device = 0, function = 0;
  if (!ParseHex(bus_id.substr(0, c1), 0xffff, &domain) ||
      !ParseHex(bus_id.substr(c1 + 1, c2 - c1 - 1), 0xff, &bus) ||
      !ParseHex(bus_id.substr(c2 + 1, dot - c2 - 1), 0x1f, &device) ||
      !ParseHex(bus_id.substr(dot + 1), 0x7, &function)) {
    return kUnknownPciBusId;
  }
  return domain << 16 | bus << 8 | device << 3 | function;
}

}  // namespace kvwire::transport::shm
