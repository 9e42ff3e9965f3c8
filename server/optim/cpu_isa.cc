// See cpu_isa.h.
#include "server/optim/cpu_isa.h"

#include <cpuid.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <oneapi/dnnl/dnnl.hpp>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/float_bits.h"
#include "server/optim/dnnl_gemm.h"

namespace muond::server {
namespace {

// AMX-BF16: CPUID leaf 7, sub-leaf 0, EDX bit 22 (the OS's tile state is oneDNN's to request).
bool CpuHasAmxBf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (edx & (1u << 22)) != 0;
}

// The widest ISA this CPU (and the OS's saved vector state, which __builtin_cpu_supports checks)
// offers, in this file's terms. AVX-512 means oneDNN's avx512_core (F, BW, VL, DQ).
CpuIsa ProbeHardwareIsa() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (avx512 && CpuHasAmxBf16()) return CpuIsa::kAmx;
  if (avx512) return CpuIsa::kAvx512;
  if (avx2) return CpuIsa::kAvx2;
  return CpuIsa::kBaseline;
}

CpuIsa HardwareIsa() {
  static const CpuIsa isa = ProbeHardwareIsa();
  return isa;
}

const char* OnednnIsaName(dnnl::cpu_isa isa) {
  using I = dnnl::cpu_isa;
  switch (isa) {
    case I::sse41: return "sse41";
    case I::avx: return "avx";
    case I::avx2: return "avx2";
    case I::avx2_vnni: return "avx2_vnni";
    case I::avx512_mic: return "avx512_mic";
    case I::avx512_mic_4ops: return "avx512_mic_4ops";
    case I::avx512_core: return "avx512_core";
    case I::avx512_core_vnni: return "avx512_core_vnni";
    case I::avx512_core_bf16: return "avx512_core_bf16";
    case I::avx512_core_amx: return "avx512_core_amx";
    default: return "unknown";
  }
}

CpuIsa FromOnednn(dnnl::cpu_isa isa) {
  using I = dnnl::cpu_isa;
  switch (isa) {
    case I::avx512_core_amx: return CpuIsa::kAmx;
    case I::avx512_core:
    case I::avx512_core_vnni:
    case I::avx512_core_bf16: return CpuIsa::kAvx512;
    case I::avx2:
    case I::avx2_vnni: return CpuIsa::kAvx2;
    default: return CpuIsa::kBaseline;
  }
}

// oneDNN's cap for a forced ISA.
dnnl::cpu_isa OnednnCap(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAmx: return dnnl::cpu_isa::avx512_core_amx;
    case CpuIsa::kAvx512: return dnnl::cpu_isa::avx512_core_bf16;
    case CpuIsa::kAvx2: return dnnl::cpu_isa::avx2;
    case CpuIsa::kBaseline: break;
  }
  return dnnl::cpu_isa::sse41;
}

std::optional<CpuIsa> ParseIsa(const std::string& name) {
  if (name == "avx2") return CpuIsa::kAvx2;
  if (name == "avx512") return CpuIsa::kAvx512;
  if (name == "amx") return CpuIsa::kAmx;
  return std::nullopt;
}

// A [4 x 32] x [32 x 4] bf16 product of small integers (every product and sum exact in fp32, the
// results exact in bf16). Empty when it ran and gave the exact answer, else why not.
std::string ProbeBf16Product() {
  constexpr int kM = 4, kK = 32, kN = 4;
  std::vector<uint16_t> a(kM * kK), b(kK * kN), c(kM * kN, 0);
  std::vector<float> want(kM * kN, 0.0f);
  for (int i = 0; i < kM; ++i)
    for (int k = 0; k < kK; ++k) a[i * kK + k] = common::FloatToBf16(static_cast<float>((i + k) % 3 - 1));
  for (int k = 0; k < kK; ++k)
    for (int j = 0; j < kN; ++j) b[k * kN + j] = common::FloatToBf16(static_cast<float>((k * j) % 4 - 2));
  for (int i = 0; i < kM; ++i)
    for (int j = 0; j < kN; ++j)
      for (int k = 0; k < kK; ++k)
        want[i * kN + j] += common::Bf16ToFloat(a[i * kK + k]) * common::Bf16ToFloat(b[k * kN + j]);
  try {
    internal::GemmArgs g;
    g.type = internal::GemmType::kBFloat16;
    g.a = a.data();
    g.b = b.data();
    g.c = c.data();
    g.m = kM;
    g.n = kN;
    g.k = kK;
    g.lda = kK;
    g.ldb = kN;
    g.ldc = kN;
    internal::DnnlGemm(g);
  } catch (const std::exception& e) {
    return absl::StrCat("the bf16 probe product failed: ", e.what());
  }
  for (int i = 0; i < kM * kN; ++i) {
    if (common::Bf16ToFloat(c[i]) != want[i]) {
      return absl::StrCat("the bf16 probe product gave ", common::Bf16ToFloat(c[i]), " for ", want[i],
                          " at element ", i);
    }
  }
  return "";
}

struct State {
  absl::Mutex mu;
  bool configured ABSL_GUARDED_BY(mu) = false;
  std::string request ABSL_GUARDED_BY(mu);
  CpuMathPath path ABSL_GUARDED_BY(mu);
};

