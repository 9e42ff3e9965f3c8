#include "server/optim/qk_clip.h"

#include <algorithm>
#include <cmath>

namespace muond::server {

QkClipFactors ComputeQkClipFactors(const common::QkClip& clip, const common::QkClipPair& pair,
                                   const float* max_logits) {
  QkClipFactors f;
  f.q.assign(static_cast<size_t>(pair.q_heads), 1.0);
  std::vector<double> gamma(static_cast<size_t>(pair.q_heads), 1.0);
  for (int64_t h = 0; h < pair.q_heads; ++h) {
    const double s = max_logits[h];
    if (!(s > clip.threshold)) continue;
    gamma[h] = clip.threshold / s;
    f.q[h] = std::pow(gamma[h], clip.alpha);
    ++f.heads_clipped;
  }
  f.k.assign(static_cast<size_t>(pair.kv_heads), 1.0);
  const int64_t per_kv = pair.q_heads / pair.kv_heads;
  for (int64_t g = 0; g < pair.kv_heads; ++g) {
    const double lowest =
        *std::min_element(gamma.begin() + g * per_kv, gamma.begin() + (g + 1) * per_kv);
    if (lowest < 1.0) f.k[g] = std::pow(lowest, 1.0 - clip.alpha);
  }
  return f;
}

void ScaleHeadRows(float* w, int64_t head_dim, int64_t in, const std::vector<double>& factors) {
  const int64_t per_head = head_dim * in;
  for (size_t h = 0; h < factors.size(); ++h) {
    const double f = factors[h];
    if (f == 1.0) continue;
    float* rows = w + static_cast<int64_t>(h) * per_head;
    for (int64_t i = 0; i < per_head; ++i) {
      rows[i] = static_cast<float>(static_cast<double>(rows[i]) * f);
    }
  }
}

}  // namespace muond::server
