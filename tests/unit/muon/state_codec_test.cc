// Compressed optimizer state (server/optim/state_codec.h) against a float64 evaluation of its
// definition: block scales, codes, rounding ties, zero, all-equal and tiny blocks, a partial last
// block, the fused momentum step, and that no finite input ever yields a NaN.
#include "server/optim/state_codec.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "server/optim/muon_math.h"

namespace muond::server {
namespace {

// A tensor spanning 3 blocks and a partial one; values over several orders of magnitude.
std::vector<float> Values(size_t n, uint32_t seed, double spread = 6.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> exponent(-spread, 0.0);
  std::vector<float> x(n);
  for (float& v : x) v = static_cast<float>(normal(rng) * std::pow(10.0, exponent(rng)));
  return x;
}

// float64 reference of the signed linear code of one element (DESIGN.md 4): the block's scale
// absmax / 127, then nearest even, clamped.
struct LinearRef {
  std::vector<double> scales;
  std::vector<double> decoded;
};

LinearRef LinearReference(const std::vector<float>& x) {
  LinearRef ref;
  for (size_t i = 0; i < x.size(); i += kStateBlock) {
    const size_t end = std::min(x.size(), i + kStateBlock);
    double absmax = 0;
    for (size_t k = i; k < end; ++k) absmax = std::max(absmax, std::fabs(double(x[k])));
    const double s = absmax / 127.0;
    ref.scales.push_back(s);
    for (size_t k = i; k < end; ++k) {
      const double q = s == 0 ? 0 : std::clamp(std::nearbyint(double(x[k]) / s), -127.0, 127.0);
      ref.decoded.push_back(q * s);
    }
  }
  return ref;
}

TEST(StateCodecTest, BytesPerElement) {
  EXPECT_EQ(StateBytes(StateDType::kFloat32, 5000), 20000u);
  EXPECT_EQ(StateBytes(StateDType::kBFloat16, 5000), 10000u);
  EXPECT_EQ(StateBytes(StateDType::kInt8, 5000), 5000u + 4 * 3);  // 3 blocks of 2048
  EXPECT_EQ(StateBlocks(2048), 1u);
  EXPECT_EQ(StateBlocks(2049), 2u);
}

TEST(StateCodecTest, LinearInt8MatchesFloat64Definition) {
  const size_t n = 3 * kStateBlock + 517;
  const std::vector<float> x = Values(n, 11);
  std::vector<int8_t> q(n);
  std::vector<float> scales(StateBlocks(n)), back(n);
  EncodeLinearInt8(x.data(), n, q.data(), scales.data());
  DecodeLinearInt8(q.data(), scales.data(), n, back.data());
  const LinearRef ref = LinearReference(x);
  for (size_t b = 0; b < scales.size(); ++b) {
    EXPECT_NEAR(scales[b], ref.scales[b], 1e-6 * ref.scales[b]) << "block " << b;
  }
  for (size_t i = 0; i < n; ++i) {
    const double s = ref.scales[i / kStateBlock];
    // The fp32 quotient may round a tie the other way: within one code of the float64 one, and
    // always within half a code (plus fp32 rounding) of the value itself.
    ASSERT_LE(std::fabs(back[i] - ref.decoded[i]), s * 1.0001) << i;
    ASSERT_LE(std::fabs(double(back[i]) - double(x[i])), s * 0.5001 + 1e-30) << i;
  }
}

TEST(StateCodecTest, LinearInt8ZeroAllEqualTinyAndTies) {
  std::vector<float> x(kStateBlock + 10, 0.0f);
  for (size_t i = kStateBlock; i < x.size(); ++i) x[i] = -0.375f;  // an all-equal partial block
  std::vector<int8_t> q(x.size());
  std::vector<float> scales(2), back(x.size());
  EncodeLinearInt8(x.data(), x.size(), q.data(), scales.data());
  DecodeLinearInt8(q.data(), scales.data(), x.size(), back.data());
  EXPECT_EQ(scales[0], 0.0f) << "a block of zeros";
  for (size_t i = 0; i < kStateBlock; ++i) ASSERT_EQ(back[i], 0.0f);
  for (size_t i = kStateBlock; i < x.size(); ++i) {
    EXPECT_EQ(q[i], -127);
    EXPECT_NEAR(back[i], -0.375f, 1e-7f);
  }
  // Ties go to even: with absmax 127 the scale is 1 and 2.5 -> 2, 3.5 -> 4, -0.5 -> -0.
  std::vector<float> ties = {127.0f, 2.5f, 3.5f, -0.5f, -1.5f};
  std::vector<int8_t> tq(ties.size());
  float ts = 0;
  EncodeLinearInt8(ties.data(), ties.size(), tq.data(), &ts);
  EXPECT_EQ(ts, 1.0f);
  EXPECT_EQ(std::vector<int>(tq.begin(), tq.end()), (std::vector<int>{127, 2, 4, 0, -2}));
  // Subnormal values: the scale underflows towards 0, never a NaN or an infinity out.
  std::vector<float> tiny = {1e-44f, -3e-45f, 0.0f};
  std::vector<int8_t> yq(3);
  std::vector<float> yb(3);
  float ys = 0;
  EncodeLinearInt8(tiny.data(), 3, yq.data(), &ys);
  DecodeLinearInt8(yq.data(), &ys, 3, yb.data());
  for (float v : yb) EXPECT_TRUE(std::isfinite(v));
}

TEST(StateCodecTest, LogInt8KeepsRelativePrecisionAtEveryMagnitude) {
  const size_t n = 2 * kStateBlock + 33;
  std::vector<float> v = Values(n, 12, 8.0);
  for (float& e : v) e = e * e;  // a second moment: non-negative, 16 orders of magnitude
  v[5] = 0.0f;
  std::vector<uint8_t> q(n);
  std::vector<float> scales(StateBlocks(n)), back(n);
  EncodeLogInt8(v.data(), n, q.data(), scales.data());
  DecodeLogInt8(q.data(), scales.data(), n, back.data());
  EXPECT_EQ(back[5], 0.0f) << "zero stays zero";
  const double step = std::exp2(1.0 / 32.0) - 1.0;  // half a code: 2^(1/32)
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(std::isfinite(back[i])) << i;
    const double top = scales[i / kStateBlock];
    if (v[i] == 0) continue;
    if (double(v[i]) >= top * std::exp2(-254.0 / 16.0)) {
      ASSERT_LE(std::fabs(back[i] - double(v[i])) / v[i], step * 1.001) << i;
    } else {
      // Below the smallest code: stored as it (an overestimate: a smaller step, never a larger).
      ASSERT_EQ(q[i], 1) << i;
      ASSERT_GE(back[i], v[i]) << i;
    }
  }
  // A linear code of the same values would have rounded most of them to 0.
  int linear_zeros = 0;
  std::vector<int8_t> lq(n);
  std::vector<float> ls(StateBlocks(n));
  EncodeLinearInt8(v.data(), n, lq.data(), ls.data());
  for (int8_t c : lq) linear_zeros += c == 0;
  EXPECT_GT(linear_zeros, static_cast<int>(n / 2));
}

TEST(StateCodecTest, Bf16IsNearestEven) {
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to 1 (even); 1 + 3 * 2^-8 ties up.
  const std::vector<float> x = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -2.0f, 0.0f, 1e-40f};
  std::vector<uint16_t> b(x.size());
  std::vector<float> back(x.size());
  EncodeBf16(x.data(), x.size(), b.data());
  DecodeBf16(b.data(), x.size(), back.data());
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], 1.0f + 0x1p-6f);
  EXPECT_EQ(back[2], -2.0f);
  EXPECT_EQ(back[3], 0.0f);
  EXPECT_TRUE(std::isfinite(back[4]));
}