State& TheState() {
  static State* state = new State;
  return *state;
}

std::atomic<const CpuMathPath*> g_path{nullptr};
std::atomic<bool> g_force_emulation{false};

absl::StatusOr<CpuMathPath> Probe(const std::string& requested) {
  CpuMathPath path;
  path.hardware = HardwareIsa();
  if (requested != "auto") {
    const std::optional<CpuIsa> want = ParseIsa(requested);  // validated by Configure
    path.forced = true;
    try {
      dnnl::set_max_cpu_isa(OnednnCap(*want));
    } catch (const dnnl::error& e) {
      // Already fixed: by $ONEDNN_MAX_CPU_ISA (fine while no wider) or by oneDNN having run.
      if (FromOnednn(dnnl::get_effective_cpu_isa()) > *want) {
        return absl::FailedPreconditionError(absl::StrCat(
            "--cpu-isa ", requested, ": oneDNN already runs with ",
            OnednnIsaName(dnnl::get_effective_cpu_isa()),
            " in this process and cannot be capped (", e.what(), ")"));
      }
    }
  }
  const dnnl::cpu_isa effective = dnnl::get_effective_cpu_isa();
  path.onednn_isa = OnednnIsaName(effective);
  path.isa = FromOnednn(effective);
  if (path.isa > path.hardware) path.isa = path.hardware;
  if (effective != dnnl::cpu_isa::avx512_core_bf16 && effective != dnnl::cpu_isa::avx512_core_amx) {
    path.bf16_native = false;
    path.why = absl::StrCat("oneDNN's ISA ", path.onednn_isa, " has no bf16 instructions");
  } else if (std::string failed = ProbeBf16Product(); !failed.empty()) {
    path.bf16_native = false;
    path.why = failed;
  } else {
    path.bf16_native = true;
    path.why = absl::StrCat("oneDNN ", path.onednn_isa, " bf16 probe product exact");
  }
  return path;
}

}  // namespace

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return "baseline";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAmx: return "amx";
  }
  return "baseline";
}

namespace {

// Whether bf16 products run natively on `path` (unless a test forced emulation).
bool NativeBf16(const CpuMathPath& path) {
  return path.bf16_native && !g_force_emulation.load(std::memory_order_relaxed);
}

}  // namespace

const char* Bf16ModeName(const CpuMathPath& path) {
  return NativeBf16(path) ? "native" : "emulated";
}

std::string DescribeCpuMathPath(const CpuMathPath& path) {
  return absl::StrCat(
      CpuIsaName(path.isa), " (bf16 ",
      NativeBf16(path) ? "native: oneDNN bf16 products, fp32 accumulation"
             : "emulated: fp32 products of bf16 values, each op's result rounded to bf16",
      "; ", path.forced ? "forced by --cpu-isa" : "auto", ", the CPU has ",
      CpuIsaName(path.hardware), ", oneDNN ", path.onednn_isa, "; ", path.why, ")");
}

namespace {

// ConfigureCpuIsa; `lazy`: a path already set, whatever its request, is kept.
absl::Status Configure(const std::string& requested, bool lazy) {
  // A bad request is refused as such whether or not a path is set.
  if (!IsCpuIsaRequest(requested)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpu-isa '", requested, "': ", kCpuIsaRequestsExpected));
  }
  if (requested != "auto") {
    const std::optional<CpuIsa> want = ParseIsa(requested);
    if (const CpuIsa hardware = HardwareIsa(); *want > hardware) {
      return absl::InvalidArgumentError(absl::StrCat("--cpu-isa ", requested,
                                                     ": this CPU has at most ",
                                                     CpuIsaName(hardware),
                                                     "; a forced path may not be wider"));
    }
  }
  State& s = TheState();
  absl::MutexLock lock(&s.mu);
  if (s.configured) {
    if (lazy || s.request == requested) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "--cpu-isa ", requested, ": the CPU path is already set (", s.request, ")"));
  }
  absl::StatusOr<CpuMathPath> path = Probe(requested);
  if (!path.ok()) return path.status();
  s.path = *std::move(path);
  s.request = requested;
  s.configured = true;
  g_path.store(&s.path, std::memory_order_release);
  return absl::OkStatus();
}

}  // namespace

absl::Status ConfigureCpuIsa(const std::string& requested) { return Configure(requested, false); }

const CpuMathPath& CurrentCpuMathPath() {
  if (const CpuMathPath* p = g_path.load(std::memory_order_acquire); p != nullptr) return *p;
  const char* env = std::getenv("MUOND_CPU_ISA");
  const std::string requested = env != nullptr && *env != '\0' ? env : "auto";
  if (absl::Status s = Configure(requested, /*lazy=*/true); !s.ok()) {
    std::fprintf(stderr, "MUOND_CPU_ISA=%s: %s\n", requested.c_str(), s.ToString().c_str());
    std::abort();
  }
  return *g_path.load(std::memory_order_acquire);
}

bool EmulateBf16() { return !NativeBf16(CurrentCpuMathPath()); }

void SetBf16EmulationForTesting(bool emulate) { g_force_emulation.store(emulate); }

}  // namespace muond::server
