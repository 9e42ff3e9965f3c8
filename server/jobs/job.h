// A job: one training run's optimizer state on this node (DESIGN.md section 4), and the state
// machine of its steps.
//
// A Job composes named parts: its JobLayout (which rank owns which spans), its MomentumStore (the
// fp32 momentum, pinned), its StepPipeline (whole matrices assembled and updated on the device)
// and its CheckpointWriter (snapshots to disk). The Job itself keeps the sessions of the ranks,
// the step counter, the step in flight and the rules of entry, refusal, abort, fence and commit.
// Ranks take part in step t through RankStep objects (gRPC, one per rank and step) or SubmitShared
// (shared memory); as soon as every span of a matrix has arrived (from all ranks) the matrix is
// queued on the daemon's ComputeExecutor for the pipeline. Finish() blocks until the step
// committed and returns the rank's update.
//
// Atomicity (DESIGN.md 4, "stage each matrix's new momentum and commit all of them when the step
// is known to be clean"): the device writes each matrix's new momentum, the one its update was
// computed from, into the momentum store's back buffers; the commit, when every matrix succeeded,
// flips the store. A refused or aborted step therefore leaves every momentum bit-identical, and
// the gradients are read once (a shared-memory peer that rewrites its region early changes nothing
// committed). Memory cost: the momentum twice (momentum_store.h), plus the gather budget.
//
// What it may call: common/, server/optim (the math), server/device (through DeviceStreams),
// server/storage (through CheckpointWriter), server/record (metrics, history, progress, limits).
// Never proto types or sockets (server/api converts). Thread-safe: all methods may be called
// concurrently (one RankStep per rank stream).
//
// Apply mode (DESIGN.md 4b): the job also holds a ParamStore (fp32 masters, Muon momentum, AdamW
// moments and step counts, double-buffered: the step computes the next state into the back and
// the commit flips it, see param_store.h), takes each step's per-group lr / weight decay and
// gradient divisor (StepHyper), returns new parameters in each tensor's param dtype, and refuses
// steps until every rank's initial weights are in (InitParams, or init_from at creation).
#ifndef MUOND_SERVER_JOBS_JOB_H_
#define MUOND_SERVER_JOBS_JOB_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "server/device/device_streams.h"
#include "server/engine/compute_executor.h"
#include "server/engine/job_layout.h"
#include "server/engine/momentum_store.h"
#include "server/engine/param_store.h"
#include "server/engine/rank_update.h"
#include "server/engine/step_pipeline.h"
#include "server/engine/step_state.h"
#include "server/jobs/checkpoint_writer.h"
#include "server/jobs/deletion_hooks.h"
#include "server/jobs/job_report.h"
#include "server/jobs/trainer_clock.h"
#include "server/storage/checkpoint.h"

namespace muond::server {

class Job;

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
  friend class Job;
  RankStep(std::shared_ptr<Job> job, int rank, int64_t step, std::shared_ptr<StepState> state,
           std::shared_ptr<const RankUpdate> replay);

  std::shared_ptr<Job> job_;
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
  friend class Job;
  ParamUpload(std::shared_ptr<Job> job, int rank, uint64_t session, bool float32);
  std::shared_ptr<Job> job_;
  int rank_;
  uint64_t session_;
  bool float32_;
  std::vector<std::string> data_;                      // per span, allocated on its first chunk
  std::vector<std::map<uint64_t, uint64_t>> claimed_;  // per span: element ranges received
  std::vector<uint64_t> received_;                     // per span: elements
};

