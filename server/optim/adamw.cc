#include "server/optim/adamw.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "server/optim/cpu_isa.h"

namespace muond::server {
namespace {

// The per-step factors, each computed in double and rounded to float once.
struct Factors {
  float decay;  // 1 - lr*wd
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float bias2_sqrt;  // sqrt(1 - b2^t)
  float eps;
  float neg_step;  // -lr / (1 - b1^t)
  float grad_scale;
};

Factors FactorsFor(const AdamWHyper& h, int64_t step, float grad_scale) {
  const double t = static_cast<double>(step);
  Factors f;
  f.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  f.beta1 = static_cast<float>(h.beta1);
  f.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  f.beta2 = static_cast<float>(h.beta2);
  f.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  f.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, t)));
  f.eps = static_cast<float>(h.eps);
  f.neg_step = static_cast<float>(-(h.lr / (1.0 - std::pow(h.beta1, t))));
  f.grad_scale = grad_scale;
  return f;
}

// Elements [begin, end), one operation at a time. -ffp-contract=off keeps the compiler from
// fusing these (see CMakeLists.txt): the vector path must round exactly the same way.
void Portable(const Factors& f, const AdamWArrays& a, size_t begin, size_t end) {
  const float* p_in = a.param_in != nullptr ? a.param_in : a.param;
  const float* m_in = a.exp_avg_in != nullptr ? a.exp_avg_in : a.exp_avg;
  const float* v_in = a.exp_avg_sq_in != nullptr ? a.exp_avg_sq_in : a.exp_avg_sq;
  for (size_t i = begin; i < end; ++i) {
    const float g = a.grad[i] * f.grad_scale;
    const float p = p_in[i] * f.decay;
    const float m = m_in[i] * f.beta1 + f.one_minus_beta1 * g;
    const float v = v_in[i] * f.beta2 + (f.one_minus_beta2 * g) * g;
    const float denom = std::sqrt(v) / f.bias2_sqrt + f.eps;
    a.param[i] = p + f.neg_step * (m / denom);
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
  }
}

// GCC 12 warns about the undefined source operand inside its own AVX-512 intrinsics.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f"))) void Avx512(const Factors& f, const AdamWArrays& a, size_t begin,
                                               size_t end) {
  const __m512 scale = _mm512_set1_ps(f.grad_scale), decay = _mm512_set1_ps(f.decay);
  const __m512 b1 = _mm512_set1_ps(f.beta1), omb1 = _mm512_set1_ps(f.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(f.beta2), omb2 = _mm512_set1_ps(f.one_minus_beta2);
  const __m512 bc2 = _mm512_set1_ps(f.bias2_sqrt), eps = _mm512_set1_ps(f.eps);
  const __m512 neg_step = _mm512_set1_ps(f.neg_step);
  const float* p_in = a.param_in != nullptr ? a.param_in : a.param;
  const float* m_in = a.exp_avg_in != nullptr ? a.exp_avg_in : a.exp_avg;
  const float* v_in = a.exp_avg_sq_in != nullptr ? a.exp_avg_sq_in : a.exp_avg_sq;
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(a.grad + i), scale);
    const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(p_in + i), decay);
    const __m512 m =
        _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(m_in + i), b1), _mm512_mul_ps(omb1, g));
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v_in + i), b2),
                                   _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
    _mm512_storeu_ps(a.param + i,
                     _mm512_add_ps(p, _mm512_mul_ps(neg_step, _mm512_div_ps(m, denom))));
    _mm512_storeu_ps(a.exp_avg + i, m);
    _mm512_storeu_ps(a.exp_avg_sq + i, v);
  }
  Portable(f, a, i, end);
}

