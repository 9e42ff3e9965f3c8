// The muond client library (C++). One Client per daemon connection; RankSession for one rank of a
// job. The C ABI in muond_client.h wraps these for other languages.
//
// Thread-safety: Client is thread-safe. A RankSession runs one step at a time (calls on one session
// must not overlap); different sessions may step concurrently.
#ifndef MUOND_CLIENT_CLIENT_H_
#define MUOND_CLIENT_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "muond/v1/muond.grpc.pb.h"

namespace muond::client {
class ShmChannel;
class SessionWatch;
}  // namespace muond::client

namespace muond::client {

// A run of consecutive elements of one matrix in the caller's memory (the matrix's dtype; for
// RankSession::InitParams float32 or the tensor's param_dtype).
struct GradientSpan {
  uint32_t matrix = 0;
  uint64_t offset = 0;  // first element in the matrix
  const void* data = nullptr;
  uint64_t length = 0;  // elements
};
struct UpdateSpan {
  uint32_t matrix = 0;
  uint64_t offset = 0;
  // Receives `length` elements of the matrix's dtype; in apply mode of its param_dtype (the new
  // parameters).
  void* data = nullptr;
  uint64_t length = 0;
};

// Apply mode (DESIGN.md 4b): the hyperparameters a step carries. `lr` names every parameter group
// of the job once; `weight_decay` any of them (the others keep the group's weight_decay from the
// job spec); `grad_divisor` divides every gradient (the loss scale of fp16 training).
struct StepHyper {
  std::vector<std::pair<std::string, double>> lr;
  std::vector<std::pair<std::string, double>> weight_decay;
  double grad_divisor = 1;
};
// A StepHyper resolved against a job: one value per group of spec.groups, in that order.
struct GroupHyperValues {
  std::vector<double> lr;
  std::vector<double> weight_decay;
  double grad_divisor = 1;
};
// Checks `hyper` against `spec` and fills the weight decays not given from the spec's groups.
// FAILED_PRECONDITION for an update-mode job; INVALID_ARGUMENT naming the group for a group
// without an lr, an unknown or repeated group, a value that is not finite, lr < 0 or weight
// decay < 0; INVALID_ARGUMENT for a divisor that is not finite and > 0.
absl::StatusOr<GroupHyperValues> ResolveStepHyper(const common::JobSpec& spec,
                                                  const StepHyper& hyper);

// How a rank's gradients and updates travel. kAuto: shared memory when the daemon is on this host
// (a unix:// address whose shared-memory socket is reachable), else gRPC.
enum class Transport { kAuto, kShm, kGrpc };
// "auto", "shm", "grpc"; INVALID_ARGUMENT otherwise.
absl::StatusOr<Transport> ParseTransport(const std::string& name);

struct StepResult {
  int64_t step = 0;
  bool replayed = false;
  // The step was skipped (a non-finite gradient on some rank, job option "nonfinite": "skip"):
  // the daemon changed nothing and returned no update (the caller's update buffers, or the
  // shared update region, were not written); the job's next step is step + 1.
  bool skipped = false;
  double compute_seconds = 0;
  // Apply mode: the raw sum of squares of the step's gradients on the daemon (before the
  // divisor): a node's share of the global norm.
  double grad_sum_sq = 0;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
};

// A tensor with a name, for whole-matrix steps (world size 1, zero_stage 0).
struct NamedTensor {
  std::string name;
  common::DType dtype = common::DType::kFloat32;
  std::vector<int64_t> shape;
  std::string data;  // raw little-endian elements
};

// Receives a job's full state as the daemon's ExportState sends it (client_export_state.cc):
// `header` once (the job spec and the header, checked against each other before it is called),
// then `data` for each chunk of array `array` (header order) as its dtype holds it
// (StateArray.dtype; common/state_export.h), at its byte offset in the array, in order, each
// chunk's CRC32C checked. An error of either ends the export with that error.
struct ExportStateSink {
  std::function<absl::Status(const common::JobSpec& spec, const v1::ExportStateHeader& header)>
      header;
  std::function<absl::Status(uint32_t array, uint64_t byte_offset, std::string_view data)> data;
};

// Where ExportStateToDir wrote a job's state, and what.
struct StateExportFiles {
  std::string payload;   // DIR/<job>.safetensors
  std::string manifest;  // DIR/<job>.manifest.json
  int64_t step = 0;
  int64_t generation = 0;  // 0: the live state
  uint64_t bytes = 0;      // payload bytes
  size_t tensors = 0;
};

class RankSession {
 public:
  // Detaches the rank (best effort: a daemon that is gone cannot be told).
  ~RankSession();
  // kShm or kGrpc: the transport this session uses.
  Transport transport() const;
  RankSession(const RankSession&) = delete;
  RankSession& operator=(const RankSession&) = delete;
  // Ends the session now. FAILED_PRECONDITION when it was taken over meanwhile.
  absl::Status Detach();

