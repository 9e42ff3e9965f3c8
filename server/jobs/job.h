// A job: one training run's optimizer state on this node (DESIGN.md section 4), and the state
// machine of its steps. This header is the jobs room's face (leveldb's DB beside DBImpl): what the
// transports (server/api), the registry, the operators' views (server/ops) and main call, and
// nothing of how it is done. It includes no header of the step engine but its edge types
// (server/engine/step_io.h), no device and no store; the implementation, JobImpl
// (server/jobs/job_impl.h, private to this room: server/LAYERS), composes the layout, the state
// stores, the step pipeline and the checkpoint writer.
//
// Ranks take part in step t through RankStep objects (gRPC, one per rank and step) or
// SubmitShared / SubmitSharedPart (shared memory); as soon as every span of a matrix has arrived
// (from all ranks) the matrix is computed; Finish() blocks until the step committed and returns the
// rank's update. A refused or aborted step leaves the state bit-identical (DESIGN.md 4).
// Thread-safe: every method may be called concurrently (one RankStep per rank stream). Never proto
// types or sockets: server/api converts.
//
// The face in groups, each with who calls it: identity; checkpoints (api, registry); sessions and
// steps (api's transports); apply mode (api, registry); reset, export and import (api, registry);
// two-phase steps (api); lifecycle (registry); views (ops, api).
#ifndef MUOND_SERVER_JOBS_JOB_H_
#define MUOND_SERVER_JOBS_JOB_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_spec.h"
#include "server/engine/step_io.h"
#include "server/jobs/deletion_hooks.h"
#include "server/jobs/job_report.h"
#include "server/storage/checkpoint.h"

namespace muond::server {

class JobImpl;
struct StepState;

// Who created a job (recorded in its job.json and shown by muonctl job show).
struct JobOwner {
  int64_t uid = -1;         // the peer's uid on the Unix socket; -1 when unknown (TCP)
  std::string description;  // e.g. "uid 1000 gid 1000 pid 4242" or "ipv4:127.0.0.1:5555"
};

// One rank's part in one step. Not thread-safe: used by the one stream of that rank.
// Destroying it before Finish() returned means the rank went away mid-step: the step is aborted for
// every rank and the job is fenced.
class RankStep {
 public:
  ~RankStep();
  RankStep(const RankStep&) = delete;
  RankStep& operator=(const RankStep&) = delete;

  // Copies `data` (elements of the matrix's dtype starting at element `offset` of the matrix) into
  // the rank's input. INVALID_ARGUMENT, and the step is refused for every rank, for a bad matrix
  // index, a chunk outside the rank's spans, overlapping data, a CRC mismatch or a non-finite
  // value.
  absl::Status AddGradient(uint32_t matrix, uint64_t offset, std::string_view data,
                           uint32_t crc32c);
  // The rank has sent everything. Blocks until the step committed or failed; `cancelled` is polled
  // while waiting (true: the rank went away, the step is aborted). On success returns the rank's
  // update, valid as long as the caller holds it.
  // `outside_sum_sq`: update mode with max_grad_norm, the rank's share of the norm from the
  // tensors the trainer updates itself (JobSpec::clips_outside_share; CheckOutsideSumSq's refusals).
  absl::StatusOr<std::shared_ptr<const RankUpdate>> Finish(const std::function<bool()>& cancelled,
                                                           double outside_sum_sq = 0);
  // The rank's stream ended before StepEnd. The answer tells the truth about the commit: ABORTED
  // when this aborted the step (the job is fenced); when the step's commit had already begun (all
  // data was in), UNAVAILABLE saying the step is committed, which the rank receives by asking
  // for the step again (a replay); a step that had already failed returns its status.
  absl::Status Abandon(const std::string& why);
  // True when this is a replay of the last committed step: gradients are not applied again.
  bool replay() const { return replay_ != nullptr; }
  int64_t step() const { return step_; }
  uint64_t bytes_in() const { return bytes_in_; }

 private:
  friend class JobImpl;
  RankStep(std::shared_ptr<JobImpl> job, int rank, int64_t step, std::shared_ptr<StepState> state,
           std::shared_ptr<const RankUpdate> replay);
  // A replay's committed update, its bytes written from the masters when it keeps none.
  absl::StatusOr<std::shared_ptr<const RankUpdate>> Committed() const;

