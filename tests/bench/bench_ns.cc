// `muond-bench ns`: throughput of the CPU Newton-Schulz (muond::server::NewtonSchulz, standard
// method, 5 iterations) against the best plain LibTorch GEMM rate of the same dtype, measured in
// the same run.
//
// NS GFLOP/s counts standard-equivalent FLOPs: what the plain formula costs on [m, n] with
// m <= n, per iteration 2 m^2 n (A = X X^T) + 2 m^3 (A A) + 2 m^2 n (B X), whatever the
// implementation actually computes; so an NS that saves work (e.g. by symmetry) can pass the GEMM
// rate. The GEMM baseline of a dtype is the best rate of the plain LibTorch matmuls (at::mm) of
// that dtype over every shape measured: X X^T ([m, n] x its transpose) and B X ([m, m] x [m, n],
// i.e. n x n @ n x n for a square shape). Each dtype is compared with the GEMMs of the dtype it is
// computed in: float16 has no CPU Half GEMM in LibTorch 1.13 (NS emulates it on fp32 GEMMs), and
// bfloat16 on a CPU path without bf16 instructions (--cpu-isa avx2, or an AVX2 machine: NS
// emulates it on fp32 products, server/optim/cpu_isa.h), so their baseline is the fp32 one. The
// header prints the CPU path measured.
//
// ratio = geometric mean over the shapes and dtypes of NS GFLOP/s / best GEMM GFLOP/s of the dtype.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "server/optim/cpu_isa.h"
#include "server/optim/muon_math.h"
#include "tests/bench/bench.h"

