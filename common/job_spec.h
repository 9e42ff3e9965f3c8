// The description of a muond job: its Muon matrices, the Muon configuration and the layout.
// This is the in-memory form of job.json (muonctl) and of the API's JobSpec message.
//
// job.json (fields absent take the defaults shown):
//   {"job_id": str, "world_size": 1, "zero_stage": 0,
//    "muon": {"momentum": 0.95, "nesterov": true, "ns_method": "standard", "ns_steps": 5,
//             "compute_dtype": "float32", "scale_mode": "original"},
//    "matrices": [{"name": str, "shape": [r, c], "num_heads": 1, "dtype": "float32"}],
//    "layout": [[{"matrix": name, "offset": 0, "length": n}, ...], ...],   (optional, per rank)
//    "gather_budget_bytes": 0,                                  (0: the daemon's default)
//    "step_window_bytes": 0,   (0: the daemon's default; the state a step computes before it is
//                               sealed, at least the largest tensor's: README "Memory")
//    "checkpoint_every_steps": 0,            (0: only on request and at shutdown)
//    "checkpoint_keep": 3,                   (generations kept, 1..1000)
//    "step_timeout_seconds": 0,             (0: the daemon's default)
//    "transport_probe": false,                  (true: updates echo gradients; no Muon math)
//    "step_buffers": 2,      (a shared-memory rank's gradient and update buffers: 1 when each
//                             step's results are taken before the next step's gradients are
//                             written, as muon_offload does (its delayed mode too); 2 for a
//                             trainer that writes step t+1's gradients while step t computes.
//                             Step t uses buffer t % step_buffers.)
//    "nonfinite": "refuse",   ("skip": a step with a NaN/Inf gradient on any rank commits as a
//                              skipped step, state unchanged, step number advanced)
//    "state": {"momentum_dtype": "float32", "adamw_dtype": "float32"}}  (how the optimizer
//             state is held: "float32", "bfloat16" or "int8"; adamw_dtype in apply mode only;
//             job_spec_state.cc)
// Apply mode (DESIGN.md 4b) adds, and only then writes:
//   "mode": "apply" ("update", the default, is section 4), "tensors" (the name "matrices" stays
//   accepted; one of the two), each entry also {"optimizer": "muon"|"adamw" (default muon),
//   "group": str (default: the optimizer's name), "param_dtype": dtype (default: "dtype")},
//   "groups": [{"name": str, "lr": x, "weight_decay": 0}], "adamw": {"betas": [0.9, 0.999],
//   "eps": 1e-8}, "max_grad_norm": x (0 or absent: no clipping), "init_from": "path.safetensors".
// Many nodes (DESIGN.md 4c; job_spec_multinode.cc): "multinode": {"global_job_id": str,
//   "node": n, "nodes": N}: this job is node n's part of a job over N nodes; its steps commit in
//   two phases (prepared, then CommitStep / AbortStep from the trainer). An AdamW tensor of such
//   a job may be rows of the trainer's tensor, split across nodes by the ownership plan:
//   "rows": {"offset": first row, "of": the trainer's tensor's rows} (shape: the rows held here).
// Plain value types; thread-compatible.
#ifndef MUOND_COMMON_JOB_SPEC_H_
#define MUOND_COMMON_JOB_SPEC_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/names.h"