class Job : public std::enable_shared_from_this<Job>, private StepPipeline::Sink {
 public:
  // `executor` must outlive the job. gather_budget_bytes: bytes of whole matrices (fp32 gradient
  // and temporary momentum) assembled at once; a larger matrix is processed alone.
  // token_sha256: the SHA-256 of the job's token (32 bytes; the token itself is not kept).
  // checkpoint_dir: the job's checkpoint directory (server/storage/checkpoint.h).
  // step_timeout: see common::JobSpec::step_timeout_seconds (the daemon's default applied).
  // prepare_timeout: how long a prepared two-phase step waits for CommitStep or AbortStep before
  // CheckStepTimeout drops it (--prepare-timeout-seconds).
  Job(common::JobSpec spec, std::string token_sha256, std::string backend,
      ComputeExecutor* executor, uint64_t gather_budget_bytes, DeviceStreams* devices,
      std::string checkpoint_dir, absl::Duration step_timeout, JobOwner owner,
      absl::Duration prepare_timeout = absl::Seconds(300));
  ~Job() override;

  const common::JobSpec& spec() const { return spec_; }
  const std::string& id() const { return spec_.job_id; }
  uint64_t gather_budget_bytes() const { return pipeline_.gather_budget_bytes(); }
  // Constant-time comparison of the token's SHA-256 with the job's.
  bool TokenMatches(std::string_view token) const;
  const std::string& token_sha256() const { return token_sha256_; }

  // ---- Checkpoints (DESIGN.md 7). Saving takes a consistent snapshot at a step boundary (the
  // store changes only at commit, so the momentum between commits is one) and writes it while
  // later steps run (state_buffers.h): a step that would overwrite a matrix the writer has not
  // copied yet hands its buffer to the snapshot and writes a fresh one (nothing copied on the
  // step's path); a reset or load copies the matrices it changes. Extra memory: one matrix's
  // staging buffer, plus at most one buffer per matrix not yet written. One save at a time per
  // job; a request while one runs waits for it, then saves.

  // Blocks until the generation is durable. FAILED_PRECONDITION for a fenced job (its momentum
  // may be inconsistent) or a transport probe; errors of the write name the path and call.
  absl::StatusOr<checkpoint::GenerationInfo> SaveCheckpoint();
  // Starts a save in the background unless one runs (the checkpoint_every_steps saves).
  void SaveCheckpointInBackground();
  // Blocks until no save of this job is running.
  void WaitForSaves();
  struct LoadResult {
    checkpoint::GenerationInfo info;
    int64_t next_step = 0;
    std::vector<std::string> set_aside;
  };
  // Loads a verified generation into the (pinned) momentum store, sets the next step to its step
  // and clears a fence. FAILED_PRECONDITION while a step is in flight or when the generation's
  // matrices do not match the job's (named); NOT_FOUND / DATA_LOSS from the store.
  absl::StatusOr<LoadResult> LoadCheckpoint(const checkpoint::Selector& selector);
  // Loads from another job's checkpoint directory (re-creating a job with another world size or
  // ZeRO stage): matrices matched by name and shape.
  absl::StatusOr<LoadResult> LoadCheckpointFrom(const std::shared_ptr<Job>& source,
                                                const checkpoint::Selector& selector);
  // Fences the job (steps FAILED_PRECONDITION until a load or reset), e.g. when its checkpoints
  // could not be read at restart.
  void Fence(const std::string& reason);
  absl::StatusOr<std::vector<checkpoint::GenerationInfo>> ListCheckpoints() const;
  // The highest generation number in the job's checkpoint directory, good or not (0: none).
  int64_t NewestGeneration() const;
  const std::string& checkpoint_dir() const { return writer_.dir(); }
  // The step of the newest generation written or loaded by this process (-1: none).
  int64_t last_checkpoint_step() const { return writer_.last_step(); }

