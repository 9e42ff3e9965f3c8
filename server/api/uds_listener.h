// UdsListener: the daemon's own accept loop for the gRPC Unix socket.
//
// gRPC listening on a Unix socket itself would not tell the daemon who connected. Instead this
// listener binds the socket (mode 0660 from its first moment), accepts connections on one thread,
// reads each one's SO_PEERCRED into the peer table (server/api/peer_identity.h) and hands the
// descriptor to a sink, in the daemon grpc::AddInsecureChannelFromFd; from then on gRPC owns it.
//
// Descriptor exhaustion: when accept fails with EMFILE/ENFILE the listener closes a reserve
// descriptor, accepts and closes the pending connection (its client sees the connection close at
// once instead of hanging in the backlog), reopens the reserve, stops accepting for 100 ms and
// logs a warning at most every 10 s; it never spins, and accepts normally as soon as descriptors
// are free again.
//
// Bounding: gRPC does not say when it closed a connection. The listener remembers each handed
// descriptor's socket inode and, before accepting beyond `max_connections` and once a second,
// counts as closed those whose descriptor is gone or now names another file. Connections beyond
// the bound are accepted and closed at once (warning, rate-limited), so gRPC never holds more than
// `max_connections` Unix-socket connections from this listener and descriptors remain for
// checkpoints and shared-memory sessions.
//
// Thread-safety: Start and Stop from one thread; the counters may be read from any thread.
#ifndef MUOND_SERVER_API_UDS_LISTENER_H_
#define MUOND_SERVER_API_UDS_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>

#include "absl/status/statusor.h"

namespace muond::server {

class UdsListener {
 public:
  // Takes ownership of an accepted, non-blocking, close-on-exec connection descriptor.
  using ConnectionSink = std::function<void(int fd)>;

  // Binds and listens on `path` (which must not exist; see PrepareUnixSocket in main.cc), the
  // socket file mode 0660. `max_connections` 0: derived from RLIMIT_NOFILE (the soft limit minus
  // a quarter of it, at least 64 descriptors kept back, and at least 16 connections).
  // UNAVAILABLE/INTERNAL naming the path and the errno on failure.
  static absl::StatusOr<std::unique_ptr<UdsListener>> Bind(const std::string& path,
                                                           size_t max_connections);
  ~UdsListener();  // Stop()
  UdsListener(const UdsListener&) = delete;
  UdsListener& operator=(const UdsListener&) = delete;

  // Starts the accept thread. REQUIRES: not started; `sink` stays valid until Stop returns.
  void Start(ConnectionSink sink);
  // Stops accepting and closes the listening socket (connections already handed over stay open).
  // Blocks until the accept thread ended. Idempotent.
  void Stop();

  size_t max_connections() const { return max_connections_; }
  // Connections handed to the sink and not yet seen closed (as of the last count).
  size_t open_connections() const { return open_.load(); }
  // Connections refused for want of descriptors (EMFILE/ENFILE) or over the bound.
  uint64_t refused_no_descriptors() const { return refused_no_fds_.load(); }
  uint64_t refused_over_bound() const { return refused_over_bound_.load(); }

 private:
  UdsListener() = default;
  void Loop();
  // Accepts what is pending; returns false when the loop should back off (out of descriptors).
  bool AcceptPending();
  void RefuseForLackOfDescriptors();
  // Drops handed descriptors that gRPC closed; updates open_.
  void CountOpen();

  std::string path_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;     // eventfd: Stop() wakes the loop
  int reserve_fd_ = -1;  // /dev/null, released to accept-and-close under EMFILE
  size_t max_connections_ = 0;
  ConnectionSink sink_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> open_{0};
  std::atomic<uint64_t> refused_no_fds_{0};
  std::atomic<uint64_t> refused_over_bound_{0};
  // Accept thread only: descriptor -> socket inode, for the connections handed to the sink.
  std::unordered_map<int, ino_t> handed_;
  int64_t last_warning_ns_ = 0;
  uint64_t refused_since_warning_ = 0;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_API_UDS_LISTENER_H_
