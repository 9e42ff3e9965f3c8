// The immutable layout tables of a job: which spans of which matrices each rank owns, and who owns
// each matrix's pieces (common/layout.h computes the spans). Built once when the job is created;
// thread-safe to read.
#ifndef MUOND_SERVER_ENGINE_JOB_LAYOUT_H_
#define MUOND_SERVER_ENGINE_JOB_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/job_spec.h"
#include "common/layout.h"

namespace muond::server {

class JobLayout {
 public:
  struct SpanRef {
    int rank;
    size_t span;  // index into spans(rank)
  };

  explicit JobLayout(const common::JobSpec& spec);

  // Rank r's spans, in the order of common::RankSpans.
  const std::vector<common::ShardSpan>& spans(int rank) const { return rank_spans_[rank]; }
  // Matrix m's pieces: every (rank, span) that owns part of it.
  const std::vector<SpanRef>& owners(uint32_t matrix) const { return matrix_spans_[matrix]; }
  // The index of the rank's span that holds elements [offset, offset + count) of `matrix`
  // entirely; nullopt when no single span does.
  std::optional<size_t> FindSpan(int rank, uint32_t matrix, uint64_t offset, uint64_t count) const;
  // Bytes of span `span` of `rank` in its matrix's dtype.
  size_t SpanBytes(int rank, size_t span) const;
  // Bytes of the same span in its tensor's param_dtype (apply mode's returned parameters).
  size_t ParamSpanBytes(int rank, size_t span) const;
  // Matrix m's pieces cut into runs of at most `max_elements` (work for several threads): each is
  // `length` elements from element `begin` of the owner's span.
  struct OwnerSlice {
    const SpanRef* ref;
    uint64_t begin;
    uint64_t length;
  };
  std::vector<OwnerSlice> OwnerSlices(uint32_t matrix, uint64_t max_elements) const;
  // Elements the rank owns over all matrices.
  uint64_t RankElements(int rank) const;

 private:
  const common::JobSpec& spec_;
  std::vector<std::vector<common::ShardSpan>> rank_spans_;
  // [rank] -> the rank's span indices sorted by (matrix, offset): the lookup of a chunk's span.
  // (Not a dense [rank][matrix] table: world size x tensors of empty vectors is gigabytes for a
  // large ZeRO-3 job whose ranks own few spans each.)
  std::vector<std::vector<uint32_t>> rank_span_index_;
  std::vector<std::vector<SpanRef>> matrix_spans_;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_JOB_LAYOUT_H_
