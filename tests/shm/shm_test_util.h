// Helpers for the shared-memory data plane tests.
//
// - Job specs and multi-step trajectories stepped through a chosen client API and transport
//   (gRPC Step/StepBuffer, shm Step/StepBuffer/StepTensors, the zero-copy views), one thread and
//   one session per rank.
// - RawShmPeer: a hand-written shm peer (not the client library) that speaks the attach protocol
//   of common/shm_protocol.h itself, so a test can ring with any ring contents it likes and hold
//   every descriptor the daemon passed.
// - ProcCounts: a process's descriptors, memfd mappings and locked memory (/proc/<pid>/...).
// - IsError: a status's code and message, as a gtest assertion.
//
// Thread-compatible: each object is used by one thread at a time.
#ifndef MUOND_TESTS_SHM_SHM_TEST_UTIL_H_
#define MUOND_TESTS_SHM_SHM_TEST_UTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/job_spec.h"
#include "common/shm_protocol.h"
#include "gtest/gtest.h"
#include "muond/v1/muond.pb.h"
#include "tests/integration/multirank_util.h"

namespace muond::shmtest {

using integration::MatrixBytes;

// A job of `world` ranks (zero_stage `stage`; 0 needs world 1) with the default Muon config.
common::JobSpec MakeSpec(const std::string& job_id, int world, int stage,
                         std::vector<common::MatrixSpec> matrices);

// How a rank pushes a step.
enum class Api {
  kGrpcStep,        // Transport::kGrpc, RankSession::Step (spans)
  kGrpcBuffer,      // Transport::kGrpc, RankSession::StepBuffer
  kShmStep,         // Transport::kShm, RankSession::Step
  kShmBuffer,       // Transport::kShm, RankSession::StepBuffer
  kShmTensors,      // Transport::kShm, RankSession::StepTensors (world size 1 only)
  kGrpcTensors,     // Transport::kGrpc, RankSession::StepTensors (world size 1 only)
  kZeroCopy,        // Transport::kShm, GradientView + StepInPlace + UpdateView
};
std::string ApiName(Api api);
client::Transport ApiTransport(Api api);

// One rank's step through `api` on an attached session: the rank's spans of the whole-matrix
// gradients `grads` go in; returns the update bytes per span (RankSpans order). The zero-copy
// path fills the gradient view's padding (bytes outside every span) with NaN first: the daemon
// must read spans only.
absl::StatusOr<std::vector<std::string>> StepWith(Api api, client::RankSession& session,
                                                  int64_t step,
                                                  const std::vector<std::string>& grads,
                                                  client::StepResult* result = nullptr);

// Writes the rank's spans of `grads` into the gradient view of `step` (padding NaN), without
// ringing.
absl::Status FillGradientView(client::RankSession& session, int64_t step,
                              const std::vector<std::string>& grads);
// The rank's update spans read from the update view of `step`.
absl::StatusOr<std::vector<std::string>> ReadUpdateView(client::RankSession& session,
                                                        int64_t step);

// Creates job `spec` and steps it with all its ranks at once (a thread and a session per rank,
// attached with `api`'s transport through one shared Client), steps 0 .. grads.size()-1.
// Returns [rank][step] -> update spans; the first error of any rank otherwise.
struct Trajectory {
  std::vector<std::vector<std::vector<std::string>>> updates;  // [rank][step][span]
  std::vector<std::vector<common::ShardSpan>> layout;          // [rank]
  std::vector<client::Transport> transport;                    // [rank], as the session reports
};
absl::StatusOr<Trajectory> RunTrajectory(client::Client& client, const common::JobSpec& spec,
                                         Api api, const MatrixBytes& grads);

// Steps `step` with every session at once (session r through apis[r], each in its own thread).
// Should a rank fail, the job is deleted so that ranks waiting for it are released (NOT_FOUND)
// instead of hanging the test. Returns per rank its update spans or error.
std::vector<absl::StatusOr<std::vector<std::string>>> StepAllRanks(
    client::Client& client, const std::string& job_id, const std::string& token,
    const std::vector<client::RankSession*>& sessions, const std::vector<Api>& apis,
    int64_t step, const std::vector<std::string>& grads);

// The rank's flat buffer bytes of `step` of a whole-matrix gradient set, for raw peers:
// the bytes at each span's byte_offset as the daemon announced them.
std::string FlatRankBuffer(const common::JobSpec& spec, int rank,
                           const std::vector<std::string>& grads);

// Descriptors (/proc/PID/fd), mappings of the daemon's regions (lines of /proc/PID/maps that
// mention memfd:muond) and locked memory (VmLck of /proc/PID/status, kB).
struct ProcCounts {
  int fds = -1;
  int memfd_maps = -1;
  int64_t vmlck_kb = -1;
  bool operator==(const ProcCounts& o) const {
    return fds == o.fds && memfd_maps == o.memfd_maps && vmlck_kb == o.vmlck_kb;
  }
  bool operator!=(const ProcCounts& o) const { return !(*this == o); }
  std::string ToString() const;
};
ProcCounts MeasureProcess(pid_t pid);
int64_t VmLckKb(pid_t pid);

// Polls MeasureProcess(pid) until it equals `want` (true) or `timeout_seconds` passed (false);
// *last receives the last measurement.
bool WaitForCounts(pid_t pid, const ProcCounts& want, double timeout_seconds, ProcCounts* last);

// A shared-memory peer written against the wire format only (no client library).
class RawShmPeer {
 public:
  // Connects to `socket_path`, sends the attach request and maps what comes back. The daemon's
  // refusal comes back as its status.
  static absl::StatusOr<std::unique_ptr<RawShmPeer>> Attach(const std::string& socket_path,
                                                            const std::string& job_id, int rank,
                                                            const std::string& token);
  ~RawShmPeer();
  RawShmPeer(const RawShmPeer&) = delete;
  RawShmPeer& operator=(const RawShmPeer&) = delete;