namespace muond::bench {
namespace {

// Newton-Schulz is GEMM-bound (three products per iteration plus O(mn) elementwise work: norm,
// casts, the write-back, the finiteness scan); counted in standard-equivalent FLOPs it should
// reach 90% of the best GEMM rate of its dtype.
constexpr double kTargetRatio = 0.90;
constexpr int kNsSteps = 5;
// Auto iteration count: after one untimed call (oneDNN creates its primitives, the scratch is
// paged in), time calls until this much has passed, at least kMinAutoIters of them. A short
// window measures the machine's hiccups, not the code: the 512 x 512 GEMM takes under a
// millisecond.
constexpr double kMinSeconds = 1.0;
constexpr int kMinAutoIters = 3;
constexpr int kMaxAutoIters = 100000;

constexpr const char* kUsage =
    "usage: muond-bench ns [--threads N] [--sizes 512,1024,1024x3072]\n"
    "                      [--dtypes float32,bfloat16] [--iters K] [--cpu-isa auto]\n"
    "  Newton-Schulz (standard, 5 iterations) on one r x c fp32 matrix computed in each dtype,\n"
    "  in standard-equivalent GFLOP/s (the plain formula's FLOPs), against the best plain\n"
    "  LibTorch matmul GFLOP/s of the same dtype over the shapes (X X^T and B X of each).\n"
    "  --threads  LibTorch compute threads (default: all hardware threads)\n"
    "  --sizes    shapes: n (n x n) or RxC (default 512,1024,1024x3072)\n"
    "  --dtypes   float32, bfloat16, float16 (default float32,bfloat16); float16 NS is emulated\n"
    "             on fp32 GEMMs and its baseline is the fp32 GEMM rate (LibTorch 1.13 has no CPU\n"
    "             Half GEMM)\n"
    "  --iters    timed calls per measurement, after one untimed call (default: auto, >= 1 s\n"
    "             and >= 3 calls)\n"
    "  --cpu-isa  auto, avx2, avx512 or amx: the CPU path, as muond's flag (avx2: bf16 emulated\n"
    "             on fp32 products, compared with the fp32 GEMM rate; the system BLAS is put on\n"
    "             its AVX2 kernels too)\n"
    "Last line: result: ns ratio=<geometric mean of NS / best GEMM of the dtype> "
    "target=<target>\n";

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Seconds per call of fn, after one untimed call; iters <= 0 means auto.
double TimePerCall(const std::function<void()>& fn, int iters) {
  fn();
  int done = 0;
  const Clock::time_point start = Clock::now();
  while (iters > 0
             ? done < iters
             : (done < kMinAutoIters || (done < kMaxAutoIters && Seconds(start) < kMinSeconds))) {
    fn();
    ++done;
  }
  return Seconds(start) / done;
}

// One matrix shape: rows x cols as given to NewtonSchulz.
struct Shape {
  int64_t rows = 0, cols = 0;
  std::string Name() const {
    return rows == cols ? std::to_string(rows) : absl::StrCat(rows, "x", cols);
  }
};

// The flags of `muond-bench ns`.
struct NsOptions {
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int iters = 0;  // 0: auto
  std::string cpu_isa = "auto";
  std::vector<Shape> shapes = {{512, 512}, {1024, 1024}, {1024, 3072}};
  std::vector<common::DType> dtypes = {common::DType::kFloat32, common::DType::kBFloat16};
};

// "512,1024x3072" -> {512x512, 1024x3072}; INVALID_ARGUMENT for anything else.
absl::StatusOr<std::vector<Shape>> ParseShapes(const std::string& value) {
  std::vector<Shape> out;
  for (const std::string& item : SplitList(value)) {
    const size_t x = item.find('x');
    Shape s;
    bool ok = false;
    if (x == std::string::npos) {
      ok = absl::SimpleAtoi(item, &s.rows);
      s.cols = s.rows;
    } else {
      ok = absl::SimpleAtoi(item.substr(0, x), &s.rows) &&
           absl::SimpleAtoi(item.substr(x + 1), &s.cols);
    }
    if (!ok || s.rows < 1 || s.cols < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--sizes: '", item, "' is not n or RxC (positive integers)"));
    }
    out.push_back(s);
  }
  if (out.empty()) return absl::InvalidArgumentError("--sizes is empty");
  return out;
}

// Parses the flags into *options; returns -1 to go on, or the exit code after printing the usage
// (--help: 0) or an error (2).
int ParseNsOptions(int argc, char** argv, NsOptions* options) {
  auto flags = ParseFlags(argc, argv, {"threads", "sizes", "dtypes", "iters", "cpu-isa"});
  if (!flags.ok()) {
    std::fprintf(stderr, "muond-bench ns: %s\n%s", std::string(flags.status().message()).c_str(),
                 kUsage);
    return 2;
  }
  if (flags->count("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (flags->count("threads") &&
      (!absl::SimpleAtoi(flags->at("threads"), &options->threads) || options->threads < 1)) {
    std::fprintf(stderr, "muond-bench ns: --threads must be a positive integer\n");
    return 2;
  }
  if (flags->count("iters") &&
      (!absl::SimpleAtoi(flags->at("iters"), &options->iters) || options->iters < 1)) {
    std::fprintf(stderr, "muond-bench ns: --iters must be a positive integer\n");
    return 2;
  }
  if (flags->count("cpu-isa")) options->cpu_isa = flags->at("cpu-isa");
  if (flags->count("sizes")) {
    auto parsed = ParseShapes(flags->at("sizes"));
    if (!parsed.ok()) {
      std::fprintf(stderr, "muond-bench ns: %s\n", std::string(parsed.status().message()).c_str());
      return 2;
    }
    options->shapes = *parsed;
  }
  if (flags->count("dtypes")) {
    options->dtypes.clear();
    for (const std::string& name : SplitList(flags->at("dtypes"))) {
      auto dtype = common::ParseDType(name);
      if (!dtype.ok()) {
        std::fprintf(stderr, "muond-bench ns: --dtypes: %s\n",
                     std::string(dtype.status().message()).c_str());
        return 2;
      }
      options->dtypes.push_back(*dtype);
    }
    if (options->dtypes.empty()) {
      std::fprintf(stderr, "muond-bench ns: --dtypes is empty\n");
      return 2;
    }
  }
  return -1;
}

// The GEMM dtype of a compute dtype's baseline: the dtype its products are computed in (float16
// always emulated on fp32; bfloat16 on fp32 where the CPU path emulates it).
common::DType GemmDType(common::DType dtype) {
  if (dtype == common::DType::kFloat16) return common::DType::kFloat32;
  if (dtype == common::DType::kBFloat16 && server::EmulateBf16()) return common::DType::kFloat32;
  return dtype;
}

// The best GEMM rate of one dtype, and where it was measured.
struct BestGemm {
  double gflops = 0;
  std::string where;
};

// GFLOP/s of the plain LibTorch GEMMs of `shape` (m = min(r, c), n = max(r, c)) in `dtype`:
// X X^T ([m, n] x [m, n]^T) and B X ([m, m] x [m, n]); prints them and keeps the best in *best.
void MeasureGemms(const Shape& shape, common::DType dtype, int iters, BestGemm* best) {
  const int64_t m = std::min(shape.rows, shape.cols), n = std::max(shape.rows, shape.cols);
  const at::ScalarType st = dtype == common::DType::kBFloat16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor x = at::randn({m, n}, at::kFloat).to(st);
  const at::Tensor b = at::randn({m, m}, at::kFloat).to(st);
  at::Tensor a = at::empty({m, m}, x.options());
  at::Tensor bx = at::empty({m, n}, x.options());
  const double flops = 2.0 * m * m * n;
  const double xxt = flops / TimePerCall([&] { at::mm_out(a, x, x.t()); }, iters) / 1e9;
  const double mm = flops / TimePerCall([&] { at::mm_out(bx, b, x); }, iters) / 1e9;
  const std::string name = shape.Name();
  std::printf("%-10s  %-9s  %14.1f  %14.1f\n", name.c_str(),
              std::string(common::DTypeName(dtype)).c_str(), xxt, mm);
  std::fflush(stdout);
  if (xxt > best->gflops) *best = {xxt, name + " X X^T"};
  if (mm > best->gflops) *best = {mm, name + " B X"};
}

// Standard-equivalent GFLOP/s of Newton-Schulz on `shape` computed in `dtype` (in place on x), or
// nullopt (the error printed) when NS fails.
std::optional<double> MeasureNs(const Shape& shape, common::DType dtype, std::vector<float>& x,
                                int iters) {
  common::MuonConfig config;
  config.ns_method = common::NsMethod::kStandard;
  config.ns_steps = kNsSteps;
  config.compute_dtype = dtype;
  config.fp32_iterations = 0;
  // NS runs in place on x: its output is as good an input as the first (same FLOPs).
  bool ns_ok = true;
  const double seconds = TimePerCall(
      [&] {
        const absl::Status status =
            server::NewtonSchulz(config, {1, shape.rows, shape.cols}, x.data());
        if (!status.ok()) {
          std::fprintf(stderr, "muond-bench ns: %s\n", status.ToString().c_str());
          ns_ok = false;
        }
      },
      iters);
  if (!ns_ok) return std::nullopt;
  const double m = std::min(shape.rows, shape.cols), n = std::max(shape.rows, shape.cols);
  return kNsSteps * (4.0 * m * m * n + 2.0 * m * m * m) / seconds / 1e9;
}

// The GEMM baselines of every dtype the NS rows need, over every shape.
std::map<common::DType, BestGemm> MeasureBaselines(const NsOptions& options) {
  std::map<common::DType, BestGemm> best;
  for (const common::DType dtype : options.dtypes) best[GemmDType(dtype)];
  std::printf("%-10s  %-9s  %14s  %14s\n", "shape", "GEMM", "X X^T GFLOP/s", "B X GFLOP/s");
  for (const Shape& shape : options.shapes) {
    for (auto& [dtype, b] : best) MeasureGemms(shape, dtype, options.iters, &b);
  }
  for (const auto& [dtype, b] : best) {
    std::printf("best GEMM %s: %.1f GFLOP/s (%s)\n", std::string(common::DTypeName(dtype)).c_str(),
                b.gflops, b.where.c_str());
  }
  return best;
}

}  // namespace

int RunNsBench(int argc, char** argv) {
  NsOptions options;
  if (const int exit_code = ParseNsOptions(argc, argv, &options); exit_code >= 0) {
    return exit_code;
  }
  if (const int exit_code = SetBenchCpuIsa("ns", options.cpu_isa, argc, argv); exit_code >= 0) {
    return exit_code;
  }
  const int iters = options.iters;
  server::SetMathThreads(options.threads);
  c10::InferenceMode no_autograd;
  std::printf("muond-bench ns: threads=%d ns_steps=%d method=standard iters=%s\n",
              server::MathThreads(), kNsSteps, iters > 0 ? std::to_string(iters).c_str() : "auto");
  std::printf("%s\n", CpuPathLine().c_str());
  const std::map<common::DType, BestGemm> best = MeasureBaselines(options);
  std::printf("%-10s  %-9s  %16s  %-9s  %14s  %7s\n", "shape", "dtype", "NS GFLOP/s (std)",
              "baseline", "GEMM GFLOP/s", "ratio");
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  double log_ratio_sum = 0.0;
  int rows_done = 0;
  for (const Shape& shape : options.shapes) {
    std::vector<float> x(static_cast<size_t>(shape.rows * shape.cols));
    for (float& v : x) v = normal(rng);
    for (const common::DType dtype : options.dtypes) {
      const std::optional<double> ns_gflops = MeasureNs(shape, dtype, x, iters);
      if (!ns_gflops) return 1;
      const BestGemm& gemm = best.at(GemmDType(dtype));
      const double ratio = *ns_gflops / gemm.gflops;
      std::printf("%-10s  %-9s  %16.1f  %-9s  %14.1f  %7.3f\n", shape.Name().c_str(),
                  std::string(common::DTypeName(dtype)).c_str(), *ns_gflops,
                  std::string(common::DTypeName(GemmDType(dtype))).c_str(), gemm.gflops, ratio);
      std::fflush(stdout);
      log_ratio_sum += std::log(ratio);
      ++rows_done;
    }
  }
  std::printf("NS GFLOP/s (std): standard-equivalent, 5 x (4 m^2 n + 2 m^3) per call on [m, n]\n");
  const double geomean = rows_done > 0 ? std::exp(log_ratio_sum / rows_done) : 0.0;
  std::printf("result: ns ratio=%.3f target=%g\n", geomean, kTargetRatio);
  return 0;
}

}  // namespace muond::bench
