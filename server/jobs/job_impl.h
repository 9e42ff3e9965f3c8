// The implementation of a job (server/jobs/job.h is its face; this header is private to the jobs
// room, server/LAYERS). JobImpl composes named parts: its JobLayout (which rank owns which spans),
// its MomentumStore (the fp32 momentum, pinned), in apply mode its ParamStore, its StepPipeline
// (whole matrices assembled and updated on the device) and its CheckpointWriter (snapshots to
// disk). Itself it keeps the sessions of the ranks, the step counter, the step in flight and the
// rules of entry, refusal, abort, fence and commit, over these files:
//   job.cc             construction, identity, report, deletion, fence, timeouts
//   job_step.cc        gRPC ranks' steps (RankStep), entry, chunks, completion
//   job_shared.cc      shared-memory ranks' submissions and parts
//   job_commit.cc      the pipeline's sink: commit, failure, skip, the end of a step
//   job_prepare.cc     two-phase steps (prepare, commit, abort, rollback)
//   job_apply.cc       apply mode's initial weights and export
//   job_checkpoint.cc  saves and loads; job_export_state.cc, job_import_state.cc the full state
//   job_init_from.cc   init_from safetensors
//
// Atomicity (DESIGN.md 4, "stage each matrix's new momentum and commit all of them when the step
// is known to be clean"): the device writes each matrix's new momentum, the one its update was
// computed from, into the momentum store's back buffers; the commit, when every matrix succeeded,
// flips the store. A refused or aborted step therefore leaves every momentum bit-identical, and
// the gradients are read once (a shared-memory peer that rewrites its region early changes nothing
// committed). Memory cost: the momentum twice (momentum_store.h), plus the gather budget.
//
// Apply mode (DESIGN.md 4b): the job also holds a ParamStore (fp32 masters, Muon momentum, AdamW
// moments and step counts, double-buffered: the step computes the next state into the back and
// the commit flips it, see param_store.h), takes each step's per-group lr / weight decay and
// gradient divisor (StepHyper), returns new parameters in each tensor's param dtype, and refuses
// steps until every rank's initial weights are in (InitParams, or init_from at creation).
//
// What it may call: common/, the engine, server/storage (through CheckpointWriter),
// server/record (metrics, history, progress, limits).
#ifndef MUOND_SERVER_JOBS_JOB_IMPL_H_
#define MUOND_SERVER_JOBS_JOB_IMPL_H_

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
#include "server/engine/step_io.h"
#include "server/engine/step_pipeline.h"
#include "server/engine/step_state.h"
#include "server/jobs/checkpoint_writer.h"
#include "server/jobs/deletion_hooks.h"
#include "server/jobs/job.h"
#include "server/jobs/job_report.h"
#include "server/jobs/trainer_clock.h"
#include "server/record/daemon_limits.h"
#include "server/storage/checkpoint.h"

