// Fuzz target: the assembly of a step's gradient from gRPC chunks (a structured harness). The
// input draws a small job (matrices, dtypes, world size, ZeRO stage), then a stream of chunks from
// any rank: mostly pieces of each rank's true gradient at random places, some with a wrong CRC,
// non-finite values, a bad matrix index, or sizes that are not whole elements. Each chunk goes
// through the job's gradient intake as Job::AddGradient runs it: CheckGradientChunk
// (server/jobs/gradient_check.cc: size, CRC32C, span lookup in JobLayout, finite values), then
// ClaimRange (server/engine/step_state.h) for its span, then the copy into the rank's span buffer.
// Properties, against a plain model (one flag per element):
// - a chunk is accepted only if it is whole elements of one of the rank's spans, with the right
//   CRC and finite values, and claimed only if none of its elements arrived before;
// - every chunk drawn from the true gradient that fits a span and overlaps nothing is accepted;
// - when all of a matrix's elements are in, its owners' spans hold exactly the bytes accepted for
//   it, each at its place in the matrix.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "server/engine/job_layout.h"
#include "server/engine/step_state.h"
#include "server/jobs/gradient_check.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using muond::common::DType;
using muond::common::JobSpec;

std::optional<JobSpec> DrawSpec(FuzzedDataProvider& in) {
  JobSpec spec;
  spec.job_id = "fuzz";
  spec.world_size = in.ConsumeIntegralInRange(1, 4);
  spec.zero_stage =
      spec.world_size == 1 ? in.ConsumeIntegralInRange(0, 3) : in.ConsumeIntegralInRange(1, 3);
  const int matrices = in.ConsumeIntegralInRange(1, 4);
  for (int m = 0; m < matrices; ++m) {
    muond::common::MatrixSpec ms;
    ms.name = "m" + std::to_string(m);
    ms.shape = {in.ConsumeIntegralInRange<int64_t>(1, 24),
                in.ConsumeIntegralInRange<int64_t>(1, 24)};
    ms.dtype = static_cast<DType>(in.ConsumeIntegralInRange(0, 2));
    spec.matrices.push_back(ms);
  }
  if (!muond::common::ValidateJobSpec(spec).ok()) return std::nullopt;
  return spec;
}

// The true gradient of matrix m: finite values in the matrix's dtype.
std::string TrueGradient(const muond::common::MatrixSpec& ms, uint32_t m) {
  std::vector<float> f(static_cast<size_t>(ms.numel()));
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>((i * 7 + m * 13) % 101) - 50.f;
  std::string bytes(f.size() * muond::common::DTypeSize(ms.dtype), '\0');
  muond::common::FromFloat32(f.data(), f.size(), ms.dtype, bytes.data());
  return bytes;
}

bool AllFinite(DType dtype, std::string_view bytes) {
  std::vector<float> f(bytes.size() / muond::common::DTypeSize(dtype));
  muond::common::ToFloat32(dtype, bytes.data(), f.size(), f.data());
  for (float v : f) {
    if (!std::isfinite(v)) return false;
  }
  return true;
}

