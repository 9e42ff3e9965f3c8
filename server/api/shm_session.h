// One attached shared-memory session of the ShmServer (server/api/shm_server.h): the regions a
// rank's steps read and write, the completion ring with its eventfd, and what the server thread
// keeps about the rank (job, rank, session id, span offsets, the peer's credentials).
//
// Thread-safety: ShmSession is read by the server thread and the metrics; only the server thread
// changes it (sub_tail). ShmRegions and CompletionChannel are shared with the steps in flight
// (keepalive), so a step that completes after its session ended still writes into valid memory;
// CompletionChannel::Complete is thread-safe.
#ifndef MUOND_SERVER_API_SHM_SESSION_H_
#define MUOND_SERVER_API_SHM_SESSION_H_

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/layout.h"
#include "common/logging.h"
#include "common/shm_protocol.h"
#include "common/shm_region.h"
#include "server/api/shm_server.h"
#include "server/device/device.h"
#include "server/jobs/job.h"

namespace muond::server {

// The regions a step reads and writes; shared with the steps that use them (keepalive).
struct ShmRegions {
  common::SharedRegion in;
  common::SharedRegion out;
  // The regions registered with the compute device for direct copies (DESIGN.md 5; empty when
  // the device has no memory of its own or refused): declared after the regions, so unregistered
  // before they are unmapped, when the last step, replay or session holding them lets go (a step
  // holds them until its device work finished: no copy of them is in flight then).
  device::HostRegistration in_device;
  device::HostRegistration out_device;
};

// Where completions go: the ring and the completion eventfd (owned; closed on destruction).
class CompletionChannel {
 public:
  CompletionChannel(common::SharedRegion ring, int event_fd)
      : ring_(std::move(ring)), event_fd_(event_fd) {}
  ~CompletionChannel() { close(event_fd_); }
  CompletionChannel(const CompletionChannel&) = delete;
  CompletionChannel& operator=(const CompletionChannel&) = delete;
  common::shm::Ring* ring() const { return reinterpret_cast<common::shm::Ring*>(ring_.data()); }
  int ring_fd() const { return ring_.fd(); }
  int event_fd() const { return event_fd_; }

  // Publishes the outcome of submission `seq` and rings the completion eventfd. A peer that
  // stopped reading completions (a full ring) loses this one, with a warning.
  // Wakes the client without a completion (progress words changed).
  void Notify() {
    const uint64_t one = 1;
    ssize_t unused = write(event_fd_, &one, sizeof(one));
    (void)unused;
  }

  void Complete(uint64_t seq, int64_t step, const absl::Status& status, uint32_t flags,
                double seconds, double grad_sum_sq = 0) {
    namespace shm = common::shm;
    absl::MutexLock lock(&mu_);
    shm::RingHeader& h = ring()->header;
    const uint64_t tail = h.comp_tail.load(std::memory_order_acquire);
    if (head_ - tail >= shm::kRingSlots) {
      MUOND_LOG(WARNING) << "shared-memory completion ring full; dropping completion of step "
                         << step;
      return;
    }
    shm::Completion& c = ring()->comps[head_ % shm::kRingSlots];
    c.seq = seq;
    c.step = step;
    c.code = static_cast<int32_t>(status.code());
    c.flags = flags;
    c.seconds = seconds;
    c.grad_sum_sq = grad_sum_sq;
    const size_t n = std::min(status.message().size(), shm::kMessageBytes - 1);
    // An OK status's message is empty with a null data(): memcpy from null is undefined even for
    // 0 bytes (UBSan stopped the daemon at the first shared-memory step).
    if (n > 0) std::memcpy(c.message, status.message().data(), n);
    c.message[n] = '\0';
    ++head_;
    h.comp_head.store(head_, std::memory_order_release);
    const uint64_t one = 1;
    ssize_t unused = write(event_fd_, &one, sizeof(one));
    (void)unused;
  }

 private:
  common::SharedRegion ring_;
  const int event_fd_;
  absl::Mutex mu_;
  uint64_t head_ ABSL_GUARDED_BY(mu_) = 0;
};

struct ShmSession {
  ShmSession() = default;
  ShmSession(const ShmSession&) = delete;
  ShmSession& operator=(const ShmSession&) = delete;
  ~ShmSession() {
    if (doorbell >= 0) close(doorbell);
  }

  int conn = -1;      // not owned: the server closes it
  int doorbell = -1;  // owned
  ShmPeer peer;
  std::shared_ptr<Job> job;
  // Ends the session when the job is deleted (ShmServer::RegisterSession); declared after `job`,
  // so unregistered before the session lets go of the job.
  DeletionHooks::Registration on_delete;
  int rank = 0;
  uint64_t session_id = 0;
  uint64_t buffer_bytes = 0;
  uint32_t buffers = 2;       // per region (JobSpec::step_buffers); step t uses buffer t % buffers
  uint64_t pinned_bytes = 0;  // bytes of the session's regions locked in memory (metrics)
  uint64_t region_bytes = 0;  // bytes of all its regions, locked or not (the job's "buffers")
  // The regions are registered with the compute device: steps copy them by DMA in place.
  bool device_registered = false;
  std::vector<common::ShardSpan> spans;  // RankSpans
  std::vector<uint64_t> byte_offsets;     // per span of RankSpans
  // Apply mode: per span, where its parameters (param dtype) are in each buffer; where the step's
  // hyperparameters are in each gradient buffer (common/shm_protocol.h).
  std::vector<uint64_t> param_byte_offsets;
  uint64_t hyper_byte_offset = 0;
  // The progress words in the update region (common/shm_protocol.h): one int64 per span.
  uint64_t progress_byte_offset = 0;
  // Parts (common/shm_protocol.h kSubmitStepPart): the step whose parts this session is sending
  // (-1: none open) and, once one of them was refused, why: the step's later parts, up to and
  // including its last, are refused with it (the daemon forgot the step; a retry starts after
  // the last part). Server thread only.
  int64_t part_step = -1;
  absl::Status part_error;
  // Apply mode: an initial-parameter submission is being installed (one at a time).
  std::shared_ptr<std::atomic<bool>> init_running = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<ShmRegions> regions;
  std::shared_ptr<CompletionChannel> completions;
  uint64_t sub_tail = 0;  // used by the server thread only
};

}  // namespace muond::server

#endif  // MUOND_SERVER_API_SHM_SESSION_H_
