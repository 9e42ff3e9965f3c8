#include "server/jobs/job_footprint.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/shm_protocol.h"
#include "common/status_macros.h"
#include "server/device/device_streams.h"
#include "server/engine/state_buffers.h"
#include "server/engine/step_pipeline.h"
#include "server/optim/muon_math.h"
#include "server/optim/newton_schulz.h"

namespace muond::server {
namespace {

// Upper bounds of the bytes each entry costs while the job exists (Job's tables, a step's
// RankInput/RankUpdate entries, allocator overhead).
constexpr uint64_t kBytesPerSpan = 320;
constexpr uint64_t kBytesPerRank = 768;
constexpr uint64_t kBytesPerTensor = 384;

bool Add(uint64_t* acc, uint64_t v) { return !__builtin_add_overflow(*acc, v, acc); }

bool MulAdd(uint64_t* acc, uint64_t a, uint64_t b) {
  uint64_t p = 0;
  return !__builtin_mul_overflow(a, b, &p) && Add(acc, p);
}

absl::Status TooLarge(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("the job's ", what, " overflows 64 bits"));
}

// The ranks' buffers and the replay copy (job_footprint.h). Per element the larger of its gradient
// and update dtypes, 2 x step_buffers times: a shared-memory session's two regions hold
// step_buffers buffers each of the rank's larger layout (server/api/shm_attach.cc); per rank the
// step's hyper block and alignment in each buffer, the ring, and each region's last page. U again
// for the replay copy in update mode (apply mode writes a replay from the masters).
absl::Status MeasureBuffers(const common::JobSpec& spec, JobFootprint* f) {
  const uint64_t world = static_cast<uint64_t>(spec.world_size);
  uint64_t grad = 0, update = 0, wide = 0;
  for (const common::MatrixSpec& m : spec.matrices) {
    const uint64_t n = static_cast<uint64_t>(m.numel());
    const uint64_t g = common::DTypeSize(m.dtype);
    const uint64_t u =
        common::DTypeSize(spec.mode == common::JobMode::kApply ? m.param_dtype : m.dtype);
    if (!MulAdd(&grad, n, g) || !MulAdd(&update, n, u) || !MulAdd(&wide, n, std::max(g, u))) {
      return TooLarge("buffer byte count");
    }
  }
  const uint64_t hyper =
      common::shm::HyperBytes(spec.groups.size(), spec.matrices.size(), spec.qk_clip.logits());
  const uint64_t per_rank = 4 * (hyper + 128) + common::shm::kRingBytes + 3 * 4096;
  uint64_t buffers = 0;
  const uint64_t replay = spec.mode == common::JobMode::kApply ? 0 : 1;
  if (!MulAdd(&grad, world, 64) || !MulAdd(&update, world, 64) ||
      !MulAdd(&buffers, wide, 2 * static_cast<uint64_t>(spec.step_buffers)) ||
      !MulAdd(&buffers, world, per_rank) || !MulAdd(&f->step_bytes, buffers, 1) ||
      !MulAdd(&f->step_bytes, update, replay)) {
    return TooLarge("buffer byte count");
  }
  f->grad_bytes = grad;
  f->update_bytes = update;
  f->replay_bytes = update * replay;
  return absl::OkStatus();
}

// The compute thread's Newton-Schulz scratch for the job's Muon matrices: a call holds at most the
// scratch budget, or its one largest matrix (server/optim/newton_schulz.h).
uint64_t ScratchFor(const common::JobSpec& spec) {
  uint64_t largest = 0, all = 0;
  for (const common::MatrixSpec& m : spec.matrices) {
    if (m.optimizer == common::Optimizer::kAdamW) continue;
    const uint64_t need = internal::ScratchPerMatrix(GeometryOf(m));
    largest = std::max(largest, need);
    all = std::min(all + need, internal::kNewtonSchulzScratchBytes);
  }
  return std::max(largest, all);
}

// The whole matrices assembled at once: what the pipeline counts per matrix
// (StepPipeline::AssembledBytesOf on the daemon's device), at most all of them, at most kDepth
// batches of the batch target or of one matrix (step_pipeline.h), at most the budget.
absl::StatusOr<uint64_t> GatherFor(const common::JobSpec& spec, uint64_t daemon_gather_budget_bytes,
                                   bool in_host_memory) {
  const uint64_t budget =
      spec.gather_budget_bytes != 0 ? spec.gather_budget_bytes : daemon_gather_budget_bytes;
  uint64_t whole = 0, one = 0, batches = 0;
  for (const common::MatrixSpec& m : spec.matrices) {
    const uint64_t bytes = StepPipeline::AssembledBytesOf(spec, m, in_host_memory);
    if (!Add(&whole, bytes)) return TooLarge("gather byte count");
    one = std::max(one, bytes);
  }
  const uint64_t per_batch = StepPipeline::BatchBytes(budget, StepPipeline::kBatchTargetBytes);
  if (!MulAdd(&batches, std::max(per_batch, one), DeviceStreams::kDepth)) {
    return TooLarge("gather byte count");
  }
  return std::min({budget, whole, batches});
}

}  // namespace

