// The daemon's API edge: everything a client reaches. This room (server/api) owns the gRPC service
// (MuondService, its streams bounded by StreamGuard), the shared-memory data plane (ShmServer,
// shm_attach), the listeners (the Unix socket and TCP, plaintext or TLS, which the daemon accepts
// itself: ConnectionListener) and authentication (peer
// credentials and allow-lists: peer_identity, tls_config; the job token is checked by
// JobRegistry::Authorize for every path). It is the only code that sees generated proto types, and
// with server/ops's HTTP endpoint the only one that sees sockets; it calls server/jobs (registry
// and jobs) and server/record (configuration, metrics recorders, operation progress), and
// converts jobs' plain reports to API messages (job_status_proto).
//
// ApiServer wires them: Prepare() checks the listen address before anything else starts, Start()
// brings every listener up, Drain() and the destructor take them down in order. The gRPC server's
// threads are bounded (kMaxServerThreads, a gRPC resource quota); streams are admitted below that
// bound so that Health and unary calls always find a thread.
#ifndef MUOND_SERVER_API_API_SERVER_H_
#define MUOND_SERVER_API_API_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/api/connection_listener.h"
#include "server/api/muond_service.h"
#include "server/api/peer_identity.h"
#include "server/api/shm_server.h"
#include "server/api/stream_guard.h"
#include "server/api/tls_config.h"
#include "server/jobs/job_registry.h"
#include "server/record/daemon_config.h"

namespace grpc {
class Server;
namespace experimental {
class ExternalConnectionAcceptor;
}  // namespace experimental
}  // namespace grpc

namespace muond::server {

// Threads the gRPC server may run at once (each call holds one while its handler runs), and of
// them the ones streams may hold (StreamGuard::Options::max_streams) and the ones WatchSession
// calls may hold (one per rank attached over gRPC, for the session's life; max_watches). The
// rest (128) serve unary calls and Health.
inline constexpr int kMaxServerThreads = 1024;
inline constexpr size_t kMaxStreams = 384;
inline constexpr size_t kMaxWatches = 512;
static_assert(kMaxStreams + kMaxWatches + 128 <= kMaxServerThreads);

class ApiServer {
 public:
  // The listen address of `config`, checked: INVALID_ARGUMENT for one that does not parse; for a
  // Unix socket its directory is made (0750), a stale socket file removed, and ALREADY_EXISTS
  // returned when a live daemon serves it. Errors name the flag.
  static absl::StatusOr<std::string> Prepare(const DaemonConfig& config);
  // Starts gRPC on `config.listen` (`unix_path` from Prepare; empty for TCP) and the
  // shared-memory socket. The pointers must outlive the server. Errors name the flag.
  static absl::StatusOr<std::unique_ptr<ApiServer>> Start(const DaemonConfig& config,
                                                          const std::string& unix_path,
                                                          const ServerTransport& transport,
                                                          const AccessPolicy* access,
                                                          JobRegistry* registry);
  // Closes the shared-memory sessions and removes the Unix socket file.
  ~ApiServer();

  // " (port N)" for TCP, "" for a Unix socket.
  std::string PortSuffix() const;
  ShmServer* shm() const { return shm_.get(); }
  const std::string& shm_path() const { return shm_path_; }
  // Connections the listener (Unix socket or TCP) lets gRPC hold at once.
  size_t max_connections() const;

  // New steps and jobs get UNAVAILABLE and streams not in a step are cancelled; waits for the
  // steps in flight (gRPC and shared memory) until `deadline`, then shuts gRPC down at once.
  // False when steps were still running.
  bool Drain(absl::Time deadline);

 private:
  ApiServer(JobRegistry* registry, const AccessPolicy* access, StreamGuard::Options streams);
  absl::Status StartGrpc(const DaemonConfig& config, const ServerTransport& transport);
  absl::Status StartShm(const DaemonConfig& config);

  JobRegistry* const registry_;
  MuondService service_;
  std::string unix_path_;
  int port_ = 0;
  std::unique_ptr<ConnectionListener> listener_;
  // TCP only: hands the listener's connections to gRPC with the transport's credentials.
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> tcp_acceptor_;
  std::unique_ptr<grpc::Server> server_;
  std::string shm_path_;
  std::unique_ptr<ShmServer> shm_;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_API_API_SERVER_H_