  std::shared_ptr<JobImpl> job_;
  int rank_;
  int64_t step_;
  std::shared_ptr<StepState> state_;
  std::shared_ptr<const RankUpdate> replay_;
  // A replay's re-sent gradients, per span (allocated as chunks arrive; a replay must carry the
  // bytes the step was computed from, checked at Finish).
  std::vector<std::string> replay_in_;
  std::vector<uint64_t> replay_got_;  // elements received per span
  bool done_ = false;
  uint64_t bytes_in_ = 0;
};

// Apply mode: one rank's upload of its initial parameters over gRPC (the chunks of its spans, in
// float32 or each tensor's param dtype). Nothing reaches the masters until Finish() found every
// span whole and finite. Not thread-safe: used by the one stream of that rank.
class ParamUpload {
 public:
  ~ParamUpload();
  ParamUpload(const ParamUpload&) = delete;
  ParamUpload& operator=(const ParamUpload&) = delete;
  // INVALID_ARGUMENT for a bad tensor index, a chunk outside the rank's spans or overlapping
  // data, a CRC mismatch, a size that is not whole elements, or a non-finite value.
  absl::Status Add(uint32_t tensor, uint64_t offset, std::string_view data, uint32_t crc32c);
  // Installs the rank's part of the masters; INVALID_ARGUMENT naming what is missing.
  absl::StatusOr<uint64_t> Finish();

 private:
  friend class JobImpl;
  ParamUpload(std::shared_ptr<JobImpl> job, int rank, uint64_t session, bool float32);
  std::shared_ptr<JobImpl> job_;
  int rank_;
  uint64_t session_;
  bool float32_;
  std::vector<std::string> data_;                      // per span, allocated on its first chunk
  std::vector<std::map<uint64_t, uint64_t>> claimed_;  // per span: element ranges received
  std::vector<uint64_t> received_;                     // per span: elements
};

class Job {
 public:
  virtual ~Job() = default;

  // ---- Identity.
  virtual const common::JobSpec& spec() const = 0;
  const std::string& id() const { return spec().job_id; }
  bool apply() const { return spec().mode == common::JobMode::kApply; }
  virtual const JobOwner& owner() const = 0;
  // Constant-time comparison of the token's SHA-256 with the job's.
  virtual bool TokenMatches(std::string_view token) const = 0;
  // The SHA-256 of the job's token (32 bytes; the token itself is not kept), for its record.
  virtual const std::string& token_sha256() const = 0;
  // Bytes of whole matrices assembled at once (the daemon's gather budget for this job).
  virtual uint64_t gather_budget_bytes() const = 0;
  // Bytes of fp32 state the job holds: the momentum, or in apply mode the whole ParamStore (0 for
  // a transport probe).
  virtual uint64_t MomentumBytes() const = 0;

  // ---- Checkpoints (DESIGN.md 7). Saving takes a consistent snapshot at a step boundary and
  // writes it while later steps run (state_buffers.h). One save at a time per job; a request
  // while one runs waits for it, then saves.
  // Blocks until the generation is durable. FAILED_PRECONDITION for a fenced job (its momentum
  // may be inconsistent) or a transport probe; errors of the write name the path and call.
  virtual absl::StatusOr<checkpoint::GenerationInfo> SaveCheckpoint() = 0;
  // Blocks until no save of this job is running.
  virtual void WaitForSaves() = 0;
  struct LoadResult {
    checkpoint::GenerationInfo info;
    int64_t next_step = 0;
    std::vector<std::string> set_aside;
  };
  // Loads a verified generation into the (pinned) state store, sets the next step to its step
  // and clears a fence. FAILED_PRECONDITION while a step is in flight or when the generation's
  // matrices do not match the job's (named); NOT_FOUND / DATA_LOSS from the store.
  virtual absl::StatusOr<LoadResult> LoadCheckpoint(const checkpoint::Selector& selector) = 0;
  // Loads from another job's checkpoint directory (re-creating a job with another world size or
  // ZeRO stage): matrices matched by name and shape.
  virtual absl::StatusOr<LoadResult> LoadCheckpointFrom(const std::shared_ptr<Job>& source,
                                                        const checkpoint::Selector& selector) = 0;
  virtual absl::StatusOr<std::vector<checkpoint::GenerationInfo>> ListCheckpoints() const = 0;
  virtual const std::string& checkpoint_dir() const = 0;
  // The step of the newest generation written or loaded by this process (-1: none).
  virtual int64_t last_checkpoint_step() const = 0;