bool KeepsTwoCopies(const common::JobSpec& spec) { return spec.two_phase(); }

uint64_t StepWindowBytes(const common::JobSpec& spec, uint64_t daemon_default) {
  if (KeepsTwoCopies(spec)) return StateBuffers::kTwoCopies;
  uint64_t largest = 0, all = 0;
  for (const common::MatrixSpec& m : spec.matrices) {
    const uint64_t bytes = spec.StateBytesOf(m);
    largest = std::max(largest, bytes);
    all = all + bytes < all ? ~uint64_t{0} : all + bytes;
  }
  const uint64_t asked = spec.step_window_bytes != 0 ? spec.step_window_bytes : daemon_default;
  return std::min(std::max(asked, largest), all);
}

absl::StatusOr<JobFootprint> MeasureJob(const common::JobSpec& spec,
                                        uint64_t daemon_gather_budget_bytes,
                                        uint64_t daemon_step_window_bytes, bool in_host_memory) {
  JobFootprint f;
  const uint64_t world = static_cast<uint64_t>(spec.world_size);
  uint64_t total = 0;
  for (const common::MatrixSpec& m : spec.matrices) {
    if (!Add(&total, static_cast<uint64_t>(m.numel()))) return TooLarge("element count");
  }
  if (!spec.explicit_layout.empty()) {
    for (const auto& rank : spec.explicit_layout) f.spans += rank.size();
  } else if (spec.zero_stage == 3) {
    for (const common::MatrixSpec& m : spec.matrices) {
      const uint64_t n = static_cast<uint64_t>(m.numel());
      const uint64_t chunk = (n + world - 1) / world;
      f.spans += (n + chunk - 1) / chunk;
    }
  } else if (spec.zero_stage == 1 || spec.zero_stage == 2) {
    const uint64_t part = (total + world - 1) / world;
    uint64_t start = 0;
    for (const common::MatrixSpec& m : spec.matrices) {
      const uint64_t end = start + static_cast<uint64_t>(m.numel());
      f.spans += (end - 1) / part - start / part + 1;
      start = end;
    }
  } else {
    f.spans = spec.matrices.size();
  }
  // Update mode: the momentum (server/engine/momentum_store.h). Apply mode
  // (server/engine/param_store.h): per tensor the master and one (Muon) or two (AdamW) optimizer
  // arrays, as the job holds them (JobSpec::state; each array a whole number of 32-bit words).
  // Once, plus the step window (a second copy for the jobs that keep two).
  for (const common::MatrixSpec& m : spec.matrices) {
    if (spec.transport_probe) break;
    const uint64_t n = static_cast<uint64_t>(m.numel());
    const auto held = [n](common::StateDType d) {
      return (common::StoredStateBytes(d, n) + 3) / 4 * 4;
    };
    uint64_t bytes = 0;
    if (spec.mode != common::JobMode::kApply) {
      bytes = held(spec.state.momentum);
    } else if (m.optimizer == common::Optimizer::kAdamW) {
      bytes = 4 * n + 2 * held(spec.state.adamw);
    } else {
      bytes = 4 * n + held(spec.state.momentum);
    }
    if (!Add(&f.state_bytes, bytes)) return TooLarge("state byte count");
  }
  if (!spec.transport_probe) {
    const uint64_t window = StepWindowBytes(spec, daemon_step_window_bytes);
    f.window_bytes = window == StateBuffers::kTwoCopies ? f.state_bytes : window;
  }
  RETURN_IF_ERROR(MeasureBuffers(spec, &f));
  // The save's copy-on-write (at most the state), plus the writer's staging: the arrays of one
  // tensor at a time, decoded to fp32 at most (a float32 export).
  uint64_t staging = 0;
  for (const common::MatrixSpec& m : spec.matrices) {
    if (spec.transport_probe) break;
    const uint64_t arrays = spec.mode != common::JobMode::kApply       ? 1
                            : m.optimizer == common::Optimizer::kAdamW ? 3
                                                                       : 2;
    staging = std::max(staging, static_cast<uint64_t>(m.numel()) * sizeof(float) * arrays);
  }
  f.save_copy_bytes = f.state_bytes;
  if (!Add(&f.save_copy_bytes, staging)) return TooLarge("save copy byte count");
  if (!spec.transport_probe) {
    ASSIGN_OR_RETURN(f.gather_bytes, GatherFor(spec, daemon_gather_budget_bytes, in_host_memory));
  }
  if (!spec.transport_probe) f.scratch_bytes = ScratchFor(spec);
  if (!MulAdd(&f.table_bytes, f.spans, sizeof(int64_t)) ||  // progress words
      !MulAdd(&f.table_bytes, f.spans, kBytesPerSpan) ||
      !MulAdd(&f.table_bytes, world, kBytesPerRank) ||
      !MulAdd(&f.table_bytes, spec.matrices.size(), kBytesPerTensor)) {
    return TooLarge("table byte count");
  }
  return f;
}

