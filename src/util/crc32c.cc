#include "src/util/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace kvwire {
namespace {

constexpr uint32_t kPoly = 0x82F63B78;  // CRC32C, reflected

struct Tables {
  // t[k][b]: the register after byte b followed by k zero bytes (slicing by 8).
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xff];
    }
  }
};
const Tables& T() {
  static const Tables tables;
  return tables;
}

// The raw register (no pre/post inversion) after `n` bytes.
uint32_t TableUpdate(uint32_t reg, const unsigned char* p, size_t n) {
  const auto& t = T().t;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= reg;  // little-endian: the register meets the first four bytes
    reg = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
          t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^
          t[0][(w >> 56) & 0xff];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) reg = (reg >> 8) ^ t[0][(reg ^ *p++) & 0xff];
  return reg;
}

#if defined(__x86_64__)
// a * b modulo the polynomial, both reflected (x^0 is bit 31), as zlib's multmodp.
uint32_t MulModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31;
  uint32_t p = 0;
  while (true) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
    if (m == 0) break;
  }
  return p;
}

// x^(8 * n) modulo the polynomial: what `n` zero bytes multiply the register by.
uint32_t ShiftFor(size_t n) {
  uint32_t x2k = 1u << 30;  // x^1
  uint32_t p = 1u << 31;    // x^0
  for (uint64_t bits = static_cast<uint64_t>(n) * 8; bits != 0; bits >>= 1) {
    if (bits & 1) p = MulModP(x2k, p);
    x2k = MulModP(x2k, x2k);
  }
  return p;
}

// The crc32 instruction has a latency of 3 cycles and a throughput of 1: three independent
// streams over three adjacent blocks keep it busy, and the linearity of the register joins
// them (reg(A|B|C) = reg(A) * x^2L + reg0(B) * x^L + reg0(C)).
constexpr size_t kBigBlock = 4096;
constexpr size_t kSmallBlock = 256;

__attribute__((target("sse4.2"))) uint32_t HardwareUpdate(uint32_t reg, const unsigned char* p,
                                                          size_t n) {
  static const uint32_t big_shift = ShiftFor(kBigBlock);
  static const uint32_t small_shift = ShiftFor(kSmallBlock);
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    reg = _mm_crc32_u8(reg, *p++);
    --n;
  }
  uint64_t r = reg;
  for (const auto& [block, shift] : {std::pair{kBigBlock, big_shift}, {kSmallBlock, small_shift}}) {
    while (n >= 3 * block) {
      uint64_t a = r, b = 0, c = 0;
      const unsigned char* pa = p;
      const unsigned char* pb = p + block;
      const unsigned char* pc = p + 2 * block;
      for (size_t i = 0; i < block; i += 8) {
        uint64_t wa, wb, wc;
        std::memcpy(&wa, pa + i, 8);
        std::memcpy(&wb, pb + i, 8);
        std::memcpy(&wc, pc + i, 8);
        a = _mm_crc32_u64(a, wa);
        b = _mm_crc32_u64(b, wb);
        c = _mm_crc32_u64(c, wc);
      }
      const uint32_t ab = MulModP(shift, static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b);
      r = MulModP(shift, ab) ^ static_cast<uint32_t>(c);
      p += 3 * block;
      n -= 3 * block;
    }
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    r = _mm_crc32_u64(r, w);
    p += 8;
    n -= 8;
  }
  reg = static_cast<uint32_t>(r);
  while (n-- > 0) reg = _mm_crc32_u8(reg, *p++);
  return reg;
}

bool DetectHardware() { return __builtin_cpu_supports("sse4.2"); }
#else
uint32_t HardwareUpdate(uint32_t reg, const unsigned char* p, size_t n) {
  return TableUpdate(reg, p, n);
}
bool DetectHardware() { return false; }
#endif

}  // namespace

bool Crc32cHardware() {
  static const bool hardware = DetectHardware();
  return hardware;
}

uint32_t Crc32c(const void* data, size_t length, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  const uint32_t reg = ~crc;
  return ~(Crc32cHardware() ? HardwareUpdate(reg, p, length) : TableUpdate(reg, p, length));
}

uint32_t Crc32cPortable(const void* data, size_t length, uint32_t crc) {
  return ~TableUpdate(~crc, static_cast<const unsigned char*>(data), length);
}

}  // namespace kvwire