namespace muond::server {

// What a job is made with besides its spec, token and owner (JobImpl's constructor).
struct JobParts {
  ComputeExecutor* executor = nullptr;  // must outlive the job
  // Bytes of whole matrices (fp32 gradient and temporary momentum) assembled at once; a larger
  // matrix is processed alone.
  uint64_t gather_budget_bytes = 0;
  // The most a batch assembles (StepPipeline::kBatchTargetBytes; tests shrink it).
  uint64_t batch_target_bytes = StepPipeline::kBatchTargetBytes;
  // The daemon's step window for a spec that sets none (--step-window-bytes).
  uint64_t step_window_bytes = kDefaultStepWindowBytes;
  DeviceStreams* devices = nullptr;  // must outlive the job
  std::string backend;               // the daemon's device backend name, for the report
  std::string checkpoint_dir;        // the job's checkpoint directory (storage/checkpoint.h)
  absl::Duration step_timeout;       // common::JobSpec::step_timeout_seconds, default applied
  // How long a prepared two-phase step waits for CommitStep or AbortStep before CheckStepTimeout
  // drops it (--prepare-timeout-seconds).
  absl::Duration prepare_timeout = absl::Seconds(300);
};

class JobImpl final : public Job,
                      public std::enable_shared_from_this<JobImpl>,
                      private StepPipeline::Sink {
 public:
  JobImpl(common::JobSpec spec, std::string token_sha256, JobOwner owner, JobParts parts);
  ~JobImpl() override;

  // Job (documented there).
  const common::JobSpec& spec() const override { return spec_; }
  const JobOwner& owner() const override { return owner_; }
  bool TokenMatches(std::string_view token) const override;
  const std::string& token_sha256() const override { return token_sha256_; }
  uint64_t gather_budget_bytes() const override { return pipeline_.gather_budget_bytes(); }
  uint64_t MomentumBytes() const override {
    return params_ != nullptr ? params_->bytes() : momentum_.bytes();
  }
  absl::StatusOr<checkpoint::GenerationInfo> SaveCheckpoint() override;
  void WaitForSaves() override;
  absl::StatusOr<LoadResult> LoadCheckpoint(const checkpoint::Selector& selector) override;
  absl::StatusOr<LoadResult> LoadCheckpointFrom(const std::shared_ptr<Job>& source,
                                                const checkpoint::Selector& selector) override;
  absl::StatusOr<std::vector<checkpoint::GenerationInfo>> ListCheckpoints() const override;
  const std::string& checkpoint_dir() const override { return writer_.dir(); }
  int64_t last_checkpoint_step() const override { return writer_.last_step(); }
  absl::StatusOr<uint64_t> Attach(int rank, bool takeover) override;
  absl::Status Detach(int rank, uint64_t session) override;
  absl::Status CheckSession(int rank, uint64_t session) const override;
  void EndLostSession(int rank, uint64_t session, const std::string& why) override;
  absl::StatusOr<std::unique_ptr<RankStep>> BeginStep(int rank, uint64_t session, int64_t step,
                                                      const StepHyper* hyper = nullptr) override;
  absl::Status SubmitShared(int rank, uint64_t session, int64_t step,
                            const std::vector<const char*>& in, const std::vector<char*>& out,
                            std::shared_ptr<const void> keepalive, SharedDone done,
                            const StepHyper* hyper = nullptr, SharedProgress progress = {},
                            double outside_sum_sq = 0) override;
  absl::Status SubmitSharedPart(int rank, uint64_t session, int64_t step, const SharedPart& part,
                                const std::vector<const char*>& in, const std::vector<char*>& out,
                                std::shared_ptr<const void> keepalive, SharedDone done,
                                const StepHyper* hyper = nullptr,
                                SharedProgress progress = {}) override;
  absl::Status RefuseSharedPart(int rank, uint64_t session, int64_t step, const void* keepalive,
                                const absl::Status& why) override;
  void EndSharedSession(int rank, uint64_t session, const void* keepalive,
                        bool clean = false) override;
  void CountTransportCopy(uint64_t bytes) override { transport_copy_bytes_.fetch_add(bytes); }
  void UpdateSent(int64_t step) override { trainer_clock_.Sent(step); }
  bool StepInFlight(int64_t step) const override;
  absl::StatusOr<uint64_t> InitParams(int rank, uint64_t session,
                                      const std::vector<const char*>& in, bool float32) override;
  absl::StatusOr<std::unique_ptr<ParamUpload>> BeginParamUpload(int rank, uint64_t session,
                                                                bool float32) override;
  absl::Status InitFromFile(int64_t peer_uid) override;
  bool WeightsComplete() const override;
  absl::Status ExportParams(
      const std::function<absl::Status(uint32_t tensor, const std::vector<float>& w)>& sink,
      int64_t* step) override;
  absl::Status Reset(int64_t next_step) override;
  absl::Status ResetDurably(int64_t next_step,
                            const std::function<absl::Status(int64_t)>& persist) override;
  absl::Status ExportState(
      const std::optional<checkpoint::Selector>& generation, bool float32,
      const std::function<absl::Status(const ExportedState&)>& header,
      const std::function<absl::Status(size_t array, const std::vector<float>& data)>& sink)
      override;
  absl::Status ImportState(const std::string& dir, int64_t peer_uid) override;
  absl::Status CommitStep(int64_t step) override;
  absl::Status AbortStep(int64_t step, const std::string& reason) override;
  absl::Status RollbackStep(int64_t step, const std::string& reason) override;
  void CheckStepTimeout(absl::Time now) override;
  void MarkDeleted() override;
  DeletionHooks::Registration OnDelete(std::function<void()> end) override {
    return deletion_hooks_.Register(std::move(end));
  }
  JobReport Report() const override;

  // ---- Within the jobs room (and its tests).
  // Starts a save in the background unless one runs (the checkpoint_every_steps saves).
  void SaveCheckpointInBackground();
  // Fences the job (steps FAILED_PRECONDITION until a load or reset), e.g. when its checkpoints
  // could not be read at restart.
  void Fence(const std::string& reason);
  // The highest generation number in the job's checkpoint directory, good or not (0: none).
  int64_t NewestGeneration() const;
  absl::Duration step_timeout() const { return step_timeout_; }
  // The digest of a rank's gradients (RankUpdate::input_digest): CRC32Cs of the slices of each of
  // its spans, `span_in[k]` holding span k's bytes; over the CPUs for large inputs.
  std::vector<uint32_t> InputDigest(int rank, const std::vector<const char*>& span_in) const;
  // ALREADY_EXISTS naming the step, rank and first differing matrix element when `span_in` is not
  // what committed step `replay` was computed from (a replay must re-send the same gradients).
  absl::Status CheckReplayInput(int rank, const RankUpdate& replay,
                                const std::vector<const char*>& span_in) const;
  // A from_masters replay (apply mode) of `replay` for a gRPC rank: the committed update with its
  // bytes written from the masters. ABORTED when the job's state changed since (a load or reset:
  // `replay` is no longer the rank's last update), with nothing changed.
  absl::StatusOr<std::shared_ptr<const RankUpdate>> ReplayFromMasters(
      int rank, const std::shared_ptr<const RankUpdate>& replay) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The report's pipeline pressure, pinned memory, Newton-Schulz times, orthogonality and trainer
  // times (each source takes its own lock; not the job's).
  void ReportObservations(JobReport& r) const;
  // r.memory and r.footprint (job_report.h): the state stores, the pipeline's gather and pools
  // and the scratch share (without the lock), then the gRPC ranks' buffers and the replay copies
  // (under it).
  void ReportMemory(JobReport& r) const ABSL_LOCKS_EXCLUDED(mu_);
  void ReportHeldBuffers(JobMemory& m) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // The rest of a commit once the store changed (`changed` OK) or failed to (the job is fenced).
  void FinishCommit(StepState& state, const absl::Status& changed);
  // Ends the step with `status` (refused: not fenced; aborted: fenced).
  // Nothing changes when the step already ended or its commit began. A step that planned state
  // in place (StepState::in_place) cannot be refused: it is fenced (FenceInPlace).
  void FailStep(StepState& state, const absl::Status& status, bool fence)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FenceInPlace(StepState& state, const absl::Status& status)
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
  // The pieces of SubmitSharedPart. The values of a part, checked in place before the step knows
  // them (finite; the last part's outside share): the refusal, or OK.
  absl::Status CheckPartValues(const std::string& where, int rank, const SharedPart& part,
                               const std::vector<const char*>& in) const;
  // A part whose values were refused (`bad`): the step is refused (or was skipped).
  absl::Status RefuseBadPart(int rank, uint64_t session, int64_t step, const SharedPart& part,
                             bool continuing, const absl::Status& bad, SharedDone& done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A part after the rank's last part of the step in flight.
  absl::Status RefuseLatePart(const std::string& where) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The part's spans are the rank's in the step (a span in two parts refuses the step).
  absl::Status TakePartSpans(const std::shared_ptr<StepState>& state, int rank,
                             const SharedPart& part, const std::string& where)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rank's last part: every span must be in; the rank has pushed its part of the step.
  absl::Status FinishSharedParts(const std::shared_ptr<StepState>& state, int rank,
                                 const SharedPart& part, const std::string& where,
                                 SharedDone done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // Apply mode: rank `rank`'s last committed update as a from_masters marker (step_io.h), so its
  // bytes (a gRPC rank's storage, or a shared region about to go) are not kept for replays.
  void KeepReplayAsMasters(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes a from_masters replay's spans into `out` (one destination per span) from the
  // committed masters. REQUIRES: `replay` is the rank's last update (nothing changed the masters
  // since its step committed: the rank has not begun a later step, which could not seal without
  // it, and a load or reset would have dropped it).
  void WriteReplayFromMasters(const RankUpdate& replay, const std::vector<char*>& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION unless the job can be saved now (not deleted, not a probe, not fenced).
  absl::Status CheckSavable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live state for ExportState, copied whole at a step boundary (the snapshot a save takes):
  // its layout into *state, each array into *arrays as held (`float32`: decoded). Errors as
  // ExportState's.
  absl::Status CopyLiveState(const CheckpointWriter::Exclusive& held, bool float32,
                             ExportedState* state, std::vector<std::vector<float>>* arrays);

  // Checks a loaded generation against the job's matrices (names and shapes): on OK index[m] is
  // matrix m's place in `loaded`.
  absl::Status MatchLoaded(const checkpoint::Loaded& loaded, const std::string& source,
                           std::vector<int>* index) const;
  // Installs a verified generation of job `from` (this job or another) and sets the next step;
  // FAILED_PRECONDITION while a step is in flight.
  absl::StatusOr<LoadResult> InstallLoaded(const checkpoint::Loaded& loaded, const JobImpl& from);


  // ---- Constant after construction.
  const common::JobSpec spec_;
  const std::string token_sha256_;
  const std::string backend_;
  ComputeExecutor* const executor_;
  const absl::Duration step_timeout_;
  const absl::Duration prepare_timeout_;
  const JobOwner owner_;
  const int64_t created_unix_ms_;
  const JobLayout layout_;
  // What admission reserved, by kind (a function of the spec and the gather budget in effect).
  const JobMemory footprint_;

  // ---- Parts with their own locks (each header says what guards what). The stores change only
  // under the pipeline's steps and the commit; the pipeline runs on the executor's thread.
  MomentumStore momentum_;
  std::unique_ptr<ParamStore> params_;  // apply mode only
  CheckpointWriter writer_;
  // The job's lock: guards the fields of the next group and the StepState in flight (which the
  // pipeline reads and writes under it: it is handed to the pipeline here).
  mutable absl::Mutex mu_;
  StepPipeline pipeline_;
  TrainerClock trainer_clock_;
  DeletionHooks deletion_hooks_;  // fired by MarkDeleted without mu_

  // ---- Atomics (read without the lock).
  std::atomic<uint64_t> transport_copy_bytes_{0};
  // The step RollbackStep may still undo (-1: none): set by a two-phase commit, cleared by
  // anything that writes the store or saves it afterwards (atomic: some of those hold only the
  // store's lock). rollback_absent_ below is that step's presence mask, for the step counts.
  std::atomic<int64_t> rollback_step_{-1};

  // ---- Under mu_.
  // Sessions: per rank, its session (0 = not attached) and why it ended without a detach ("" while
  // fine; cleared when it attaches again).
  std::vector<uint64_t> sessions_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> lost_ ABSL_GUARDED_BY(mu_);
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
  // The step counter and the step in flight.
  int64_t next_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<StepState> in_flight_ ABSL_GUARDED_BY(mu_);
  bool fenced_ ABSL_GUARDED_BY(mu_) = false;
  bool deleted_ ABSL_GUARDED_BY(mu_) = false;
  std::string fence_reason_ ABSL_GUARDED_BY(mu_);
  // The last committed step's update per rank (for replays).
  std::vector<std::shared_ptr<const RankUpdate>> last_updates_ ABSL_GUARDED_BY(mu_);
  // Input buffers of the last finished step, reused by the next one (per rank, per span).
  std::vector<std::vector<std::string>> input_pool_ ABSL_GUARDED_BY(mu_);
  StepRefusal refusal_ ABSL_GUARDED_BY(mu_);
  // Per rank: the try it was sending in parts when that try ended without it (another rank's
  // refusal, an abort). Its later parts of that try are answered with why it ended.
  struct CutShort {
    int64_t step = -1;
    uint64_t session = 0;
    absl::Status why;
  };
  std::vector<CutShort> cut_short_ ABSL_GUARDED_BY(mu_);
  // Two-phase: the last prepared step dropped and why (a later CommitStep of it says so); the
  // last step rolled back.
  int64_t dropped_step_ ABSL_GUARDED_BY(mu_) = -1;
  std::string dropped_why_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t> rollback_absent_ ABSL_GUARDED_BY(mu_);
  int64_t rolled_back_step_ ABSL_GUARDED_BY(mu_) = -1;
  // Apply mode: per rank, its part of the initial weights is in; an upload in progress.
  std::vector<bool> weights_in_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> uploading_ ABSL_GUARDED_BY(mu_);
  // Counts and last values for the report.
  int64_t steps_completed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_refused_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_skipped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_aborted_ ABSL_GUARDED_BY(mu_) = 0;
  double last_step_device_seconds_ ABSL_GUARDED_BY(mu_) = 0;  // simulated clock, last commit
  int64_t clip_redo_steps_ ABSL_GUARDED_BY(mu_) = 0;
  double last_grad_norm_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t qk_heads_clipped_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<double> last_qk_max_logit_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_JOB_IMPL_H_
