// Internal to server/optim: one Newton-Schulz iteration as independent single-threaded GEMM tasks
// (dnnl_gemm.h) spread over the calling thread's OpenMP team; the fp32 and bf16 iteration of
// ns_batched_math.cc.
//
// On blocks X [batch, m, n] (m <= n, contiguous) the iteration is, per block,
//   A = X X^T,  P = b A + c A A,  next = a X + P X,
// each product's fp32 accumulation rounded once to the storage dtype. A and P are symmetric, so
// only their upper triangle is computed, in strips of StripRows(m) rows: the strip at row r is
//   A[r:r+h, r:m] = X[r:r+h, :] X[r:m, :]^T          (then mirrored into A[r:m, r:r+h])
//   P[r:r+h, r:m] = b A[r:r+h, r:m] + c A[r:r+h, :] A[r:m, :]^T    (A A = A A^T; mirrored)
// which costs (1 + 1/S) / 2 of the full product for S strips (0.625 at m = 1024). next is computed
// in column chunks of ChunkCols(n): next[:, j:j+w] = a X[:, j:j+w] + P X[:, j:j+w].
//
// Each task is one block's strip or chunk; a phase's tasks (all blocks, of every group when several
// shapes iterate together) run on the team with a dynamic schedule, largest first, and the three
// phases are separated by the team's barrier. A block's tasks depend only on (m, n), and each task
// is a single-threaded primitive of fixed shape, so a block's bits do not depend on the batch it
// is in, on the other shapes beside it, on the thread count or on which thread ran which task
// (same-shape batching, DESIGN.md 3).
#ifndef MUOND_SERVER_OPTIM_NS_TASKS_H_
#define MUOND_SERVER_OPTIM_NS_TASKS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "server/optim/dnnl_gemm.h"
#include "server/optim/ns_schedule.h"

namespace muond::server::internal {

inline constexpr int64_t kMaxStripRows = 256;

// Strip height for blocks of m rows: a quarter of m rounded up to a multiple of 64, from 64 to 256
// (a function of m only, so a block's products and bits do not depend on the batch or the thread
// count). Four strips or more (from m = 256 on) split a block evenly over two threads (a 512-row
// block in two strips of 256 splits its work 2:1) and cost at most (1 + 1/4)/2 of the full
// product.
inline int64_t StripRows(int64_t m) {
  const int64_t quarter = (m + 3) / 4;  // >= 1 for m >= 1, so the rounding gives >= 64
  return std::min((quarter + 63) / 64 * 64, kMaxStripRows);
}
// Column chunk width for blocks of n columns: an even number of chunks (so two threads split a
// block evenly), each at most kMaxChunkCols (a function of n only, like StripRows). Wider chunks pay: at 1024 x 3072, 512-column chunks ran Newton-Schulz at 218
// GFLOP/s against 206 with 256 on AVX-512, and 188 against 137 on oneDNN's AVX2 kernels (its
// fp32 GEMM re-packs the [m, m] operand per chunk).
inline constexpr int64_t kMaxChunkCols = 512;
inline int64_t ChunkCols(int64_t n) {
  const int64_t pairs = (n + 2 * kMaxChunkCols - 1) / (2 * kMaxChunkCols);  // >= 1 for n >= 1
  return (n + 2 * pairs - 1) / (2 * pairs);
}

struct TaskBlocks {
  GemmType type = GemmType::kBFloat16;
  int64_t batch = 0, m = 0, n = 0;
  const void* x = nullptr;  // [batch, m, n]
  void* a = nullptr;        // [batch, m, m] scratch
  void* p = nullptr;        // [batch, m, m] scratch
  void* next = nullptr;     // [batch, m, n] result
  // bf16 emulation (cpu_isa.h): type is kFloat32, x holds bf16 values, and each product's fp32
  // result is rounded to bf16 (kept as fp32) where a bf16 product would round it.
  bool round_bf16 = false;
};

// One iteration with coefficients k of the blocks of `count` groups (each its own shape) on
// `threads` threads (>= 1): each phase's tasks of all groups form one pool, so the groups share
// the team's barriers and the largest tasks of any group go first. `*op` names the phase in flight
// for error messages. Throws std::runtime_error (the first task's failure) if a product fails;
// the outputs are then unspecified.
void TaskIteration(const TaskBlocks* groups, size_t count, const ns::Coefficients& k, int threads,
                   const char** op);

inline void TaskIteration(const TaskBlocks& blocks, const ns::Coefficients& k, int threads,
                          const char** op) {
  TaskIteration(&blocks, 1, k, threads, op);
}

}  // namespace muond::server::internal

#endif  // MUOND_SERVER_OPTIM_NS_TASKS_H_
