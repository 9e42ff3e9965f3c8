#include "server/api/api_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/server_posix.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "server/storage/durable_file.h"

namespace muond::server {
namespace {

// Largest gRPC message: a 4 MiB data chunk plus headroom for the envelope.
constexpr int kMaxMessageBytes = (4 << 20) + (64 << 10);

// Not INVALID_ARGUMENT (the daemon's exit code 2 means a bad flag or file): the address was fine.
absl::Status NotUsage(const absl::Status& s) {
  if (s.code() != absl::StatusCode::kInvalidArgument) return s;
  return absl::FailedPreconditionError(s.message());
}

// Prepares the socket path: creates its directory 0750, refuses to steal the socket of a live
// daemon, and removes a stale socket file left by a crashed one.
absl::Status PrepareUnixSocket(const std::string& path) {
  const std::string dir = path.substr(0, path.rfind('/'));
  if (!dir.empty()) {
    struct stat st;
    const bool existed = ::stat(dir.c_str(), &st) == 0;
    if (absl::Status s = durable::MakeDirs(dir, 0750); !s.ok()) return s;
    if (!existed) ::chmod(dir.c_str(), 0750);
  }
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a socket"));
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const bool live = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  if (live) {
    return absl::AlreadyExistsError(absl::StrCat("another process serves unix://", path));
  }
  ::unlink(path.c_str());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> ApiServer::Prepare(const DaemonConfig& config) {
  std::string unix_path;
  if (absl::Status s = ParseListenAddress(config.listen, &unix_path); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--listen ", config.listen, ": ", s.message()));
  }
  if (!unix_path.empty()) {
    if (absl::Status s = PrepareUnixSocket(unix_path); !s.ok()) {
      return NotUsage(
          absl::Status(s.code(), absl::StrCat("--listen ", config.listen, ": ", s.message())));
    }
  }
  return unix_path;
}

ApiServer::ApiServer(JobRegistry* registry, const AccessPolicy* access,
                     StreamGuard::Options streams)
    : registry_(registry), service_(registry, access, [&] {
        // A cancelled stream still blocked on a client that reads nothing ends only with its
        // connection. (Leases exist only while handlers run, within the listener's life.)
        streams.close_connection = [this](const std::string& peer) {
          return listener_ != nullptr && listener_->ShutdownPeer(peer);
        };
        return streams;
      }()) {}

absl::StatusOr<std::unique_ptr<ApiServer>> ApiServer::Start(const DaemonConfig& config,
                                                            const std::string& unix_path,
                                                            const ServerTransport& transport,
                                                            const AccessPolicy* access,
                                                            JobRegistry* registry) {
  StreamGuard::Options streams;
  streams.idle_limit = absl::Seconds(config.stream_idle_seconds);
  streams.max_streams = kMaxStreams;
  streams.max_watches = kMaxWatches;
  std::unique_ptr<ApiServer> api(new ApiServer(registry, access, streams));
  api->unix_path_ = unix_path;
  if (absl::Status s = api->StartGrpc(config, transport); !s.ok()) return NotUsage(s);
  if (!unix_path.empty()) {
    MUOND_LOG(INFO) << "unix socket " << unix_path << " (0660): peer credentials recorded, up to "
                    << api->listener_->max_connections() << " connections";
  } else {
    MUOND_LOG(INFO) << "TCP " << config.listen << ": " << transport.Describe() << ", up to "
                    << api->listener_->max_connections() << " connections";
    if (access->restricted() && !transport.mutual_tls) {
      MUOND_LOG(WARNING) << "--allow-uids/--allow-groups on TCP without --tls-client-ca: TCP "
                            "peers have no identity, so none of them may create jobs";
    }
  }
  MUOND_LOG(INFO) << "CreateJob: " << access->Describe();
  if (absl::Status s = api->StartShm(config); !s.ok()) return NotUsage(s);
  api->server_->GetHealthCheckService()->SetServingStatus(true);
  return api;
}

absl::Status ApiServer::StartGrpc(const DaemonConfig& config, const ServerTransport& transport) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // The daemon accepts itself (Unix: peer credentials; both: an accept loop that survives
  // EMFILE, where gRPC 1.51's gives a TCP port up for good) and hands connections to gRPC; on TCP
  // through an external-connection acceptor with the transport's credentials (TLS included).
  auto bound = unix_path_.empty()
                   ? ConnectionListener::BindTcp(config.listen, config.max_connections)
                   : ConnectionListener::BindUnix(unix_path_, config.max_connections);
  if (!bound.ok()) {
    return absl::Status(bound.status().code(),
                        absl::StrCat("--listen ", config.listen, ": ", bound.status().message()));
  }
  listener_ = *std::move(bound);
  port_ = listener_->port();
  if (unix_path_.empty()) {
    tcp_acceptor_ = builder.experimental().AddExternalConnectionAcceptor(
        grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD,
        transport.credentials);
  }
  // Each call holds a thread while its handler runs: bounded, so that clients cannot make the
  // daemon run out of threads (or memory for their stacks). Streams and session watches stay
  // below it (StreamGuard), so unary calls and Health always find one.
  grpc::ResourceQuota quota("muond-grpc");
  quota.SetMaxThreads(kMaxServerThreads);
  builder.SetResourceQuota(quota);
  builder.RegisterService(&service_);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || (unix_path_.empty() && tcp_acceptor_ == nullptr)) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", config.listen));
  }
  if (tcp_acceptor_ != nullptr) {
    listener_->Start([a = tcp_acceptor_.get()](int listen_fd, int fd) {
      grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
      p.listener_fd = listen_fd;
      p.fd = fd;
      a->HandleNewConnection(&p);
    });
  } else {
    listener_->Start([s = server_.get()](int, int fd) { grpc::AddInsecureChannelFromFd(s, fd); });
  }
  return absl::OkStatus();
}

