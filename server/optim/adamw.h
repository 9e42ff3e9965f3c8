// AdamW on host memory (DESIGN.md section 4b), as torch.optim.AdamW computes it (decoupled weight
// decay, bias correction, step count per tensor), in one fused pass per element: read g, p, m, v;
// write p, m, v and, optionally, the new p in the trainer's parameter dtype.
//
// Arithmetic, in float32 with every operation rounded on its own (no contraction into FMAs), in
// torch's order:
//   p <- p * (1 - lr*wd)
//   m <- m * b1 + (1 - b1) * g
//   v <- v * b2 + ((1 - b2) * g) * g
//   p <- p + (-lr / (1 - b1^t)) * (m / (sqrt(v) / sqrt(1 - b2^t) + eps))
// with g = grad * grad_scale, and the scalar factors computed in double and rounded to float once
// (as torch passes Python floats to its float32 kernels). torch's own CPU kernels fuse some of
// these products into FMAs, so results agree with torch to about 1e-7 relative per step, not bit
// for bit; the vectorized paths (AVX-512 and AVX2, where the CPU has them) and the portable path
// agree bit for bit, so a result never depends on the machine.
//
// Thread-safe: pure functions over memory the caller owns.
#ifndef MUOND_SERVER_OPTIM_ADAMW_H_
#define MUOND_SERVER_OPTIM_ADAMW_H_

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace muond::server {

struct AdamWHyper {
  double lr = 1e-3;
  double weight_decay = 1e-2;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
};

// One tensor's (or one slice's) arrays for a step. `out`, when not null, receives the new p in
// `out_dtype` (round to nearest even, identical to torch's .to(dtype)).
struct AdamWArrays {
  const float* grad = nullptr;
  float* param = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* out = nullptr;
  common::DType out_dtype = common::DType::kFloat32;
  // Where p, m and v are read from when not the arrays above (null: in place). A job's step reads
  // the committed state and writes the next one elsewhere (server/engine/param_store.h).
  const float* param_in = nullptr;
  const float* exp_avg_in = nullptr;
  const float* exp_avg_sq_in = nullptr;
};

enum class AdamWPath { kAuto, kPortable, kAvx2, kAvx512 };

// The path `path` runs on this CPU: "avx512", "avx2" or "portable". kAuto follows the process's
// CPU path (server/optim/cpu_isa.h, capped by --cpu-isa); a path the CPU lacks runs the next
// narrower one.
const char* AdamWPathName(AdamWPath path);
// AdamWPathName(AdamWPath::kAuto).
const char* AdamWAutoPathName();

// Applies step `step` (>= 1: the tensor's step count after this step) to n elements, multiplying
// each gradient value by `grad_scale` first. Splits the work over up to `threads` threads when n is
// large. A path the CPU lacks falls back to the next narrower one (AdamWPathName).
void AdamWUpdate(const AdamWHyper& hyper, int64_t step, float grad_scale, const AdamWArrays& a,
                 size_t n, int threads = 1, AdamWPath path = AdamWPath::kAuto);

}  // namespace muond::server

#endif  // MUOND_SERVER_OPTIM_ADAMW_H_
