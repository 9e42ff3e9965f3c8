// The node-local shared-memory data plane (DESIGN.md section 5; wire format in
// common/shm_protocol.h).
//
// ShmServer listens on a Unix SOCK_SEQPACKET socket next to the gRPC one. A rank attaches with its
// job token; the daemon creates the session's memfd regions (gradient in, update out, each double
// buffered, sized for the rank's spans; sealed; mlock()ed once; registered with a GPU device
// for direct copies, server/engine/step_pipeline.h) and ring, and passes them with
// SCM_RIGHTS. Doorbells are handled by one thread (epoll over every session's socket and doorbell
// eventfd); the step itself runs on the job's compute queue, which reads the gradient spans from
// the region and writes the update spans into the out region directly. A session ends when its
// socket hangs up: a step in flight is aborted and the job fenced, the regions are released once
// no step references them.
//
// The event thread never allocates a session: an attach's regions (GiBs for a large rank:
// memfd, ftruncate, mlock, device registration) are made on a worker thread of their own, and
// the reply is sent back on the event thread, so one job's attach never delays another job's
// doorbells. Deleting a job ends its sessions (Job::OnDelete): each gets a completion saying
// so and its connection is closed, which releases the daemon's side of its regions.
//
// Thread-safe; Start() returns a running server, the destructor stops it.
#ifndef MUOND_SERVER_API_SHM_SERVER_H_
#define MUOND_SERVER_API_SHM_SERVER_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/heartbeat.h"
#include "common/shm_protocol.h"
#include "muond/v1/muond.pb.h"
#include "server/jobs/job_registry.h"

namespace muond::server {

struct ShmSession;

// What local peers may make the shared-memory server hold.
struct ShmLimits {
  // Connections held at once: attached sessions plus connections that have not attached yet
  // (--max-shm-sessions). One more is answered RESOURCE_EXHAUSTED and closed.
  size_t max_sessions = 256;
  // Connections not attached yet that one peer uid, and one peer pid, may hold at once
  // (--max-shm-pending-per-uid, --max-shm-pending-per-pid; 0: a quarter of max_sessions, and
  // half the per-uid bound, at least 1 each): one user's or one process's flood of idle
  // connections cannot take every place, so another user's attach still gets in. One more from
  // that uid or pid is answered RESOURCE_EXHAUSTED naming the bound and closed.
  size_t max_pending_per_uid = 0;
  size_t max_pending_per_pid = 0;
  // A connection that has not completed its attach this long after it was accepted is answered
  // DEADLINE_EXCEEDED and closed (--shm-attach-timeout-seconds).
  absl::Duration attach_timeout = absl::Seconds(5);
  // A larger attach request is answered INVALID_ARGUMENT and its connection closed.
  size_t max_attach_request_bytes = 64 * 1024;
  // Register each session's regions with the compute device at attach, where the device has
  // memory of its own (Device::DirectHostCopies), so that steps copy them in place by DMA; off:
  // every step stages on the host (tests and comparisons of the two paths).
  bool register_with_device = true;
};

// Who is at the other end of a connection (SO_PEERCRED, taken when it was accepted).
struct ShmPeer {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

class ShmServer {
 public:
  // Binds `path` (removing a stale socket file; the caller checked no daemon serves it), mode 0660.
  // Keeps one descriptor in reserve (/dev/null) to refuse connections when the process has none
  // left. INVALID_ARGUMENT for a zero max_sessions or a non-positive attach_timeout.
  static absl::StatusOr<std::unique_ptr<ShmServer>> Start(const std::string& path,
                                                          JobRegistry* registry,
                                                          const ShmLimits& limits = {});
  ~ShmServer();
  ShmServer(const ShmServer&) = delete;
  ShmServer& operator=(const ShmServer&) = delete;

