// Same-shape batching (MuonUpdateSameShape): several matrices of one shape in one batched
// Newton-Schulz give exactly the bits of each matrix alone, for every compute dtype, method and
// block shape (small blocks that LibTorch routes differently by batch size, wide and tall blocks,
// heads); and its errors name the matrix and leave every momentum untouched. The same for several
// shapes in one call (MuonUpdateGroups), and a non-finite result names its group. Newton-Schulz's
// bits do not depend on the math thread count either.
#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/optim/muon_math.h"
#include "server/optim/newton_schulz.h"
#include "server/optim/ns_tasks.h"

namespace muond::server {
namespace {

using common::DType;
using common::MatrixSpec;
using common::MuonConfig;
using common::NsMethod;

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Shape {
  std::vector<int64_t> dims;
  int64_t heads;
};

TEST(MuonSameShapeTest, BatchedEqualsOneAtATimeBitForBit) {
  SetMathThreads(2);
  const std::vector<Shape> shapes = {
      {{8, 12}, 1},     {{12, 8}, 1},      {{16, 16}, 1},   {{40, 24}, 1},   {{64, 64}, 1},
      {{64, 1024}, 1},  {{1024, 64}, 1},   {{96, 160}, 1},  {{256, 256}, 1}, {{128, 64}, 4},
      {{4, 24, 16}, 1}, {{8, 4, 3, 3}, 1}, {{300, 200}, 1}, {{12, 160}, 1},
  };
  int compared = 0;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (NsMethod method : {NsMethod::kStandard, NsMethod::kGram, NsMethod::kPolarExpress}) {
      MuonConfig config;
      config.compute_dtype = dtype;
      config.ns_method = method;
      for (const Shape& shape : shapes) {
        MatrixSpec spec;
        spec.name = "w";
        spec.shape = shape.dims;
        spec.num_heads = shape.heads;
        const size_t n = static_cast<size_t>(spec.numel());
        SCOPED_TRACE(absl::StrCat(std::string(common::DTypeName(dtype)), " method ",
                                  static_cast<int>(method), " shape ",
                                  absl::StrJoin(shape.dims, "x"), " heads ", shape.heads));
        constexpr size_t kCount = 3;
        std::vector<std::vector<float>> grads, moms, alone_u, alone_m, batch_u, batch_m;
        for (size_t k = 0; k < kCount; ++k) {
          grads.push_back(Random(n, 11 * k + n));
          moms.push_back(Random(n, 7 * k + 3 * n + 1));
        }
        for (size_t k = 0; k < kCount; ++k) {
          alone_m.push_back(moms[k]);
          alone_u.emplace_back(n);
          ASSERT_TRUE(
              MuonUpdate(config, spec, grads[k].data(), alone_m[k].data(), alone_u[k].data()).ok());
        }
        batch_m = moms;
        batch_u.assign(kCount, std::vector<float>(n));
        std::vector<const float*> g;
        std::vector<float*> m, u;
        for (size_t k = 0; k < kCount; ++k) {
          g.push_back(grads[k].data());
          m.push_back(batch_m[k].data());
          u.push_back(batch_u[k].data());
        }
        const std::vector<const MatrixSpec*> specs(kCount, &spec);
        ASSERT_TRUE(
            MuonUpdateSameShape(config, kCount, specs.data(), g.data(), m.data(), u.data()).ok());
        for (size_t k = 0; k < kCount; ++k) {
          EXPECT_TRUE(SameBits(batch_u[k], alone_u[k])) << "update of matrix " << k;
          EXPECT_TRUE(SameBits(batch_m[k], alone_m[k])) << "momentum of matrix " << k;
          ++compared;
        }
      }
    }
  }
  EXPECT_EQ(compared, 3 * 3 * 14 * 3);
}

// A non-finite gradient in the second of three matrices: INVALID_ARGUMENT naming it, and no
// momentum written (not even the first matrix's).
TEST(MuonSameShapeTest, NonFiniteGradientNamesTheMatrixAndWritesNoMomentum) {
  MuonConfig config;
  MatrixSpec spec, spec1;
  spec.name = "layers.0.mlp";
  spec.shape = {16, 32};
  spec1 = spec;
  spec1.name = "layers.1.mlp";
  const std::vector<const MatrixSpec*> specs = {&spec, &spec1, &spec};
  const size_t n = 16 * 32;
  std::vector<std::vector<float>> grads = {Random(n, 1), Random(n, 2), Random(n, 3)};
  grads[1][77] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::vector<float>> moms = {Random(n, 4), Random(n, 5), Random(n, 6)};
  const auto before = moms;
  std::vector<std::vector<float>> ups(3, std::vector<float>(n));
  std::vector<const float*> g = {grads[0].data(), grads[1].data(), grads[2].data()};
  std::vector<float*> m = {moms[0].data(), moms[1].data(), moms[2].data()};
  std::vector<float*> u = {ups[0].data(), ups[1].data(), ups[2].data()};
  absl::Status s = MuonUpdateSameShape(config, 3, specs.data(), g.data(), m.data(), u.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("'layers.1.mlp'"), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find("element 77"), std::string::npos) << s;
  for (int k = 0; k < 3; ++k) EXPECT_TRUE(SameBits(moms[k], before[k])) << k;
}

TEST(MuonSameShapeTest, DifferentShapesAreRefused) {
  common::MuonConfig config;
  common::MatrixSpec a, b;
  a.name = "a";
  a.shape = {8, 8};
  b.name = "b";
  b.shape = {8, 8};
  b.num_heads = 2;
  std::vector<float> ga(64, 1.0f), gb(64, 1.0f), ma(64, 0.0f), mb(64, 0.0f);
  const std::vector<const common::MatrixSpec*> specs = {&a, &b};
  std::vector<const float*> g = {ga.data(), gb.data()};
  std::vector<float*> m = {ma.data(), mb.data()}, u = {ga.data(), gb.data()};
  absl::Status s = MuonUpdateSameShape(config, 2, specs.data(), g.data(), m.data(), u.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("'a' and 'b'"), std::string::npos) << s;
  EXPECT_EQ(ma, std::vector<float>(64, 0.0f));
}

// Several shapes in one call (MuonUpdateGroups, ScaledNewtonSchulzGroups): each matrix gets
// exactly the bits of MuonUpdate on it alone, for every compute dtype and method (bf16 standard and
// polar express take the pooled task iteration, the others one group after another).
// Matrices of several shapes (two of each), with their buffers.
struct Model {
  std::vector<MatrixSpec> specs;
  std::vector<std::vector<float>> grads, moms, ups;

