// See ns_tasks.h.
#include "server/optim/ns_tasks.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <vector>

#include "server/optim/ns_layout.h"

namespace muond::server::internal {
namespace {

size_t ElementSize(GemmType type) { return type == GemmType::kBFloat16 ? 2 : 4; }

struct Task {
  size_t group;
  int64_t block;
  int64_t offset;  // first row (strips) or column (chunks)
  int64_t size;    // rows or columns
  int64_t work;    // multiply-adds
};

// Largest first (a phase ends when its last task does), ties in listing order.
void Order(std::vector<Task>* tasks) {
  std::stable_sort(tasks->begin(), tasks->end(),
                   [](const Task& x, const Task& y) { return x.work > y.work; });
}

// Strips of the upper triangles of every group's blocks; `inner` is the products' inner size
// (n for X X^T, m for A A).
std::vector<Task> Strips(const TaskBlocks* groups, size_t count, bool gram) {
  std::vector<Task> tasks;
  for (size_t g = 0; g < count; ++g) {
    const int64_t m = groups[g].m, inner = gram ? groups[g].n : groups[g].m;
    const int64_t rows = StripRows(m);
    for (int64_t r = 0; r < m; r += rows) {
      const int64_t h = std::min(rows, m - r);
      for (int64_t j = 0; j < groups[g].batch; ++j)
        tasks.push_back({g, j, r, h, h * (m - r) * inner});
    }
  }
  Order(&tasks);
  return tasks;
}

std::vector<Task> Chunks(const TaskBlocks* groups, size_t count) {
  std::vector<Task> tasks;
  for (size_t g = 0; g < count; ++g) {
    const int64_t m = groups[g].m, n = groups[g].n;
    const int64_t cols = ChunkCols(n);
    for (int64_t c = 0; c < n; c += cols) {
      const int64_t w = std::min(cols, n - c);
      for (int64_t j = 0; j < groups[g].batch; ++j) tasks.push_back({g, j, c, w, m * w * m});
    }
  }
  Order(&tasks);
  return tasks;
}

int64_t Work(const std::vector<Task>& tasks) {
  int64_t sum = 0;
  for (const Task& t : tasks) sum += t.work;
  return sum;
}

// Copies the strip's upper part M[r:r+h, r:m] into the lower triangle: M[c, r + i] = M[r + i, c]
// for c > r + i. Elements are `E` bytes wide (bit copies).
template <typename E>
void MirrorStrip(E* mat, int64_t m, int64_t r, int64_t h) {
  constexpr int64_t kTile = 32;  // a tile's source rows and destination rows stay in L1
  for (int64_t c0 = r; c0 < m; c0 += kTile) {
    const int64_t c1 = std::min(c0 + kTile, m);
    for (int64_t i0 = 0; i0 < h && r + i0 < c1; i0 += kTile) {
      const int64_t i1 = std::min(i0 + kTile, h);
      for (int64_t c = c0; c < c1; ++c) {
        E* row = mat + c * m + r;
        const int64_t upto = std::min(i1, c - r);
        for (int64_t i = i0; i < upto; ++i) row[i] = mat[(r + i) * m + c];
      }
    }
  }
}

void Mirror(GemmType type, void* mat, int64_t m, int64_t r, int64_t h) {
  if (type == GemmType::kBFloat16) {
    MirrorStrip(static_cast<uint16_t*>(mat), m, r, h);
  } else {
    MirrorStrip(static_cast<uint32_t*>(mat), m, r, h);
  }
}

// Copies rows x cols elements between row-major matrices with the given row strides.
void CopyRect(const char* src, int64_t lds, char* dst, int64_t ldd, int64_t rows, int64_t cols,
              size_t esize) {
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(dst + i * ldd * esize, src + i * lds * esize, static_cast<size_t>(cols) * esize);
  }
}

// A phase gets one thread per kMinMultiplyAddsPerThread of work (at least one, at most `threads`):
// waking a thread for a fraction of a millisecond of work costs more than it saves, much more when
// the cores are oversubscribed and the team's barrier waits for a descheduled thread.
constexpr int64_t kMinMultiplyAddsPerThread = int64_t{1} << 25;

int PhaseThreads(int threads, size_t tasks, int64_t multiply_adds) {
  const int64_t by_work = std::max<int64_t>(1, multiply_adds / kMinMultiplyAddsPerThread);
  return static_cast<int>(std::min<int64_t>({threads, static_cast<int64_t>(tasks), by_work}));
}

// Runs fn on every task over `threads` threads (dynamic schedule, in order); rethrows the first
// failure.
void RunPhase(const std::vector<Task>& tasks, int threads,
              const std::function<void(const Task&)>& fn) {
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  const int64_t count = static_cast<int64_t>(tasks.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t t = 0; t < count; ++t) {
    if (failed.load(std::memory_order_relaxed)) continue;
    try {
      fn(tasks[static_cast<size_t>(t)]);
    } catch (...) {
#pragma omp critical(muond_ns_task_error)
      {
        if (!error) error = std::current_exception();
      }
      failed.store(true, std::memory_order_relaxed);
    }
  }
  if (error) std::rethrow_exception(error);
}

// Under bf16 emulation, the product's fp32 result rounded to bf16 values (in cache: the task's
// own output, just written).
void RoundResult(const TaskBlocks& blk, const GemmArgs& g) {
  if (blk.round_bf16) RoundRowsToBf16(static_cast<float*>(g.c), g.m, g.n, g.ldc);
}

// The three phases of TaskIteration, each over its task pool.
void GramPhase(const TaskBlocks* groups, const std::vector<Task>& gram_strips, int threads,
               const char** op) {
  *op = "X X^T (upper strips)";
  RunPhase(gram_strips, PhaseThreads(threads, gram_strips.size(), Work(gram_strips)),
           [&](const Task& t) {
             const TaskBlocks& blk = groups[t.group];
             const int64_t m = blk.m, n = blk.n;
             const size_t es = ElementSize(blk.type);
             const char* xb = static_cast<const char*>(blk.x) + t.block * m * n * es;
             char* ab = static_cast<char*>(blk.a) + t.block * m * m * es;
             GemmArgs g{blk.type,
                        xb + t.offset * n * es,
                        xb + t.offset * n * es,
                        ab + (t.offset * m + t.offset) * es,
                        t.size,
                        m - t.offset,
                        n,
                        n,
                        n,
                        m,
                        /*b_transposed=*/true};
             DnnlGemm(g);
             RoundResult(blk, g);
             Mirror(blk.type, ab, m, t.offset, t.size);
           });
}

void PolyPhase(const TaskBlocks* groups, const std::vector<Task>& poly_strips,
               const ns::Coefficients& k, int threads, const char** op) {
  *op = "b A + c A A (upper strips)";
  RunPhase(poly_strips, PhaseThreads(threads, poly_strips.size(), Work(poly_strips)),
           [&](const Task& t) {
             const TaskBlocks& blk = groups[t.group];
             const int64_t m = blk.m;
             const size_t es = ElementSize(blk.type);
             const char* ab = static_cast<const char*>(blk.a) + t.block * m * m * es;
             char* pb = static_cast<char*>(blk.p) + t.block * m * m * es;
             const int64_t corner = (t.offset * m + t.offset) * static_cast<int64_t>(es);
             CopyRect(ab + corner, m, pb + corner, m, t.size, m - t.offset, es);
             GemmArgs g{blk.type,
                        ab + t.offset * m * es,
                        ab + t.offset * m * es,
                        pb + corner,
                        t.size,
                        m - t.offset,
                        m,
                        m,
                        m,
                        m,
                        /*b_transposed=*/true,
                        static_cast<float>(k.c),
                        static_cast<float>(k.b)};
             DnnlGemm(g);
             RoundResult(blk, g);
             Mirror(blk.type, pb, m, t.offset, t.size);
           });
}

void ApplyPhase(const TaskBlocks* groups, const std::vector<Task>& chunks,
                const ns::Coefficients& k, int threads, const char** op) {
  *op = "a X + P X (column chunks)";
  RunPhase(chunks, PhaseThreads(threads, chunks.size(), Work(chunks)), [&](const Task& t) {
    const TaskBlocks& blk = groups[t.group];
    const int64_t m = blk.m, n = blk.n;
    const size_t es = ElementSize(blk.type);
    const char* xb = static_cast<const char*>(blk.x) + t.block * m * n * es;
    const char* pb = static_cast<const char*>(blk.p) + t.block * m * m * es;
    char* nb = static_cast<char*>(blk.next) + t.block * m * n * es;
    CopyRect(xb + t.offset * es, n, nb + t.offset * es, n, m, t.size, es);
    GemmArgs g{blk.type,
               pb,
               xb + t.offset * es,
               nb + t.offset * es,
               m,
               t.size,
               m,
               m,
               n,
               n,
               /*b_transposed=*/false,
               1.0f,
               static_cast<float>(k.a)};
    DnnlGemm(g);
    RoundResult(blk, g);
  });
}

}  // namespace

void TaskIteration(const TaskBlocks* groups, size_t count, const ns::Coefficients& k, int threads,
                   const char** op) {
  threads = std::max(threads, 1);
  GramPhase(groups, Strips(groups, count, /*gram=*/true), threads, op);
  PolyPhase(groups, Strips(groups, count, /*gram=*/false), k, threads, op);
  ApplyPhase(groups, Chunks(groups, count), k, threads, op);
}

}  // namespace muond::server::internal
