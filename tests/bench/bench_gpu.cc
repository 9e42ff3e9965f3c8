// `muond-bench gpu`: the CUDA backend on a real GPU, each number against a baseline measured in
// the same run:
//  - Newton-Schulz (the whole Muon kernel of one n x n matrix, standard method, 5 iterations,
//    through the device layer) in TFLOP/s against a plain cuBLAS n x n x n GEMM of the same dtype.
//    bf16 NS runs its first 2 iterations in fp32 (newton_schulz.cc's precision plan), so its
//    ratio is also given against the mix of fp32 and bf16 GEMM peaks that plan needs;
//  - host<->device copies through the device layer: registered (pinned) against pageable memory;
//  - the Muon apply of Qwen3-4B-like layers (hidden 2560, intermediate 9728, 32 q heads, 8 kv
//  heads,
//    head_dim 128: q [4096, 2560], k/v [1024, 2560], o [2560, 4096], gate/up [9728, 2560],
//    down [2560, 9728]) pipelined as the daemon does it (copy in of gradient and momentum, Muon,
//    writeback of the update on three streams, 3 layers in flight), against the floor of its
//    bytes over the measured pinned bandwidth (H2D and D2H overlapping).
// Last line: result: gpu ratio=<geometric mean of NS / GEMM-mix rate> target=<target>.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "server/device/device.h"
#include "tests/bench/bench.h"

