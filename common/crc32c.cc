// CRC32C with two implementations: the SSE4.2 crc32 instruction (8 bytes per instruction) and a
// slicing-by-8 table for CPUs without it. The choice is made once, on first use.
#include "common/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define MUOND_CRC32C_HAVE_X86 1
#endif

namespace muond::common {
namespace {

constexpr uint32_t kPolyReflected = 0x82F63B78u;  // Castagnoli polynomial, bit-reversed.

// tables[k][b] is the CRC of byte b followed by k zero bytes; slicing-by-8 folds 8 input bytes
// per iteration with 8 independent lookups.
struct SlicingTables {
  std::array<std::array<uint32_t, 256>, 8> t;
  constexpr SlicingTables() : t() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t crc = b;
      for (int i = 0; i < 8; ++i) crc = (crc >> 1) ^ ((crc & 1u) ? kPolyReflected : 0u);
      t[0][b] = crc;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
    }
  }
};
constexpr SlicingTables kTables;

inline uint64_t LoadLittleEndian64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));  // x86 and the other targets we build for are little-endian.
  return v;
}

// `crc` is the raw (already inverted) register.
uint32_t ExtendPortable(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& t = kTables.t;
  while (n >= 8) {
    const uint64_t v = LoadLittleEndian64(p) ^ crc;
    crc = t[7][v & 0xFF] ^ t[6][(v >> 8) & 0xFF] ^ t[5][(v >> 16) & 0xFF] ^ t[4][(v >> 24) & 0xFF] ^
          t[3][(v >> 32) & 0xFF] ^ t[2][(v >> 40) & 0xFF] ^ t[1][(v >> 48) & 0xFF] ^ t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#if defined(MUOND_CRC32C_HAVE_X86) && defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t crc, const unsigned char* p,
                                                       size_t n) {
  // Align to 8 bytes first so the 8-byte loads in the main loop never straddle a cache line.
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
  uint64_t crc64 = crc;
  while (n >= 8) {
    crc64 = _mm_crc32_u64(crc64, LoadLittleEndian64(p));
    p += 8;
    n -= 8;
  }
  crc = static_cast<uint32_t>(crc64);
  while (n-- > 0) crc = _mm_crc32_u8(crc, *p++);
  return crc;
}

bool CpuHasSse42() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}
#endif

using ExtendFn = uint32_t (*)(uint32_t, const unsigned char*, size_t);

ExtendFn ChooseExtend() {
#if defined(MUOND_CRC32C_HAVE_X86) && defined(__x86_64__)
  if (CpuHasSse42()) return &ExtendSse42;
#endif
  return &ExtendPortable;
}

}  // namespace

namespace crc32c_internal {
// Not declared in any header: the unit test declares it to check the table path on machines where
// Crc32cExtend always takes the SSE4.2 one.
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n) {
  return ~ExtendPortable(~crc, static_cast<const unsigned char*>(data), n);
}
}  // namespace crc32c_internal

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  static const ExtendFn extend = ChooseExtend();  // thread-safe static initialization
  return ~extend(~crc, static_cast<const unsigned char*>(data), n);
}

}  // namespace muond::common
