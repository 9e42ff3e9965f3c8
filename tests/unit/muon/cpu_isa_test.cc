// The CPU path (server/optim/cpu_isa.h): what it reports, how a bad --cpu-isa is refused, and bf16
// emulation against the native path and the precision contract (DESIGN.md 3). The ctest entry
// muon_math_tests_emulated runs this binary again with MUOND_CPU_ISA=avx2, so every bf16 case of
// the suite (float64 contract, same-shape batching, thread counts) also runs emulated.
#include "server/optim/cpu_isa.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/float_bits.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/optim/adamw.h"
#include "server/optim/muon_math.h"

namespace muond::server {
namespace {

using common::DType;
using common::MuonConfig;
using common::NsMethod;

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Restores the probed bf16 path when a test that forced emulation ends.
class ForceEmulation {
 public:
  explicit ForceEmulation(bool on) { SetBf16EmulationForTesting(on); }
  ~ForceEmulation() { SetBf16EmulationForTesting(false); }
};

TEST(CpuIsaTest, ThePathIsConsistentAndDescribed) {
  const CpuMathPath& path = CurrentCpuMathPath();
  EXPECT_LE(path.isa, path.hardware);
  EXPECT_FALSE(path.onednn_isa.empty());
  EXPECT_FALSE(path.why.empty());
  // Native bf16 only on AVX-512 BF16 or AMX.
  if (path.bf16_native) EXPECT_GE(path.isa, CpuIsa::kAvx512);
  const std::string text = DescribeCpuMathPath(path);
  EXPECT_EQ(text.rfind(CpuIsaName(path.isa), 0), 0u) << text;
  EXPECT_NE(text.find(path.bf16_native ? "bf16 native" : "bf16 emulated"), std::string::npos)
      << text;
  const char* env = std::getenv("MUOND_CPU_ISA");
  if (env != nullptr && std::string(env) == "avx2") {
    EXPECT_EQ(path.isa, CpuIsa::kAvx2);
    EXPECT_TRUE(path.forced);
    EXPECT_FALSE(path.bf16_native);
    EXPECT_EQ(path.onednn_isa.rfind("avx2", 0), 0u) << path.onednn_isa;  // oneDNN capped too
    EXPECT_TRUE(EmulateBf16());
  }
}

TEST(CpuIsaTest, BadRequestsAreRefused) {
  (void)CurrentCpuMathPath();  // set from the environment first
  // An unknown name: INVALID_ARGUMENT naming it.
  absl::Status s = ConfigureCpuIsa("avx1024");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("avx1024"), absl::string_view::npos) << s;
  EXPECT_EQ(ConfigureCpuIsa("").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConfigureCpuIsa("AVX2").code(), absl::StatusCode::kInvalidArgument);
  // Wider than the CPU: INVALID_ARGUMENT naming what the CPU has.
  const CpuIsa hardware = CurrentCpuMathPath().hardware;
  if (hardware < CpuIsa::kAmx) {
    s = ConfigureCpuIsa("amx");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(CpuIsaName(hardware)), absl::string_view::npos) << s;
  }
  // Another valid request once the path is set: FAILED_PRECONDITION; the path is unchanged.
  const CpuIsa before = CurrentCpuMathPath().isa;
  const char* env = std::getenv("MUOND_CPU_ISA");
  const std::string current = env != nullptr && *env != '\0' ? env : "auto";
  const std::string other = current == "avx2" ? "auto" : "avx2";
  s = ConfigureCpuIsa(other);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(ConfigureCpuIsa(current).ok());  // the same request again is fine
  EXPECT_EQ(CurrentCpuMathPath().isa, before);
}

// Every element of NS's result at scale 1 is a bf16 value widened (the last op rounds to bf16).
bool AllBf16Values(const std::vector<float>& x) {
  for (float v : x) {
    if (common::Bf16ToFloat(common::FloatToBf16(v)) != v) return false;
  }
  return true;
}

// ||a - b||_F / ||b||_F.
double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    n += double(b[i]) * double(b[i]);
  }
  return std::sqrt(d / n);
}

std::vector<float> Ns(const MuonConfig& config, int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<float> x = Random(static_cast<size_t>(rows * cols), seed);
  absl::Status s = NewtonSchulz(config, {1, rows, cols}, x.data());
  EXPECT_TRUE(s.ok()) << s;
  return x;
}

TEST(CpuIsaTest, EmulatedBf16RoundsLikeBf16AndStaysNearTheNativeAndFp32Results) {
  SetMathThreads(2);
  for (NsMethod method : {NsMethod::kStandard, NsMethod::kPolarExpress, NsMethod::kGram}) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{96, 96}, {64, 520}, {300, 128}}) {
      MuonConfig config;
      config.ns_method = method;
      config.compute_dtype = DType::kFloat32;
      const std::vector<float> fp32 = Ns(config, rows, cols, 5);
      config.compute_dtype = DType::kBFloat16;
      std::vector<float> emulated;
      {
        ForceEmulation on(true);
        emulated = Ns(config, rows, cols, 5);
      }
      const std::string where = absl::StrCat(std::string(common::NsMethodName(method)), " ", rows, "x", cols);
      // Rounded to bf16 (the fp32 path's values are not), and bf16's distance from fp32.
      EXPECT_TRUE(AllBf16Values(emulated)) << where;
      EXPECT_FALSE(AllBf16Values(fp32)) << where;
      const double from_fp32 = RelativeError(emulated, fp32);
      EXPECT_GT(from_fp32, 0.0) << where;
      EXPECT_LT(from_fp32, 5e-2) << where;  // bf16's distance from fp32 (DESIGN.md 3's bound)
      if (!CurrentCpuMathPath().bf16_native) continue;
      // The native path rounds at the same points; only the accumulation order differs.
      const std::vector<float> native = Ns(config, rows, cols, 5);
      EXPECT_TRUE(AllBf16Values(native)) << where;
      const double from_native = RelativeError(emulated, native);
      std::printf("%s: emulated vs fp32 %.2e, vs native bf16 %.2e, native vs fp32 %.2e\n",
                  where.c_str(), from_fp32, from_native, RelativeError(native, fp32));
      // Same rounding points: much nearer each other than either is to fp32 (measured here up to
      // 6.4e-3 against 1.3e-2 from fp32; rounding only the result would put it at fp32's
      // distance). The Gram method picks its shapes by cost, which differs between the paths.
      EXPECT_LT(from_native, method == NsMethod::kGram ? 5e-2 : 1e-2) << where;
    }
  }
}

TEST(CpuIsaTest, EmulatedBf16IsDeterministic) {
  MuonConfig config;
  config.compute_dtype = DType::kBFloat16;
  ForceEmulation on(true);
  std::vector<float> first;
  for (int threads : {1, 2, 3}) {
    SetMathThreads(threads);
    std::vector<float> x = Ns(config, 200, 330, 9);
    if (first.empty()) {
      first = x;
    } else {
      EXPECT_EQ(std::memcmp(x.data(), first.data(), x.size() * sizeof(float)), 0) << threads;
    }
  }
  SetMathThreads(2);
}

}  // namespace
}  // namespace muond::server
