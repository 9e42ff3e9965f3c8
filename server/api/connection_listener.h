// ConnectionListener: the daemon's own accept loop for the gRPC API's Unix socket and TCP, handing
// each accepted connection to gRPC (Unix: grpc::AddInsecureChannelFromFd; TCP, plaintext or TLS:
// an ExternalConnectionAcceptor with the server's credentials, so gRPC runs the TLS handshake).
//
// Unix socket: gRPC listening itself would not tell the daemon who connected. This listener binds
// the socket (mode 0660 from its first moment) and reads each connection's SO_PEERCRED into the
// peer table (server/api/peer_identity.h) before handing it over; from then on gRPC owns it.
// TCP: gRPC 1.51's own accept loop gives a listening port up for good on EMFILE; this one does not
// (below). The connection gets TCP_NODELAY, as gRPC's own listener sets.
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
// `max_connections` connections from this listener and descriptors remain for checkpoints and
// shared-memory sessions.
//
// Thread-safety: Start and Stop from one thread; the counters may be read from any thread.
#ifndef MUOND_SERVER_API_CONNECTION_LISTENER_H_
#define MUOND_SERVER_API_CONNECTION_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/heartbeat.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace muond::server {

class ConnectionListener {
 public:
  // Takes ownership of an accepted, non-blocking, close-on-exec connection descriptor `fd`,
  // accepted on listening socket `listen_fd`.
  using ConnectionSink = std::function<void(int listen_fd, int fd)>;

  // Binds and listens on Unix socket `path` (which must not exist; see PrepareUnixSocket in
  // api_server.cc), the socket file mode 0660. `max_connections` 0: derived from RLIMIT_NOFILE
  // (the soft limit minus a quarter of it, at least 64 descriptors kept back, and at least 16
  // connections). UNAVAILABLE/INTERNAL naming the path and the errno on failure.
  static absl::StatusOr<std::unique_ptr<ConnectionListener>> BindUnix(const std::string& path,
                                                                      size_t max_connections);
  // Binds and listens on TCP `host_port` (every address the host resolves to, one port; port 0:
  // one the system picks, see port()). `max_connections` as for BindUnix. INVALID_ARGUMENT for a
  // host that does not resolve, UNAVAILABLE naming the address and errno when it cannot bind.
  static absl::StatusOr<std::unique_ptr<ConnectionListener>> BindTcp(const std::string& host_port,
                                                                     size_t max_connections);
  ~ConnectionListener();  // Stop()
  ConnectionListener(const ConnectionListener&) = delete;
  ConnectionListener& operator=(const ConnectionListener&) = delete;

  // Starts the accept thread. REQUIRES: not started; `sink` stays valid until Stop returns.
  void Start(ConnectionSink sink);
  // Stops accepting and closes the listening sockets (connections already handed over stay open).
  // Blocks until the accept thread ended. Idempotent.
  void Stop();

  // The TCP port listened on (0 for a Unix socket).
  int port() const { return port_; }
  size_t max_connections() const { return max_connections_; }
  // Connections handed to the sink and not yet seen closed (as of the last count).
  size_t open_connections() const { return open_.load(); }
  // Shuts down (both directions) the connection of gRPC peer `peer` (ServerContext::peer():
  // "fd:N" for a Unix connection, "ipv4:A:P" / "ipv6:[A]:P" for TCP) if it is one this listener
  // handed over and still open; gRPC then fails every call on it, including a Write blocked on a
  // client that reads nothing (which cancelling the call alone does not end). False when the
  // connection is not known (closed, or not this listener's). Thread-safe.
  bool ShutdownPeer(const std::string& peer);

  // Connections refused for want of descriptors (EMFILE/ENFILE) or over the bound.
  uint64_t refused_no_descriptors() const { return refused_no_fds_.load(); }
  uint64_t refused_over_bound() const { return refused_over_bound_.load(); }

 private:
  ConnectionListener() = default;
  absl::Status OpenWakeAndReserve();
  void Loop();
  // Accepts what is pending on `listen_fd`; returns false when the loop should back off (out of
  // descriptors).
  bool AcceptPending(int listen_fd);
  void RefuseForLackOfDescriptors(int listen_fd);
  // Records the gRPC peer name of handed connection `fd` (ShutdownPeer).
  void RememberPeer(int fd, ino_t inode);
  // Drops handed descriptors that gRPC closed; updates open_.
  void CountOpen();

  std::string what_;  // "unix socket /path", "TCP host:port": for the log
  bool unix_ = false;
  int port_ = 0;
  std::vector<int> listen_fds_;
  int wake_fd_ = -1;     // eventfd: Stop() wakes the loop
  int reserve_fd_ = -1;  // /dev/null, released to accept-and-close under EMFILE
  size_t max_connections_ = 0;
  ConnectionSink sink_;
  common::Heartbeat heartbeat_{"grpc accept loop"};  // beaten by Loop() on every wake-up
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> open_{0};
  std::atomic<uint64_t> refused_no_fds_{0};
  std::atomic<uint64_t> refused_over_bound_{0};
  // Accept thread only: descriptor -> socket inode, for the connections handed to the sink; and
  // each one's gRPC peer name.
  std::unordered_map<int, ino_t> handed_;
  std::unordered_map<int, std::string> peer_of_fd_;
  // The handed connections by gRPC peer name: descriptor and socket inode (ShutdownPeer).
  absl::Mutex peers_mu_;
  std::unordered_map<std::string, std::pair<int, ino_t>> by_peer_ ABSL_GUARDED_BY(peers_mu_);
  int64_t last_warning_ns_ = 0;
  uint64_t refused_since_warning_ = 0;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_API_CONNECTION_LISTENER_H_
