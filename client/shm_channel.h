// The client end of a shared-memory session (common/shm_protocol.h): attaches a rank over the
// daemon's SOCK_SEQPACKET socket, maps the regions it receives and rings the doorbell for a step.
//
// The trainer writes step t's gradients into GradientBuffer(t) (for example with a device-to-host
// copy straight into it), calls Ring(t), and reads the update from UpdateBuffer(t): no copy on the
// host in between. Closing the channel ends the session. Not thread-safe: one step at a time.
#ifndef MUOND_CLIENT_SHM_CHANNEL_H_
#define MUOND_CLIENT_SHM_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "common/shm_protocol.h"
#include "common/shm_region.h"

namespace muond::v1 {
class ShmAttachResponse;
}

namespace muond::client {

struct ShmSpan {
  uint32_t matrix = 0;
  uint64_t offset = 0;       // first element in the matrix
  uint64_t length = 0;       // elements
  uint64_t byte_offset = 0;  // in each buffer
  // Apply mode: where the span's parameters (its tensor's param_dtype) start in each buffer of
  // the update region, and in gradient buffer 0 for an initial-parameter submission.
  uint64_t param_byte_offset = 0;
};

class ShmChannel {
 public:
  struct Ringing {
    int64_t step = 0;
    bool replayed = false;
    double seconds = 0;
    bool skipped = false;  // the step was skipped: the update region was not written
    double grad_sum_sq = 0;  // apply mode: the daemon's raw sum of squares of the step
  };

  // Errors carry the daemon's code (NOT_FOUND, UNAUTHENTICATED, ALREADY_EXISTS, ...); UNAVAILABLE
  // when the socket cannot be reached.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Attach(const std::string& socket_path,
                                                            const std::string& job_id, int rank,
                                                            const std::string& token,
                                                            bool takeover);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  const common::JobSpec& spec() const { return spec_; }
  uint64_t session_id() const { return session_id_; }
  int64_t next_step_at_attach() const { return next_step_; }
  bool pinned() const { return pinned_; }
  const std::vector<ShmSpan>& spans() const { return spans_; }
  uint64_t buffer_bytes() const { return buffer_bytes_; }
  // Buffers per region (the job's step_buffers): step t uses buffer t % buffers().
  uint32_t buffers() const { return buffers_; }
  // Apply mode: where a step's hyperparameters go in each gradient buffer (float64 lr[G],
  // weight_decay[G], grad_divisor; common/shm_protocol.h).
  uint64_t hyper_byte_offset() const { return hyper_byte_offset_; }
  // The buffers of step t (t % buffers()): gradients are written by the caller, the update is
  // read-only.
  char* GradientBuffer(int64_t step) const;
  const char* UpdateBuffer(int64_t step) const;

  // Publishes step t's gradients (GradientBuffer(t) must hold them) and waits for the update.
  absl::StatusOr<Ringing> Ring(int64_t step);
  // Apply mode: publishes the initial parameters in GradientBuffer(0) (each span at its
  // param_byte_offset, in its tensor's param_dtype; submission kind kSubmitInitParams, step -1)
  // and waits for the daemon to install them.
  absl::Status RingInitParams();
  // ---- A step in parts (common/shm_protocol.h kSubmitStepPart), streamed while the trainer still
  // produces gradients. Post() publishes [offset, offset + size) of GradientBuffer(t) (whole spans;
  // `last`: the rank's last part of the step) and returns without waiting for the daemon, except
  // while kRingSlots submissions lack their completion. One step in parts at a time.
  absl::Status Post(int64_t step, uint64_t offset, uint64_t size, bool last);
  // Waits for the end of the step posted in parts: the first refusal among its parts, else the
  // last part's outcome.
  absl::StatusOr<Ringing> WaitStep(int64_t step);
  // Waits at most `timeout_ms` (-1: no limit) for news of the step in parts (a completion or
  // progress words changed); UNAVAILABLE when the daemon ended the session.
  absl::Status WaitProgress(int timeout_ms);
  // Span i's result of `step` is in UpdateBuffer(step) (its progress word; final if the step
  // commits). False when the daemon writes no progress words (an older daemon).
  bool SpanReady(size_t span, int64_t step) const;
  // The step in parts ended: its last part's completion arrived.
  bool StepEnded(int64_t step) const;
  // What ended it: OK, or the first refusal among its parts.
  absl::Status StepOutcome(int64_t step) const;

  // Rings with explicit fields, for tests of the daemon's checks.
  absl::StatusOr<Ringing> RingRaw(int64_t step, uint32_t buffer, uint64_t offset, uint64_t size,
                                  uint64_t generation,
                                  uint32_t kind = common::shm::kSubmitStep);

 private:
  ShmChannel() = default;
  // Connects conn_ to the daemon's socket, with kAttachTimeoutSeconds for sends and receives.
  absl::Status Connect(const std::string& socket_path);
  // Takes the accepted attach's fields and descriptors (doorbell, completion) and maps its
  // regions; owns `fds` from then on, also on failure.
  absl::Status MapRegions(const v1::ShmAttachResponse& reply,
                          const int (&fds)[common::shm::kNumFds]);
  // Publishes one submission; returns its sequence number.
  absl::StatusOr<uint64_t> Publish(int64_t step, uint32_t buffer, uint64_t offset, uint64_t size,
                                   uint64_t generation, uint32_t kind);
  // Takes every completion published so far into the step-in-parts bookkeeping.
  void Reap();
  // Polls the completion eventfd and the socket for `timeout_ms`.
  absl::Status Poll(int timeout_ms);
  int conn_ = -1;
  int doorbell_ = -1;
  int completion_ = -1;
  common::SharedRegion in_, out_, ring_;
  common::JobSpec spec_;
  uint64_t session_id_ = 0;
  uint64_t generation_ = 0;
  uint64_t buffer_bytes_ = 0;
  uint32_t buffers_ = 2;
  uint64_t hyper_byte_offset_ = 0;
  int64_t next_step_ = 0;
  bool pinned_ = false;
  uint64_t next_seq_ = 0;
  std::vector<ShmSpan> spans_;
  uint64_t progress_byte_offset_ = 0;  // 0: the daemon writes no progress words
  // The step in parts: its id (-1: none), the sequence of its last part (none yet: UINT64_MAX),
  // whether that completed and how, and the first refusal among its parts.
  int64_t part_step_ = -1;
  uint64_t last_seq_ = UINT64_MAX;
  // The try of part_step_ now being sent: the sequence of its first part, and whether the daemon
  // answered it (its progress words are this try's from then on).
  uint64_t first_seq_ = 0;
  bool opened_ = false;
  bool part_ended_ = false;
  Ringing part_result_;
  absl::Status part_error_;
};

// The shared-memory socket of a daemon listening on `address` ("unix:///p" -> "/p.shm"), or ""
// for TCP addresses.
std::string ShmSocketFor(const std::string& address);

}  // namespace muond::client

#endif  // MUOND_CLIENT_SHM_CHANNEL_H_
