// See dnnl_gemm.h.
#include "server/optim/dnnl_gemm.h"

#include <omp.h>

#include <map>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace muond::server::internal {
namespace {

using Key =
    std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, float, float>;

Key KeyOf(const GemmArgs& g) {
  return Key{static_cast<int>(g.type), g.m,     g.n,   g.k, g.lda, g.ldb, g.ldc,
             g.b_transposed,           g.alpha, g.beta};
}

struct Entry {
  dnnl::memory::desc a, b, c, scratch;
  dnnl::matmul primitive;
  size_t scratch_bytes = 0;
};

dnnl::engine& Engine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

// The calling thread's OpenMP thread count is 1 while in scope (oneDNN sizes its work by it).
class OneThread {
 public:
  OneThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved_); }

 private:
  const int saved_;
};

std::shared_ptr<const Entry> Create(const GemmArgs& g) {
  using dnnl::memory;
  const memory::data_type t =
      g.type == GemmType::kBFloat16 ? memory::data_type::bf16 : memory::data_type::f32;
  auto e = std::make_shared<Entry>();
  e->a = memory::desc({g.m, g.k}, t, memory::dims{g.lda, 1});
  e->b =
      memory::desc({g.k, g.n}, t, g.b_transposed ? memory::dims{1, g.ldb} : memory::dims{g.ldb, 1});
  e->c = memory::desc({g.m, g.n}, t, memory::dims{g.ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (g.alpha != 1.0f) attr.set_output_scales(0, {g.alpha});
  if (g.beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(g.beta);
    attr.set_post_ops(ops);
  }
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(e->a, e->b, e->c), attr, Engine());
  e->scratch = pd.scratchpad_desc();
  e->scratch_bytes = e->scratch.get_size();
  e->primitive = dnnl::matmul(pd);
  return e;
}

class Cache {
 public:
  std::shared_ptr<const Entry> Get(const GemmArgs& g) {
    const Key key = KeyOf(g);
    {
      absl::MutexLock lock(&mu_);
      auto it = entries_.find(key);
      if (it != entries_.end()) return it->second;
    }
    std::shared_ptr<const Entry> made = Create(g);  // outside the lock: JIT takes milliseconds
    absl::MutexLock lock(&mu_);
    if (entries_.size() >= kMaxCachedPrimitives) entries_.clear();
    return entries_.emplace(key, std::move(made)).first->second;
  }

  size_t size() {
    absl::MutexLock lock(&mu_);
    return entries_.size();
  }

 private:
  absl::Mutex mu_;
  std::map<Key, std::shared_ptr<const Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

Cache& GlobalCache() {
  static Cache* cache = new Cache;
  return *cache;
}

// Per thread: a oneDNN stream (not shareable between threads) and the scratchpad.
struct ThreadState {
  dnnl::stream stream{Engine()};
  std::vector<char> scratch;
};

ThreadState& State() {
  thread_local ThreadState state;
  return state;
}

}  // namespace

void DnnlGemm(const GemmArgs& g) {
  OneThread one;
  try {
    std::shared_ptr<const Entry> e = GlobalCache().Get(g);
    ThreadState& s = State();
    if (s.scratch.size() < e->scratch_bytes) s.scratch.resize(e->scratch_bytes);
    const dnnl::engine& engine = Engine();
    dnnl::memory a(e->a, engine, const_cast<void*>(g.a));
    dnnl::memory b(e->b, engine, const_cast<void*>(g.b));
    dnnl::memory c(e->c, engine, g.c);
    dnnl::memory scratch(e->scratch, engine, s.scratch.data());
    e->primitive.execute(s.stream, {{DNNL_ARG_SRC, a},
                                    {DNNL_ARG_WEIGHTS, b},
                                    {DNNL_ARG_DST, c},
                                    {DNNL_ARG_SCRATCHPAD, scratch}});
    s.stream.wait();
  } catch (const dnnl::error& e) {
    throw std::runtime_error(absl::StrCat("oneDNN matmul [", g.m, " x ", g.k, "] x [", g.k, " x ",
                                          g.n, "]",
                                          g.type == GemmType::kBFloat16 ? " bf16" : " f32", ": ",
                                          e.what(), " (status ", e.status, ")"));
  }
}

size_t DnnlCachedPrimitives() { return GlobalCache().size(); }

}  // namespace muond::server::internal