// The fused step is decode, ApplyMomentum, encode: the fp32 momentum it returns is bit for bit the
// fp32 path's from the decoded value, and the stored code is that momentum encoded; against a
// float64 EMA of the quantized momentum it is within fp32 rounding.
TEST(StateCodecTest, FusedMomentumStepIsTheFp32EmaOfTheDecodedMomentum) {
  common::MuonConfig config;
  config.momentum = 0.95;
  const size_t n = 2 * kStateBlock + 100;
  const std::vector<float> m0 = Values(n, 13, 3.0), grad = Values(n, 14, 3.0);
  std::vector<int8_t> q(n);
  std::vector<float> scales(StateBlocks(n));
  EncodeLinearInt8(m0.data(), n, q.data(), scales.data());
  std::vector<float> decoded(n);
  DecodeLinearInt8(q.data(), scales.data(), n, decoded.data());
  std::vector<float> expect = decoded;
  ApplyMomentum(config, grad.data(), expect.data(), n);

  std::vector<float> momentum(n);
  MomentumStepInt8(config, grad.data(), q.data(), scales.data(), n, momentum.data(), q.data(),
                   scales.data());  // in place
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(momentum[i], expect[i]) << i;
    const double ema = double(decoded[i]) + 0.05 * (double(grad[i]) - double(decoded[i]));
    // fp32 rounding of the operands' magnitude (the difference G - M cancels).
    const double ulps = 4 * 0x1p-24 * (std::fabs(decoded[i]) + std::fabs(grad[i]));
    ASSERT_NEAR(momentum[i], ema, ulps + 1e-30) << i;
  }
  std::vector<int8_t> q_expect(n);
  std::vector<float> s_expect(StateBlocks(n));
  EncodeLinearInt8(expect.data(), n, q_expect.data(), s_expect.data());
  EXPECT_EQ(q, q_expect);
  EXPECT_EQ(scales, s_expect);

  std::vector<uint16_t> b(n);
  EncodeBf16(m0.data(), n, b.data());
  std::vector<float> bdec(n), bm(n);
  DecodeBf16(b.data(), n, bdec.data());
  ApplyMomentum(config, grad.data(), bdec.data(), n);
  MomentumStepBf16(config, grad.data(), b.data(), n, bm.data(), b.data());
  EXPECT_EQ(bm, bdec);
  for (size_t i = 0; i < n; ++i) ASSERT_TRUE(std::isfinite(bm[i]));
}