namespace muond::common {

enum class NsMethod { kStandard, kGram, kPolarExpress };
enum class JobMode { kUpdate, kApply };
enum class Optimizer { kMuon, kAdamW };

std::string_view JobModeName(JobMode m);      // "update", "apply"
absl::StatusOr<JobMode> ParseJobMode(std::string_view name);
std::string_view OptimizerName(Optimizer o);  // "muon", "adamw"
absl::StatusOr<Optimizer> ParseOptimizer(std::string_view name);
enum class ScaleMode { kOriginal, kMatchRmsAdamw, kNone };

std::string_view NsMethodName(NsMethod m);        // "standard", "gram", "polar_express"
absl::StatusOr<NsMethod> ParseNsMethod(std::string_view name);
std::string_view ScaleModeName(ScaleMode m);      // "original", "match_rms_adamw", "none"
absl::StatusOr<ScaleMode> ParseScaleMode(std::string_view name);

// How an optimizer state array is held (job.json "state"; server/optim/state_codec.h): fp32,
// bfloat16 (round to nearest even), or int8 in blocks of kStateBlock consecutive row-major
// elements with an fp32 scale per block (the last block of a tensor may be shorter, so every
// shape is served).
enum class StateDType { kFloat32, kBFloat16, kInt8 };
std::string_view StateDTypeName(StateDType d);  // "float32", "bfloat16", "int8"
absl::StatusOr<StateDType> ParseStateDType(std::string_view name);
inline constexpr uint64_t kStateBlock = 2048;
// Blocks of n elements (the int8 scales).
inline constexpr uint64_t StateBlocks(uint64_t n) { return (n + kStateBlock - 1) / kStateBlock; }
// Bytes n elements take held as `dtype` (int8: the scales, then the codes).
inline constexpr uint64_t StoredStateBytes(StateDType dtype, uint64_t n) {
  return dtype == StateDType::kFloat32    ? uint64_t{4} * n
         : dtype == StateDType::kBFloat16 ? uint64_t{2} * n
                                          : uint64_t{4} * StateBlocks(n) + n;
}
// The job's choice (job.json "state": {"momentum_dtype", "adamw_dtype"}, written only when not
// fp32): Muon's momentum (both modes) and AdamW's first and second moments (apply mode). The
// masters stay fp32.
struct StateStorage {
  StateDType momentum = StateDType::kFloat32;
  StateDType adamw = StateDType::kFloat32;
  bool compressed() const {
    return momentum != StateDType::kFloat32 || adamw != StateDType::kFloat32;
  }
};

struct MuonConfig {
  double momentum = 0.95;  // beta, in [0, 1)
  bool nesterov = true;
  NsMethod ns_method = NsMethod::kStandard;
  int ns_steps = 5;  // 1..kMaxNsSteps
  DType compute_dtype = DType::kFloat32;
  ScaleMode scale_mode = ScaleMode::kOriginal;
  // bf16/fp16 compute: the first fp32_iterations Newton-Schulz iterations run in fp32, the rest
  // in the compute dtype (DESIGN.md 3: < 5e-2 with 0, < 2e-2 with >= 2). 0..ns_steps; no effect
  // on fp32 compute.
  int fp32_iterations = 0;
};

struct MatrixSpec {
  std::string name;
  // [r, c]; [E, r, c] for expert batches; [out, in, kh, kw] for conv weights (viewed as
  // [out, in*kh*kw]).
  std::vector<int64_t> shape;
  int64_t num_heads = 1;  // must divide the rows r (out for conv)
  DType dtype = DType::kFloat32;  // the gradient's (and the update's) dtype
  // Apply mode only: how the tensor is updated, its parameter group, and the dtype the trainer
  // holds its parameters in (what the new parameters come back as). AdamW tensors may have any
  // shape of 0 to 8 dimensions.
  Optimizer optimizer = Optimizer::kMuon;
  std::string group = {};
  DType param_dtype = DType::kFloat32;
  // Many nodes, apply mode, AdamW tensors only: this job holds rows [row_offset, row_offset +
  // shape[0]) of the trainer's tensor `name`, which has full_rows rows (the rest of its shape as
  // here); 0: the whole tensor. job.json "rows": {"offset": row_offset, "of": full_rows}.
  int64_t row_offset = 0;
  int64_t full_rows = 0;

  int64_t numel() const;
};

// Apply mode: a parameter group. Its lr and weight decay are the defaults of a step; each step
// may carry its own (schedules).
struct ParamGroup {
  std::string name;
  double lr = 0;
  double weight_decay = 0;
};

// Apply mode: AdamW's constants for every AdamW tensor of the job.
struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
};

// Many nodes (DESIGN.md 4c): the job is one node's part of a job spanning several nodes, tied to
// the others by the global job id. Present when nodes > 0; steps then commit in two phases.
struct MultiNode {
  std::string global_job_id;
  int node = 0;   // 0..nodes-1
  int nodes = 0;  // 0: not part of a multi-node job
  bool operator==(const MultiNode& o) const {
    return global_job_id == o.global_job_id && node == o.node && nodes == o.nodes;
  }
};

// One run of consecutive elements of one matrix owned by a rank (explicit layouts).
struct LayoutSpan {
  uint32_t matrix = 0;  // index into JobSpec::matrices
  uint64_t offset = 0;  // first element
  uint64_t length = 0;  // elements, > 0
  bool operator==(const LayoutSpan& o) const {
    return matrix == o.matrix && offset == o.offset && length == o.length;
  }
};

// QK-Clip (MuonClip, DESIGN.md 4e): one attention's query and key projections. `q` is
// [q_heads * head_dim, in] and `k` [kv_heads * head_dim, in], rows grouped by head; query head h
// uses key head h / (q_heads / kv_heads).
struct QkClipPair {
  std::string q;
  std::string k;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
};

