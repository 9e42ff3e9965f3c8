#include "server/engine/job_layout.h"

#include <algorithm>
#include <utility>

#include "common/dtype.h"

namespace muond::server {

JobLayout::JobLayout(const common::JobSpec& spec) : spec_(spec) {
  matrix_spans_.resize(spec.matrices.size());
  for (int r = 0; r < spec.world_size; ++r) {
    rank_spans_.push_back(common::RankSpans(spec, r));
    const std::vector<common::ShardSpan>& spans = rank_spans_[r];
    std::vector<uint32_t>& index = rank_span_index_.emplace_back(spans.size());
    for (size_t i = 0; i < spans.size(); ++i) {
      index[i] = static_cast<uint32_t>(i);
      matrix_spans_[spans[i].matrix].push_back({r, i});
    }
    std::sort(index.begin(), index.end(), [&spans](uint32_t a, uint32_t b) {
      return spans[a].matrix != spans[b].matrix ? spans[a].matrix < spans[b].matrix
                                                : spans[a].offset < spans[b].offset;
    });
  }
}

std::optional<size_t> JobLayout::FindSpan(int rank, uint32_t matrix, uint64_t offset,
                                          uint64_t count) const {
  // The rank's last span of `matrix` starting at or before `offset` is the only candidate.
  const std::vector<common::ShardSpan>& spans = rank_spans_[rank];
  const std::vector<uint32_t>& index = rank_span_index_[rank];
  auto after = std::upper_bound(index.begin(), index.end(), std::make_pair(matrix, offset),
                                [&spans](const std::pair<uint32_t, uint64_t>& key, uint32_t i) {
                                  return key.first != spans[i].matrix
                                             ? key.first < spans[i].matrix
                                             : key.second < spans[i].offset;
                                });
  if (after == index.begin()) return std::nullopt;
  const uint32_t i = *std::prev(after);
  const common::ShardSpan& span = spans[i];
  if (span.matrix == matrix && offset - span.offset <= span.length &&
      count <= span.length - (offset - span.offset)) {
    return i;
  }
  return std::nullopt;
}

size_t JobLayout::SpanBytes(int rank, size_t span) const {
  const common::ShardSpan& s = rank_spans_[rank][span];
  return s.length * common::DTypeSize(spec_.matrices[s.matrix].dtype);
}

std::vector<JobLayout::OwnerSlice> JobLayout::OwnerSlices(uint32_t matrix,
                                                          uint64_t max_elements) const {
  std::vector<OwnerSlice> out;
  for (const SpanRef& ref : owners(matrix)) {
    const uint64_t n = rank_spans_[ref.rank][ref.span].length;
    for (uint64_t b = 0; b < n; b += max_elements) {
      out.push_back({&ref, b, std::min(max_elements, n - b)});
    }
  }
  return out;
}

size_t JobLayout::ParamSpanBytes(int rank, size_t span) const {
  const common::ShardSpan& s = rank_spans_[rank][span];
  return s.length * common::DTypeSize(spec_.matrices[s.matrix].param_dtype);
}

uint64_t JobLayout::RankElements(int rank) const {
  uint64_t n = 0;
  for (const common::ShardSpan& span : rank_spans_[rank]) n += span.length;
  return n;
}

}  // namespace muond::server
