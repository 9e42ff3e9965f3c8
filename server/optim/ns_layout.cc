// See ns_layout.h.
#include "server/optim/ns_layout.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <vector>

#include "common/dtype.h"
#include "common/float_bits.h"

namespace muond::server::internal {
namespace {

// Rows of the caller's block per partial sum of the norm.
constexpr int64_t kNormRows = 16;
// Side of a transposing tile: 64 x 64 fp32 source rows and bf16 destination rows fit in L1.
constexpr int64_t kTile = 64;
constexpr int kLanes = 16;

using common::Bf16ToFloat;
using common::FloatBits;
using common::FloatToBf16;

inline void Store(float v, float* out) { *out = v; }
inline void Store(float v, uint16_t* out) { *out = FloatToBf16(v); }
inline float Load(const float* in) { return *in; }
inline float Load(const uint16_t* in) { return Bf16ToFloat(*in); }

// Sum of squares of p[0, len) in float64: 16 lanes over the elements in order, then the lanes.
double SumSquares(const float* p, int64_t len) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double v = p[i + l];
      acc[l] += v * v;
    }
  }
  for (int l = 0; i < len; ++i, ++l) {
    const double v = p[i];
    acc[l] += v * v;
  }
  double sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

const float* BlockOf(const BlockLayout& layout, const float* const* src, int64_t block) {
  return src[block / layout.batch] + (block % layout.batch) * layout.block_elements();
}

// Per block: ||X||_F * factor + eps in fp32.
std::vector<float> Denominators(const BlockLayout& layout, const float* const* src,
                                double norm_factor, float eps, int threads) {
  const int64_t blocks = static_cast<int64_t>(layout.count) * layout.batch;
  const int64_t chunks = (layout.rows + kNormRows - 1) / kNormRows;
  std::vector<double> partial(static_cast<size_t>(blocks * chunks));
  const int64_t tasks = blocks * chunks;
  const int team = tasks * kNormRows * layout.cols >= 2 * kRangeElements ? threads : 1;
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t block = t / chunks, row = (t % chunks) * kNormRows;
    const int64_t rows = std::min(kNormRows, layout.rows - row);
    partial[static_cast<size_t>(t)] =
        SumSquares(BlockOf(layout, src, block) + row * layout.cols, rows * layout.cols);
  }
  std::vector<float> denom(static_cast<size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    double sum = 0;
    for (int64_t c = 0; c < chunks; ++c) sum += partial[static_cast<size_t>(b * chunks + c)];
    const float norm = static_cast<float>(std::sqrt(sum));
    const float scaled = norm * static_cast<float>(norm_factor);
    denom[static_cast<size_t>(b)] = scaled + eps;
  }
  return denom;
}

// One kTile x kTile tile of a transposed block: out[i][j] = f(in[j][i]) for the tile's i in
// [i0, i1) (in's columns) and j in [j0, j1) (in's rows); in has `in_cols` columns, out `out_cols`.
template <typename In, typename Out, typename F>
void TransposeTile(const In* in, int64_t in_cols, Out* out, int64_t out_cols, int64_t i0,
                   int64_t i1, int64_t j0, int64_t j1, F f) {
  for (int64_t i = i0; i < i1; ++i) {
    Out* row = out + i * out_cols;
    for (int64_t j = j0; j < j1; ++j) Store(f(Load(in + j * in_cols + i)), row + j);
  }
}

struct Tiles {
  int64_t row_tiles, col_tiles;  // over the caller's rows and columns
  int64_t per_block() const { return row_tiles * col_tiles; }
};

Tiles TilesOf(const BlockLayout& layout) {
  return {(layout.rows + kTile - 1) / kTile, (layout.cols + kTile - 1) / kTile};
}

template <typename Out>
void Normalize(const BlockLayout& layout, const float* const* src, const std::vector<float>& denom,
               Out* out, int threads) {
  const int64_t blocks = static_cast<int64_t>(layout.count) * layout.batch;
  const int64_t elements = layout.block_elements();
  if (!layout.transposed()) {
    const int64_t rows = blocks * layout.rows;
    const int team = rows * layout.cols >= 2 * kRangeElements ? threads : 1;
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t block = r / layout.rows, row = r % layout.rows;
      const float d = denom[static_cast<size_t>(block)];
      const float* in = BlockOf(layout, src, block) + row * layout.cols;
      Out* o = out + block * elements + row * layout.cols;
      for (int64_t j = 0; j < layout.cols; ++j) Store(in[j] / d, o + j);
    }
    return;
  }
  const Tiles tiles = TilesOf(layout);
  const int64_t tasks = blocks * tiles.per_block();
  const int team = blocks * elements >= 2 * kRangeElements ? threads : 1;
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t block = t / tiles.per_block(), tile = t % tiles.per_block();
    const int64_t j0 = (tile / tiles.col_tiles) * kTile, i0 = (tile % tiles.col_tiles) * kTile;
    const float d = denom[static_cast<size_t>(block)];
    // The block's transpose is [cols, rows]: out row i is the caller's column i.
    TransposeTile(BlockOf(layout, src, block), layout.cols, out + block * elements, layout.rows, i0,
                  std::min(i0 + kTile, layout.cols), j0, std::min(j0 + kTile, layout.rows),
                  [d](float v) { return v / d; });
  }
}