JobMemory JobFootprint::kinds() const {
  JobMemory m;
  m.state = state_bytes;
  m.step_window = window_bytes;
  m.replay = replay_bytes;
  m.buffers = step_bytes - replay_bytes;
  m.save_copy = save_copy_bytes;
  m.gather = gather_bytes;
  m.tables = table_bytes;
  m.scratch = scratch_bytes;
  return m;
}

absl::Status CheckJobLimits(const common::JobSpec& spec, const JobFootprint& f,
                            const DaemonLimits& limits, uint64_t daemon_gather_budget_bytes) {
  const std::string job = absl::StrCat("job '", spec.job_id, "': ");
  if (spec.world_size > limits.max_world_size) {
    return absl::ResourceExhaustedError(absl::StrCat(job, "world_size ", spec.world_size,
                                                     " is over the limit --max-world-size ",
                                                     limits.max_world_size));
  }
  if (spec.matrices.size() > static_cast<size_t>(limits.max_tensors_per_job)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        job, spec.matrices.size(), " tensors are over the limit --max-tensors-per-job ",
        limits.max_tensors_per_job));
  }
  if (f.spans > limits.max_spans_per_job) {
    return absl::ResourceExhaustedError(absl::StrCat(job, "the layout has ", f.spans,
                                                     " shard spans over all ranks, over the limit "
                                                     "--max-spans-per-job ",
                                                     limits.max_spans_per_job));
  }
  if (spec.gather_budget_bytes > daemon_gather_budget_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(job, "gather_budget_bytes ", spec.gather_budget_bytes,
                     " is over the daemon's --gather-budget-bytes ", daemon_gather_budget_bytes));
  }
  return absl::OkStatus();
}

}  // namespace muond::server
