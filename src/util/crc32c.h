// CRC32C (Castagnoli), the checksum of kvwire's optional end-to-end verification
// (EngineOptions::verify_checksums): computed over an op's bytes by the side that has them and
// checked by the other. x86-64 CPUs with SSE4.2 compute it with the crc32 instruction
// (checked at run time, once); others use a table (slicing by 8). Debian 12's abseil
// (20220623) has no absl/crc yet, hence our own.
#ifndef KVWIRE_UTIL_CRC32C_H_
#define KVWIRE_UTIL_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace kvwire {

// The CRC32C of `length` bytes at `data`, continuing from `crc` (the value of the bytes
// before them; 0 for none): Crc32c(b, Crc32c(a)) == Crc32c(a followed by b).
uint32_t Crc32c(const void* data, size_t length, uint32_t crc = 0);

// The same with the table only (tests compare both paths).
uint32_t Crc32cPortable(const void* data, size_t length, uint32_t crc = 0);

// Whether Crc32c uses the CPU's crc32 instruction (logged, shown by the perf tool).
bool Crc32cHardware();

}  // namespace kvwire

#endif  // KVWIRE_UTIL_CRC32C_H_