inline bool NonFinite(float v) { return (FloatBits(v) & 0x7F800000u) == 0x7F800000u; }

template <typename In>
int64_t WriteBack(const BlockLayout& layout, const In* result, float scale, float* const* dst,
                  int threads) {
  const int64_t blocks = static_cast<int64_t>(layout.count) * layout.batch;
  const int64_t elements = layout.block_elements();
  std::unique_ptr<std::atomic<bool>[]> bad(new std::atomic<bool>[layout.count]);
  for (size_t k = 0; k < layout.count; ++k) bad[k].store(false, std::memory_order_relaxed);
  const auto out_of = [&](int64_t block) {
    return dst[block / layout.batch] + (block % layout.batch) * elements;
  };
  const int team = blocks * elements >= 2 * kRangeElements ? threads : 1;
  if (!layout.transposed()) {
    const int64_t rows = blocks * layout.rows;
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t block = r / layout.rows, row = r % layout.rows;
      const In* in = result + block * elements + row * layout.cols;
      float* o = out_of(block) + row * layout.cols;
      bool any = false;
      for (int64_t j = 0; j < layout.cols; ++j) {
        const float v = Load(in + j) * scale;
        o[j] = v;
        any |= NonFinite(v);
      }
      if (any) bad[static_cast<size_t>(block / layout.batch)].store(true);
    }
  } else {
    const Tiles tiles = TilesOf(layout);
    const int64_t tasks = blocks * tiles.per_block();
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t block = t / tiles.per_block(), tile = t % tiles.per_block();
      // Caller's tile: rows [r0, r1) and columns [c0, c1); result is the block's transpose.
      const int64_t r0 = (tile / tiles.col_tiles) * kTile, c0 = (tile % tiles.col_tiles) * kTile;
      bool any = false;
      TransposeTile(result + block * elements, layout.rows, out_of(block), layout.cols, r0,
                    std::min(r0 + kTile, layout.rows), c0, std::min(c0 + kTile, layout.cols),
                    [scale, &any](float v) {
                      const float s = v * scale;
                      any |= NonFinite(s);
                      return s;
                    });
      if (any) bad[static_cast<size_t>(block / layout.batch)].store(true);
    }
  }
  for (size_t k = 0; k < layout.count; ++k) {
    if (bad[k].load()) return static_cast<int64_t>(k);
  }
  return -1;
}

}  // namespace

void NormalizeBlocksInto(const BlockLayout& layout, const float* const* src, double norm_factor,
                         float eps, GemmType out_type, void* out, int threads) {
  threads = std::max(threads, 1);
  const std::vector<float> denom = Denominators(layout, src, norm_factor, eps, threads);
  if (out_type == GemmType::kBFloat16) {
    Normalize(layout, src, denom, static_cast<uint16_t*>(out), threads);
  } else {
    Normalize(layout, src, denom, static_cast<float*>(out), threads);
  }
}

int64_t WriteBackBlocks(const BlockLayout& layout, const void* result, GemmType result_type,
                        double scale, float* const* dst, int threads) {
  threads = std::max(threads, 1);
  const float s = static_cast<float>(scale);
  if (result_type == GemmType::kBFloat16) {
    return WriteBack(layout, static_cast<const uint16_t*>(result), s, dst, threads);
  }
  return WriteBack(layout, static_cast<const float*>(result), s, dst, threads);
}

void RoundRowsToBf16(float* data, int64_t rows, int64_t cols, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = data + i * ld;
    for (int64_t j = 0; j < cols; ++j) row[j] = Bf16ToFloat(FloatToBf16(row[j]));
  }
}

void RoundToBf16(float* data, int64_t n, int threads) {
  ParallelRanges(n, threads, [data](int64_t begin, int64_t end) {
    RoundRowsToBf16(data + begin, 1, end - begin, 0);
  });
}

void RunRanges(int64_t n, int threads, void (*fn)(void*, int64_t, int64_t), void* ctx) {
  const int64_t ranges = (n + kRangeElements - 1) / kRangeElements;
  if (threads <= 1 || ranges < 2) {
    if (n > 0) fn(ctx, 0, n);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < ranges; ++r) {
    fn(ctx, r * kRangeElements, std::min(n, (r + 1) * kRangeElements));
  }
}

int64_t FindNonFiniteParallel(const float* data, int64_t n, int threads) {
  const int64_t ranges = (n + kRangeElements - 1) / kRangeElements;
  std::vector<int64_t> first(static_cast<size_t>(ranges), -1);
  ParallelRanges(n, threads, [&](int64_t begin, int64_t end) {
    const int64_t bad = common::FindNonFinite(data + begin, static_cast<size_t>(end - begin));
    if (bad >= 0) first[static_cast<size_t>(begin / kRangeElements)] = begin + bad;
  });
  for (int64_t f : first) {
    if (f >= 0) return f;
  }
  return -1;
}

}  // namespace muond::server::internal