  const std::string& path() const { return path_; }
  // New attaches get UNAVAILABLE; sessions keep working until the server is destroyed.
  void BeginShutdown() { shutting_down_.store(true); }
  // Attached sessions (not counting connections that have not attached yet).
  size_t session_count() const;
  const ShmLimits& limits() const { return limits_; }
  // For the metrics (muond_shm_sessions, muond_pinned_bytes): attached sessions and the bytes of
  // their regions that are locked in memory.
  struct Usage {
    size_t sessions = 0;
    uint64_t pinned_bytes = 0;
    std::map<std::string, uint64_t> pinned_bytes_by_job;  // by job id (muond_job_pinned_bytes)
    std::map<std::string, uint64_t> region_bytes_by_job;  // all regions, locked or not
    // The bytes of `job_id`'s sessions' regions (0: none), what its memory kind "buffers" adds.
    uint64_t region_bytes(const std::string& job_id) const {
      const auto it = region_bytes_by_job.find(job_id);
      return it == region_bytes_by_job.end() ? 0 : it->second;
    }
  };
  Usage usage() const;
  // The attached sessions' session ids by (job id, rank), for the status page (a rank attached
  // with another session id is on gRPC).
  std::map<std::pair<std::string, int>, uint64_t> shared_sessions() const;

 private:
  using Clock = std::chrono::steady_clock;
  // A connection accepted but not attached yet.
  struct Pending {
    Clock::time_point deadline;
    ShmPeer peer;
  };

  ShmServer(std::string path, JobRegistry* registry, const ShmLimits& limits, int listen_fd,
            int epoll_fd, int wake_fd, int reserve_fd);
  void Loop();
  void Dispatch(int fd, uint32_t events);
  // Milliseconds until the next deadline (a pending connection's, or the end of a pause of the
  // listening socket); -1 when there is none.
  int WaitMillis(Clock::time_point now) const;
  // Closes pending connections past their deadline; resumes a paused listening socket.
  void ExpireDeadlines(Clock::time_point now);
  // Declares the server's metric families (shm_admission.cc).
  static void DeclareMetrics();
  void Accept();
  void Admit(int conn);
  // accept4 failed with `err` (EMFILE, ENFILE, ...): accepts one connection with the reserve
  // descriptor and refuses it. False when there was no connection or no reserve.
  bool RefuseWithoutDescriptors(int err);
  void PauseListening(Clock::time_point now);
  void HandleAttach(int conn);
  // The event thread's half of an attach whose session a worker made (`created`: how that went):
  // sends the reply with the descriptors and registers the session, or refuses the connection.
  void FinishAttach(const std::shared_ptr<ShmSession>& session, const v1::ShmAttachResponse& reply,
                    const absl::Status& created, const std::string& who);
  // Runs `task` on the event thread (from any thread; the destructor runs what is left).
  void Post(std::function<void()> task);
  void RunPosted();
  // The job of session `session_id` on `conn` was deleted: the peer is told (a completion) and
  // the session ended.
  void EndDeletedSession(int conn, uint64_t session_id);
  // RESOURCE_EXHAUSTED when `peer` holds as many pending connections as its uid or pid may.
  absl::Status CheckPeerPending(const ShmPeer& peer) const;
  // Registers the session's regions with the compute device (ShmLimits::register_with_device);
  // a failure is logged and counted, the session works through host staging.
  void RegisterWithDevice(ShmSession& session, const std::string& who);
  void RegisterSession(const std::shared_ptr<ShmSession>& session, const std::string& who,
                       bool pinned);
  // Answers a pending connection with `status` (best effort) and closes it; `reason` (the label
  // of muond_shm_connections_refused_total) counts and logs it, nullptr does neither.
  void RefusePending(int conn, const absl::Status& status, const char* reason);
  void AddPending(int conn, const ShmPeer& peer);
  void RemovePending(int conn);  // the bookkeeping only
  void ClosePending(int conn);
  // After attaching, the peer says one thing on its socket: the detach byte.
  void HandleSessionSocket(int conn);
  void HandleDoorbell(const std::shared_ptr<ShmSession>& session);
  // A checked submission: a step (its gradients, and in apply mode its hyperparameters, in the
  // step's buffer), or apply mode's initial parameters (buffer 0, installed off this thread).
  // A part of a step (common/shm_protocol.h) the server refused: when the session has that step
  // open in parts, the job refuses the step (once) and the step's later parts are refused.
  void RefusePart(const std::shared_ptr<ShmSession>& session, const common::shm::Submission& sub,
                  const absl::Status& why);
  // The rank's spans inside a part's range; INVALID_ARGUMENT for a range that cuts a span.
  absl::StatusOr<Job::SharedPart> PartSpans(const ShmSession& session,
                                            const common::shm::Submission& sub,
                                            const std::string& where) const;
  // Takes a part of a step in `part`; false when it was refused (its completion posted).
  bool TakePart(const std::shared_ptr<ShmSession>& session, const common::shm::Submission& sub,
                const std::string& where, Job::SharedPart* part);
  void SubmitStep(const std::shared_ptr<ShmSession>& session, const common::shm::Submission& sub,
                  const std::string& where);
  void SubmitInitParams(const std::shared_ptr<ShmSession>& session, uint64_t seq,
                        const std::string& where);
  // `clean`: the peer detached (rather than dying); see Job::EndSharedSession.
  void EndSession(int conn, const std::string& why, bool clean = false);
  // Answers a session's unread submissions (and the next one) with status_of(session), then ends
  // it (`why` for the log); nothing when `conn` is no longer that session.
  void EndSessionTelling(int conn, uint64_t session_id,
                         const std::function<absl::Status(const ShmSession&)>& status_of,
                         const std::string& why);
  // A takeover attach of `rank` (new session `new_session`): the rank's older shared-memory
  // sessions end now, and their regions with them.
  void EndTakenOverSessions(const Job& job, int rank, uint64_t new_session);
  // Logs a warning for a recurring refusal at most every few seconds, with the count held back.
  void LogRefusal(const char* reason, const absl::Status& status, const ShmPeer& peer);

