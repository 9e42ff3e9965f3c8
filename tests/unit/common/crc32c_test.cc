#include "common/crc32c.h"

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace muond::common {
namespace crc32c_internal {
// The table implementation, defined in crc32c.cc and deliberately absent from the header.
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n);
}  // namespace crc32c_internal
namespace {

// One bit at a time, straight from the definition (reflected polynomial 0x82F63B78).
uint32_t BitwiseCrc32c(const unsigned char* p, size_t n) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

uint32_t Crc(const std::string& s) { return Crc32c(s.data(), s.size()); }

TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
  EXPECT_EQ(Crc("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc("a"), 0xC1D04330u);
  EXPECT_EQ(Crc("abc"), 0x364B3FB7u);
  // RFC 3720 (iSCSI) B.4 test patterns.
  EXPECT_EQ(Crc(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc(std::string(32, '\xFF')), 0x62A8AB43u);
  std::string ascending(32, 0), descending(32, 0);
  for (int i = 0; i < 32; ++i) {
    ascending[i] = static_cast<char>(i);
    descending[i] = static_cast<char>(31 - i);
  }
  EXPECT_EQ(Crc(ascending), 0x46DD794Eu);
  EXPECT_EQ(Crc(descending), 0x113FDB5Cu);
}

TEST(Crc32cTest, PortableKnownVectors) {
  EXPECT_EQ(crc32c_internal::Crc32cExtendPortable(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c_internal::Crc32cExtendPortable(0, std::string(32, '\xFF').data(), 32),
            0x62A8AB43u);
}

TEST(Crc32cTest, ExtendEqualsWhole) {
  const std::string s = "The quick brown fox jumps over the lazy dog";
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    const uint32_t first = Crc32c(s.data(), cut);
    EXPECT_EQ(Crc32cExtend(first, s.data() + cut, s.size() - cut), Crc(s)) << "cut " << cut;
    EXPECT_EQ(crc32c_internal::Crc32cExtendPortable(first, s.data() + cut, s.size() - cut), Crc(s));
  }
  EXPECT_EQ(Crc(s), 0x22620404u);
}

// Every length 0..100 at every alignment 0..7, both implementations against the bitwise one.
TEST(Crc32cTest, UnalignedLengthsMatchBitwiseReference) {
  std::vector<unsigned char> buf(128);
  uint32_t x = 12345;
  for (auto& b : buf) {
    x = x * 1103515245u + 12345u;
    b = static_cast<unsigned char>(x >> 16);
  }
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t n = 0; n <= 100; ++n) {
      const unsigned char* p = buf.data() + offset;
      const uint32_t want = BitwiseCrc32c(p, n);
      ASSERT_EQ(Crc32c(p, n), want) << "offset " << offset << " n " << n;
      ASSERT_EQ(crc32c_internal::Crc32cExtendPortable(0, p, n), want)
          << "offset " << offset << " n " << n;
    }
  }
}

TEST(Crc32cTest, LargeBufferBothPathsAgree) {
  std::vector<unsigned char> buf((1 << 20) + 13);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 131 + (i >> 9));
  const uint32_t want = BitwiseCrc32c(buf.data() + 3, buf.size() - 3);
  EXPECT_EQ(Crc32c(buf.data() + 3, buf.size() - 3), want);
  EXPECT_EQ(crc32c_internal::Crc32cExtendPortable(0, buf.data() + 3, buf.size() - 3), want);
}

}  // namespace
}  // namespace muond::common