struct QkClip {
  double threshold = 0;           // tau, > 0
  double alpha = 0.5;             // in [0, 1]
  std::vector<QkClipPair> pairs;  // empty: no QK-Clip
  bool enabled() const { return !pairs.empty(); }
  // The per-head maxima a step carries: the sum of q_heads over the pairs, in pair order.
  size_t logits() const {
    size_t n = 0;
    for (const QkClipPair& p : pairs) n += static_cast<size_t>(p.q_heads);
    return n;
  }
};

// The rows of a tensor of this shape, as a tensor split across nodes counts them (DESIGN.md 4c,
// "rows"): its first dimension; a 0-d tensor has one row. Shared by the client's ownership plan
// and the daemon's import of rows.
inline int64_t TensorRows(const std::vector<int64_t>& shape) {
  return shape.empty() ? 1 : shape[0];
}

struct JobSpec {
  std::string job_id;
  int world_size = 1;
  // 0: whole matrices (world_size 1) or an explicit layout; 1, 2: the matrices concatenated and
  // split into world_size partitions; 3: each matrix split into world_size chunks.
  int zero_stage = 0;
  MuonConfig muon;
  std::vector<MatrixSpec> matrices;
  // Explicit layout: per rank, the spans it owns, in the order of the rank's flat buffer. Empty
  // unless given; then zero_stage is 0 and world_size == explicit_layout.size().
  std::vector<std::vector<LayoutSpan>> explicit_layout;
  // Bytes of whole matrices the daemon assembles at once for this job; 0: the daemon's default.
  uint64_t gather_budget_bytes = 0;
  // Bytes of state the step window holds for the tensors computed before the step is sealed
  // (server/engine/state_buffers.h); 0: the daemon's default. At least the largest tensor's
  // state (4 bytes an element in update mode; 8 for a Muon tensor, 12 for AdamW in apply mode).
  uint64_t step_window_bytes = 0;
  // The state bytes one step writes of tensor m (what the step window holds of it), as held
  // (`state`).
  uint64_t StateBytesOf(const MatrixSpec& m) const;
  // How the optimizer state is held (see StateStorage).
  StateStorage state;
  // A data-path probe: the daemon returns every gradient span unchanged as its update and keeps
  // no momentum (for checking and measuring transports, e.g. muond-bench transport).
  bool transport_probe = false;
  // A step with a non-finite gradient on any rank: refused (false) or skipped (true).
  bool nonfinite_skip = false;
  // A checkpoint generation every N committed steps (0: only on request and at shutdown).
  uint64_t checkpoint_every_steps = 0;
  // Newest generations kept (1..kMaxCheckpointKeep).
  int checkpoint_keep = 3;
  // A shared-memory rank's gradient and update buffers per region (1 or 2; step t uses buffer
  // t % step_buffers). 2 unless the trainer asks for 1 (README, "Memory").
  int step_buffers = 2;
  // Seconds from a step's first rank entry until every rank pushed its part (0: the daemon's
  // default; else 1..kMaxStepTimeoutSeconds).
  int step_timeout_seconds = 0;
  // DESIGN.md 4b. The fields below are used (and accepted) in apply mode only.
  JobMode mode = JobMode::kUpdate;
  std::vector<ParamGroup> groups;
  AdamWConfig adamw;
  // Global gradient clipping: 0 for none.
  double max_grad_norm = 0;
  // Initial parameters from this safetensors file on the daemon's host ("": uploaded by ranks).
  std::string init_from;
  // QK-Clip on the masters (DESIGN.md 4e); apply mode only.
  QkClip qk_clip;
  // Many nodes: which node's part of which global job this is (nodes 0: a single-node job).
  MultiNode multinode;
  // Steps are prepared and committed on the trainer's word (CommitStep), as multi-node jobs do.
  bool two_phase() const { return multinode.nodes > 0; }
  // Update mode with max_grad_norm: the step's norm adds every rank's share of the tensors outside
  // the job (the trainer's own), which comes with the rank's last part.
  bool clips_outside_share() const { return mode == JobMode::kUpdate && max_grad_norm > 0; }
};

inline constexpr int kMaxNsSteps = 100;
inline constexpr int kMaxCheckpointKeep = 1000;
inline constexpr int kMaxWorldSize = 65536;
inline constexpr size_t kMaxJobIdLength = kMaxJobIdBytes;  // common/names.h
inline constexpr int kMaxStepTimeoutSeconds = 7 * 24 * 3600;
// Largest matrix muond accepts, in elements (2^34: 64 GiB of fp32 momentum).
inline constexpr int64_t kMaxMatrixElements = int64_t{1} << 34;
inline constexpr size_t kMaxParamGroups = 1024;
inline constexpr size_t kMaxInitFromBytes = 4096;
inline constexpr int kMaxNodes = 65536;
inline constexpr size_t kMaxQkClipPairs = 4096;
// Per-head maxima a QK-Clip step carries, all pairs (4 bytes each in the step's hyper block).
inline constexpr size_t kMaxQkClipLogits = size_t{1} << 20;