  explicit Model(const std::vector<std::vector<int64_t>>& shapes) {
    for (size_t s = 0; s < shapes.size(); ++s) {
      for (int copy = 0; copy < 2; ++copy) {
        MatrixSpec spec;
        spec.name = absl::StrCat("w", s, ".", copy);
        spec.shape = shapes[s];
        const size_t n = static_cast<size_t>(spec.numel());
        specs.push_back(spec);
        grads.push_back(Random(n, static_cast<uint32_t>(3 * specs.size() + n)));
        moms.push_back(Random(n, static_cast<uint32_t>(5 * specs.size() + 1)));
        ups.emplace_back(n);
      }
    }
  }

  // MuonUpdateGroups with groups of two same-shape matrices each.
  absl::Status UpdateGroups(const MuonConfig& config) {
    const size_t groups = specs.size() / 2;
    spec_ptrs.clear();
    g.clear();
    m.clear();
    u.clear();
    for (size_t i = 0; i < specs.size(); ++i) {
      spec_ptrs.push_back(&specs[i]);
      g.push_back(grads[i].data());
      m.push_back(moms[i].data());
      u.push_back(ups[i].data());
    }
    std::vector<MuonGroup> list;
    for (size_t k = 0; k < groups; ++k) {
      list.push_back({2, &spec_ptrs[2 * k], &g[2 * k], &m[2 * k], &u[2 * k]});
    }
    return MuonUpdateGroups(config, list.data(), list.size());
  }