  // Starts a session for `rank`. INVALID_ARGUMENT for a rank outside the world size;
  // ALREADY_EXISTS when the rank is attached, unless `takeover` (a restarted trainer replacing a
  // session whose process is gone; a step the old session was still pushing is aborted and the
  // job fenced; one it had finished pushing completes, and the new session can replay it).
  absl::StatusOr<uint64_t> Attach(int rank, bool takeover);
  // Ends `rank`'s session. FAILED_PRECONDITION when `session` is not the rank's current one.
  // During a step the rank has not finished pushing (or not begun), the step is aborted for every
  // rank and the job fenced: the others would otherwise wait for a part that never comes.
  absl::Status Detach(int rank, uint64_t session);
  // OK while `session` is `rank`'s current session, else FAILED_PRECONDITION saying why.
  absl::Status CheckSession(int rank, uint64_t session) const;
  // A gRPC rank's session watch ended without a detach (its process died or its connection
  // broke): as Detach mid-step; between steps the rank is remembered as lost, and a step that
  // other ranks try to begin before it attaches again is refused with ABORTED naming it.
  void EndLostSession(int rank, uint64_t session, const std::string& why);
  // Aborts the step in flight (ABORTED for every rank, job fenced) when it has run longer than
  // the job's step timeout since its first rank entered it without every rank having pushed its
  // part; the message names the ranks missing. A step prepared longer than the prepare timeout is
  // dropped (DropPrepared: nothing changed, not fenced). Called periodically by the registry.
  void CheckStepTimeout(absl::Time now);
  absl::Duration step_timeout() const { return step_timeout_; }
  // Bytes of fp32 state the job holds: the momentum, or in apply mode the whole ParamStore (0 for
  // a transport probe).
  uint64_t MomentumBytes() const {
    return params_ != nullptr ? params_->bytes() : momentum_.bytes();
  }
  const JobOwner& owner() const { return owner_; }
  // Starts `rank`'s part in `step`. FAILED_PRECONDITION when the job is fenced, the session is not
  // the rank's current one, the step is out of order, or the rank already has the step in flight.
  // `hyper`: apply mode's lr / weight decay / divisor (required there; INVALID_ARGUMENT when
  // given to an update-mode job). In apply mode FAILED_PRECONDITION while the initial weights are
  // incomplete (naming the ranks), and a rank whose hyper differs from the step's refuses the
  // step (INVALID_ARGUMENT).
  absl::StatusOr<std::unique_ptr<RankStep>> BeginStep(int rank, uint64_t session, int64_t step,
                                                      const StepHyper* hyper = nullptr);
  // The shared-memory path: `rank` submits all its gradients for `step` at once. `in[i]` holds span
  // i of RankSpans (the matrix dtype), `out[i]` receives span i of the update; both stay mapped as
  // long as `keepalive` lives (the step holds it). The gradient memory must not change until
  // `done` ran. Validation errors (session, order, fence, non-finite values) are returned at once
  // and `done` is not called; otherwise `done` is called exactly once.
  // `progress`: where the daemon tells the rank which spans' results are in (see SharedProgress).
  absl::Status SubmitShared(int rank, uint64_t session, int64_t step,
                            const std::vector<const char*>& in, const std::vector<char*>& out,
                            std::shared_ptr<const void> keepalive, SharedDone done,
                            const StepHyper* hyper = nullptr, SharedProgress progress = {},
                            double outside_sum_sq = 0);
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
  absl::Status SubmitSharedPart(int rank, uint64_t session, int64_t step, const SharedPart& part,
                                const std::vector<const char*>& in, const std::vector<char*>& out,
                                std::shared_ptr<const void> keepalive, SharedDone done,
                                const StepHyper* hyper = nullptr, SharedProgress progress = {});
  // A part the transport refused before it reached the job (outside the buffer, cutting a span,
  // after the rank's last part): when `rank` has the step open in parts from this session and
  // `keepalive`, the step is refused with `why` (nothing of it is committed). Returns `why`.
  absl::Status RefuseSharedPart(int rank, uint64_t session, int64_t step, const void* keepalive,
                                const absl::Status& why);

