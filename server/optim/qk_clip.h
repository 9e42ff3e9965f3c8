// QK-Clip (MuonClip, DESIGN.md 4e) of one attention pair's master weights, from the step's
// largest attention logit per query head S[h]: heads with S[h] > tau have gamma_h = tau / S[h];
// query head h's rows of W_q are multiplied by gamma_h^alpha, and key head g's rows of W_k by
// (min over its query heads of gamma_h)^(1 - alpha) when that is below 1. Heads at or under tau
// are untouched (factor exactly 1: their bits do not change).
//
// Thread-safety: pure functions.
#ifndef MUOND_SERVER_OPTIM_QK_CLIP_H_
#define MUOND_SERVER_OPTIM_QK_CLIP_H_

#include <cstdint>
#include <vector>

#include "common/job_spec.h"

namespace muond::server {

struct QkClipFactors {
  std::vector<double> q;  // per query head (q_heads)
  std::vector<double> k;  // per key head (kv_heads)
  int heads_clipped = 0;  // query heads with S[h] > tau
};

// The factors of `pair` from its q_heads values of S (`max_logits`), in float64.
QkClipFactors ComputeQkClipFactors(const common::QkClip& clip, const common::QkClipPair& pair,
                                   const float* max_logits);

// Multiplies each head's rows of `w` ([heads * head_dim, in], row-major) by its factor, in float64
// and rounded to float32 once; a head whose factor is 1 is not touched.
void ScaleHeadRows(float* w, int64_t head_dim, int64_t in, const std::vector<double>& factors);

}  // namespace muond::server

#endif  // MUOND_SERVER_OPTIM_QK_CLIP_H_
