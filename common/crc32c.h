// CRC32C (Castagnoli), the checksum carried by every data chunk on the wire.
// Uses the SSE4.2 crc32 instruction when the CPU has it, a table otherwise. Thread-safe.
#ifndef MUOND_COMMON_CRC32C_H_
#define MUOND_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace muond::common {

// Extends `crc` (the CRC32C of earlier bytes, 0 for none) with n bytes at data.
// Crc32c(0, "123456789", 9) == 0xE3069283.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

}  // namespace muond::common

#endif  // MUOND_COMMON_CRC32C_H_
