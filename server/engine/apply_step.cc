#include "server/engine/apply_step.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "server/optim/adamw.h"
#include "server/optim/grad_norm.h"
#include "server/optim/muon_apply.h"
#include "server/optim/muon_math.h"
#include "server/optim/qk_clip.h"
#include "server/optim/state_codec.h"

namespace muond::server {
namespace {

// Slices of a tensor's owner spans for the host threads: at most kSlice elements (whole 16-element
// lines, so threads never share one).
constexpr size_t kSlice = size_t{1} << 18;

}  // namespace

ApplyStep::ApplyStep(const common::JobSpec& spec, const JobLayout& layout, ParamStore* params)
    : spec_(spec), layout_(layout), params_(params) {
  for (const common::MatrixSpec& m : spec.matrices) {
    size_t g = 0;
    while (g < spec.groups.size() && spec.groups[g].name != m.group) ++g;
    group_of_.push_back(g);  // validated: every tensor's group exists
  }
  if (spec.qk_clip.enabled()) qk_tensors_ = common::QkClipTensors(spec);
}

absl::Status ApplyStep::CheckSumOfSquares(const StepState& state, uint32_t t, double ss,
                                          const std::function<int64_t()>& find_bad) const {
  const common::MatrixSpec& ms = spec_.matrices[t];
  const std::string where = absl::StrCat("job '", spec_.job_id, "' step ", state.step);
  if (!std::isfinite(ss)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": tensor '", ms.name, "' element ", find_bad(),
        " is not finite when assembled (its gradient memory changed after it was checked); the "
        "step is refused and nothing changed"));
  }
  // Every |g_i| * scale is at most ||g|| * scale: within float32 when that is.
  if (!(std::sqrt(ss) * static_cast<double>(state.grad_scale) <= FLT_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": tensor '", ms.name, "': gradient divisor ", state.hyper.grad_divisor,
        " makes its gradient overflow float32 (norm ", std::sqrt(ss), " before the divisor)"));
  }
  return absl::OkStatus();
}

absl::Status ApplyStep::CheckRawGradient(const StepState& state, uint32_t t,
                                         std::vector<RawPiece> pieces, double* sum_sq) const {
  const common::MatrixSpec& ms = spec_.matrices[t];
  double ss = 0;
  RETURN_IF_ERROR(RawSumOfSquares(ms, &pieces, &ss));
  RETURN_IF_ERROR(CheckSumOfSquares(state, t, ss, [&]() -> int64_t {
    for (const RawPiece& p : pieces) {
      const int64_t bad = common::FindNonFiniteRaw(ms.dtype, p.data, p.length);
      if (bad >= 0) return static_cast<int64_t>(p.at) + bad;
    }
    return -1;
  }));
  *sum_sq = ss;
  return absl::OkStatus();
}

absl::Status ApplyStep::RawSumOfSquares(const common::MatrixSpec& ms, std::vector<RawPiece>* raw,
                                        double* sum_sq) {
  std::vector<RawPiece>& pieces = *raw;
  const size_t n = static_cast<size_t>(ms.numel());
  const size_t esize = common::DTypeSize(ms.dtype);
  std::sort(pieces.begin(), pieces.end(), [](const RawPiece& a, const RawPiece& b) {
    return a.at != b.at ? a.at < b.at : a.length < b.length;
  });
  uint64_t covered = 0;
  for (const RawPiece& p : pieces) {
    if (p.at != covered) break;
    covered += p.length;
  }
  if (covered != n) {
    return absl::InternalError(absl::StrCat("tensor '", ms.name, "': its owners' spans cover ",
                                            covered, " of its ", n, " elements in order"));
  }
  // PrepareGradient's sums, block by block: each block widened to fp32 from the pieces it
  // overlaps.
  const double ss = BlockSumOfSquares(n, n * esize, [&](uint64_t begin, uint64_t end) {
    std::vector<float> values(end - begin);
    auto it = std::upper_bound(pieces.begin(), pieces.end(), begin,
                               [](uint64_t at, const RawPiece& p) { return at < p.at; });
    for (--it; it != pieces.end() && it->at < end; ++it) {
      const uint64_t from = std::max(begin, it->at), to = std::min(end, it->at + it->length);
      common::ToFloat32(ms.dtype, it->data + (from - it->at) * esize, to - from,
                        values.data() + (from - begin));
    }
    return SumOfSquares(values.data(), values.size());
  });
  *sum_sq = ss;
  return absl::OkStatus();
}