  // ---- Apply mode (DESIGN.md 4b).
  bool apply() const { return spec_.mode == common::JobMode::kApply; }
  // `rank`'s initial parameters: in[i] holds span i of RankSpans, float32 or (float32 false) the
  // tensor's param dtype. Checked whole (finite) before the masters change; FAILED_PRECONDITION
  // on an update-mode job, for a session that is not the rank's or while a step is in flight.
  // Returns the elements installed.
  absl::StatusOr<uint64_t> InitParams(int rank, uint64_t session,
                                      const std::vector<const char*>& in, bool float32);
  // The gRPC form: chunks collected by a ParamUpload. One upload per rank at a time.
  absl::StatusOr<std::unique_ptr<ParamUpload>> BeginParamUpload(int rank, uint64_t session,
                                                                bool float32);
  // Reads the job's init_from safetensors file (tensors matched by name and shape; F32, BF16 or
  // F16) into the masters and marks every rank's weights in. `peer_uid` (-1: unknown) must be
  // able to read the file: it must be a regular file owned by that uid or readable by everyone.
  absl::Status InitFromFile(int64_t peer_uid);
  // True when every rank's part of the initial weights is in.
  bool WeightsComplete() const;
  // The master weights at a step boundary, tensor by tensor in job order (`sink` gets each whole
  // fp32 tensor); *step the next step at the snapshot. FAILED_PRECONDITION on an update-mode job
  // or while the weights are incomplete. The masters are copied first (their size in memory) and
  // `sink` called with nothing of the job held: a slow sink delays no save, load, reset or delete.
  absl::Status ExportParams(
      const std::function<absl::Status(uint32_t tensor, const std::vector<float>& w)>& sink,
      int64_t* step);
  // A shared-memory session of `rank` ended (its peer hung up): a step the rank had in flight is
  // aborted and the job fenced; replays that point into its regions are dropped; the rank is
  // detached if `session` is still its session.
  // `clean`: the peer detached on purpose (only the message differs: a rank that still owed its
  // part of the step in flight aborts it either way, as a gRPC rank's Detach does).
  void EndSharedSession(int rank, uint64_t session, const void* keepalive, bool clean = false);
  // Bytes a transport copied on the host between its own buffers and the job's: gRPC chunks into
  // the input buffers, updates into response messages, a replayed update into a shared-memory
  // rank's region. (Assembly and return of whole matrices are the step's own work, not counted;
  // a shared-memory step adds nothing.)
  void CountTransportCopy(uint64_t bytes) { transport_copy_bytes_.fetch_add(bytes); }
  // A gRPC rank was sent the last byte of its update of `step` (trainer_clock.h).
  void UpdateSent(int64_t step) { trainer_clock_.Sent(step); }