// Decoding then encoding again gives the same bits, so a checkpoint or export that holds the
// decoded fp32 values reloads the job's state exactly: every dtype and map, values over 12 orders
// of magnitude, a partial last block, a zero block.
TEST(StateCodecTest, EncodingDecodedValuesGivesTheSameBits) {
  const size_t n = 5 * kStateBlock + 77;
  std::vector<float> x = Values(n, 23, 12.0);
  for (size_t i = kStateBlock; i < 2 * kStateBlock; ++i) x[i] = 0.0f;
  for (StateDType dtype : {StateDType::kBFloat16, StateDType::kInt8}) {
    for (StateRole role : {StateRole::kSigned, StateRole::kNonNegative}) {
      std::vector<float> in = x;
      if (role == StateRole::kNonNegative) {
        for (float& v : in) v = v * v;
      }
      std::vector<float> held(StoredWords(dtype, n)), again(held.size()), decoded(n);
      EncodeStoredAll(dtype, role, in.data(), n, held.data());
      DecodeStoredAll(dtype, role, held.data(), n, decoded.data());
      EncodeStoredAll(dtype, role, decoded.data(), n, again.data());
      ASSERT_EQ(0, std::memcmp(held.data(), again.data(), StateBytes(dtype, n)))
          << common::StateDTypeName(dtype) << " role " << static_cast<int>(role);
    }
  }
}