struct Rank {
  std::vector<std::string> owned;                     // per span, as RankInput::owned
  std::vector<std::map<uint64_t, uint64_t>> claimed;  // per span, as RankInput::claimed
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const std::optional<JobSpec> spec = DrawSpec(in);
  if (!spec) return 0;
  const muond::server::JobLayout layout(*spec);
  std::vector<std::string> truth;
  std::vector<std::vector<bool>> arrived;  // the model: per matrix, per element
  std::vector<std::string> model;          // the model: per matrix, the accepted bytes
  for (uint32_t m = 0; m < spec->matrices.size(); ++m) {
    truth.push_back(TrueGradient(spec->matrices[m], m));
    model.emplace_back(truth.back().size(), '\0');
    arrived.emplace_back(static_cast<size_t>(spec->matrices[m].numel()), false);
  }
  std::vector<Rank> ranks(spec->world_size);
  for (int r = 0; r < spec->world_size; ++r) {
    for (size_t s = 0; s < layout.spans(r).size(); ++s) {
      ranks[r].owned.emplace_back(layout.SpanBytes(r, s), '\0');
    }
    ranks[r].claimed.resize(layout.spans(r).size());
  }
  while (in.remaining_bytes() > 0) {
    const int rank = in.ConsumeIntegralInRange(0, spec->world_size - 1);
    uint32_t matrix = in.ConsumeIntegralInRange<uint32_t>(0, spec->matrices.size() - 1);
    const muond::common::MatrixSpec& ms = spec->matrices[matrix];
    const size_t esize = muond::common::DTypeSize(ms.dtype);
    const uint64_t numel = static_cast<uint64_t>(ms.numel());
    const uint64_t offset = in.ConsumeIntegralInRange<uint64_t>(0, numel - 1);
    const uint64_t count = in.ConsumeIntegralInRange<uint64_t>(1, numel - offset);
    std::string bytes = truth[matrix].substr(offset * esize, count * esize);
    uint32_t crc = muond::common::Crc32c(bytes.data(), bytes.size());
    bool genuine = true;
    switch (in.ConsumeIntegralInRange(0, 9)) {
      case 0:
        crc ^= 1u << in.ConsumeIntegralInRange(0, 31);
        genuine = false;
        break;
      case 1:
        bytes.pop_back();
        crc = muond::common::Crc32c(bytes.data(), bytes.size());
        break;
      case 2: {  // a value made non-finite (or any bytes), with a matching CRC
        const std::string junk = in.ConsumeBytesAsString(esize);
        std::memcpy(bytes.data() + in.ConsumeIntegralInRange<size_t>(0, count - 1) * esize,
                    junk.data(), junk.size());
        crc = muond::common::Crc32c(bytes.data(), bytes.size());
        break;
      }
      case 3:
        matrix = in.ConsumeIntegral<uint32_t>();
        break;
      default:
        break;
    }
    const std::string where = "job 'fuzz' step 0 rank " + std::to_string(rank);
    size_t span = 0;
    uint64_t got = 0;
    const absl::Status checked = muond::server::CheckGradientChunk(
        where, *spec, layout, rank, matrix, offset, bytes, crc, &span, &got);
    // The model: which of the rank's spans holds the chunk whole, if it is whole elements.
    const bool known = matrix < spec->matrices.size();
    const DType dtype = known ? spec->matrices[matrix].dtype : DType::kFloat32;
    const size_t es = muond::common::DTypeSize(dtype);
    const uint64_t n = bytes.size() / es;
    const bool whole = known && !bytes.empty() && bytes.size() % es == 0;
    std::optional<size_t> fits;
    for (size_t s = 0; whole && s < layout.spans(rank).size(); ++s) {
      const auto& sp = layout.spans(rank)[s];
      if (sp.matrix == matrix && sp.offset <= offset && offset + n <= sp.offset + sp.length)
        fits = s;
    }
    const bool valid = fits && genuine && AllFinite(dtype, bytes);
    FUZZ_CHECK(checked.ok() == valid, where + ": " + checked.ToString());
    if (!checked.ok()) {
      FUZZ_CHECK(checked.message().rfind(where + ": ", 0) == 0, checked.ToString());
      continue;
    }
    FUZZ_CHECK(span == *fits && got == n, "chunk placed in the wrong span");
    bool overlaps = false;
    for (uint64_t e = offset; e < offset + n; ++e) overlaps = overlaps || arrived[matrix][e];
    const auto& sp = layout.spans(rank)[span];
    const auto claim = muond::server::ClaimRange(ranks[rank].claimed[span], offset, n);
    if (claim == muond::server::ClaimResult::kTooManyPieces) continue;
    FUZZ_CHECK((claim == muond::server::ClaimResult::kOverlaps) == overlaps,
               "ClaimRange disagrees with the model on an overlap at " + std::to_string(offset));
    if (overlaps) continue;
    std::memcpy(ranks[rank].owned[span].data() + (offset - sp.offset) * es, bytes.data(),
                bytes.size());
    std::memcpy(model[matrix].data() + offset * es, bytes.data(), bytes.size());
    for (uint64_t e = offset; e < offset + n; ++e) arrived[matrix][e] = true;
  }
  // Every complete matrix: its owners' spans hold the true gradient.
  for (uint32_t m = 0; m < spec->matrices.size(); ++m) {
    bool complete = true;
    for (bool a : arrived[m]) complete = complete && a;
    if (!complete) continue;
    const size_t esize = muond::common::DTypeSize(spec->matrices[m].dtype);
    for (const auto& ref : layout.owners(m)) {
      const auto& sp = layout.spans(ref.rank)[ref.span];
      FUZZ_CHECK(
          ranks[ref.rank].owned[ref.span] == model[m].substr(sp.offset * esize, sp.length * esize),
          "matrix " + std::to_string(m) + " assembled wrong");
    }
  }
  return 0;
}