// The same operations on 8 lanes (AVX2 machines). Multiplies and adds stay separate instructions:
// an FMA rounds once where the portable path rounds twice, and the paths must agree bit for bit.
__attribute__((target("avx2,fma"))) void Avx2(const Factors& f, const AdamWArrays& a, size_t begin,
                                              size_t end) {
  const __m256 scale = _mm256_set1_ps(f.grad_scale), decay = _mm256_set1_ps(f.decay);
  const __m256 b1 = _mm256_set1_ps(f.beta1), omb1 = _mm256_set1_ps(f.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(f.beta2), omb2 = _mm256_set1_ps(f.one_minus_beta2);
  const __m256 bc2 = _mm256_set1_ps(f.bias2_sqrt), eps = _mm256_set1_ps(f.eps);
  const __m256 neg_step = _mm256_set1_ps(f.neg_step);
  const float* p_in = a.param_in != nullptr ? a.param_in : a.param;
  const float* m_in = a.exp_avg_in != nullptr ? a.exp_avg_in : a.exp_avg;
  const float* v_in = a.exp_avg_sq_in != nullptr ? a.exp_avg_sq_in : a.exp_avg_sq;
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(a.grad + i), scale);
    const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(p_in + i), decay);
    const __m256 m =
        _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(m_in + i), b1), _mm256_mul_ps(omb1, g));
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v_in + i), b2),
                                   _mm256_mul_ps(_mm256_mul_ps(omb2, g), g));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
    _mm256_storeu_ps(a.param + i,
                     _mm256_add_ps(p, _mm256_mul_ps(neg_step, _mm256_div_ps(m, denom))));
    _mm256_storeu_ps(a.exp_avg + i, m);
    _mm256_storeu_ps(a.exp_avg_sq + i, v);
  }
  Portable(f, a, i, end);
}
#pragma GCC diagnostic pop

bool HaveAvx512() {
  static const bool have = __builtin_cpu_supports("avx512f");
  return have;
}

bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return have;
}

// kAuto follows the process's CPU path (cpu_isa.h: --cpu-isa caps it); a named path runs when the
// CPU has it, else the next narrower one.
AdamWPath Resolve(AdamWPath path) {
  if (path == AdamWPath::kAuto) {
    switch (CurrentCpuMathPath().isa) {
      case CpuIsa::kAmx:
      case CpuIsa::kAvx512: path = AdamWPath::kAvx512; break;
      case CpuIsa::kAvx2: path = AdamWPath::kAvx2; break;
      case CpuIsa::kBaseline: path = AdamWPath::kPortable; break;
    }
  }
  if (path == AdamWPath::kAvx512 && !HaveAvx512()) path = AdamWPath::kAvx2;
  if (path == AdamWPath::kAvx2 && !HaveAvx2()) path = AdamWPath::kPortable;
  return path;
}

// Elements [begin, end): the update in blocks small enough to stay in L1, each block's new p
// converted to the output dtype right after it is computed.
void Range(const Factors& f, const AdamWArrays& a, size_t begin, size_t end, AdamWPath path) {
  constexpr size_t kBlock = 2048;
  for (size_t b = begin; b < end; b += kBlock) {
    const size_t e = std::min(end, b + kBlock);
    switch (path) {
      case AdamWPath::kAvx512: Avx512(f, a, b, e); break;
      case AdamWPath::kAvx2: Avx2(f, a, b, e); break;
      default: Portable(f, a, b, e); break;
    }
    if (a.out != nullptr) {
      char* out = static_cast<char*>(a.out) + b * common::DTypeSize(a.out_dtype);
      common::FromFloat32(a.param + b, e - b, a.out_dtype, out);
    }
  }
}

}  // namespace

const char* AdamWPathName(AdamWPath path) {
  switch (Resolve(path)) {
    case AdamWPath::kAvx512: return "avx512";
    case AdamWPath::kAvx2: return "avx2";
    default: return "portable";
  }
}

const char* AdamWAutoPathName() { return AdamWPathName(AdamWPath::kAuto); }

void AdamWUpdate(const AdamWHyper& hyper, int64_t step, float grad_scale, const AdamWArrays& a,
                 size_t n, int threads, AdamWPath path) {
  const Factors f = FactorsFor(hyper, step, grad_scale);
  const AdamWPath resolved = Resolve(path);
  // A thread pays for itself from about a million elements (16 MiB touched).
  constexpr size_t kPerThread = size_t{1} << 20;
  const size_t workers = std::max<size_t>(
      1, std::min<size_t>(static_cast<size_t>(std::max(threads, 1)), n / kPerThread));
  if (workers == 1) {
    Range(f, a, 0, n, resolved);
    return;
  }
  // Slices on 64-byte boundaries of the float arrays (16 elements), so threads never share a line.
  const size_t slice = (n / workers + 15) / 16 * 16;
  std::vector<std::thread> helpers;
  for (size_t w = 1; w < workers; ++w) {
    const size_t b = std::min(n, w * slice), e = w + 1 == workers ? n : std::min(n, b + slice);
    helpers.emplace_back([&f, &a, b, e, resolved] { Range(f, a, b, e, resolved); });
  }
  Range(f, a, 0, std::min(n, slice), resolved);
  for (auto& t : helpers) t.join();
}

}  // namespace muond::server