  // Zeroes the momentum (apply mode: the momentum, AdamW moments and step counts; the masters
  // stay), clears a fence and sets the next step. FAILED_PRECONDITION while a step is in flight.
  absl::Status Reset(int64_t next_step);
  // Reset, made durable by `persist`, which is called with the newest checkpoint generation on
  // disk (0: none) and records the reset. No save of this job runs between the reset and the
  // record, so every generation up to that number holds the momentum before the reset. When
  // `persist` fails the job is fenced (memory reset, disk not) and its error returned.
  absl::Status ResetDurably(int64_t next_step, const std::function<absl::Status(int64_t)>& persist);
  // ---- Full-state export and import (re-sharding a job across nodes; DESIGN.md 4c;
  // job_export_state.cc, common/state_export.h for the files).
  struct ExportedState {
    int64_t step = 0;                             // the next step of the state
    int64_t generation = 0;                       // 0: the live state
    std::vector<checkpoint::StateTensor> arrays;  // checkpoint::StateTensors order
    std::vector<uint32_t> tensor_of;              // per array, its job tensor
    std::vector<int64_t> tensor_steps;            // apply mode: per job tensor, AdamW step count
  };
  // The job's full state: live (`generation` empty: a snapshot at a step boundary, as a save
  // takes; a prepared step is not in it) or of a checkpoint generation. `header` is called once,
  // then `sink` with each array in order; their errors end the export. FAILED_PRECONDITION for a
  // fenced job, a transport probe or apply-mode weights not yet in; NOT_FOUND / DATA_LOSS from the
  // checkpoint store. Nothing of the job changes. The state is copied (or read) whole first, and
  // `header` and `sink` are called with nothing of the job held.
  absl::Status ExportState(
      const std::optional<checkpoint::Selector>& generation,
      const std::function<absl::Status(const ExportedState&)>& header,
      const std::function<absl::Status(size_t array, const std::vector<float>& data)>& sink);
  // Takes, for every tensor of the job, its state from export directory `dir` (by tensor name;
  // every manifest there of one step and the job's mode; shapes as the job's), sets the next step
  // and, in apply mode, marks the weights in. Read where `peer_uid` could read (as init_from).
  // INVALID_ARGUMENT / NOT_FOUND / PERMISSION_DENIED / DATA_LOSS naming the file and tensor; the
  // job is unchanged on error. REQUIRES: no step has run (called at creation).
  absl::Status ImportState(const std::string& dir, int64_t peer_uid);
  // ---- Two-phase steps (multi-node jobs, spec().two_phase(); DESIGN.md 4c; job_prepare.cc).
  // When every matrix of step t succeeded, the ranks receive their results and the step stays
  // prepared: the state store (momentum; apply mode masters, moments, counts) is unchanged and
  // step t + 1 is refused until the trainer, having agreed across nodes, calls one of these.
  // Makes prepared step `step` the job's state. OK when `step` is already committed (a second
  // rank's commit); FAILED_PRECONDITION when it is neither prepared nor committed, or fenced.
  absl::Status CommitStep(int64_t step);
  // Drops step `step`: a prepared step, or one still in flight (its ranks get ABORTED with
  // `reason`); the store stays bit-identical, the job is not fenced, and `step` is expected again.
  // OK when no step `step` is in flight and it is the next step (nothing to drop);
  // FAILED_PRECONDITION when it is already committed.
  absl::Status AbortStep(int64_t step, const std::string& reason);
  // The commit window across nodes: after step `step` committed here but not on every node, the
  // trainer rolls it back: the store's front becomes what it was before the step (the double
  // buffer kept it: a two-phase commit flips without reusing the old front), the step counts
  // drop back and the job expects `step` again. Also drops `step` when it is still prepared
  // here (this node never committed it). OK when it was rolled back already (another rank of
  // the node), or when nothing of `step` is here and the job expects it. FAILED_PRECONDITION,
  // state unchanged, when `step` is not the last step committed, or when something happened
  // since its commit that the old front does not hold (a later step began, a checkpoint was
  // saved or loaded, parameters were uploaded, a reset): then only a checkpoint load makes the
  // nodes agree.
  absl::Status RollbackStep(int64_t step, const std::string& reason);

  // The digest of a rank's gradients (RankUpdate::input_digest): CRC32Cs of the slices of each of
  // its spans, `span_in[k]` holding span k's bytes; over the CPUs for large inputs.
  std::vector<uint32_t> InputDigest(int rank, const std::vector<const char*>& span_in) const;
  // ALREADY_EXISTS naming the step, rank and first differing matrix element when `span_in` is not
  // what committed step `replay` was computed from (a replay must re-send the same gradients).
  absl::Status CheckReplayInput(int rank, const RankUpdate& replay,
                                const std::vector<const char*>& span_in) const;

  // Marks the job deleted: steps in flight and later ones fail with NOT_FOUND, and every
  // deletion hook runs (OnDelete), so that whatever still holds the job lets go of it.
  void MarkDeleted();
  // Registers how a holder of the job between steps (an attached shared-memory session, a gRPC
  // stream blocked in Read, an export) lets go of it when the job is deleted: `end` runs once,
  // from MarkDeleted, or at once when the job is deleted already. It runs under a lock: it must
  // not block nor call into the job (it posts to a loop, cancels a call). Destroying the
  // registration unregisters it (see deletion_hooks.h).
  DeletionHooks::Registration OnDelete(std::function<void()> end) {
    return deletion_hooks_.Register(std::move(end));
  }

  // True while `step` is the step in flight (some rank began it, it has not ended).
  bool StepInFlight(int64_t step) const;

  JobReport Report() const;

