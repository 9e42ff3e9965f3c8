// The node-local shared-memory data plane (DESIGN.md section 5; wire format in
// common/shm_protocol.h).
//
// ShmServer listens on a Unix SOCK_SEQPACKET socket next to the gRPC one. A rank attaches with its
// job token; the daemon creates the session's memfd regions (gradient in, update out, each double
// buffered, sized for the rank's spans; sealed; mlock()ed once) and ring, and passes them with
// SCM_RIGHTS. Doorbells are handled by one thread (epoll over every session's socket and doorbell
// eventfd); the step itself runs on the job's compute queue, which reads the gradient spans from
// the region and writes the update spans into the out region directly. A session ends when its
// socket hangs up: a step in flight is aborted and the job fenced, the regions are released once
// no step references them.
//
// Thread-safe; Start() returns a running server, the destructor stops it.
#ifndef MUOND_SERVER_SHM_SERVER_H_
#define MUOND_SERVER_SHM_SERVER_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/job_registry.h"

namespace muond::server {

struct ShmSession;

class ShmServer {
 public:
  // Binds `path` (removing a stale socket file; the caller checked no daemon serves it), mode 0660.
  static absl::StatusOr<std::unique_ptr<ShmServer>> Start(const std::string& path,
                                                          JobRegistry* registry);
  ~ShmServer();
  ShmServer(const ShmServer&) = delete;
  ShmServer& operator=(const ShmServer&) = delete;

  const std::string& path() const { return path_; }
  // New attaches get UNAVAILABLE; sessions keep working until the server is destroyed.
  void BeginShutdown() { shutting_down_.store(true); }
  size_t session_count() const;
  // For the metrics (muond_shm_sessions, muond_pinned_bytes): attached sessions and the bytes of
  // their regions that are locked in memory.
  struct Usage {
    size_t sessions = 0;
    uint64_t pinned_bytes = 0;
  };
  Usage usage() const;

 private:
  ShmServer(std::string path, JobRegistry* registry, int listen_fd, int epoll_fd, int wake_fd);
  void Loop();
  void Accept();
  void HandleAttach(int conn);
  void HandleDoorbell(const std::shared_ptr<ShmSession>& session);
  // `clean`: the peer detached (rather than dying); see Job::EndSharedSession.
  void EndSession(int conn, const std::string& why, bool clean = false);

  const std::string path_;
  JobRegistry* const registry_;
  const int listen_fd_;
  const int epoll_fd_;
  const int wake_fd_;  // eventfd that stops Loop()
  std::atomic<bool> shutting_down_{false};
  std::atomic<bool> stopping_{false};
  mutable absl::Mutex mu_;
  // By connection fd. Pending connections (not attached yet) map to nullptr.
  std::map<int, std::shared_ptr<ShmSession>> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::shared_ptr<ShmSession>> by_doorbell_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_SHM_SERVER_H_