  std::vector<const MatrixSpec*> spec_ptrs;
  std::vector<const float*> g;
  std::vector<float*> m, u;
};

const std::vector<std::vector<int64_t>> kShapes = {{96, 160}, {160, 96},   {64, 64},
                                                   {300, 70}, {4, 24, 16}, {8, 12}};

TEST(MuonGroupsTest, EveryShapeGetsTheBitsOfItsMatrixAlone) {
  SetMathThreads(2);
  for (DType dtype : {DType::kBFloat16, DType::kFloat32, DType::kFloat16}) {
    for (NsMethod method : {NsMethod::kStandard, NsMethod::kPolarExpress, NsMethod::kGram}) {
      MuonConfig config;
      config.compute_dtype = dtype;
      config.ns_method = method;
      SCOPED_TRACE(absl::StrCat(std::string(common::DTypeName(dtype)), " method ",
                                static_cast<int>(method)));
      Model grouped(kShapes), alone(kShapes);
      ASSERT_TRUE(grouped.UpdateGroups(config).ok());
      for (size_t i = 0; i < alone.specs.size(); ++i) {
        ASSERT_TRUE(MuonUpdate(config, alone.specs[i], alone.grads[i].data(), alone.moms[i].data(),
                               alone.ups[i].data())
                        .ok());
        EXPECT_TRUE(SameBits(grouped.ups[i], alone.ups[i])) << alone.specs[i].name;
        EXPECT_TRUE(SameBits(grouped.moms[i], alone.moms[i])) << alone.specs[i].name;
      }
    }
  }
}

TEST(MuonGroupsTest, ANonFiniteGradientInALaterGroupWritesNoMomentumInAnyGroup) {
  MuonConfig config;
  config.compute_dtype = DType::kBFloat16;
  Model model(kShapes);
  model.grads[7][3] = std::numeric_limits<float>::infinity();  // w3.1
  const auto before = model.moms;
  const absl::Status s = model.UpdateGroups(config);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("'w3.1'"), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find("element 3"), std::string::npos) << s;
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(SameBits(model.moms[i], before[i])) << i;
}

// MuonGroup::momenta_in (how the cpu device runs a step in place: the committed momentum read
// where it is stored, the new one written into the store's back buffer): the input is never
// written, and the new momentum and the update are the bits of the in-place call; a refused
// gradient writes neither output.
TEST(MuonGroupsTest, ASeparateMomentumInputIsOnlyReadAndGivesTheInPlaceBits) {
  SetMathThreads(2);
  for (bool nesterov : {true, false}) {
    MuonConfig config;
    config.compute_dtype = DType::kBFloat16;
    config.nesterov = nesterov;
    SCOPED_TRACE(nesterov ? "nesterov" : "plain momentum");
    Model in_place(kShapes), separate(kShapes);
    ASSERT_TRUE(in_place.UpdateGroups(config).ok());
    const auto committed = separate.moms;
    std::vector<std::vector<float>> next(committed.size());
    std::vector<const MatrixSpec*> specs;
    std::vector<const float*> g, m_in;
    std::vector<float*> m_out, u;
    for (size_t i = 0; i < separate.specs.size(); ++i) {
      next[i].assign(committed[i].size(), -7.0f);
      specs.push_back(&separate.specs[i]);
      g.push_back(separate.grads[i].data());
      m_in.push_back(separate.moms[i].data());
      m_out.push_back(next[i].data());
      u.push_back(separate.ups[i].data());
    }
    std::vector<MuonGroup> list;
    for (size_t k = 0; 2 * k < specs.size(); ++k) {
      list.push_back({2, &specs[2 * k], &g[2 * k], &m_out[2 * k], &u[2 * k], &m_in[2 * k]});
    }
    ASSERT_TRUE(MuonUpdateGroups(config, list.data(), list.size()).ok());
    for (size_t i = 0; i < specs.size(); ++i) {
      EXPECT_TRUE(SameBits(separate.moms[i], committed[i])) << "input written: " << i;
      EXPECT_TRUE(SameBits(next[i], in_place.moms[i])) << "new momentum: " << i;
      EXPECT_TRUE(SameBits(separate.ups[i], in_place.ups[i])) << "update: " << i;
    }

    // A refused gradient: neither the input nor the output momentum changes.
    for (auto& v : next) std::fill(v.begin(), v.end(), -7.0f);
    separate.grads[9][5] = std::numeric_limits<float>::quiet_NaN();  // w4.1
    const absl::Status s = MuonUpdateGroups(config, list.data(), list.size());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find("'w4.1'"), std::string::npos) << s;
    for (size_t i = 0; i < specs.size(); ++i) {
      EXPECT_TRUE(SameBits(separate.moms[i], committed[i])) << i;
      EXPECT_EQ(next[i], std::vector<float>(next[i].size(), -7.0f)) << i;
    }
  }
}

