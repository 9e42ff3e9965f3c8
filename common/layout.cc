#include "common/layout.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace muond::common {

std::vector<ShardSpan> RankSpans(const JobSpec& spec, int rank) {
  std::vector<ShardSpan> spans;
  const uint64_t world = static_cast<uint64_t>(spec.world_size);
  const uint64_t r = static_cast<uint64_t>(rank);
  if (!spec.explicit_layout.empty()) {
    uint64_t at = 0;
    for (const LayoutSpan& s : spec.explicit_layout[rank]) {
      spans.push_back({s.matrix, s.offset, s.length, at});
      at += s.length;
    }
  } else if (spec.zero_stage == 0) {
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

uint64_t RankBufferElements(const JobSpec& spec, int rank) {
  const uint64_t world = static_cast<uint64_t>(spec.world_size);
  if (spec.explicit_layout.empty() && spec.zero_stage == 3) {
    uint64_t n = 0;
    for (const MatrixSpec& ms : spec.matrices) {
      n += (static_cast<uint64_t>(ms.numel()) + world - 1) / world;
    }
    return n;
  }
  if (spec.explicit_layout.empty() && (spec.zero_stage == 1 || spec.zero_stage == 2)) {
    uint64_t total = 0;
    for (const MatrixSpec& ms : spec.matrices) total += static_cast<uint64_t>(ms.numel());
    return (total + world - 1) / world;
  }
  uint64_t n = 0;
  for (const ShardSpan& s : RankSpans(spec, rank)) n += s.length;
  return n;
}

absl::Status ValidateExplicitLayout(const JobSpec& spec) {
  // (offset, end, rank) of every span, per matrix.
  std::vector<std::vector<std::tuple<uint64_t, uint64_t, int>>> per_matrix(spec.matrices.size());
  for (size_t r = 0; r < spec.explicit_layout.size(); ++r) {
    for (const LayoutSpan& s : spec.explicit_layout[r]) {
      if (s.matrix >= spec.matrices.size()) {
        return absl::InvalidArgumentError(absl::StrCat("layout: rank ", r, " names matrix index ",
                                                       s.matrix, ", out of range"));
      }
      const uint64_t numel = static_cast<uint64_t>(spec.matrices[s.matrix].numel());
      if (s.length == 0 || s.offset >= numel || s.length > numel - s.offset) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layout: rank ", r, " span of matrix '", spec.matrices[s.matrix].name,
            "' at offset ", s.offset, " length ", s.length, " is outside its ", numel,
            " elements"));
      }
      per_matrix[s.matrix].emplace_back(s.offset, s.offset + s.length, static_cast<int>(r));
    }
  }
  for (size_t m = 0; m < spec.matrices.size(); ++m) {
    auto& spans = per_matrix[m];
    std::sort(spans.begin(), spans.end());
    const std::string& name = spec.matrices[m].name;
    uint64_t covered = 0;  // elements [0, covered) are owned
    int last_rank = -1;
    for (const auto& [begin, end, rank] : spans) {
      if (begin > covered) {
        return absl::InvalidArgumentError(absl::StrCat("layout: matrix '", name,
                                                       "' has a gap: elements [", covered, ", ",
                                                       begin, ") are owned by no rank"));
      }
      if (begin < covered) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layout: matrix '", name, "' has an overlap: elements [", begin, ", ",
            std::min(covered, end), ") are owned by rank ", last_rank, " and rank ", rank));
      }
      covered = end;
      last_rank = rank;
    }
    const uint64_t numel = static_cast<uint64_t>(spec.matrices[m].numel());
    if (covered != numel) {
      return absl::InvalidArgumentError(absl::StrCat("layout: matrix '", name,
                                                     "' has a gap: elements [", covered, ", ",
                                                     numel, ") are owned by no rank"));
    }
  }
  return absl::OkStatus();
}

}  // namespace muond::common