namespace muond::bench {
namespace {

using server::device::Device;
using server::device::DeviceBuffer;
using server::device::Event;
using server::device::MuonKernelItem;
using server::device::Stream;

// NS is 3 GEMMs per iteration plus O(n^2) work: on large matrices it should reach most of the
// rate of its GEMMs (at their measured peaks).
constexpr double kTarget = 0.70;
constexpr int kNsSteps = 5;

constexpr const char* kUsage =
    "usage: muond-bench gpu [--sizes 2048,4096] [--copy-mib 256] [--layers 36] [--seconds 60]\n"
    "  Newton-Schulz TFLOP/s (fp32, bf16) vs a cuBLAS GEMM of the same size and dtype; pinned\n"
    "  vs pageable copy GB/s; the pipelined Muon apply of up to --layers Qwen3-4B-like layers\n"
    "  (as many as fit in --seconds) vs its bytes over the pinned bandwidth. Needs a CUDA GPU.\n"
    "Last line: result: gpu ratio=<geometric mean of NS / GEMM-mix rate> target=<target>\n";

bool Check(const absl::Status& s, const char* what) {
  if (!s.ok()) std::fprintf(stderr, "muond-bench gpu: %s: %s\n", what, s.ToString().c_str());
  return s.ok();
}

// A cuBLAS n x n x n GEMM (fp32 accumulation, no TF32) in TFLOP/s, timed with events.
double GemmTflops(int n, common::DType dtype) {
  const cudaDataType type = dtype == common::DType::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
  const size_t esize = dtype == common::DType::kFloat32 ? 4 : 2;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  cublasHandle_t h = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  double tflops = 0;
  const size_t bytes = static_cast<size_t>(n) * n * esize;
  if (cudaMalloc(&a, bytes) == cudaSuccess && cudaMalloc(&b, bytes) == cudaSuccess &&
      cudaMalloc(&c, bytes) == cudaSuccess && cudaMemset(a, 0, bytes) == cudaSuccess &&
      cudaMemset(b, 0, bytes) == cudaSuccess && cublasCreate(&h) == CUBLAS_STATUS_SUCCESS &&
      cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess) {
    const float one = 1, zero = 0;
    auto gemm = [&] {
      return cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, type, n, b, type, n, &zero,
                          c, type, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    };
    bool ok = gemm() == CUBLAS_STATUS_SUCCESS && cudaDeviceSynchronize() == cudaSuccess;
    const int iters = std::max(3, static_cast<int>(2e12 / (2.0 * n * n * n)));
    ok = ok && cudaEventRecord(start) == cudaSuccess;
    for (int i = 0; ok && i < iters; ++i) ok = gemm() == CUBLAS_STATUS_SUCCESS;
    float ms = 0;
    ok = ok && cudaEventRecord(stop) == cudaSuccess && cudaEventSynchronize(stop) == cudaSuccess &&
         cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
    if (ok && ms > 0) tflops = 2.0 * n * n * n * iters / (ms * 1e-3) / 1e12;
  }
  if (h != nullptr) cublasDestroy(h);
  if (start != nullptr) cudaEventDestroy(start);
  if (stop != nullptr) cudaEventDestroy(stop);
  for (void* p : {a, b, c}) {
    if (p != nullptr) cudaFree(p);
  }
  return tflops;
}

std::vector<float> Gaussian(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// The Muon kernel of one n x n matrix through the device layer, in TFLOP/s (0 on error).
double NsTflops(Device& dev, Stream& s, int64_t n, common::DType dtype) {
  common::MatrixSpec spec;
  spec.name = "ns";
  spec.shape = {n, n};
  common::MuonConfig config;
  config.compute_dtype = dtype;
  config.ns_steps = kNsSteps;
  const size_t bytes = static_cast<size_t>(n * n) * sizeof(float);
  auto g = dev.Allocate(bytes);
  auto m = dev.Allocate(bytes);
  if (!Check(g.status(), "Allocate") || !Check(m.status(), "Allocate")) return 0;
  const std::vector<float> grad = Gaussian(n * n, 1), mom = Gaussian(n * n, 2);
  if (!Check(s.CopyToDevice(*g, 0, grad.data(), bytes), "copy") ||
      !Check(s.CopyToDevice(*m, 0, mom.data(), bytes), "copy") ||
      !Check(s.Muon(config, {{&spec, &*g, &*m}}), "Muon") || !Check(s.Synchronize(), "warm-up")) {
    return 0;
  }
  const double flops = kNsSteps * 6.0 * n * n * n;
  const int iters = std::max(3, static_cast<int>(4e12 / flops));
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    // The update of one call is the next call's gradient (finite, same work).
    if (!Check(s.Muon(config, {{&spec, &*g, &*m}}), "Muon")) return 0;
  }
  if (!Check(s.Synchronize(), "Newton-Schulz")) return 0;
  return flops * iters / Since(t0) / 1e12;
}

// GB/s of `rounds` H2D (or D2H) copies of `bytes` through the device layer.
double CopyGbps(Stream& s, DeviceBuffer& d, char* host, size_t bytes, bool to_device) {
  const int rounds = 8;
  (void)(to_device ? s.CopyToDevice(d, 0, host, bytes) : s.CopyToHost(host, d, 0, bytes));
  if (!Check(s.Synchronize(), "copy warm-up")) return 0;
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < rounds; ++i) {
    const absl::Status st =
        to_device ? s.CopyToDevice(d, 0, host, bytes) : s.CopyToHost(host, d, 0, bytes);
    if (!Check(st, "copy")) return 0;
  }
  if (!Check(s.Synchronize(), "copy")) return 0;
  return static_cast<double>(bytes) * rounds / Since(t0) / 1e9;
}

struct LayerMatrix {
  const char* name;
  int64_t rows, cols;
};
constexpr LayerMatrix kQwen3_4B[] = {
    {"q_proj", 4096, 2560},    {"k_proj", 1024, 2560},    {"v_proj", 1024, 2560},
    {"o_proj", 2560, 4096},    {"gate_proj", 9728, 2560}, {"up_proj", 9728, 2560},
    {"down_proj", 2560, 9728},
};
constexpr int kDepth = 3;

// One layer slot of the pipeline: pinned host gradient/momentum/update and device buffers.
struct Slot {
  std::vector<common::MatrixSpec> specs;
  std::vector<std::vector<float>> grad, mom, update;
  std::vector<DeviceBuffer> g, m;
  std::shared_ptr<Event> written;
};

// Seconds for `layers` layers through three streams, kDepth layers in flight (0 on error).
double ApplySeconds(Device& dev, Stream& in, Stream& compute, Stream& out, std::vector<Slot>& slots,
                    int layers, common::DType dtype) {
  common::MuonConfig config;
  config.compute_dtype = dtype;
  const Clock::time_point t0 = Clock::now();
  for (int l = 0; l < layers; ++l) {
    Slot& slot = slots[l % kDepth];
    if (slot.written != nullptr && !Check(slot.written->Wait(), "writeback")) return 0;
    std::vector<MuonKernelItem> items;
    for (size_t i = 0; i < slot.specs.size(); ++i) {
      const size_t bytes = slot.grad[i].size() * sizeof(float);
      if (!Check(in.CopyToDevice(slot.g[i], 0, slot.grad[i].data(), bytes), "copy in") ||
          !Check(in.CopyToDevice(slot.m[i], 0, slot.mom[i].data(), bytes), "copy in")) {
        return 0;
      }
      items.push_back({&slot.specs[i], &slot.g[i], &slot.m[i]});
    }
    auto copied = in.Record();
    if (!Check(copied.status(), "Record") || !Check(compute.WaitFor(*copied), "WaitFor") ||
        !Check(compute.Muon(config, std::move(items)), "Muon")) {
      return 0;
    }
    auto computed = compute.Record();
    if (!Check(computed.status(), "Record") || !Check(out.WaitFor(*computed), "WaitFor")) return 0;
    for (size_t i = 0; i < slot.specs.size(); ++i) {
      const size_t bytes = slot.grad[i].size() * sizeof(float);
      if (!Check(out.CopyToHost(slot.update[i].data(), slot.g[i], 0, bytes), "writeback")) return 0;
    }
    auto written = out.Record();
    if (!Check(written.status(), "Record")) return 0;
    slot.written = *written;
  }
  for (Slot& slot : slots) {
    if (slot.written != nullptr && !Check(slot.written->Wait(), "writeback")) return 0;
    slot.written = nullptr;
  }
  return Since(t0);
}

// The flags of `muond-bench gpu`.
struct GpuOptions {
  std::vector<int64_t> sizes = {2048, 4096};
  int copy_mib = 256;
  int max_layers = 36;
  double seconds = 60;
};

// Parses the flags into *options; returns -1 to go on, or the exit code after printing the usage
// (--help: 0) or an error (2).
int ParseGpuOptions(int argc, char** argv, GpuOptions* options) {
  auto flags = ParseFlags(argc, argv, {"sizes", "copy-mib", "layers", "seconds"});
  if (!flags.ok()) {
    std::fprintf(stderr, "muond-bench gpu: %s\n%s", std::string(flags.status().message()).c_str(),
                 kUsage);
    return 2;
  }
  if (flags->count("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  GpuOptions& o = *options;
  if (flags->count("sizes")) {
    auto parsed = ParsePositiveList("sizes", flags->at("sizes"));
    if (!parsed.ok()) {
      std::fprintf(stderr, "muond-bench gpu: %s\n", std::string(parsed.status().message()).c_str());
      return 2;
    }
    o.sizes = *parsed;
  }
  if ((flags->count("copy-mib") &&
       (!absl::SimpleAtoi(flags->at("copy-mib"), &o.copy_mib) || o.copy_mib < 1)) ||
      (flags->count("layers") &&
       (!absl::SimpleAtoi(flags->at("layers"), &o.max_layers) || o.max_layers < 1)) ||
      (flags->count("seconds") &&
       (!absl::SimpleAtod(flags->at("seconds"), &o.seconds) || !(o.seconds > 0)))) {
    std::fprintf(stderr, "muond-bench gpu: --copy-mib, --layers and --seconds must be positive\n");
    return 2;
  }
  return -1;
}

// 1. Newton-Schulz against cuBLAS GEMM peak: prints the table; adds log(NS / GEMM mix) of each
// row to *log_sum and counts the rows in *rows. False on error.
bool MeasureNewtonSchulz(Device& dev, Stream& s, const std::vector<int64_t>& sizes, double* log_sum,
                         int* rows) {
  std::printf("%6s  %-9s  %9s  %11s  %8s  %11s  %8s\n", "size", "dtype", "NS TF/s", "GEMM TF/s",
              "NS/GEMM", "mix TF/s", "NS/mix");
  for (const int64_t n : sizes) {
    const double gemm32 = GemmTflops(static_cast<int>(n), common::DType::kFloat32);
    const double gemm16 = GemmTflops(static_cast<int>(n), common::DType::kBFloat16);
    for (const common::DType dtype : {common::DType::kFloat32, common::DType::kBFloat16}) {
      const double ns = NsTflops(dev, s, n, dtype);
      if (ns <= 0 || gemm32 <= 0 || gemm16 <= 0) return false;
      const bool bf16 = dtype == common::DType::kBFloat16;
      const double gemm = bf16 ? gemm16 : gemm32;
      // bf16 NS: 2 of 5 iterations' GEMMs run in fp32.
      const double f32_share = bf16 ? 2.0 / kNsSteps : 1.0;
      const double mix = 1.0 / (f32_share / gemm32 + (1 - f32_share) / gemm16);
      std::printf("%6lld  %-9s  %9.1f  %11.1f  %8.3f  %11.1f  %8.3f\n", static_cast<long long>(n),
                  std::string(common::DTypeName(dtype)).c_str(), ns, gemm, ns / gemm, mix,
                  ns / mix);
      std::fflush(stdout);
      *log_sum += std::log(ns / mix);
      ++*rows;
    }
  }
  return true;
}

// Copy rates through pinned (registered) host memory, in GB/s.
struct PinnedRates {
  double h2d = 0, d2h = 0;
};

// 2. Copies of `copy_mib` MiB: registered against pageable host memory; prints the line. False
// on error.
bool MeasureCopies(Device& dev, Stream& s, int copy_mib, PinnedRates* rates) {
  const size_t copy_bytes = static_cast<size_t>(copy_mib) << 20;
  auto dbuf = dev.Allocate(copy_bytes);
  if (!Check(dbuf.status(), "Allocate")) return false;
  std::vector<char> pinned(copy_bytes, 1), pageable(copy_bytes, 2);
  const bool registered = dev.RegisterHost(pinned.data(), copy_bytes);
  const double h2d_pinned = CopyGbps(s, *dbuf, pinned.data(), copy_bytes, true);
  const double d2h_pinned = CopyGbps(s, *dbuf, pinned.data(), copy_bytes, false);
  const double h2d_pageable = CopyGbps(s, *dbuf, pageable.data(), copy_bytes, true);
  const double d2h_pageable = CopyGbps(s, *dbuf, pageable.data(), copy_bytes, false);
  dev.UnregisterHost(pinned.data(), copy_bytes);
  std::printf(
      "copies of %d MiB (GB/s): H2D pinned %.1f pageable %.1f (x%.2f); D2H pinned %.1f "
      "pageable %.1f (x%.2f)%s\n",
      copy_mib, h2d_pinned, h2d_pageable, h2d_pinned / h2d_pageable, d2h_pinned, d2h_pageable,
      d2h_pinned / d2h_pageable,
      registered ? "" : " [cudaHostRegister refused: 'pinned' is pageable]");
  std::fflush(stdout);
  rates->h2d = h2d_pinned;
  rates->d2h = d2h_pinned;
  return true;
}

// The kDepth pipeline slots of Qwen3-4B-like layers: random gradients, zero momentum, host
// buffers registered, device buffers allocated. *layer_elems: the elements of one layer. False on
// error.
bool MakeSlots(Device& dev, std::vector<Slot>* slots, int64_t* layer_elems) {
  slots->resize(kDepth);
  *layer_elems = 0;
  for (const LayerMatrix& lm : kQwen3_4B) *layer_elems += lm.rows * lm.cols;
  uint32_t seed = 10;
  for (Slot& slot : *slots) {
    for (const LayerMatrix& lm : kQwen3_4B) {
      common::MatrixSpec spec;
      spec.name = lm.name;
      spec.shape = {lm.rows, lm.cols};
      const size_t n = static_cast<size_t>(lm.rows * lm.cols);
      slot.specs.push_back(spec);
      slot.grad.push_back(Gaussian(n, seed++));
      slot.mom.push_back(std::vector<float>(n, 0.0f));
      slot.update.push_back(std::vector<float>(n, 0.0f));
      auto g = dev.Allocate(n * sizeof(float));
      auto m = dev.Allocate(n * sizeof(float));
      if (!Check(g.status(), "Allocate") || !Check(m.status(), "Allocate")) return false;
      slot.g.push_back(*std::move(g));
      slot.m.push_back(*std::move(m));
      for (auto* v : {&slot.grad.back(), &slot.mom.back(), &slot.update.back()}) {
        dev.RegisterHost(v->data(), n * sizeof(float));
      }
    }
  }
  return true;
}

// 3. The Muon apply of as many Qwen3-4B-like layers as fit in about `seconds` (at most
// `max_layers`) on streams in, compute and out, in bf16 and fp32, against the copy floor at the
// pinned rates; prints a line per dtype. False on error.
bool MeasureApply(Device& dev, Stream& in, Stream& compute, Stream& out, std::vector<Slot>& slots,
                  int64_t layer_elems, double seconds, int max_layers, const PinnedRates& pinned) {
  const double layer_bytes_in = 8.0 * layer_elems, layer_bytes_out = 4.0 * layer_elems;
  for (const common::DType dtype : {common::DType::kBFloat16, common::DType::kFloat32}) {
    const double one = ApplySeconds(dev, in, compute, out, slots, 1, dtype);  // warm-up
    if (one <= 0) return false;
    const int layers = std::clamp(static_cast<int>(seconds / 2 / one), 1, max_layers);
    const double t = ApplySeconds(dev, in, compute, out, slots, layers, dtype);
    if (t <= 0) return false;
    const double floor = std::max(layers * layer_bytes_in / (pinned.h2d * 1e9),
                                  layers * layer_bytes_out / (pinned.d2h * 1e9));
    std::printf(
        "Muon apply, Qwen3-4B-like, %s: %d layers (%.2f GB in, %.2f GB out) in %.3f s "
        "(%.1f ms/layer); copy floor %.3f s; floor/time %.3f\n",
        std::string(common::DTypeName(dtype)).c_str(), layers, layers * layer_bytes_in / 1e9,
        layers * layer_bytes_out / 1e9, t, 1e3 * t / layers, floor, floor / t);
    std::fflush(stdout);
  }
  return true;
}

void UnregisterSlots(Device& dev, std::vector<Slot>& slots) {
  for (Slot& slot : slots) {
    for (size_t i = 0; i < slot.specs.size(); ++i) {
      for (auto* v : {&slot.grad[i], &slot.mom[i], &slot.update[i]}) {
        dev.UnregisterHost(v->data(), v->size() * sizeof(float));
      }
    }
  }
}

}  // namespace

int RunGpuBench(int argc, char** argv) {
  GpuOptions options;
  if (const int exit_code = ParseGpuOptions(argc, argv, &options); exit_code >= 0) {
    return exit_code;
  }
  auto opened = server::device::OpenCudaDevice(0);
  if (!opened.ok()) {
    std::fprintf(stderr, "muond-bench gpu: %s\n", std::string(opened.status().message()).c_str());
    return 1;
  }
  Device& dev = **opened;
  auto s1 = dev.CreateStream(), s2 = dev.CreateStream(), s3 = dev.CreateStream();
  if (!Check(s1.status(), "CreateStream") || !Check(s2.status(), "CreateStream") ||
      !Check(s3.status(), "CreateStream")) {
    return 1;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    std::printf("muond-bench gpu: %s (compute capability %d.%d), ns_steps=%d\n", prop.name,
                prop.major, prop.minor, kNsSteps);
  }
  double log_sum = 0;
  int rows = 0;
  if (!MeasureNewtonSchulz(dev, **s1, options.sizes, &log_sum, &rows)) return 1;
  PinnedRates pinned;
  if (!MeasureCopies(dev, **s1, options.copy_mib, &pinned)) return 1;
  std::vector<Slot> slots;
  int64_t layer_elems = 0;
  if (!MakeSlots(dev, &slots, &layer_elems)) return 1;
  if (!MeasureApply(dev, **s1, **s2, **s3, slots, layer_elems, options.seconds, options.max_layers,
                    pinned)) {
    return 1;
  }
  UnregisterSlots(dev, slots);
  std::printf("result: gpu ratio=%.3f target=%.3f\n", std::exp(log_sum / rows), kTarget);
  return 0;
}

}  // namespace muond::bench