  const common::JobSpec& spec() const { return spec_; }
  int rank() const { return rank_; }
  uint64_t session_id() const { return session_id_; }
  // The step the job expected when the rank attached.
  int64_t next_step_at_attach() const { return next_step_; }
  // This rank's spans (common::RankSpans of the job's layout).
  const std::vector<common::ShardSpan>& spans() const { return spans_; }
  // The job is in apply mode (DESIGN.md 4b): the daemon holds the master weights, a step needs
  // SetHyper first and returns the rank's new parameters in each tensor's param_dtype.
  bool apply() const { return spec_.mode == common::JobMode::kApply; }

  // Pushes this rank's gradients for `step` and writes the update into `updates`, which must cover
  // exactly the same elements as `grads` (the rank's spans). Blocks until the update arrived.
  // Apply mode: the "update" is the rank's new parameters in each tensor's param_dtype, and the
  // step carries the hyperparameters of SetHyper (FAILED_PRECONDITION without them).
  // Errors carry the daemon's code and message (e.g. INVALID_ARGUMENT for a non-finite gradient,
  // FAILED_PRECONDITION for a step out of order, ABORTED when another rank failed).
  absl::StatusOr<StepResult> Step(int64_t step, const std::vector<GradientSpan>& grads,
                                  const std::vector<UpdateSpan>& updates);

  // Flat-buffer step: `grads` is the rank's buffer in the job's layout (RankBufferElements
  // elements: the stage 1/2 partition, the stage 3 chunks back to back, or the explicit layout's
  // spans back to back), `updates` receives the update in the same form, padding zeroed.
  // REQUIRES every matrix to share one dtype (FAILED_PRECONDITION otherwise). Apply mode: `grads`
  // in the one gradient dtype, `updates` receives the new parameters in the one param_dtype
  // (every tensor must share that one too).
  absl::StatusOr<StepResult> StepBuffer(int64_t step, const void* grads, void* updates);
  // Elements of the rank's flat buffer (common::RankBufferElements).
  uint64_t buffer_elements() const;

  // Zero-copy steps (shared-memory sessions only; FAILED_PRECONDITION otherwise): write step t's
  // gradients, in the rank's flat-buffer layout, into GradientView(t), call StepInPlace(t), read
  // the update from UpdateView(t). Views stay valid for the session's life; step t uses t % B, B
  // the job's step_buffers (with 1, step t+1's gradients overwrite step t's; take step t's update
  // first). Apply mode: StepInPlace also writes the SetHyper values at hyper_byte_offset() of the
  // gradient view (leave those HyperBytes(G) bytes to it), and UpdateView(t) holds the new
  // parameters, span i at ParamByteOffset(i) in its param_dtype.
  struct View {
    char* data = nullptr;
    size_t size = 0;
  };
  absl::StatusOr<View> GradientView(int64_t step);
  absl::StatusOr<View> UpdateView(int64_t step);
  absl::StatusOr<StepResult> StepInPlace(int64_t step);

  // A zero-copy step in parts (shared memory only; FAILED_PRECONDITION over gRPC, whose step
  // stream carries chunks as they come instead): PostPart sends [byte_offset, byte_offset + bytes)
  // of GradientView(t), whole spans, as soon as they are written; `last` marks the rank's last
  // part (it may be empty). Apply mode: the first part carries the SetHyper values. WaitParts
  // returns the step's outcome as StepInPlace does; PartsProgress waits at most `timeout_seconds`
  // (< 0: until news) for news and says which spans' results are in UpdateView(t) (`ready`, one
  // per span) and whether the step ended; a refusal of any part is returned at once.
  absl::Status PostPart(int64_t step, uint64_t byte_offset, uint64_t bytes, bool last);
  absl::StatusOr<StepResult> WaitParts(int64_t step);
  absl::Status PartsProgress(int64_t step, double timeout_seconds, std::vector<bool>* ready,
                             bool* ended);