  // ---- Sessions and steps (the transports).
  // Starts a session for `rank`. INVALID_ARGUMENT for a rank outside the world size;
  // ALREADY_EXISTS when the rank is attached, unless `takeover` (a restarted trainer replacing a
  // session whose process is gone; a step the old session was still pushing is aborted and the
  // job fenced; one it had finished pushing completes, and the new session can replay it).
  virtual absl::StatusOr<uint64_t> Attach(int rank, bool takeover) = 0;
  // Ends `rank`'s session. FAILED_PRECONDITION when `session` is not the rank's current one.
  // During a step the rank has not finished pushing (or not begun), the step is aborted for every
  // rank and the job fenced: the others would otherwise wait for a part that never comes.
  virtual absl::Status Detach(int rank, uint64_t session) = 0;
  // OK while `session` is `rank`'s current session, else FAILED_PRECONDITION saying why.
  virtual absl::Status CheckSession(int rank, uint64_t session) const = 0;
  // A gRPC rank's session watch ended without a detach (its process died or its connection
  // broke): as Detach mid-step; between steps the rank is remembered as lost, and a step that
  // other ranks try to begin before it attaches again is refused with ABORTED naming it.
  virtual void EndLostSession(int rank, uint64_t session, const std::string& why) = 0;
  // Starts `rank`'s part in `step`. FAILED_PRECONDITION when the job is fenced, the session is not
  // the rank's current one, the step is out of order, or the rank already has the step in flight.
  // `hyper`: apply mode's lr / weight decay / divisor (required there; INVALID_ARGUMENT when
  // given to an update-mode job). In apply mode FAILED_PRECONDITION while the initial weights are
  // incomplete (naming the ranks), and a rank whose hyper differs from the step's refuses the
  // step (INVALID_ARGUMENT).
  virtual absl::StatusOr<std::unique_ptr<RankStep>> BeginStep(
      int rank, uint64_t session, int64_t step, const StepHyper* hyper = nullptr) = 0;
  // The shared-memory path: `rank` submits all its gradients for `step` at once. `in[i]` holds span
  // i of RankSpans (the matrix dtype), `out[i]` receives span i of the update; both stay mapped as
  // long as `keepalive` lives (the step holds it). The gradient memory must not change until
  // `done` ran. Validation errors (session, order, fence, non-finite values) are returned at once
  // and `done` is not called; otherwise `done` is called exactly once.
  // `progress`: where the daemon tells the rank which spans' results are in (see SharedProgress).
  virtual absl::Status SubmitShared(int rank, uint64_t session, int64_t step,
                                    const std::vector<const char*>& in,
                                    const std::vector<char*>& out,
                                    std::shared_ptr<const void> keepalive, SharedDone done,
                                    const StepHyper* hyper = nullptr, SharedProgress progress = {},
                                    double outside_sum_sq = 0) = 0;
  // A part of a shared-memory submission (common/shm_protocol.h kSubmitStepPart): `part.spans`
  // (indices into RankSpans) are in, each checked finite first; `in`/`out` as above for every
  // span. The first part enters the step (as SubmitShared: replays, order, fence; apply mode's
  // `hyper` is taken from it), later ones continue it (same session and `keepalive`). A span in
  // two parts, or (at the last part) in none, refuses the step, INVALID_ARGUMENT naming it, as
  // does a non-finite value. OK for a part that is not the last means it was taken; `done` runs
  // for the last part only, as SubmitShared's.
  struct SharedPart {
    std::vector<size_t> spans;
    bool last = true;
    // A later part of a try the transport saw begin (not the try's first part): it never opens
    // a try of its own.
    bool continues = false;
    // The last part, update mode with max_grad_norm: the rank's sum of squares of its gradients
    // outside the job (RankStep::Finish's `outside_sum_sq`).
    double outside_sum_sq = 0;
  };
  virtual absl::Status SubmitSharedPart(int rank, uint64_t session, int64_t step,
                                        const SharedPart& part, const std::vector<const char*>& in,
                                        const std::vector<char*>& out,
                                        std::shared_ptr<const void> keepalive, SharedDone done,
                                        const StepHyper* hyper = nullptr,
                                        SharedProgress progress = {}) = 0;
  // A part the transport refused before it reached the job (outside the buffer, cutting a span,
  // after the rank's last part): when `rank` has the step open in parts from this session and
  // `keepalive`, the step is refused with `why` (nothing of it is committed). Returns `why`.
  virtual absl::Status RefuseSharedPart(int rank, uint64_t session, int64_t step,
                                        const void* keepalive, const absl::Status& why) = 0;
  // A shared-memory session of `rank` ended (its peer hung up): a step the rank had in flight is
  // aborted and the job fenced; replays that point into its regions are dropped; the rank is
  // detached if `session` is still its session.
  // `clean`: the peer detached on purpose (only the message differs: a rank that still owed its
  // part of the step in flight aborts it either way, as a gRPC rank's Detach does).
  virtual void EndSharedSession(int rank, uint64_t session, const void* keepalive,
                                bool clean = false) = 0;
  // Bytes a transport copied on the host between its own buffers and the job's: gRPC chunks into
  // the input buffers, updates into response messages, a replayed update into a shared-memory
  // rank's region. (Assembly and return of whole matrices are the step's own work, not counted;
  // a shared-memory step adds nothing.)
  virtual void CountTransportCopy(uint64_t bytes) = 0;
  // A gRPC rank was sent the last byte of its update of `step` (trainer_clock.h).
  virtual void UpdateSent(int64_t step) = 0;
  // True while `step` is the step in flight (some rank began it, it has not ended).
  virtual bool StepInFlight(int64_t step) const = 0;