  const v1::ShmAttachResponse& reply() const { return reply_; }
  uint64_t buffer_bytes() const { return reply_.buffer_bytes(); }
  uint64_t generation() const { return reply_.generation(); }
  // The descriptors in the order of common/shm_protocol.h.
  int grad_fd() const { return fds_[0]; }
  int update_fd() const { return fds_[1]; }
  int ring_fd() const { return fds_[2]; }
  int doorbell_fd() const { return fds_[3]; }
  int completion_fd() const { return fds_[4]; }
  int conn() const { return conn_; }
  char* grad() const { return grad_; }              // 2 buffers, writable
  const char* update() const { return update_; }    // 2 buffers, read-only mapping
  common::shm::Ring* ring() const { return ring_; }  // writable

  // Writes submission `sub` into slot sub.seq % kRingSlots, stores `head` into sub_head and
  // rings the doorbell.
  void Publish(const common::shm::Submission& sub, uint64_t head);
  // A well-formed submission for `step` (next sequence number).
  common::shm::Submission Valid(int64_t step) const;
  // The next completion in the ring (advancing comp_tail); UNAVAILABLE when the daemon hung up,
  // DEADLINE_EXCEEDED after `timeout_seconds`.
  absl::StatusOr<common::shm::Completion> NextCompletion(double timeout_seconds = 20);
  // Publish(sub, sub.seq + 1) and wait for its completion: the completion's status (code and
  // message), UNAVAILABLE when the daemon hung up, DEADLINE_EXCEEDED after `timeout_seconds`.
  absl::Status Ring(const common::shm::Submission& sub, double timeout_seconds = 20);
  // True once the daemon has closed the connection (within `timeout_seconds`).
  bool WaitHangUp(double timeout_seconds);

 private:
  RawShmPeer() = default;
  int conn_ = -1;
  int fds_[common::shm::kNumFds] = {-1, -1, -1, -1, -1};
  v1::ShmAttachResponse reply_;
  char* grad_ = nullptr;
  const char* update_ = nullptr;
  common::shm::Ring* ring_ = nullptr;
  size_t region_bytes_ = 0;
};

// Bytes of a float32 / bfloat16 quiet NaN.
std::string NanBytes(common::DType dtype);

// Success when `s` has `code` and its message contains `text`.
::testing::AssertionResult IsError(const absl::Status& s, absl::StatusCode code,
                                   const std::string& text);

}  // namespace muond::shmtest

#endif  // MUOND_TESTS_SHM_SHM_TEST_UTIL_H_