  // Whole-matrix step: `grads` holds one tensor per matrix of the job, named and shaped as the job
  // says; returns the updates with the same names, shapes and dtypes. INVALID_ARGUMENT naming the
  // tensor for a missing, extra, mis-shaped or mis-typed tensor. REQUIRES: rank owns whole
  // matrices. Apply mode: returns the new parameters, each in its tensor's param_dtype.
  absl::StatusOr<std::vector<NamedTensor>> StepTensors(int64_t step,
                                                       const std::vector<NamedTensor>& grads,
                                                       StepResult* result = nullptr);

  // ---- Apply mode (DESIGN.md 4b). FAILED_PRECONDITION on an update-mode job.

  // The hyperparameters every later step of this session carries (ResolveStepHyper's checks and
  // errors). Over gRPC in StepBegin; over shared memory written into the step's gradient buffer.
  absl::Status SetHyper(const StepHyper& hyper);
  // The presence mask every later step of this session carries: the job tensors (indices into
  // spec.matrices) that have no gradient on any rank (each is skipped: state, step count and
  // parameters unchanged); empty: every tensor has one. Their gradient spans are still sent
  // (their bytes are not used; send zeros). INVALID_ARGUMENT for an index out of range or given
  // twice. Every rank of a step must send the same mask (else the step is refused).
  absl::Status SetAbsent(const std::vector<uint32_t>& tensors);
  // Apply mode, a node of a multi-node job with max_grad_norm: the global clip every later step of
  // this session carries (the gradient norm spans the nodes; DESIGN.md 4c): mode 0 none (what
  // such a job refuses), 1 compute with clip 1 and report the node's raw sum of squares
  // (StepResult::grad_sum_sq), 2 clip by `sum_sq`, the raw sum of squares over every node.
  // INVALID_ARGUMENT for another mode, or a sum that is not finite and >= 0 with mode 2.
  absl::Status SetGlobalClip(int mode, double sum_sq);
  // Apply mode, a job with qk_clip (DESIGN.md 4e): the largest pre-softmax attention logit of each
  // query head that this rank saw in the step's forward, pair after pair in the job's order
  // (q_heads values each), which every later step of this session carries until set again (set
  // it before each step; the daemon takes the maximum over the ranks). INVALID_ARGUMENT naming
  // the pair for a wrong count or a value that is not finite; FAILED_PRECONDITION on a job
  // without qk_clip. A step of a qk_clip job before any is set is refused here.
  absl::Status SetMaxLogits(std::vector<float> logits);

  // Update mode, a job with max_grad_norm (FAILED_PRECONDITION otherwise): the sum of squares of
  // this rank's gradients outside the job (the tensors the trainer updates itself, e.g. its
  // in-process AdamW tensors; 0 when it has none), which every later step of this session carries
  // with its last part until set again; the daemon clips by the norm over the job's matrices and
  // every rank's share, and returns that whole raw sum of squares (StepResult::grad_sum_sq), by
  // which the caller clips its own tensors (ClipCoefficient). Ranks that hold the same tensors
  // (replicated AdamW) must count them once: one rank sends their sum, the others 0.
  // INVALID_ARGUMENT for a negative value. A NaN or infinity (a non-finite gradient among those
  // tensors) is sent: the daemon refuses the step for every rank, or skips it ("nonfinite":
  // "skip"), as for a non-finite gradient of its own.
  absl::Status SetOutsideSumSq(double sum_sq);

