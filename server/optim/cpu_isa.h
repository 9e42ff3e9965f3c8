// Which CPU kernels the optimizer math runs on (the cpu backend's Newton-Schulz, and the fused
// AdamW of every backend), decided once per process.
//
// The widest instruction set the process may use (`muond --cpu-isa`, default auto) is probed at
// start from oneDNN's own ISA query (after capping it, when forced) and a tiny bf16 probe product:
//  - amx, avx512: bf16 products run natively in oneDNN (AMX-BF16 / AVX-512 BF16 kernels) when the
//    probe product succeeds and gives the exact answer;
//  - otherwise (avx2, or an AVX-512 CPU without BF16): bf16 is emulated: operands are held as fp32
//    values that are exactly bf16 numbers, every product runs on oneDNN's fp32 kernel for the
//    machine (fp32 accumulation), and each op's result is rounded to bf16 (nearest even) at the
//    points where the native plan rounds. The precision contract (DESIGN.md 3) holds on both
//    paths; the bits differ between paths, never within one (batch and thread count do not
//    change them).
//  - fp16 is emulated the same way on every path (LibTorch 1.13 has no CPU fp16 GEMM).
// A forced ISA is also oneDNN's cap for the whole process (fp32 products use that ISA's kernels),
// so a machine with AVX-512 runs what an AVX2 machine runs.
//
// Thread-safe after the first call; ConfigureCpuIsa must run before any oneDNN primitive exists in
// the process (muond's main calls it first thing). Without it, the first use configures from
// $MUOND_CPU_ISA (auto when unset): test binaries force a path that way.
#ifndef MUOND_SERVER_OPTIM_CPU_ISA_H_
#define MUOND_SERVER_OPTIM_CPU_ISA_H_

#include <string>

#include "absl/status/status.h"

namespace muond::server {

// Ordered from narrowest to widest.
enum class CpuIsa { kBaseline, kAvx2, kAvx512, kAmx };

struct CpuMathPath {
  CpuIsa isa = CpuIsa::kBaseline;       // the widest the math uses (after a forced cap)
  CpuIsa hardware = CpuIsa::kBaseline;  // the widest this CPU has
  bool forced = false;                  // --cpu-isa named an ISA (not auto)
  bool bf16_native = false;             // bf16 products on oneDNN's bf16 kernels
  std::string onednn_isa;               // oneDNN's effective ISA, as it names it
  std::string why;                      // one line: the probe's outcome
};

// "baseline", "avx2", "avx512", "amx".
const char* CpuIsaName(CpuIsa isa);
// "native" or "emulated".
const char* Bf16ModeName(const CpuMathPath& path);
// One line for logs and muonctl job show, e.g. "avx2 (bf16 emulated: fp32 products rounded to bf16
// at each op; forced by --cpu-isa, the CPU has avx512)".
std::string DescribeCpuMathPath(const CpuMathPath& path);

// Whether `name` is a --cpu-isa request ("auto", "avx2", "avx512" or "amx"), and the words that say
// so in an error. Inline: the flag parser (server/record/daemon_config.cc) checks names without
// linking the optimizer math (the fuzz targets build it alone).
inline bool IsCpuIsaRequest(const std::string& name) {
  return name == "auto" || name == "avx2" || name == "avx512" || name == "amx";
}
inline constexpr char kCpuIsaRequestsExpected[] = "expected auto, avx2, avx512 or amx";

// Sets the path from `requested` ("auto", "avx2", "avx512" or "amx"). INVALID_ARGUMENT for another
// name or an ISA wider than the CPU has; FAILED_PRECONDITION if the path was already set (or oneDNN
// already ran) differently. Calling it again with the same request is a no-op.
absl::Status ConfigureCpuIsa(const std::string& requested);

// The path in use (configured from $MUOND_CPU_ISA on first use when ConfigureCpuIsa was not called;
// an invalid value there aborts with a message, as only tests set it).
const CpuMathPath& CurrentCpuMathPath();

// Whether bf16 products are emulated in fp32 (CurrentCpuMathPath().bf16_native is false, or a test
// forced emulation with SetBf16EmulationForTesting).
bool EmulateBf16();

// Tests: forces bf16 emulation on (true) or back to the probed path (false) in this process.
void SetBf16EmulationForTesting(bool emulate);

}  // namespace muond::server

#endif  // MUOND_SERVER_OPTIM_CPU_ISA_H_