  // ---- Apply mode (DESIGN.md 4b).
  // `rank`'s initial parameters: in[i] holds span i of RankSpans, float32 or (float32 false) the
  // tensor's param dtype. Checked whole (finite) before the masters change; FAILED_PRECONDITION
  // on an update-mode job, for a session that is not the rank's or while a step is in flight.
  // Returns the elements installed.
  virtual absl::StatusOr<uint64_t> InitParams(int rank, uint64_t session,
                                              const std::vector<const char*>& in,
                                              bool float32) = 0;
  // The gRPC form: chunks collected by a ParamUpload. One upload per rank at a time.
  virtual absl::StatusOr<std::unique_ptr<ParamUpload>> BeginParamUpload(int rank,
                                                                        uint64_t session,
                                                                        bool float32) = 0;
  // Reads the job's init_from safetensors file (tensors matched by name and shape; F32, BF16 or
  // F16) into the masters and marks every rank's weights in. `peer_uid` (-1: unknown) must be
  // able to read the file: it must be a regular file owned by that uid or readable by everyone.
  virtual absl::Status InitFromFile(int64_t peer_uid) = 0;
  // True when every rank's part of the initial weights is in.
  virtual bool WeightsComplete() const = 0;
  // The master weights at a step boundary, tensor by tensor in job order (`sink` gets each whole
  // fp32 tensor); *step the next step at the snapshot. FAILED_PRECONDITION on an update-mode job
  // or while the weights are incomplete. The masters are copied first (their size in memory) and
  // `sink` called with nothing of the job held: a slow sink delays no save, load, reset or delete.
  virtual absl::Status ExportParams(
      const std::function<absl::Status(uint32_t tensor, const std::vector<float>& w)>& sink,
      int64_t* step) = 0;

  // ---- Reset, full-state export and import (re-sharding a job across nodes; DESIGN.md 4c;
  // common/state_export.h for the files).
  // Zeroes the momentum (apply mode: the momentum, AdamW moments and step counts; the masters
  // stay), clears a fence and sets the next step. FAILED_PRECONDITION while a step is in flight.
  virtual absl::Status Reset(int64_t next_step) = 0;
  // Reset, made durable by `persist`, which is called with the newest checkpoint generation on
  // disk (0: none) and records the reset. No save of this job runs between the reset and the
  // record, so every generation up to that number holds the momentum before the reset. When
  // `persist` fails the job is fenced (memory reset, disk not) and its error returned.
  virtual absl::Status ResetDurably(int64_t next_step,
                                    const std::function<absl::Status(int64_t)>& persist) = 0;
  struct ExportedState {
    int64_t step = 0;                             // the next step of the state
    int64_t generation = 0;                       // 0: the live state
    std::vector<checkpoint::StateTensor> arrays;  // checkpoint::StateTensors order
    std::vector<uint32_t> tensor_of;              // per array, its job tensor
    std::vector<int64_t> tensor_steps;            // apply mode: per job tensor, AdamW step count
  };
  // The job's full state: live (`generation` empty: a snapshot at a step boundary, as a save
  // takes; a prepared step is not in it) or of a checkpoint generation. Each array as the job
  // holds it (arrays[a].dtype: compressed state stays compressed), or, with `float32`, decoded to
  // float32 (arrays[a].dtype kFloat32). `header` is called once, then `sink` with each array in
  // order: its first arrays[a].stored_bytes() bytes are the array's data (fp32 values; bf16
  // codes; int8 the block scales, then the codes). Their errors end the export.
  // FAILED_PRECONDITION for a fenced job, a transport probe or apply-mode weights not yet in;
  // NOT_FOUND / DATA_LOSS from the checkpoint store. Nothing of the job changes. The state is
  // copied (or read) whole first, and `header` and `sink` are called with nothing of the job held.
  virtual absl::Status ExportState(
      const std::optional<checkpoint::Selector>& generation, bool float32,
      const std::function<absl::Status(const ExportedState&)>& header,
      const std::function<absl::Status(size_t array, const std::vector<float>& data)>& sink) = 0;
  // Takes, for every tensor of the job, its state from export directory `dir` (by tensor name;
  // every manifest there of one step and the job's mode; shapes as the job's), sets the next step
  // and, in apply mode, marks the weights in. Read where `peer_uid` could read (as init_from).
  // INVALID_ARGUMENT / NOT_FOUND / PERMISSION_DENIED / DATA_LOSS naming the file and tensor; the
  // job is unchanged on error. REQUIRES: no step has run (called at creation).
  virtual absl::Status ImportState(const std::string& dir, int64_t peer_uid) = 0;