 private:
  // The report's pipeline pressure, pinned memory, Newton-Schulz times, orthogonality and trainer
  // times (each source takes its own lock; not the job's).
  void ReportObservations(JobReport& r) const;
  // The step's results go to its ranks now: starts timing their delivery (trainer_clock.h).
  // REQUIRES: before the shared-memory ranks' completions are posted.
  void ReleaseResults(const StepState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  friend class RankStep;
  friend class ParamUpload;

  absl::Status AddGradient(const std::shared_ptr<StepState>& state, int rank, uint32_t matrix,
                           uint64_t offset, std::string_view data, uint32_t crc32c);
  // The checks of a gradient chunk that need no lock (the layout is immutable): on OK *span is the
  // index of the rank's span that holds the chunk and *count its elements.
  absl::Status CheckChunk(const std::string& where, int rank, uint32_t matrix, uint64_t offset,
                          std::string_view data, uint32_t crc32c, size_t* span,
                          uint64_t* count) const;
  // Claims elements [offset, offset + count) of the rank's span `span` for a gRPC chunk and returns
  // where its bytes go; an error ends the step (refused).
  absl::StatusOr<char*> ClaimChunk(StepState& state, const std::string& where, int rank,
                                   size_t span, uint64_t offset, uint64_t count)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `count` more elements of `matrix` arrived: queues the matrix when it is complete, and a drain
  // of the pipeline unless one is queued.
  void MarkReceived(const std::shared_ptr<StepState>& state, uint32_t matrix, uint64_t count)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A shared-memory rank's last part is in: when every matrix is computed already and no other
  // rank owes its last part, queues the drain that commits the step.
  void CommitWhenComplete(const std::shared_ptr<StepState>& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<const RankUpdate>> FinishRank(
      const std::shared_ptr<StepState>& state, int rank, const std::function<bool()>& cancelled,
      double outside_sum_sq);
  // StepPipeline::Sink.
  void DeviceFailed(StepState& state, const absl::Status& status) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Commit(StepState& state) override;
  // Changes the store for a step whose matrices all succeeded, then FinishCommit.
  void CommitNow(StepState& state);
  // Two-phase: `state`'s commit may be rolled back (RollbackStep) until the store changes again.
  void NoteRollback(const StepState& state) ABSL_LOCKS_EXCLUDED(mu_);
  // Two-phase: hands the ranks their results and keeps the step prepared (job_prepare.cc).
  void Prepare(StepState& state);
  // NOT_FOUND (deleted) or FAILED_PRECONDITION (not a multi-node job) for a two-phase call.
  absl::Status CheckTwoPhase(const std::string& where) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Step `step` in flight and not committed: drops it (prepared) or fails it ABORTED ("<verb> by
  // the trainer: <reason>"), and OK. nullopt when it is not in flight, or committed meanwhile.
  std::optional<absl::Status> EndUncommitted(int64_t step, const std::string& verb,
                                             const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a prepared step in flight (not fenced), e.g. before a load or reset; `why` for the log.
  void DropPrepared(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The last prepared step dropped and why (a later CommitStep of it says so).
  int64_t dropped_step_ ABSL_GUARDED_BY(mu_) = -1;
  std::string dropped_why_ ABSL_GUARDED_BY(mu_);
  // The step RollbackStep may still undo (-1: none): set by a two-phase commit, cleared by
  // anything that writes the store or saves it afterwards (atomic: some of those hold only the
  // store's lock). With the presence mask of that step, for the step counts.
  std::atomic<int64_t> rollback_step_{-1};
  std::vector<uint8_t> rollback_absent_ ABSL_GUARDED_BY(mu_);
  int64_t rolled_back_step_ ABSL_GUARDED_BY(mu_) = -1;
  // The rest of a commit once the store changed (`changed` OK) or failed to (the job is fenced).
  void FinishCommit(StepState& state, const absl::Status& changed);
  // Ends the step with `status` (refused: not fenced; aborted: fenced).
  // Nothing changes when the step already ended or its commit began.
  void FailStep(StepState& state, const absl::Status& status, bool fence)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the step for every rank with `result` (shared-memory ranks' completions carry `flags`)
  // and clears in_flight_ if it is this step; returns what keeps `state` alive until the caller
  // is done with it.
  std::shared_ptr<StepState> EndStep(StepState& state, const absl::Status& result, uint32_t flags)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "nonfinite": "skip": `status` (a non-finite gradient) skips step `step` instead of refusing
  // it: true when it did. The step in flight (`state`, or none yet) ends for every rank with a
  // skipped update, the ranks not in it yet (and any retry of the step) get the same answer,
  // nothing in the state store changes and the step number advances.
  bool SkipStep(StepState* state, int64_t step, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A shared-memory rank's submission for `step` was refused (`bad`) before it entered the step:
  // the refusal is recorded so the ranks that have not learned of it do.
  void RefuseSubmission(int rank, uint64_t session, int64_t step, const absl::Status& bad)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Aborts the step for every rank (job fenced) because `rank` left it; when the commit had
  // already begun it waits for it and says so instead (see RankStep::Abandon).
  absl::Status AbandonRank(const std::shared_ptr<StepState>& state, int rank,
                           const std::string& why);
  // Aborts the step in flight if `rank` still owes its part (not begun, or begun and not
  // finished pushing). REQUIRES: a step in flight.
  void AbortIfOwed(int rank, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<StepState> NewStepState(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // INVALID_ARGUMENT for a rank outside the world size.
  absl::Status CheckRank(int rank) const;
  // FAILED_PRECONDITION unless `session` is `rank`'s current session.
  absl::Status CheckCurrentSession(int rank, uint64_t session, const char* hint) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The checks every rank's entry into `step` shares (gRPC and shared memory): job deleted,
  // session, fence, replay, order, owed refusal, the rank already in the step. On OK either
  // *replay is the committed update to hand back, or the rank is marked begun in in_flight_.
  absl::Status EnterStep(int rank, uint64_t session, int64_t step, const StepHyper* hyper,
                         std::shared_ptr<const RankUpdate>* replay)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The answer to a later part of a try of `step` that ended before the part arrived.
  absl::Status CutShortPart(int rank, uint64_t session, int64_t step,
                            const std::string& where) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The input of `rank` in the step in flight when that step is `step` and the rank sends it
  // through shared-memory `session` and the regions `keepalive`; else null.
  RankInput* SharedRankInFlight(int rank, uint64_t session, int64_t step, const void* keepalive)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A shared-memory rank's first part of `step`: EnterStep, then the rank's input and outputs
  // (all spans) in the step. *replayed when the step is committed already: the committed bytes
  // are in `out` and, for a last part, `done` ran.
  absl::Status OpenSharedStep(int rank, uint64_t session, int64_t step, bool last,
                              const std::vector<const char*>& in, const std::vector<char*>& out,
                              std::shared_ptr<const void> keepalive, SharedDone& done,
                              const StepHyper* hyper, SharedProgress progress, bool* replayed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Apply mode's part of EnterStep before the step exists: weights complete, hyper valid.
  absl::Status CheckApplyEntry(int64_t step, const StepHyper* hyper) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Apply mode, `rank` entering the step in flight: takes or compares its hyper. A rank that
  // disagrees refuses the step.
  absl::Status AgreeHyper(StepState& state, int rank, const StepHyper& hyper)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Apply mode: the ranks whose part of the initial weights is not in, in order.
  std::vector<int> RanksMissingWeights() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Apply mode: installs `rank`'s checked initial parameters into the masters.
  void InstallParams(ParamStore::Lock& store, int rank, const std::vector<const char*>& in,
                     bool float32);
  // Apply mode's save.
  absl::StatusOr<checkpoint::GenerationInfo> SaveApplyCheckpoint(
      const CheckpointWriter::Exclusive& exclusive);

  // Gives a gRPC rank its input buffers (reused from the last step) and update storage.
  void PrepareOwnedRank(StepState& state, int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION naming `what` while a step is in flight.
  absl::Status CheckNoStepInFlight(const char* what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION unless the job can be saved now (not deleted, not a probe, not fenced).
  absl::Status CheckSavable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live state for ExportState, copied whole at a step boundary (the snapshot a save takes):
  // its layout into *state, each array into *arrays. Errors as ExportState's.
  absl::Status CopyLiveState(const CheckpointWriter::Exclusive& held, ExportedState* state,
                             std::vector<std::vector<float>>* arrays);

  // Checks a loaded generation against the job's matrices (names and shapes): on OK index[m] is
  // matrix m's place in `loaded`.
  absl::Status MatchLoaded(const checkpoint::Loaded& loaded, const std::string& source,
                           std::vector<int>* index) const;
  // Installs a verified generation of job `from` (this job or another) and sets the next step;
  // FAILED_PRECONDITION while a step is in flight.
  absl::StatusOr<LoadResult> InstallLoaded(const checkpoint::Loaded& loaded, const Job& from);

  const common::JobSpec spec_;
  const std::string token_sha256_;
  const std::string backend_;
  ComputeExecutor* const executor_;
  const absl::Duration step_timeout_;
  const absl::Duration prepare_timeout_;
  const JobOwner owner_;
  const int64_t created_unix_ms_;
  const JobLayout layout_;
  MomentumStore momentum_;
  std::unique_ptr<ParamStore> params_;  // apply mode only
  CheckpointWriter writer_;

  mutable absl::Mutex mu_;
  StepPipeline pipeline_;
  TrainerClock trainer_clock_;
  std::vector<uint64_t> sessions_ ABSL_GUARDED_BY(mu_);  // per rank; 0 = not attached
  // Per rank: why its session ended without a detach ("" while fine); cleared when it attaches.
  std::vector<std::string> lost_ ABSL_GUARDED_BY(mu_);
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t next_step_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_completed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_refused_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_skipped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_aborted_ ABSL_GUARDED_BY(mu_) = 0;
  double last_step_device_seconds_ ABSL_GUARDED_BY(mu_) = 0;  // simulated clock, last commit
  bool fenced_ ABSL_GUARDED_BY(mu_) = false;
  bool deleted_ ABSL_GUARDED_BY(mu_) = false;
  std::string fence_reason_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<StepState> in_flight_ ABSL_GUARDED_BY(mu_);
  // The last committed step's update per rank (for replays).
  std::vector<std::shared_ptr<const RankUpdate>> last_updates_ ABSL_GUARDED_BY(mu_);
  // Input buffers of the last finished step, reused by the next one (per rank, per span).
  std::vector<std::vector<std::string>> input_pool_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> transport_copy_bytes_{0};
  StepRefusal refusal_ ABSL_GUARDED_BY(mu_);
  // Per rank: the try it was sending in parts when that try ended without it (another rank's
  // refusal, an abort). Its later parts of that try are answered with why it ended.
  struct CutShort {
    int64_t step = -1;
    uint64_t session = 0;
    absl::Status why;
  };
  std::vector<CutShort> cut_short_ ABSL_GUARDED_BY(mu_);
  // Apply mode: per rank, its part of the initial weights is in; an upload in progress.
  std::vector<bool> weights_in_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> uploading_ ABSL_GUARDED_BY(mu_);
  int64_t clip_redo_steps_ ABSL_GUARDED_BY(mu_) = 0;
  double last_grad_norm_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t qk_heads_clipped_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<double> last_qk_max_logit_ ABSL_GUARDED_BY(mu_);
  DeletionHooks deletion_hooks_;  // its own lock; fired by MarkDeleted without mu_
};

// Test hook (the chaos run's kill in the middle of a commit; muond arms it from
// $MUOND_TEST_COMMIT_HOLD_MS in a build with MUOND_TEST_HOOKS): every commit, once the state store
// has flipped and before the step is finished and its results released, logs that it holds and
// sleeps `ms` milliseconds with the store's lock held. 0 (the default) disarms it.
void SetCommitHoldForTesting(int ms);

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_JOB_H_