  // Uploads the rank's part of the initial parameters: `params` must cover the rank's spans
  // exactly, in float32 (`float32`) or each tensor's param_dtype. The daemon installs them only
  // when every span arrived whole and finite (INVALID_ARGUMENT naming the tensor otherwise) and
  // refuses them while a step is in flight. Over shared memory the parameters travel in the
  // param_dtype: float32 values are rounded to it here (round to nearest even), so a bf16/fp16
  // job's masters start from the rounded values; over gRPC float32 values reach the masters
  // as they are.
  absl::Status InitParams(const std::vector<GradientSpan>& params, bool float32);
  // The same from the rank's flat buffer (buffer_elements() elements, the layout of StepBuffer),
  // float32 or (float32 false) the one param_dtype of every tensor (FAILED_PRECONDITION when the
  // tensors mix param dtypes).
  absl::Status InitParamsBuffer(const void* flat, bool float32);
  // Whole tensors (world size 1, zero_stage 0), named and shaped as the job says, each float32 or
  // its param_dtype. INVALID_ARGUMENT naming the tensor for a missing, extra, mis-shaped or
  // mis-typed tensor.
  absl::Status InitParamsTensors(const std::vector<NamedTensor>& params);
  // Zero-copy initial parameters (shared-memory sessions only; FAILED_PRECONDITION otherwise):
  // write span i's parameters at ParamByteOffset(i) of InitParamsView() (gradient buffer 0) in
  // its param_dtype, then call InitParamsInPlace().
  absl::StatusOr<View> InitParamsView();
  absl::Status InitParamsInPlace();
  // Where span i of spans() keeps its parameters (param_dtype) in the update view and in the
  // initial-parameter view. Shared memory only (FAILED_PRECONDITION over gRPC); INVALID_ARGUMENT
  // for i >= spans().size().
  absl::StatusOr<uint64_t> ParamByteOffset(size_t span) const;
  // Where StepInPlace writes the hyperparameters in the gradient view (shared memory only).
  absl::StatusOr<uint64_t> HyperByteOffset() const;

 private:
  friend class Client;
  // A session of `rank` that the daemon numbered `session_id`; `next_step`: the step the job
  // expected then. The caller adds the transport (shm_, or attached_ and watch_).
  RankSession(std::shared_ptr<v1::Muond::Stub> stub, std::string token, common::JobSpec spec,
              int rank, uint64_t session_id, int64_t next_step);
  // Step() over each transport, after its checks of the spans' matrix indices.
  absl::StatusOr<StepResult> StepShared(int64_t step, const std::vector<GradientSpan>& grads,
                                        const std::vector<UpdateSpan>& updates);
  absl::StatusOr<StepResult> StepOverGrpc(int64_t step, const std::vector<GradientSpan>& grads,
                                          const std::vector<UpdateSpan>& updates);
  // Apply mode: OK with hyperparameters set (FAILED_PRECONDITION saying to set them otherwise);
  // OK in update mode.
  absl::Status CheckStepHyper(int64_t step) const;
  // Writes the hyperparameters into step t's shared-memory gradient buffer (apply mode).
  absl::Status WriteSharedHyper(int64_t step);
  // Update mode with max_grad_norm: writes SetOutsideSumSq's value into step t's shared-memory
  // gradient buffer (before the step's last part); OK and nothing otherwise.
  absl::Status WriteSharedOutsideSumSq(int64_t step);
  // InitParams over each transport, after the checks of the spans' matrix indices.
  absl::Status InitParamsShared(const std::vector<GradientSpan>& params, bool float32);
  absl::Status InitParamsOverGrpc(const std::vector<GradientSpan>& params, bool float32);
  // FAILED_PRECONDITION naming `what` on an update-mode job.
  absl::Status RequireApply(const char* what) const;
  std::shared_ptr<v1::Muond::Stub> stub_;
  std::string token_;
  common::JobSpec spec_;
  int rank_ = 0;
  uint64_t session_id_ = 0;
  int64_t next_step_ = 0;
  bool attached_ = false;
  std::vector<common::ShardSpan> spans_;
  // Apply mode: set by SetHyper, sent with every step.
  std::optional<GroupHyperValues> hyper_;
  std::vector<uint8_t> absent_;  // SetAbsent: per job tensor, 1 when absent (empty: none)
  double outside_sum_sq_ = 0;    // SetOutsideSumSq
  int global_clip_mode_ = 0;     // SetGlobalClip
  std::vector<float> max_logits_;  // SetMaxLogits (empty: none yet)
  double global_sum_sq_ = 0;
  std::unique_ptr<ShmChannel> shm_;
  int64_t parts_step_ = -1;  // the step whose parts are being posted (-1: none)
  // gRPC sessions: the WatchSession stream that tells the daemon this process is alive (when
  // the process dies, the daemon ends the session and aborts a step the rank owes).
  std::unique_ptr<SessionWatch> watch_;
};

// TLS to a daemon on TCP. TLS is chosen by the address alone: "tls://HOST:PORT" connects with
// TLS and verifies the daemon's certificate (against `ca_file`, else gRPC's default roots) for
// HOST; `cert_file` + `key_file` (both or neither) are presented for mutual TLS. "HOST:PORT" is
// plaintext (a loopback daemon, or one started with --insecure-tcp); "unix:///path" the local
// socket. Files are PEM.
struct TlsOptions {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
};
// $MUOND_TLS_CA, $MUOND_TLS_CERT, $MUOND_TLS_KEY (unset: empty).
TlsOptions TlsOptionsFromEnvironment();

class Client {
 public:
  // Connects lazily to `address` (unix:///path, HOST:PORT or tls://HOST:PORT; empty: the default
  // address) with TlsOptionsFromEnvironment() for tls:// addresses.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& address);
  // The same with explicit TLS settings. INVALID_ARGUMENT naming the file when a PEM file cannot
  // be read, for a certificate without its key (or the reverse), and for non-empty `tls` with an
  // address that is not tls://.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& address,
                                                         const TlsOptions& tls);
  const std::string& address() const { return address_; }