// The held layout: a range of whole blocks encodes and decodes as the whole array does; fp32
// copies; every scale satisfies (127 s) / 127 == s and lies within a few ulps of absmax / 127.
TEST(StateCodecTest, HeldRangesMatchTheWholeArray) {
  const size_t n = 3 * kStateBlock + 5;
  const std::vector<float> x = Values(n, 31);
  for (StateDType dtype : {StateDType::kFloat32, StateDType::kBFloat16, StateDType::kInt8}) {
    std::vector<float> whole(StoredWords(dtype, n)), ranges(whole.size());
    EncodeStoredAll(dtype, StateRole::kSigned, x.data(), n, whole.data());
    EncodeStored(dtype, StateRole::kSigned, x.data(), n, 0, 2 * kStateBlock, ranges.data());
    EncodeStored(dtype, StateRole::kSigned, x.data() + 2 * kStateBlock, n, 2 * kStateBlock,
                 n - 2 * kStateBlock, ranges.data());
    ASSERT_EQ(0, std::memcmp(whole.data(), ranges.data(), StateBytes(dtype, n)));
    std::vector<float> part(kStateBlock + 5), all(n);
    DecodeStoredAll(dtype, StateRole::kSigned, whole.data(), n, all.data());
    DecodeStored(dtype, StateRole::kSigned, whole.data(), n, 2 * kStateBlock, kStateBlock + 5,
                 part.data());
    for (size_t i = 0; i < part.size(); ++i) ASSERT_EQ(part[i], all[2 * kStateBlock + i]);
    if (dtype == StateDType::kFloat32) EXPECT_EQ(all, x);
  }
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(1e-30f, 1e30f);
  for (int i = 0; i < 100000; ++i) {
    const float absmax = u(rng);
    const float s = LinearScale(absmax);
    ASSERT_EQ((s * 127.0f) / 127.0f, s) << absmax;
    ASSERT_LE(s, std::nextafter(std::nextafter(absmax / 127.0f, 1e38f), 1e38f)) << absmax;
    ASSERT_GE(s, absmax / 127.0f) << absmax;
  }
}

// The fused kernel (MuonGroup::held_in/held_out, what the cpu device runs for compressed
// momentum): over the compute team's ranges (a matrix of several ranges, two math threads),
// encoding in place into the committed array, bit for bit the whole-array decode, MuonUpdate and
// encode, for the update and the new momentum.
TEST(StateCodecTest, FusedKernelIsDecodeMuonUpdateEncode) {
  SetMathThreads(2);
  common::MatrixSpec spec;
  spec.name = "w";
  spec.shape = {300, 1001};  // 300300 elements: 5 ranges of 65536, a partial block at the end
  const size_t n = static_cast<size_t>(spec.numel());
  common::MuonConfig config;
  for (StateDType dtype : {StateDType::kBFloat16, StateDType::kInt8}) {
    const std::vector<float> m0 = Values(n, 3, 2.0), grad = Values(n, 4, 2.0);
    std::vector<float> held(StoredWords(dtype, n));
    EncodeStoredAll(dtype, StateRole::kSigned, m0.data(), n, held.data());
    // The reference: decode, MuonUpdate, encode.
    std::vector<float> momentum(n), update(n), want(held.size());
    DecodeStoredAll(dtype, StateRole::kSigned, held.data(), n, momentum.data());
    ASSERT_TRUE(MuonUpdate(config, spec, grad.data(), momentum.data(), update.data()).ok());
    EncodeStoredAll(dtype, StateRole::kSigned, momentum.data(), n, want.data());
    // Fused, in place.
    std::vector<float> fused(n);
    const common::MatrixSpec* specs[] = {&spec};
    const float* grads[] = {grad.data()};
    float* updates[] = {fused.data()};
    const float* in[] = {held.data()};
    float* out[] = {held.data()};
    MuonGroup group;
    group.count = 1;
    group.specs = specs;
    group.grads = grads;
    group.updates = updates;
    group.held_in = in;
    group.held_out = out;
    group.held_dtype = dtype;
    ASSERT_TRUE(MuonUpdateGroups(config, &group, 1).ok());
    EXPECT_EQ(0, std::memcmp(fused.data(), update.data(), n * sizeof(float)))
        << common::StateDTypeName(dtype);
    EXPECT_EQ(0, std::memcmp(held.data(), want.data(), StateBytes(dtype, n)))
        << common::StateDTypeName(dtype);
  }
}

}  // namespace
}  // namespace muond::server
