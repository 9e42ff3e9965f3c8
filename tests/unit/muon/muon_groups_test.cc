// Several shapes in one call (MuonUpdateGroups, ScaledNewtonSchulzGroups): each matrix gets exactly
// the bits of MuonUpdate on it alone, for every compute dtype and method (bf16 standard and polar
// express take the pooled task iteration, the others one group after another); a refused gradient
// in any group leaves every group's momentum untouched; a non-finite result names its group.
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/optim/muon_math.h"
#include "server/optim/newton_schulz.h"

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

const std::vector<std::vector<int64_t>> kShapes = {
    {96, 160}, {160, 96}, {64, 64}, {300, 70}, {4, 24, 16}, {8, 12}};

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

}  // namespace
}  // namespace muond::server