  // OK when the daemon reports SERVING; UNAVAILABLE when it cannot be reached or does not serve.
  absl::Status Health(double timeout_seconds = 5);
  // Creates a job; returns its token. With `restore`, the job's momentum and next step come from a
  // checkpoint generation of another job of the daemon (RestoreFrom.token: that job's token).
  absl::StatusOr<std::string> CreateJob(const common::JobSpec& spec,
                                        const v1::RestoreFrom* restore = nullptr);
  // Checkpoints (DESIGN.md 7). Save returns once the generation is durable. Load: generation > 0,
  // or the newest generation at `step` >= 0, or (0, -1) the newest good one.
  absl::StatusOr<v1::CheckpointInfo> SaveCheckpoint(const std::string& job_id,
                                                    const std::string& token);
  absl::StatusOr<v1::LoadCheckpointResponse> LoadCheckpoint(const std::string& job_id,
                                                            const std::string& token,
                                                            int64_t generation, int64_t step);
  absl::StatusOr<std::vector<v1::CheckpointInfo>> ListCheckpoints(const std::string& job_id,
                                                                  const std::string& token);
  // The job's running and recently finished long operations (checkpoint saves and loads, restores
  // from its checkpoints), oldest first. UNIMPLEMENTED from a daemon that predates GetProgress.
  absl::StatusOr<std::vector<v1::OperationProgress>> GetProgress(const std::string& job_id,
                                                                 const std::string& token);
  absl::Status DeleteJob(const std::string& job_id, const std::string& token);
  absl::Status ResetJob(const std::string& job_id, const std::string& token, int64_t next_step);
  // Multi-node jobs (DESIGN.md 4c, client_multinode.cc): commit or abort a prepared step.
  absl::Status CommitStep(const std::string& job_id, const std::string& token, int64_t step);
  // RollbackStep (see the proto); bounded by a deadline like the commit.
  absl::Status RollbackStep(const std::string& job_id, const std::string& token, int64_t step,
                            const std::string& reason);
  absl::Status AbortStep(const std::string& job_id, const std::string& token, int64_t step,
                         const std::string& reason);
  absl::StatusOr<v1::JobStatus> GetJob(const std::string& job_id, const std::string& token);
  absl::StatusOr<std::vector<v1::JobStatus>> ListJobs();
  // Apply mode: the job's master weights at a step boundary, every tensor whole (names and shapes
  // from the job spec, in job order) in `dtype` (float32, bfloat16 or float16; rounded to nearest
  // even). *step (may be null): the job's next step at the snapshot. FAILED_PRECONDITION on an
  // update-mode job or while the initial weights are incomplete (the daemon's answer); DATA_LOSS
  // for a chunk whose CRC32C does not match; INTERNAL for a stream that does not cover every
  // tensor exactly once.
  // `progress` (may be empty) is called with the bytes received so far and the total after each
  // chunk.
  absl::StatusOr<std::vector<NamedTensor>> ExportParams(
      const std::string& job_id, const std::string& token,
      common::DType dtype = common::DType::kFloat32, int64_t* step = nullptr,
      const std::function<void(uint64_t done, uint64_t total)>& progress = {});
  // The job's full optimizer state by tensor name (re-sharding, DESIGN.md 4c): live (generation 0,
  // step -1; a snapshot at a step boundary) or of checkpoint generation `generation` > 0 or the
  // newest generation at `step` >= 0, handed to `sink` as it arrives (nothing of it is held
  // here). Each array as the job holds it (compressed state stays compressed), or with `float32`
  // decoded to float32. The daemon's errors as they are; DATA_LOSS for a header that does not
  // match its job spec (or asked float32 and has other dtypes), a chunk out of order or whose
  // CRC32C does not match, or a stream that does not cover every array exactly once.
  absl::Status ExportState(const std::string& job_id, const std::string& token, int64_t generation,
                           int64_t step, const ExportStateSink& sink,
                           const std::function<void(uint64_t done, uint64_t total)>& progress = {},
                           bool float32 = false);
  // Creates a job that takes its state (and next step) from a full-state export directory
  // (absolute path, read by the daemon as this client could; common/state_export.h); returns its
  // token. The daemon's errors name the file and tensor.
  absl::StatusOr<std::string> CreateJobFromExport(const common::JobSpec& spec,
                                                  const std::string& import_dir);
  // ListJobs with the job directories the daemon set aside at start (broken). Jobs of other users
  // come with their details withheld (JobStatus.details_withheld) unless `token` is theirs.
  absl::StatusOr<v1::ListJobsResponse> ListJobsWithBroken(const std::string& token = "");
  // Attaches `rank` of the job (fetching the job's spec) and returns its session; the session
  // detaches when destroyed. ALREADY_EXISTS when the rank is attached elsewhere, unless `takeover`
  // (for a restarted trainer whose old process is gone: its step in flight is aborted).
  absl::StatusOr<std::unique_ptr<RankSession>> Attach(const std::string& job_id, int rank,
                                                      const std::string& token,
                                                      bool takeover = false,
                                                      Transport transport = Transport::kAuto);

