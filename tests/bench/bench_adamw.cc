// `muond-bench adamw`: the daemon's fused AdamW (server/optim/adamw.h) over --params parameters
// against LibTorch's own torch::optim::AdamW on the same tensors, and the bytes it touches per
// second against a memcpy of as many bytes, all measured in the same run with the same threads.
//
// Bytes touched per parameter: read g, p, m, v (16) and write p, m, v (12), plus the new parameter
// in --out-dtype (2 for bfloat16; none for "none"). torch's step touches at least the same 28 and
// writes no low-precision copy.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "server/optim/adamw.h"
#include "tests/bench/bench.h"

namespace muond::bench {
namespace {

struct Options {
  int64_t params = int64_t{64} << 20;
  int threads = 1;
  int reps = 3;
  bool out = true;
  common::DType out_dtype = common::DType::kBFloat16;
};

absl::StatusOr<Options> ParseOptions(int argc, char** argv) {
  auto flags = ParseFlags(argc, argv, {"params", "threads", "reps", "out-dtype"});
  if (!flags.ok()) return flags.status();
  if (flags->count("help")) return absl::CancelledError("help");
  Options o;
  o.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto positive = [&](const char* name, int64_t* v) -> absl::Status {
    auto it = flags->find(name);
    if (it == flags->end()) return absl::OkStatus();
    if (!absl::SimpleAtoi(it->second, v) || *v <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " '", it->second, "': expected a positive integer"));
    }
    return absl::OkStatus();
  };
  int64_t threads = o.threads, reps = o.reps;
  if (auto s = positive("params", &o.params); !s.ok()) return s;
  if (auto s = positive("threads", &threads); !s.ok()) return s;
  if (auto s = positive("reps", &reps); !s.ok()) return s;
  // 2^31 parameters are 64 GiB of arrays for both sides: more than any machine this runs on.
  if (o.params > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat("--params ", o.params, ": at most 2147483648"));
  }
  o.threads = static_cast<int>(std::min<int64_t>(threads, 1024));
  o.reps = static_cast<int>(std::min<int64_t>(reps, 1000));
  if (auto it = flags->find("out-dtype"); it != flags->end()) {
    if (it->second == "none") {
      o.out = false;
    } else {
      auto d = common::ParseDType(it->second);
      if (!d.ok())
        return absl::InvalidArgumentError(absl::StrCat("--out-dtype: ", d.status().message()));
      o.out_dtype = *d;
    }
  }
  return o;
}

void PrintHelp() {
  std::printf(
      "usage: muond-bench adamw [--params N] [--threads T] [--reps K]\n"
      "                         [--out-dtype bfloat16|float16|float32|none]\n"
      "  The fused AdamW of muond against torch::optim::AdamW on the same fp32 tensors, and\n"
      "  the GB/s of bytes it touches against memcpy; best of K steps each.\n"
      "  --params     parameters (default 67108864)\n"
      "  --threads    threads for all three (default: all hardware threads)\n"
      "  --out-dtype  the new parameters written in this dtype as well (default bfloat16)\n"
      "Last line: result: adamw ratio=<muond seconds / torch seconds> target=0.5\n");
}

// Best of `reps` parallel copies of `src` into `dst` over `threads` threads; seconds.
double BestMemcpy(std::vector<char>& dst, const std::vector<char>& src, int threads, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    const size_t slice = (src.size() + threads - 1) / threads;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      const size_t b = std::min(src.size(), t * slice), e = std::min(src.size(), b + slice);
      pool.emplace_back([&, b, e] { std::memcpy(dst.data() + b, src.data() + b, e - b); });
    }
    for (auto& t : pool) t.join();
    best = std::min(best, Since(t0));
  }
  return best;
}

}  // namespace

int RunAdamWBench(int argc, char** argv) {
  auto opts = ParseOptions(argc, argv);
  if (!opts.ok() && absl::IsCancelled(opts.status())) {
    PrintHelp();
    return 0;
  }
  if (!opts.ok()) {
    std::fprintf(stderr, "muond-bench adamw: %s\n", std::string(opts.status().message()).c_str());
    return 2;
  }
  const Options& o = *opts;
  const size_t n = static_cast<size_t>(o.params);
  const size_t out_bytes = o.out ? common::DTypeSize(o.out_dtype) : 0;
  const double touched = static_cast<double>(n) * (28 + out_bytes);
  std::printf(
      "muond-bench adamw: %lld parameters (fp32 p, m, v, g; new p also as %s), %d threads,"
      " best of %d\n",
      static_cast<long long>(n),
      o.out ? std::string(common::DTypeName(o.out_dtype)).c_str() : "nothing", o.threads, o.reps);
  std::printf("%s\n", CpuPathLine().c_str());  // MUOND_CPU_ISA=avx2 measures the AVX2 path
  at::set_num_threads(o.threads);
  torch::manual_seed(5);
  torch::Tensor p0 = torch::randn({o.params});
  torch::Tensor g = torch::randn({o.params}) * 1e-2;
  // muond: its own arrays, starting where torch starts (zero moments).
  std::vector<float> p(p0.data_ptr<float>(), p0.data_ptr<float>() + n), m(n, 0.0f), v(n, 0.0f);
  std::vector<char> out(n * std::max<size_t>(out_bytes, 1));
  server::AdamWArrays arrays{g.data_ptr<float>(),          p.data(),   m.data(), v.data(),
                             o.out ? out.data() : nullptr, o.out_dtype};
  const server::AdamWHyper hyper{1e-3, 0.1, 0.9, 0.95, 1e-8};
  double ours = 1e30;
  for (int r = 1; r <= o.reps; ++r) {
    const auto t0 = Clock::now();
    server::AdamWUpdate(hyper, r, 1.0f, arrays, n, o.threads);
    ours = std::min(ours, Since(t0));
  }
  // torch: the same tensors through torch::optim::AdamW.
  torch::Tensor tp = p0.clone().set_requires_grad(true);
  tp.mutable_grad() = g;
  torch::optim::AdamW opt({tp}, torch::optim::AdamWOptions(hyper.lr)
                                    .betas({hyper.beta1, hyper.beta2})
                                    .eps(hyper.eps)
                                    .weight_decay(hyper.weight_decay));
  double theirs = 1e30;
  for (int r = 1; r <= o.reps; ++r) {
    const auto t0 = Clock::now();
    opt.step();
    theirs = std::min(theirs, Since(t0));
  }
  // memcpy of as many bytes as muond touches (half read, half written).
  std::vector<char> src(static_cast<size_t>(touched / 2), 1), dst(src.size(), 0);
  const double copy = BestMemcpy(dst, src, o.threads, o.reps);
  std::printf("                      seconds   GB/s touched\n");
  const std::string label = absl::StrCat("muond (", server::AdamWAutoPathName(), ")");
  std::printf("  %-16s  %10.4f   %8.2f\n", label.c_str(), ours, touched / ours / 1e9);
  std::printf("  torch AdamW       %10.4f   %8.2f\n", theirs, n * 28.0 / theirs / 1e9);
  std::printf("  memcpy            %10.4f   %8.2f\n", copy, touched / copy / 1e9);
  std::printf("muond GB/s / memcpy GB/s: %.3f\n", copy / ours);
  std::printf("result: adamw ratio=%.3f target=0.5\n", ours / theirs);
  return 0;
}

}  // namespace muond::bench
