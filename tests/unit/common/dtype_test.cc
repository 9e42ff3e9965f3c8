#include "common/dtype.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace muond::common {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t ToBf16(float f) {
  uint16_t h;
  FromFloat32(&f, 1, DType::kBFloat16, &h);
  return h;
}
uint16_t ToFp16(float f) {
  uint16_t h;
  FromFloat32(&f, 1, DType::kFloat16, &h);
  return h;
}
float Widen(DType dtype, uint16_t h) {
  float f;
  ToFloat32(dtype, &h, 1, &f);
  return f;
}

TEST(DTypeTest, NamesAndSizes) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2u);
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    EXPECT_EQ(*ParseDType(DTypeName(d)), d);
    EXPECT_EQ(*ParseSafetensorsDType(SafetensorsDTypeName(d)), d);
  }
  EXPECT_EQ(*ParseDType("fp32"), DType::kFloat32);
  EXPECT_EQ(*ParseDType("bf16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("fp16"), DType::kFloat16);
  const auto bad = ParseDType("int8");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'int8'"), std::string_view::npos);
  EXPECT_NE(bad.status().message().find("bfloat16"), std::string_view::npos);
  const auto bad_st = ParseSafetensorsDType("I64");
  EXPECT_EQ(bad_st.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_st.status().message().find("'I64'"), std::string_view::npos);
}

TEST(DTypeTest, Bf16Rounding) {
  EXPECT_EQ(ToBf16(1.0f), 0x3F80);
  EXPECT_EQ(ToBf16(-2.0f), 0xC000);
  EXPECT_EQ(ToBf16(FromBits(0x3F808000)), 0x3F80);               // tie, 0x3F80 is even: down
  EXPECT_EQ(ToBf16(FromBits(0x3F818000)), 0x3F82);               // tie, 0x3F81 is odd: up
  EXPECT_EQ(ToBf16(FromBits(0x3F808001)), 0x3F81);               // just above the tie
  EXPECT_EQ(ToBf16(FromBits(0x3F807FFF)), 0x3F80);               // just below the tie
  EXPECT_EQ(ToBf16(FromBits(0x3F7FFFFF)), 0x3F80);               // carry into the exponent
  EXPECT_EQ(ToBf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds past the max: inf
  EXPECT_EQ(ToBf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(ToBf16(FromBits(0x00000001)), 0x0000);  // smallest float subnormal
  EXPECT_EQ(ToBf16(FromBits(0x00018000)), 0x0002);  // subnormal tie to even
  EXPECT_EQ(ToBf16(-0.0f), 0x8000);
}

TEST(DTypeTest, Bf16NaNStaysNaN) {
  EXPECT_EQ(ToBf16(std::numeric_limits<float>::quiet_NaN()), 0x7FC0);
  // A signaling NaN whose payload lies only in the low 16 bits must not truncate to inf.
  const uint16_t h = ToBf16(FromBits(0xFF800001));
  EXPECT_TRUE(std::isnan(Widen(DType::kBFloat16, h)));
  EXPECT_EQ(h & 0x8000, 0x8000);
  EXPECT_EQ(ToBf16(FromBits(0x7FFFFFFF)), 0x7FFF);  // rounding never wraps a NaN to zero
}

TEST(DTypeTest, Fp16Rounding) {
  EXPECT_EQ(ToFp16(1.0f), 0x3C00);
  EXPECT_EQ(ToFp16(-1.5f), 0xBE00);
  EXPECT_EQ(ToFp16(1.0f + 0x1p-11f), 0x3C00);      // tie, even: down
  EXPECT_EQ(ToFp16(1.0f + 3 * 0x1p-11f), 0x3C02);  // tie, odd: up
  EXPECT_EQ(ToFp16(std::nextafter(1.0f + 0x1p-11f, 2.0f)), 0x3C01);
  EXPECT_EQ(ToFp16(65504.0f), 0x7BFF);  // max half
  EXPECT_EQ(ToFp16(65519.996f), 0x7BFF);
  EXPECT_EQ(ToFp16(65520.0f), 0x7C00);  // tie between 65504 (odd) and 2^16: inf
  EXPECT_EQ(ToFp16(1e6f), 0x7C00);
  EXPECT_EQ(ToFp16(-1e6f), 0xFC00);
  EXPECT_EQ(ToFp16(std::numeric_limits<float>::max()), 0x7C00);
  EXPECT_EQ(ToFp16(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(ToFp16(-0.0f), 0x8000);
}

TEST(DTypeTest, Fp16Subnormals) {
  EXPECT_EQ(ToFp16(0x1p-14f), 0x0400);  // smallest normal
  EXPECT_EQ(ToFp16(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(ToFp16(0x1p-25f), 0x0000);  // tie with zero: even
  EXPECT_EQ(ToFp16(-0x1p-25f), 0x8000);
  EXPECT_EQ(ToFp16(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(ToFp16(3 * 0x1p-25f), 0x0002);        // 1.5 units: tie to even 2
  EXPECT_EQ(ToFp16(5 * 0x1p-25f), 0x0002);        // 2.5 units: tie to even 2
  EXPECT_EQ(ToFp16(1023 * 0x1p-24f), 0x03FF);     // largest subnormal
  EXPECT_EQ(ToFp16(1023.5f * 0x1p-24f), 0x0400);  // tie, odd: up into the normals
  EXPECT_EQ(ToFp16(1e-10f), 0x0000);
  EXPECT_EQ(Widen(DType::kFloat16, 0x0001), 0x1p-24f);
  EXPECT_EQ(Widen(DType::kFloat16, 0x83FF), -1023 * 0x1p-24f);
  EXPECT_EQ(Widen(DType::kFloat16, 0x7BFF), 65504.0f);
  EXPECT_EQ(Widen(DType::kFloat16, 0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(Bits(Widen(DType::kFloat16, 0x8000)), 0x80000000u);
}

TEST(DTypeTest, Fp16NaNStaysNaN) {
  EXPECT_EQ(ToFp16(std::numeric_limits<float>::quiet_NaN()), 0x7E00);
  const uint16_t h = ToFp16(FromBits(0xFF800001));  // payload below the fp16 mantissa
  EXPECT_EQ(h & 0x7C00, 0x7C00);
  EXPECT_NE(h & 0x03FF, 0);
  EXPECT_EQ(h & 0x8000, 0x8000);
}

// Every 16-bit pattern widens exactly and narrows back to itself; NaNs stay NaN of the same sign
// (a signaling NaN comes back quiet).
void CheckExhaustiveRoundTrip(DType dtype) {
  std::vector<uint16_t> all(65536), back(65536);
  std::vector<float> wide(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  ToFloat32(dtype, all.data(), all.size(), wide.data());
  FromFloat32(wide.data(), wide.size(), dtype, back.data());
  int nans = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    if (std::isnan(wide[i])) {
      ++nans;
      float again;
      ToFloat32(dtype, &back[i], 1, &again);
      ASSERT_TRUE(std::isnan(again)) << std::hex << i;
      ASSERT_EQ(back[i] & 0x8000, i & 0x8000) << std::hex << i;
    } else {
      ASSERT_EQ(back[i], all[i]) << std::hex << i;
    }
  }
  EXPECT_EQ(nans, dtype == DType::kBFloat16 ? 2 * 127 : 2 * 1023);
}

TEST(DTypeTest, ExhaustiveBf16RoundTrip) { CheckExhaustiveRoundTrip(DType::kBFloat16); }
TEST(DTypeTest, ExhaustiveFp16RoundTrip) { CheckExhaustiveRoundTrip(DType::kFloat16); }

#if defined(__FLT16_MAX__)
// The compiler's own float -> _Float16 conversion (round to nearest even) as an independent
// reference, on a stride through all float bit patterns.
TEST(DTypeTest, Fp16NarrowingMatchesCompiler) {
  std::vector<float> src;
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += 4093)
    src.push_back(FromBits(static_cast<uint32_t>(u)));
  std::vector<uint16_t> got(src.size());
  FromFloat32(src.data(), src.size(), DType::kFloat16, got.data());
  for (size_t i = 0; i < src.size(); ++i) {
    if (std::isnan(src[i])) continue;
    const _Float16 h = static_cast<_Float16>(src[i]);
    uint16_t want;
    std::memcpy(&want, &h, 2);
    ASSERT_EQ(got[i], want) << std::hex << Bits(src[i]);
  }
}
#endif

TEST(DTypeTest, Float32IsACopy) {
  const std::vector<float> src = {1.5f, -0.0f, std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> a(3), b(3);
  ToFloat32(DType::kFloat32, src.data(), 3, a.data());
  FromFloat32(a.data(), 3, DType::kFloat32, b.data());
  EXPECT_EQ(std::memcmp(b.data(), src.data(), 12), 0);
}

TEST(DTypeTest, FindNonFinite) {
  std::vector<float> v(1 << 20, 1.0f);
  EXPECT_EQ(FindNonFinite(v.data(), 0), -1);
  EXPECT_EQ(FindNonFinite(v.data(), v.size()), -1);
  v[777777] = std::numeric_limits<float>::quiet_NaN();
  v[900000] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FindNonFinite(v.data(), v.size()), 777777);
  EXPECT_EQ(FindNonFinite(v.data(), 777777), -1);
  v[1023] = -std::numeric_limits<float>::infinity();  // last element of the first block
  EXPECT_EQ(FindNonFinite(v.data(), v.size()), 1023);
  v[0] = FromBits(0x7F800001);  // signaling NaN
  EXPECT_EQ(FindNonFinite(v.data(), v.size()), 0);
  std::vector<float> edge = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                             std::numeric_limits<float>::denorm_min(), -0.0f};
  EXPECT_EQ(FindNonFinite(edge.data(), edge.size()), -1);
  edge.push_back(-std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(FindNonFinite(edge.data(), edge.size()), 4);
}

// Prints the throughput against a plain std::isfinite loop measured in the same run.
TEST(DTypeTest, FindNonFiniteThroughput) {
  std::vector<float> v(1 << 24, 0.5f);
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const int64_t found = FindNonFinite(v.data(), v.size());
  const auto t1 = Clock::now();
  int64_t naive = -1;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) {
      naive = static_cast<int64_t>(i);
      break;
    }
  }
  const auto t2 = Clock::now();
  EXPECT_EQ(found, -1);
  EXPECT_EQ(naive, -1);
  const double ours = std::chrono::duration<double>(t1 - t0).count();
  const double base = std::chrono::duration<double>(t2 - t1).count();
  std::printf("FindNonFinite: %.2f GB/s, isfinite loop %.2f GB/s, ratio %.2fx\n",
              v.size() * 4 / ours / 1e9, v.size() * 4 / base / 1e9, base / ours);
}

}  // namespace
}  // namespace muond::common

namespace muond::common {
namespace {

TEST(DTypeRawTest, FindNonFiniteRawMatchesConvertedScan) {
  // Every 16-bit pattern once, in both 16-bit dtypes: the raw scan finds exactly the elements
  // whose float32 widening is non-finite.
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<float> wide(all.size());
    ToFloat32(dt, all.data(), all.size(), wide.data());
    size_t start = 0;
    while (start < all.size()) {
      const int64_t raw = FindNonFiniteRaw(dt, all.data() + start, all.size() - start);
      const int64_t conv = FindNonFinite(wide.data() + start, wide.size() - start);
      ASSERT_EQ(raw, conv) << DTypeName(dt) << " from " << start;
      if (raw < 0) break;
      start += static_cast<size_t>(raw) + 1;
    }
  }
  std::vector<float> f(5000, 1.0f);
  EXPECT_EQ(FindNonFiniteRaw(DType::kFloat32, f.data(), f.size()), -1);
  f[4097] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(FindNonFiniteRaw(DType::kFloat32, f.data(), f.size()), 4097);
}

}  // namespace
}  // namespace muond::common