absl::Status ApplyStep::PrepareGradient(const StepState& state, uint32_t t, float* grad,
                                        double* sum_sq, bool kernel_writes_momentum) {
  const common::MatrixSpec& ms = spec_.matrices[t];
  const size_t n = static_cast<size_t>(ms.numel());
  // A tensor's raw sum in the one order both paths sum it (grad_norm.h), so the norm, the clip
  // and the grad-norm metric are the same bits whether the gradient was assembled or not.
  const double ss = ParallelSumOfSquares(grad, n);
  RETURN_IF_ERROR(CheckSumOfSquares(state, t, ss, [&] { return common::FindNonFinite(grad, n); }));
  *sum_sq = ss;
  if (state.grad_scale != 1.0f) {
    const float scale = state.grad_scale;
    common::ParallelFor((n + kSlice - 1) / kSlice, n * sizeof(float), [&](size_t i) {
      const size_t e = std::min(n, (i + 1) * kSlice);
      for (size_t k = i * kSlice; k < e; ++k) grad[k] *= scale;
    });
  }
  if (ms.optimizer == common::Optimizer::kMuon && !kernel_writes_momentum) {
    const float* committed = params_->front(t, ParamStore::kMomentum);
    float* next = params_->back(t, ParamStore::kMomentum);
    common::ParallelFor((n + kSlice - 1) / kSlice, n * sizeof(float), [&](size_t i) {
      const size_t b = i * kSlice, len = std::min(n, b + kSlice) - b;
      if (next != committed) std::memcpy(next + b, committed + b, len * sizeof(float));
      ApplyMomentum(spec_.muon, grad + b, next + b, len);
    });
  }
  return absl::OkStatus();
}

void ApplyStep::ApplyAdamW(StepState& state, uint32_t t, const float* grad) {
  const common::MatrixSpec& ms = spec_.matrices[t];
  const size_t g = group_of_[t];
  AdamWHyper h;
  h.lr = state.hyper.lr[g];
  h.weight_decay = state.hyper.weight_decay[g];
  h.beta1 = spec_.adamw.beta1;
  h.beta2 = spec_.adamw.beta2;
  h.eps = spec_.adamw.eps;
  const int64_t step = params_->steps(t) + 1;
  if (spec_.state.adamw != common::StateDType::kFloat32) {
    ApplyAdamWHeld(state, t, h, step, grad);
    return;
  }
  const size_t esize = common::DTypeSize(ms.param_dtype);
  const std::vector<JobLayout::OwnerSlice> slices = layout_.OwnerSlices(t, kSlice);
  common::ParallelFor(slices.size(), ms.numel() * 7 * sizeof(float), [&](size_t i) {
    const JobLayout::OwnerSlice& s = slices[i];
    const uint64_t at = layout_.spans(s.ref->rank)[s.ref->span].offset + s.begin;
    AdamWArrays a;
    a.grad = grad + at;
    a.param_in = params_->front(t, ParamStore::kMaster) + at;
    a.exp_avg_in = params_->front(t, ParamStore::kExpAvg) + at;
    a.exp_avg_sq_in = params_->front(t, ParamStore::kExpAvgSq) + at;
    a.param = params_->back(t, ParamStore::kMaster) + at;
    a.exp_avg = params_->back(t, ParamStore::kExpAvg) + at;
    a.exp_avg_sq = params_->back(t, ParamStore::kExpAvgSq) + at;
    a.out = state.outputs[s.ref->rank]->spans[s.ref->span].data + s.begin * esize;
    a.out_dtype = ms.param_dtype;
    AdamWUpdate(h, step, 1.0f, a, s.length);
  });
}

// Moments held compressed: piece by piece of whole blocks, m and v decoded into fp32, the same
// AdamW arithmetic (AdamWUpdate, elementwise: the fp32 path's bits for the same m and v), the new
// moments encoded into the back; then the new masters go to the owners.
void ApplyStep::ApplyAdamWHeld(StepState& state, uint32_t t, const AdamWHyper& h, int64_t step,
                               const float* grad) {
  const size_t n = params_->numel(t);
  constexpr size_t kPiece = kStateBlock * 32;
  const common::StateDType dtype = spec_.state.adamw;
  common::ParallelFor((n + kPiece - 1) / kPiece, n * 5 * sizeof(float), [&](size_t p) {
    const size_t at = p * kPiece, len = std::min(kPiece, n - at);
    std::vector<float> m(len), v(len), m_next(len), v_next(len);
    DecodeStored(dtype, StateRole::kSigned, params_->front(t, ParamStore::kExpAvg), n, at, len,
                 m.data());
    DecodeStored(dtype, StateRole::kNonNegative, params_->front(t, ParamStore::kExpAvgSq), n, at,
                 len, v.data());
    AdamWArrays a;
    a.grad = grad + at;
    a.param_in = params_->front(t, ParamStore::kMaster) + at;
    a.param = params_->back(t, ParamStore::kMaster) + at;
    a.exp_avg_in = m.data();
    a.exp_avg_sq_in = v.data();
    a.exp_avg = m_next.data();
    a.exp_avg_sq = v_next.data();
    AdamWUpdate(h, step, 1.0f, a, len, /*threads=*/1);
    EncodeStored(dtype, StateRole::kSigned, m_next.data(), n, at, len,
                 params_->back(t, ParamStore::kExpAvg));
    EncodeStored(dtype, StateRole::kNonNegative, v_next.data(), n, at, len,
                 params_->back(t, ParamStore::kExpAvgSq));
  });
  WriteParameters(state, t);
}