  // ---- Two-phase steps (multi-node jobs, spec().two_phase(); DESIGN.md 4c).
  // When every matrix of step t succeeded, the ranks receive their results and the step stays
  // prepared: the state store is unchanged and step t + 1 is refused until the trainer, having
  // agreed across nodes, calls one of these.
  // Makes prepared step `step` the job's state. OK when `step` is already committed (a second
  // rank's commit); FAILED_PRECONDITION when it is neither prepared nor committed, or fenced.
  virtual absl::Status CommitStep(int64_t step) = 0;
  // Drops step `step`: a prepared step, or one still in flight (its ranks get ABORTED with
  // `reason`); the store stays bit-identical, the job is not fenced, and `step` is expected again.
  // OK when no step `step` is in flight and it is the next step (nothing to drop);
  // FAILED_PRECONDITION when it is already committed.
  virtual absl::Status AbortStep(int64_t step, const std::string& reason) = 0;
  // The commit window across nodes: after step `step` committed here but not on every node, the
  // trainer rolls it back: the store's front becomes what it was before the step, the step counts
  // drop back and the job expects `step` again. Also drops `step` when it is still prepared here.
  // OK when it was rolled back already (another rank of the node), or when nothing of `step` is
  // here and the job expects it. FAILED_PRECONDITION, state unchanged, when `step` is not the last
  // step committed, or when something happened since its commit that the old front does not hold
  // (a later step began, a checkpoint was saved or loaded, parameters were uploaded, a reset).
  virtual absl::Status RollbackStep(int64_t step, const std::string& reason) = 0;

  // ---- Lifecycle (the registry).
  // Aborts the step in flight (ABORTED for every rank, job fenced) when it has run longer than
  // the job's step timeout since its first rank entered it without every rank having pushed its
  // part; the message names the ranks missing. A step prepared longer than the prepare timeout is
  // dropped (nothing changed, not fenced). Called periodically by the registry.
  virtual void CheckStepTimeout(absl::Time now) = 0;
  // Marks the job deleted: steps in flight and later ones fail with NOT_FOUND, and every
  // deletion hook runs (OnDelete), so that whatever still holds the job lets go of it.
  virtual void MarkDeleted() = 0;
  // Registers how a holder of the job between steps (an attached shared-memory session, a gRPC
  // stream blocked in Read, an export) lets go of it when the job is deleted: `end` runs once,
  // from MarkDeleted, or at once when the job is deleted already. It runs under a lock: it must
  // not block nor call into the job (it posts to a loop, cancels a call). Destroying the
  // registration unregisters it (see deletion_hooks.h).
  virtual DeletionHooks::Registration OnDelete(std::function<void()> end) = 0;

  // ---- Views (status, metrics, muonctl job show).
  virtual JobReport Report() const = 0;
};

// Test hook (the chaos run's kill in the middle of a commit; muond arms it from
// $MUOND_TEST_COMMIT_HOLD_MS in a build with MUOND_TEST_HOOKS): every commit, once the state store
// has flipped and before the step is finished and its results released, logs that it holds and
// sleeps `ms` milliseconds with the store's lock held. 0 (the default) disarms it.
void SetCommitHoldForTesting(int ms);
// The chaos test's in-place hold ($MUOND_TEST_INPLACE_HOLD_MS): a step holds `ms` in the middle of
// an in-place update of its state, logging "test hook: job 'J' step T holds in the middle of an
// in-place update" (server/engine/step_pipeline.h).
void SetInPlaceHoldForTesting(int ms);

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_JOB_H_