TEST(MuonGroupsTest, ANonFiniteResultNamesItsGroup) {
  MuonConfig config;
  config.compute_dtype = DType::kBFloat16;  // the pooled path
  std::vector<float> a = Random(64 * 96, 1), b = Random(96 * 64, 2), c = Random(32 * 32, 3);
  b[100] = std::numeric_limits<float>::quiet_NaN();  // past the gradient check: NS input itself
  float* pa = a.data();
  float* pb = b.data();
  float* pc = c.data();
  const internal::NsGroup groups[] = {
      {MatrixGeometry{1, 64, 96}, 1, 1.0, &pa},
      {MatrixGeometry{1, 96, 64}, 1, 1.0, &pb},
      {MatrixGeometry{1, 32, 32}, 1, 1.0, &pc},
  };
  size_t failed = 0;
  const absl::Status s = internal::ScaledNewtonSchulzGroups(config, groups, 3, &failed);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(failed, 1u);
  EXPECT_NE(std::string(s.message()).find("not finite"), std::string::npos) << s;

  const internal::NsGroup bad_geometry[] = {{MatrixGeometry{1, 0, 5}, 1, 1.0, &pa}};
  EXPECT_EQ(internal::ScaledNewtonSchulzGroups(config, bad_geometry, 1, &failed).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(failed, 0u);
}

// The task pool's pieces depend only on the block's shape (ns_tasks.h).
TEST(NsTasksTest, StripRowsDependOnlyOnTheRowCount) {
  EXPECT_EQ(internal::StripRows(1), 64);
  EXPECT_EQ(internal::StripRows(100), 64);
  EXPECT_EQ(internal::StripRows(512), 128);
  EXPECT_EQ(internal::StripRows(520), 192);
  EXPECT_EQ(internal::StripRows(1024), 256);
  EXPECT_EQ(internal::StripRows(4096), internal::kMaxStripRows);
}

TEST(NsTasksTest, ChunkColsDependOnlyOnTheColumnCountAndSplitEvenly) {
  EXPECT_EQ(internal::ChunkCols(1), 1);
  EXPECT_EQ(internal::ChunkCols(512), 256);
  EXPECT_EQ(internal::ChunkCols(768), 384);
  EXPECT_EQ(internal::ChunkCols(1024), 512);
  EXPECT_EQ(internal::ChunkCols(1536), 384);
  EXPECT_EQ(internal::ChunkCols(3072), internal::kMaxChunkCols);
  for (int64_t n = 33; n <= 20000; n += 7) {
    const int64_t w = internal::ChunkCols(n), chunks = (n + w - 1) / w;
    EXPECT_LE(w, internal::kMaxChunkCols) << n;
    EXPECT_EQ(chunks % 2, 0) << n << " columns in " << chunks << " chunks of " << w;
  }
}

// One, two and three math threads give the same bits, for every dtype the task pool and BLAS run
// (fp32 and bf16 on the pool, fp16 emulation on BLAS, bf16 with fp32 iterations first, and gram),
// on shapes with several strips and column chunks, wide and tall.
TEST(MuonThreadsTest, NewtonSchulzBitsDoNotDependOnTheThreadCount) {
  struct Case {
    DType dtype;
    NsMethod method;
    int fp32_iterations;
  };
  const std::vector<Case> cases = {
      {DType::kFloat32, NsMethod::kStandard, 0},  {DType::kBFloat16, NsMethod::kStandard, 0},
      {DType::kBFloat16, NsMethod::kStandard, 2}, {DType::kFloat16, NsMethod::kStandard, 0},
      {DType::kFloat32, NsMethod::kGram, 0},      {DType::kBFloat16, NsMethod::kPolarExpress, 0},
      {DType::kBFloat16, NsMethod::kGram, 0},
  };
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{520, 520}, {700, 300}, {300, 1100}};
  for (const Case& c : cases) {
    MuonConfig config;
    config.compute_dtype = c.dtype;
    config.ns_method = c.method;
    config.fp32_iterations = c.fp32_iterations;
    for (const auto& [rows, cols] : shapes) {
      const std::vector<float> input = Random(static_cast<size_t>(rows * cols), 11);
      std::vector<float> expected;
      for (int threads : {1, 2, 3}) {
        SetMathThreads(threads);
        std::vector<float> x = input;
        ASSERT_TRUE(NewtonSchulz(config, {1, rows, cols}, x.data()).ok());
        if (expected.empty()) {
          expected = x;
          continue;
        }
        EXPECT_TRUE(SameBits(x, expected))
            << common::DTypeName(c.dtype) << " fp32_iterations=" << c.fp32_iterations << " " << rows
            << "x" << cols << " with " << threads << " threads";
      }
    }
  }
  SetMathThreads(2);
}

}  // namespace
}  // namespace muond::server
