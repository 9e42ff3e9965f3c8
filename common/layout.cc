#include "common/layout.h"

#include <algorithm>

namespace muond::common {

std::vector<ShardSpan> RankSpans(const JobSpec& spec, int rank) {
  std::vector<ShardSpan> spans;
  const uint64_t world = static_cast<uint64_t>(spec.world_size);
  const uint64_t r = static_cast<uint64_t>(rank);
  if (spec.zero_stage == 0) {
    uint64_t at = 0;
    for (uint32_t m = 0; m < spec.matrices.size(); ++m) {
      const uint64_t n = static_cast<uint64_t>(spec.matrices[m].numel());
      spans.push_back({m, 0, n, at});
      at += n;
    }
  } else if (spec.zero_stage == 3) {
    // Each matrix split on its own into world chunks of ceil(numel / world) elements.
    uint64_t at = 0;
    for (uint32_t m = 0; m < spec.matrices.size(); ++m) {
      const uint64_t n = static_cast<uint64_t>(spec.matrices[m].numel());
      const uint64_t chunk = (n + world - 1) / world;
      const uint64_t begin = std::min(n, r * chunk);
      const uint64_t end = std::min(n, begin + chunk);
      if (end > begin) spans.push_back({m, begin, end - begin, at});
      at += chunk;  // the rank's buffer holds a padded chunk per matrix
    }
  } else {
    // Stage 1/2: the matrices concatenated, split into world partitions of ceil(total / world).
    uint64_t total = 0;
    for (const MatrixSpec& ms : spec.matrices) total += static_cast<uint64_t>(ms.numel());
    const uint64_t part = (total + world - 1) / world;
    const uint64_t p_begin = std::min(total, r * part);
    const uint64_t p_end = std::min(total, p_begin + part);
    uint64_t m_begin = 0;
    for (uint32_t m = 0; m < spec.matrices.size(); ++m) {
      const uint64_t n = static_cast<uint64_t>(spec.matrices[m].numel());
      const uint64_t lo = std::max(p_begin, m_begin);
      const uint64_t hi = std::min(p_end, m_begin + n);
      if (hi > lo) spans.push_back({m, lo - m_begin, hi - lo, lo - p_begin});
      m_begin += n;
    }
  }
  return spans;
}

}  // namespace muond::common
