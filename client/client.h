// The muond client library (C++). One Client per daemon connection; RankSession for one rank of a
// job. The C ABI in muond_client.h wraps these for other languages.
//
// Thread-safety: Client is thread-safe. A RankSession runs one step at a time (calls on one session
// must not overlap); different sessions may step concurrently.
#ifndef MUOND_CLIENT_CLIENT_H_
#define MUOND_CLIENT_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "muond/v1/muond.grpc.pb.h"

namespace muond::client {
class ShmChannel;
class SessionWatch;
}

namespace muond::client {

// A run of consecutive elements of one matrix in the caller's memory (the matrix's dtype).
struct GradientSpan {
  uint32_t matrix = 0;
  uint64_t offset = 0;   // first element in the matrix
  const void* data = nullptr;
  uint64_t length = 0;   // elements
};
struct UpdateSpan {
  uint32_t matrix = 0;
  uint64_t offset = 0;
  void* data = nullptr;  // receives `length` elements of the matrix's dtype
  uint64_t length = 0;
};

// How a rank's gradients and updates travel. kAuto: shared memory when the daemon is on this host
// (a unix:// address whose shared-memory socket is reachable), else gRPC.
enum class Transport { kAuto, kShm, kGrpc };
// "auto", "shm", "grpc"; INVALID_ARGUMENT otherwise.
absl::StatusOr<Transport> ParseTransport(const std::string& name);

struct StepResult {
  int64_t step = 0;
  bool replayed = false;
  double compute_seconds = 0;
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

  // Pushes this rank's gradients for `step` and writes the update into `updates`, which must cover
  // exactly the same elements as `grads` (the rank's spans). Blocks until the update arrived.
  // Errors carry the daemon's code and message (e.g. INVALID_ARGUMENT for a non-finite gradient,
  // FAILED_PRECONDITION for a step out of order, ABORTED when another rank failed).
  absl::StatusOr<StepResult> Step(int64_t step, const std::vector<GradientSpan>& grads,
                                  const std::vector<UpdateSpan>& updates);

  // Flat-buffer step: `grads` is the rank's buffer in the job's layout (RankBufferElements
  // elements: the stage 1/2 partition, the stage 3 chunks back to back, or the explicit layout's
  // spans back to back), `updates` receives the update in the same form, padding zeroed.
  // REQUIRES every matrix to share one dtype (FAILED_PRECONDITION otherwise).
  absl::StatusOr<StepResult> StepBuffer(int64_t step, const void* grads, void* updates);
  // Elements of the rank's flat buffer (common::RankBufferElements).
  uint64_t buffer_elements() const;

  // Zero-copy steps (shared-memory sessions only; FAILED_PRECONDITION otherwise): write step t's
  // gradients, in the rank's flat-buffer layout, into GradientView(t), call StepInPlace(t), read
  // the update from UpdateView(t). Views stay valid for the session's life; step t uses t % 2.
  struct View {
    char* data = nullptr;
    size_t size = 0;
  };
  absl::StatusOr<View> GradientView(int64_t step);
  absl::StatusOr<View> UpdateView(int64_t step);
  absl::StatusOr<StepResult> StepInPlace(int64_t step);

  // Whole-matrix step: `grads` holds one tensor per matrix of the job, named and shaped as the job
  // says; returns the updates with the same names, shapes and dtypes. INVALID_ARGUMENT naming the
  // tensor for a missing, extra, mis-shaped or mis-typed tensor. REQUIRES: rank owns whole matrices.
  absl::StatusOr<std::vector<NamedTensor>> StepTensors(int64_t step,
                                                       const std::vector<NamedTensor>& grads,
                                                       StepResult* result = nullptr);

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
  std::shared_ptr<v1::Muond::Stub> stub_;
  std::string token_;
  common::JobSpec spec_;
  int rank_ = 0;
  uint64_t session_id_ = 0;
  int64_t next_step_ = 0;
  bool attached_ = false;
  std::vector<common::ShardSpan> spans_;
  std::unique_ptr<ShmChannel> shm_;
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
  absl::Status DeleteJob(const std::string& job_id, const std::string& token);
  absl::Status ResetJob(const std::string& job_id, const std::string& token, int64_t next_step);
  absl::StatusOr<v1::JobStatus> GetJob(const std::string& job_id, const std::string& token);
  absl::StatusOr<std::vector<v1::JobStatus>> ListJobs();
  // ListJobs with the job directories the daemon set aside at start (broken).
  absl::StatusOr<v1::ListJobsResponse> ListJobsWithBroken();
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

}  // namespace muond::client

#endif  // MUOND_CLIENT_CLIENT_H_