  const std::string path_;
  JobRegistry* const registry_;
  const ShmLimits limits_;
  const size_t pending_per_uid_;  // limits_ with the defaults applied
  const size_t pending_per_pid_;
  const int listen_fd_;
  const int epoll_fd_;
  const int wake_fd_;  // eventfd that stops Loop()
  std::atomic<bool> shutting_down_{false};
  std::atomic<bool> stopping_{false};
  mutable absl::Mutex mu_;
  // Attached sessions, by connection fd and by doorbell fd.
  std::map<int, std::shared_ptr<ShmSession>> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::shared_ptr<ShmSession>> by_doorbell_ ABSL_GUARDED_BY(mu_);
  // Used by the server thread only (and the destructor once it has stopped).
  // Pending connections whose attach request was accepted and whose session a worker is making
  // stay here (counted against the limits) without a deadline and out of the epoll set.
  std::map<int, Pending> pending_;
  std::set<std::pair<Clock::time_point, int>> deadlines_;  // of pending_, soonest first
  std::map<uid_t, size_t> pending_uids_;                   // pending_ by peer uid and pid
  std::map<pid_t, size_t> pending_pids_;
  int reserve_fd_;                           // /dev/null, closed to accept-and-refuse at EMFILE
  Clock::time_point listen_paused_until_{};  // the listening socket's EPOLLIN is off until then
  bool listen_paused_ = false;
  std::map<std::string, std::pair<Clock::time_point, uint64_t>> refusal_log_;  // last line, held
  common::Heartbeat heartbeat_{"shm event loop"};  // beaten by Loop() on every wake-up
  std::thread thread_;
  // Work for the event thread (attach replies, deleted jobs' sessions), and the attach workers
  // running (the destructor waits for them).
  absl::Mutex post_mu_;
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(post_mu_);
  int attach_workers_ ABSL_GUARDED_BY(post_mu_) = 0;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_API_SHM_SERVER_H_