void ApplyStep::ApplyMuon(StepState& state, uint32_t t, const float* update) {
  const common::MatrixSpec& ms = spec_.matrices[t];
  const size_t g = group_of_[t];
  const double lr = state.hyper.lr[g], wd = state.hyper.weight_decay[g];
  const size_t esize = common::DTypeSize(ms.param_dtype);
  const std::vector<JobLayout::OwnerSlice> slices = layout_.OwnerSlices(t, kSlice);
  common::ParallelFor(slices.size(), ms.numel() * 4 * sizeof(float), [&](size_t i) {
    const JobLayout::OwnerSlice& s = slices[i];
    const uint64_t at = layout_.spans(s.ref->rank)[s.ref->span].offset + s.begin;
    MuonApplyArrays a;
    a.param_in = params_->front(t, ParamStore::kMaster) + at;
    a.update = update + at;
    a.param_out = params_->back(t, ParamStore::kMaster) + at;
    a.out = state.outputs[s.ref->rank]->spans[s.ref->span].data + s.begin * esize;
    a.out_dtype = ms.param_dtype;
    MuonApply(lr, wd, a, s.length);
  });
}

void ApplyStep::QkClip(StepState& state) {
  const common::QkClip& clip = spec_.qk_clip;
  if (!clip.enabled()) return;
  const std::vector<float>& logits = state.hyper.max_logits;
  size_t at = 0;
  for (size_t i = 0; i < clip.pairs.size(); ++i) {
    const common::QkClipPair& pair = clip.pairs[i];
    const auto [q, k] = qk_tensors_[i];
    const QkClipFactors f = ComputeQkClipFactors(clip, pair, logits.data() + at);
    for (int64_t h = 0; h < pair.q_heads; ++h) {
      state.qk_max_logit = std::max(state.qk_max_logit, logits[at + h]);
    }
    at += static_cast<size_t>(pair.q_heads);
    state.qk_heads_clipped += f.heads_clipped;
    if (f.heads_clipped == 0) continue;
    const int64_t in = spec_.matrices[q].shape[1];
    ScaleHeadRows(NewMaster(state, q), pair.head_dim, in, f.q);
    ScaleHeadRows(NewMaster(state, k), pair.head_dim, in, f.k);
    for (uint32_t t : {q, k}) WriteParameters(state, t);
  }
}

float* ApplyStep::NewMaster(const StepState& state, uint32_t t) {
  float* next = params_->back(t, ParamStore::kMaster);
  // An absent tensor's step wrote nothing: its new master starts as the committed one.
  const float* committed = params_->front(t, ParamStore::kMaster);
  if (state.hyper.absent_at(t) && next != committed) {
    std::memcpy(next, committed, params_->numel(t) * sizeof(float));
  }
  return next;
}

void ApplyStep::WriteParameters(StepState& state, uint32_t t) {
  const common::MatrixSpec& ms = spec_.matrices[t];
  const size_t esize = common::DTypeSize(ms.param_dtype);
  const std::vector<JobLayout::OwnerSlice> slices = layout_.OwnerSlices(t, kSlice);
  common::ParallelFor(slices.size(), ms.numel() * (sizeof(float) + esize), [&](size_t i) {
    const JobLayout::OwnerSlice& s = slices[i];
    const uint64_t at = layout_.spans(s.ref->rank)[s.ref->span].offset + s.begin;
    common::FromFloat32(params_->back(t, ParamStore::kMaster) + at, s.length, ms.param_dtype,
                        state.outputs[s.ref->rank]->spans[s.ref->span].data + s.begin * esize);
  });
}

void ApplyStep::Carry(StepState& state, uint32_t t) {
  const common::MatrixSpec& ms = spec_.matrices[t];
  const size_t esize = common::DTypeSize(ms.param_dtype);
  const std::vector<JobLayout::OwnerSlice> slices = layout_.OwnerSlices(t, kSlice);
  common::ParallelFor(slices.size(), ms.numel() * (sizeof(float) + esize), [&](size_t i) {
    const JobLayout::OwnerSlice& s = slices[i];
    const uint64_t at = layout_.spans(s.ref->rank)[s.ref->span].offset + s.begin;
    common::FromFloat32(params_->front(t, ParamStore::kMaster) + at, s.length, ms.param_dtype,
                        state.outputs[s.ref->rank]->spans[s.ref->span].data + s.begin * esize);
  });
}


double ApplyStep::GradNorm(const StepState& state) {
  return std::sqrt(state.TotalSumSq()) / state.hyper.grad_divisor;
}

float ApplyStep::ClipCoefficient(const StepState& state) const {
  const double d = state.hyper.grad_divisor;
  return server::ClipCoefficient(state.TotalSumSq() / (d * d), spec_.max_grad_norm);
}

float ApplyStep::GradScale(float clip, double grad_divisor) {
  return static_cast<float>(static_cast<double>(clip) / grad_divisor);
}

}  // namespace muond::server