absl::Status ApiServer::StartShm(const DaemonConfig& config) {
  // The shared-memory data plane listens next to the gRPC socket (node-local only).
  shm_path_ = config.shm_socket;
  if (shm_path_.empty() && !unix_path_.empty()) shm_path_ = unix_path_ + ".shm";
  if (shm_path_ == "off") shm_path_.clear();
  if (shm_path_.empty()) return absl::OkStatus();
  ShmLimits limits;
  limits.max_sessions = static_cast<size_t>(config.limits.max_shm_sessions);
  limits.attach_timeout = absl::Seconds(config.limits.shm_attach_timeout_seconds);
  limits.max_pending_per_uid = static_cast<size_t>(config.limits.max_shm_pending_per_uid);
  limits.max_pending_per_pid = static_cast<size_t>(config.limits.max_shm_pending_per_pid);
  auto started = ShmServer::Start(shm_path_, registry_, limits);
  if (!started.ok()) {
    return absl::Status(started.status().code(),
                        absl::StrCat("--shm-socket ", shm_path_, ": ", started.status().message()));
  }
  shm_ = *std::move(started);
  service_.SetSharedMemory(shm_.get());
  return absl::OkStatus();
}

std::string ApiServer::PortSuffix() const {
  return unix_path_.empty() ? absl::StrCat(" (port ", port_, ")") : "";
}

size_t ApiServer::max_connections() const { return listener_->max_connections(); }

bool ApiServer::Drain(absl::Time deadline) {
  service_.BeginShutdown();
  if (shm_) shm_->BeginShutdown();
  server_->GetHealthCheckService()->SetServingStatus(false);
  // Drain only the steps in flight, then shut down at once: a graceful gRPC shutdown would also
  // wait (10-20 s, gRPC's GOAWAY timeout) for idle client connections, which trainers keep open.
  // Steps still running at the deadline are cancelled (they abort and fence their jobs).
  bool drained = service_.WaitForStepsToDrain(deadline);
  // Shared-memory steps have no RPC in flight: wait for the jobs' steps themselves.
  while (drained && registry_->AnyStepInFlight() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  drained = drained && !registry_->AnyStepInFlight();
  if (!drained) MUOND_LOG(WARNING) << "grace period over; cancelling the steps still in flight";
  listener_->Stop();  // no connection is handed to a server shutting down
  // Streams blocked on clients that read nothing would hold Shutdown's Wait forever: the guard
  // closes their connections.
  service_.CancelAllStreams();
  server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
  return drained;
}

ApiServer::~ApiServer() {
  if (listener_ != nullptr) listener_->Stop();  // hands nothing to a server being destroyed
  service_.SetSharedMemory(nullptr);
  shm_.reset();  // ends the shared-memory sessions (a step still in flight aborts)
  if (!unix_path_.empty()) ::unlink(unix_path_.c_str());
}

}  // namespace muond::server