// Parses job.json. INVALID_ARGUMENT naming the field (e.g. "matrices[2].shape") for malformed JSON,
// wrong types, unknown enum values and unknown fields. Runs ValidateJobSpec on the result.
absl::StatusOr<JobSpec> ParseJobSpecJson(std::string_view json);
// The canonical job.json of a spec (every field written).
std::string JobSpecToJson(const JobSpec& spec);
// Checks a spec: job_id 1..128 chars of [A-Za-z0-9._-]; world_size 1..kMaxWorldSize; zero_stage
// 0..3 (0 requires world_size 1); at least one matrix; names non-empty, unique; shapes of rank 2-4
// with positive dims and at most kMaxMatrixElements elements; num_heads >= 1 dividing the rows;
// momentum in [0, 1); ns_steps 1..kMaxNsSteps; an explicit layout tiles every matrix exactly once
// (ValidateExplicitLayout); the apply-mode rules (ValidateApplyMode). INVALID_ARGUMENT naming the
// field and value.
absl::Status ValidateJobSpec(const JobSpec& spec);
// Update mode: every tensor is a Muon tensor and no apply-mode field is set. Apply mode: groups
// 1..kMaxParamGroups with unique names, finite lr and weight_decay >= 0; every tensor's group
// exists; betas in [0, 1), eps > 0, max_grad_norm finite and >= 0; init_from at most
// kMaxInitFromBytes; ZeRO 1/2 partitions of one parameter dtype as well.
absl::Status ValidateApplyMode(const JobSpec& spec);
// The "multinode" block: global_job_id a valid job id, 0 <= node < nodes <= kMaxNodes (when
// present); a tensor's "rows" only on an AdamW tensor of an apply-mode multi-node job, with at
// least one dimension, 0 <= offset, offset + shape[0] <= of, and at most kMaxMatrixElements
// elements in the whole tensor. INVALID_ARGUMENT naming the field.
absl::Status ValidateMultiNode(const JobSpec& spec);
// The "qk_clip" block (DESIGN.md 4e): apply mode, not a multi-node job; threshold finite and > 0;
// alpha in [0, 1]; 1..kMaxQkClipPairs pairs whose q and k name distinct Muon tensors of the job,
// no tensor in two pairs, q_heads, kv_heads, head_dim >= 1 with kv_heads dividing q_heads, q of
// shape [q_heads * head_dim, in] and k of [kv_heads * head_dim, in] (2-D, the same in, one head
// each: num_heads 1), and at most kMaxQkClipLogits query heads in all. INVALID_ARGUMENT naming the
// field ("qk_clip.pairs[1].k") and the value. An update-mode spec carries no pair.
absl::Status ValidateQkClip(const JobSpec& spec);
// The "state" block: adamw_dtype other than float32 only in apply mode; nothing compressed in a
// transport probe. INVALID_ARGUMENT naming the field.
absl::Status ValidateStateStorage(const JobSpec& spec);
// Per pair, the indices of its q and k tensors in spec.matrices. REQUIRES: ValidateQkClip passed.
std::vector<std::pair<uint32_t, uint32_t>> QkClipTensors(const JobSpec& spec);
// The per-head maxima of a step (`logits`: spec.qk_clip.logits() values, pair after pair) are
// finite: OK, else INVALID_ARGUMENT naming the pair's q tensor and the head (prefixed `where`).
// A wrong count: INVALID_ARGUMENT naming the first pair without its values.
absl::Status CheckMaxLogits(const JobSpec& spec, const std::vector<float>& logits,
                            const std::string& where);

// Fills what apply mode defaults: a tensor's group (its optimizer's name). Both parsers call it.
void FillApplyDefaults(JobSpec* spec);
// Apply mode's presence mask of a step from the indices of the tensors without a gradient: one
// byte per tensor of `spec`, 1 for an absent one; empty for no index. INVALID_ARGUMENT for an
// index past the tensors or one given twice (the client's SetAbsent and the gRPC StepBegin).
absl::StatusOr<std::vector<uint8_t>> PresenceMask(const JobSpec& spec,
                                                  const std::vector<uint32_t>& absent);

}  // namespace muond::common

#endif  // MUOND_COMMON_JOB_SPEC_H_
