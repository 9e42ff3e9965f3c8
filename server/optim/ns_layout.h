// Internal to server/optim: the memory passes around the Newton-Schulz iterations on the CPU, on
// raw buffers and over the calling thread's OpenMP team: the per-block normalization into the
// iteration's layout and dtype, the scaled write-back into the caller's fp32 buffers (with the
// finiteness check folded in), and the elementwise passes of the Muon update before it.
//
// Why not LibTorch ops: a block with rows > cols is iterated transposed ([cols, rows], m <= n).
// ATen's norm, division and copy over a transposed view walk the caller's buffer column by column
// (a cache miss per element on 4 MiB rows of 3072 x 1024 blocks) and each is its own pass. Here
// the transpose goes through 64 x 64 tiles that stay in L1, norm, division and rounding are one
// read and one write, and the write-back widens, scales and checks in the same pass.
//
// Determinism: every result is elementwise except the norm, whose sum has one fixed order (rows
// in chunks of kNormRows, each chunk's float64 sum over 16 fixed lanes, chunks added in order), so
// no bit depends on the thread count or on the batch a block is in (same-shape batching).
#ifndef MUOND_SERVER_OPTIM_NS_LAYOUT_H_
#define MUOND_SERVER_OPTIM_NS_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#include "server/optim/dnnl_gemm.h"

namespace muond::server::internal {

// `count` buffers, each `batch` contiguous fp32 blocks of [rows, cols] (the caller's layout). The
// iteration's layout is [count * batch, m, n] with m = min(rows, cols), n = max(rows, cols): each
// block transposed when rows > cols.
struct BlockLayout {
  size_t count = 0;
  int64_t batch = 0, rows = 0, cols = 0;
  bool transposed() const { return rows > cols; }
  int64_t block_elements() const { return rows * cols; }
};

// Per block: out = X / (||X||_F * norm_factor + eps), the norm rounded to fp32 and the quotient
// computed in fp32, stored in the iteration's layout as fp32 or rounded to bf16 (nearest even).
void NormalizeBlocksInto(const BlockLayout& layout, const float* const* src, double norm_factor,
                         float eps, GemmType out_type, void* out, int threads);

// Per block: dst = widen(result) * float(scale) in the caller's layout (result in the iteration's
// layout, fp32 or bf16). Returns the index of the first buffer holding a non-finite value after
// the write, or -1.
int64_t WriteBackBlocks(const BlockLayout& layout, const void* result, GemmType result_type,
                        double scale, float* const* dst, int threads);

// Rounds fp32 values to the nearest bf16 value (nearest even, common/float_bits.h), kept as fp32:
// bf16 emulation's rounding of an op's result (cpu_isa.h). RoundRowsToBf16 on the calling thread,
// rows of `cols` elements `ld` apart; RoundToBf16 on n contiguous elements over the team.
void RoundRowsToBf16(float* data, int64_t rows, int64_t cols, int64_t ld);
void RoundToBf16(float* data, int64_t n, int threads);

// The Muon momentum and update of n elements (muon_math.cc's formulas, elementwise) over the team:
// `fn(begin, end)` on consecutive ranges covering [0, n).
template <typename Fn>
void ParallelRanges(int64_t n, int threads, Fn fn);

// Index of the first non-finite element of data[0, n), or -1; ranges scanned over the team.
int64_t FindNonFiniteParallel(const float* data, int64_t n, int threads);

// Ranges of kRangeElements; a pass over fewer elements than two of them stays on the calling
// thread (waking the team costs more than it saves).
inline constexpr int64_t kRangeElements = int64_t{1} << 16;

void RunRanges(int64_t n, int threads, void (*fn)(void*, int64_t, int64_t), void* ctx);

template <typename Fn>
void ParallelRanges(int64_t n, int threads, Fn fn) {
  RunRanges(
      n, threads,
      [](void* ctx, int64_t begin, int64_t end) { (*static_cast<Fn*>(ctx))(begin, end); }, &fn);
}

}  // namespace muond::server::internal

#endif  // MUOND_SERVER_OPTIM_NS_LAYOUT_H_