 private:
  Client() = default;
  // Attach() over gRPC: AttachRank, then a WatchSession stream for the session's life.
  absl::StatusOr<std::unique_ptr<RankSession>> AttachOverGrpc(const std::string& job_id, int rank,
                                                              const std::string& token,
                                                              bool takeover);
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::Muond::Stub> stub_;
};

// ExportParams written to `path` as a safetensors model file (every tensor under its name, in
// full shape; metadata "format": "pt", "job", "step"), through a temporary file in the same
// directory, fsync and rename. Returns the step of the snapshot.
absl::StatusOr<int64_t> ExportParamsToFile(
    Client& client, const std::string& job_id, const std::string& token, common::DType dtype,
    const std::string& path,
    const std::function<void(uint64_t done, uint64_t total)>& progress = {});

// ExportState written into directory `dir` (created when missing) as <job>.safetensors and
// <job>.manifest.json (common/state_export.h), so the node jobs of one run share a directory.
// ALREADY_EXISTS, before anything is asked of the daemon, when either file exists; nothing of an
// export that failed stays in `dir`. The payload is written as the chunks arrive (memory: one
// chunk), into a temporary file renamed into place when complete. Arrays as the job holds them,
// or with `float32` decoded to float32.
// A full-state export's dtype choice: "held" (as the job holds its state) -> false, "float32" ->
// true; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<bool> ParseExportStateDType(std::string_view dtype);

absl::StatusOr<StateExportFiles> ExportStateToDir(
    Client& client, const std::string& job_id, const std::string& token, int64_t generation,
    int64_t step, const std::string& dir,
    const std::function<void(uint64_t done, uint64_t total)>& progress = {}, bool float32 = false);

}  // namespace muond::client

#endif  // MUOND_CLIENT_CLIENT_H_
