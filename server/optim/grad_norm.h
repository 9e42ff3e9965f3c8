// Global gradient clipping of apply mode (DESIGN.md 4b):
//   G <- G * min(1, max_norm / (||all G||_2 + 1e-6)), the norm over every tensor of the job,
// accumulated in float64.
//
// The sum of squares has one fixed order, whatever the threads or the CPU: blocks of kNormBlock
// elements, each summed in 8 interleaved float64 lanes (lane j takes the elements i = j mod 8 in
// order) combined pairwise, the blocks' sums added in block order. Callers add the sums of whole
// blocks (or of whole tensors) in an order they fix, so a step computed speculatively and one
// computed after the norm was known see the same bits.
// Thread-safe: pure functions.
#ifndef MUOND_SERVER_OPTIM_GRAD_NORM_H_
#define MUOND_SERVER_OPTIM_GRAD_NORM_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/parallel_for.h"

namespace muond::server {

inline constexpr size_t kNormBlock = size_t{1} << 16;

// The float64 sum of squares of n float32 values, in the order above (n <= kNormBlock gives one
// block's sum; a longer run is summed block by block, in order).
double SumOfSquares(const float* g, size_t n);

// The factor gradients are multiplied by: min(1, max_norm / (sqrt(sum_sq) + 1e-6)) computed in
// float64 and rounded to float32 once; exactly 1 when max_norm is 0 (no clipping) or the norm is
// within it.
float ClipCoefficient(double sum_sq, double max_norm);

// A sum of squares in the order above, its blocks summed over the CPUs: whole blocks of
// kNormBlock elements, block(begin, end) summing elements [begin, end), added in block order.
// `bytes`: what the blocks read, for ParallelFor.
template <typename Block>
double BlockSumOfSquares(size_t n, size_t bytes, const Block& block) {
  std::vector<double> blocks((n + kNormBlock - 1) / kNormBlock);
  common::ParallelFor(blocks.size(), bytes, [&](size_t b) {
    const uint64_t begin = b * kNormBlock;
    blocks[b] = block(begin, std::min<uint64_t>(n, begin + kNormBlock));
  });
  double ss = 0;
  for (double s : blocks) ss += s;
  return ss;
}

// SumOfSquares(g, n) bit for bit, its blocks summed over the CPUs.
inline double ParallelSumOfSquares(const float* g, size_t n) {
  return BlockSumOfSquares(n, n * sizeof(float), [g](uint64_t begin, uint64_t end) {
    return SumOfSquares(g + begin, end - begin);
  });
}

}  // namespace muond::server

#endif  // MUOND_SERVER_OPTIM_GRAD_NORM_H_
