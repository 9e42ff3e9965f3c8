// muond: the Muon optimizer-offload daemon. See `muond --help`.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "server/ops/daemon_config.h"
#include "server/ops/daemon_metrics.h"
#include "server/ops/metrics_http.h"
#include "server/ops/sd_notify.h"
#include "server/device/device_streams.h"
#include "server/jobs/compute_executor.h"
#include "server/device/device.h"
#include "server/storage/durable_file.h"
#include "server/jobs/job_registry.h"
#include "server/api/shm_server.h"
#include "server/optim/muon_math.h"
#include "server/api/muond_service.h"
#include "server/api/peer_identity.h"
#include "server/api/tls_config.h"
#include "server/api/uds_listener.h"

#ifndef MUOND_VERSION
#define MUOND_VERSION "0.0.0"
#endif

namespace muond::server {
namespace {

// Largest gRPC message: a 4 MiB data chunk plus headroom for the envelope.
constexpr int kMaxMessageBytes = (4 << 20) + (64 << 10);

// SIGTERM/SIGINT: a handler that writes the signal number to a pipe the main thread reads. A
// handler, not only sigwait with the signals blocked: threads that libraries start before main
// (OpenBLAS's workers) do not have them blocked, and a process-directed signal delivered to one of
// them while the main thread still blocks it would take the default action and kill the daemon.
int stop_pipe[2] = {-1, -1};

extern "C" void OnStopSignal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t n = ::write(stop_pipe[1], &b, 1);
  errno = saved;
}

// Blocks until SIGTERM or SIGINT arrived (also one that arrived earlier); returns it.
int WaitForStopSignal(const sigset_t& signals) {
  pthread_sigmask(SIG_UNBLOCK, &signals, nullptr);
  unsigned char b = 0;
  while (::read(stop_pipe[0], &b, 1) != 1) {
  }
  return b;
}

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "muond: %s\n", message.c_str());
  return code;
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

// Fault injection for the checkpoint tests, from $MUOND_TEST_CHECKPOINT_FAULT: "delay:MS" (every
// checkpoint write call sleeps MS ms: a slow disk) or "POINT:NTH:ERRNO" (the NTH call at POINT =
// mkdir|open|write|fsync|fsyncdir|rename fails with ERRNO, e.g. "write:2:28" for ENOSPC).
absl::Status ArmCheckpointFault() {
#ifndef MUOND_TEST_HOOKS
  return absl::OkStatus();  // a release build has no fault hooks
#else
  const char* env = std::getenv("MUOND_TEST_CHECKPOINT_FAULT");
  if (env == nullptr || *env == '\0') return absl::OkStatus();
  const std::vector<std::string> parts = absl::StrSplit(env, ':');
  durable::Fault f;
  int a = 0, b = 0;
  if (parts.size() == 2 && parts[0] == "delay" && absl::SimpleAtoi(parts[1], &a) && a > 0) {
    f.point = durable::IoPoint::kWrite;
    f.delay_ms = a;
  } else if (parts.size() == 3 && absl::SimpleAtoi(parts[1], &a) && a > 0 &&
             absl::SimpleAtoi(parts[2], &b) && b > 0) {
    const std::map<std::string, durable::IoPoint> points = {
        {"mkdir", durable::IoPoint::kMkdir},     {"open", durable::IoPoint::kOpen},
        {"write", durable::IoPoint::kWrite},     {"fsync", durable::IoPoint::kFsyncFile},
        {"fsyncdir", durable::IoPoint::kFsyncDir}, {"rename", durable::IoPoint::kRename}};
    auto it = points.find(parts[0]);
    if (it == points.end()) return absl::InvalidArgumentError(absl::StrCat("unknown point ", parts[0]));
    f.point = it->second;
    f.nth = a;
    f.error = b;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("cannot parse '", env, "'"));
  }
  durable::SetFaultForTesting(f);
  MUOND_LOG(WARNING) << "checkpoint fault injection armed: " << env;
  return absl::OkStatus();
#endif
}

int Run(int argc, char** argv) {
  // Stop signals go to OnStopSignal (any thread) and are read by the main thread; threads this
  // process starts from here on block them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  if (::pipe2(stop_pipe, O_CLOEXEC) != 0) {
    return Fail(1, absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  struct sigaction stop_action = {};
  stop_action.sa_handler = OnStopSignal;
  sigemptyset(&stop_action.sa_mask);
  stop_action.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &stop_action, nullptr);
  ::sigaction(SIGINT, &stop_action, nullptr);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  // Resident memory must not depend on the step history (issue 3, "Memory"). glibc raises its
  // mmap threshold to the size of each large block freed (up to 32 MiB), after which the
  // multi-MiB gradient, update, gather and Newton-Schulz buffers come from per-thread arenas and
  // stay resident once freed: 40-65 MiB above the job's needs for a 4 MiB job, varying from step
  // to step. A fixed threshold keeps blocks of 256 KiB and more on mmap, returned when freed
  // (cost: page faults on those buffers each step).
#ifdef M_MMAP_THRESHOLD
  mallopt(M_MMAP_THRESHOLD, 256 * 1024);
#endif

  auto config = ParseDaemonConfig(argc, argv);
  if (!config.ok()) return Fail(2, std::string(config.status().message()));
  if (config->help) {
    std::fputs(DaemonUsage().c_str(), stdout);
    return 0;
  }
  if (config->version) {
    std::printf("muond %s\n", MUOND_VERSION);
    return 0;
  }
  common::LogLevel level;
  common::ParseLogLevel(config->log_level, &level);
  common::SetMinLogLevel(level);
  // Who may connect and create jobs: TLS for TCP, allow-lists for CreateJob.
  auto transport = ServerTransportFor(*config);
  if (!transport.ok()) return Fail(2, std::string(transport.status().message()));
  if (!transport->warning.empty()) MUOND_LOG(WARNING) << transport->warning;
  auto access = AccessPolicy::Create(config->allow_uids, config->allow_groups,
                                     transport->mutual_tls, ::geteuid());
  if (!access.ok()) return Fail(2, std::string(access.status().message()));

  const int threads = config->threads > 0
                          ? config->threads
                          : std::max(1u, std::thread::hardware_concurrency());
  SetMathThreads(threads);
  // The compute device: cpu and simulated are always built; GPU backends plug in via OpenBackend.
  auto opened = device::OpenBackend(config->backend, threads, config->simulated);
  if (!opened.ok()) {
    return Fail(opened.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1,
                absl::StrCat("--backend ", config->backend, ": ", opened.status().message()));
  }
  const std::string backend = opened->device->name();
  // Device memory (GPU backends) is bounded by the gather budget: the gathered gradients and
  // momentum of the batches in flight plus Newton-Schulz scratch (up to about twice that again).
  opened->device->SetMemoryLimit(
      static_cast<size_t>(std::max<uint64_t>(3 * config->gather_budget_bytes, uint64_t{1} << 30)));
  MUOND_LOG(INFO) << "backend " << opened->why;
  auto compute = DeviceStreams::Create(std::move(opened->device), opened->why,
                                       config->serial_schedule);
  if (!compute.ok()) {
    return Fail(1, absl::StrCat("--backend ", config->backend, ": ", compute.status().message()));
  }

  if (absl::Status s = durable::MakeDirs(config->state_dir, 0750); !s.ok()) {
    return Fail(1, absl::StrCat("--state-dir: ", s.message()));
  }
  std::string unix_path;
  if (absl::Status s = ParseListenAddress(config->listen, &unix_path); !s.ok()) {
    return Fail(2, absl::StrCat("--listen ", config->listen, ": ", s.message()));
  }
  if (!unix_path.empty()) {
    if (absl::Status s = PrepareUnixSocket(unix_path); !s.ok()) {
      return Fail(1, absl::StrCat("--listen ", config->listen, ": ", s.message()));
    }
  }

  // Declared before the registry: destroyed after it, once every queued task ran.
  ComputeExecutor executor(threads);
  JobRegistry registry((*compute)->why, config->limits, config->gather_budget_bytes, &executor,
                       compute->get(), config->state_dir);
  if (config->limits.max_state_bytes == 0) {
    MUOND_LOG(WARNING) << "--max-state-bytes 0: job state is not limited";
  }
  if (absl::Status s = ArmCheckpointFault(); !s.ok()) {
    return Fail(2, absl::StrCat("MUOND_TEST_CHECKPOINT_FAULT: ", s.message()));
  }
  if (absl::Status s = registry.Restore(); !s.ok()) {
    return Fail(1, absl::StrCat("--state-dir ", config->state_dir, ": ", s.message()));
  }
  MuondService service(&registry, access->get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  // Unix sockets: the daemon accepts itself (peer credentials) and hands connections to gRPC.
  std::unique_ptr<UdsListener> uds;
  if (unix_path.empty()) {
    builder.AddListeningPort(config->listen, transport->credentials, &port);
  } else {
    auto bound = UdsListener::Bind(unix_path, config->max_connections);
    if (!bound.ok()) {
      return Fail(1, absl::StrCat("--listen ", config->listen, ": ", bound.status().message()));
    }
    uds = *std::move(bound);
  }
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || (uds == nullptr && port == 0)) {
    return Fail(1, absl::StrCat("cannot listen on ", config->listen));
  }
  if (uds != nullptr) {
    uds->Start([s = server.get()](int fd) { grpc::AddInsecureChannelFromFd(s, fd); });
    MUOND_LOG(INFO) << "unix socket " << unix_path << " (0660): peer credentials recorded, up to "
                    << uds->max_connections() << " connections";
  } else {
    MUOND_LOG(INFO) << "TCP " << config->listen << ": " << transport->Describe();
    if ((*access)->restricted() && !transport->mutual_tls) {
      MUOND_LOG(WARNING) << "--allow-uids/--allow-groups on TCP without --tls-client-ca: TCP "
                            "peers have no identity, so none of them may create jobs";
    }
  }
  MUOND_LOG(INFO) << "CreateJob: " << (*access)->Describe();
  // The shared-memory data plane listens next to the gRPC socket (node-local only).
  std::unique_ptr<ShmServer> shm;
  std::string shm_path = config->shm_socket;
  if (shm_path.empty() && !unix_path.empty()) shm_path = unix_path + ".shm";
  if (shm_path == "off") shm_path.clear();
  if (!shm_path.empty()) {
    ShmLimits shm_limits;
    shm_limits.max_sessions = static_cast<size_t>(config->limits.max_shm_sessions);
    shm_limits.attach_timeout = absl::Seconds(config->limits.shm_attach_timeout_seconds);
    auto started = ShmServer::Start(shm_path, &registry, shm_limits);
    if (!started.ok()) {
      return Fail(1, absl::StrCat("--shm-socket ", shm_path, ": ", started.status().message()));
    }
    shm = *std::move(started);
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  MUOND_LOG(INFO) << "muond " << MUOND_VERSION << " serving on " << config->listen
                  << (unix_path.empty() ? absl::StrCat(" (port ", port, ")") : "")
                  << "; backend " << backend << ", " << threads << " compute threads, gather budget "
                  << config->gather_budget_bytes << " bytes, state "
                  << config->state_dir
                  << (shm ? absl::StrCat("; shared memory on ", shm_path) : "");

  // --- Observability (issue 8): /metrics, then systemd readiness and watchdog pings. ----------
  std::unique_ptr<DaemonMetricsCollector> metrics_collector;
  std::unique_ptr<MetricsServer> metrics_server;
  if (config->metrics_address != "off") {
    std::vector<std::pair<std::string, double>> limits =
        LimitValues(config->limits, config->gather_budget_bytes);
    if (uds != nullptr) {
      limits.emplace_back("max_connections", static_cast<double>(uds->max_connections()));
    }
    metrics_collector = std::make_unique<DaemonMetricsCollector>(
        &registry, shm.get(),
        DaemonInfo{MUOND_VERSION, backend,
                   backend == "cpu" || backend == "simulated" ? CpuModelName() : backend,
                   config->limits.max_state_bytes, std::move(limits)});
    const std::string address =
        config->metrics_address.empty() ? kDefaultMetricsAddress : config->metrics_address;
    MetricsServerOptions metrics_options;
    metrics_options.max_connections = static_cast<size_t>(config->limits.max_metrics_connections);
    auto started = MetricsServer::Start(address, &common::DefaultRegistry(), metrics_options);
    if (started.ok()) {
      metrics_server = *std::move(started);
      MUOND_LOG(INFO) << "metrics on http://" << metrics_server->address() << "/metrics";
    } else if (config->metrics_address.empty()) {
      MUOND_LOG(ERROR) << "serving without metrics: " << started.status().message()
                       << " (set --metrics-address or metrics-address = off)";
    } else {
      return Fail(1, absl::StrCat("--metrics-address: ", started.status().message()));
    }
  }
  if (absl::Status s = SdNotify(absl::StrCat("READY=1\nSTATUS=serving on ", config->listen));
      !s.ok()) {
    MUOND_LOG(WARNING) << "systemd notification: " << s;
  }
  SdWatchdog watchdog;  // WATCHDOG=1 at half of $WATCHDOG_USEC until muond returns
  // ------------------------------------------------------------------------------------------
  const int sig = WaitForStopSignal(signals);
  (void)SdNotify("STOPPING=1\nSTATUS=draining steps in flight");  // issue 8
  MUOND_LOG(INFO) << "received " << strsignal(sig) << "; draining steps in flight (grace "
                  << config->shutdown_grace_seconds << " s)";
  service.BeginShutdown();
  if (shm) shm->BeginShutdown();
  server->GetHealthCheckService()->SetServingStatus(false);
  // Drain only the steps in flight, then shut down at once: a graceful gRPC shutdown would also
  // wait (10-20 s, gRPC's GOAWAY timeout) for idle client connections, which trainers keep open.
  // Steps still running at the deadline are cancelled (they abort and fence their jobs).
  const absl::Duration grace =
      absl::Milliseconds(static_cast<int64_t>(config->shutdown_grace_seconds * 1000));
  const absl::Time deadline = absl::Now() + grace;
  bool drained = service.WaitForStepsToDrain(deadline);
  // Shared-memory steps have no RPC in flight: wait for the jobs' steps themselves.
  while (drained && registry.AnyStepInFlight() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  drained = drained && !registry.AnyStepInFlight();
  if (!drained) MUOND_LOG(WARNING) << "grace period over; cancelling the steps still in flight";
  if (uds != nullptr) uds->Stop();  // no connection is handed to a server shutting down
  server->Shutdown(std::chrono::system_clock::now());
  server->Wait();
  // Every job's momentum to disk (after draining; no step runs now), unless nothing changed since
  // its newest generation.
  registry.WaitForSaves();
  for (const auto& job : registry.List()) {
    const JobReport st = job->Report();
    if (job->spec().transport_probe || st.fenced) {
      if (st.fenced) {
        MUOND_LOG(WARNING) << "job '" << job->id() << "' is fenced; no checkpoint at shutdown";
      }
      continue;
    }
    if (job->last_checkpoint_step() == st.next_step) continue;  // unchanged since
    if (job->last_checkpoint_step() < 0 && st.steps_completed == 0) continue;  // never stepped
    auto saved = job->SaveCheckpoint();
    if (!saved.ok()) {
      MUOND_LOG(ERROR) << "shutdown checkpoint of job '" << job->id()
                       << "' failed: " << saved.status().message();
    }
  }
  metrics_server.reset();  // issue 8: no scrape reads the registry or shm after this
  metrics_collector.reset();
  shm.reset();  // ends the shared-memory sessions (a step still in flight aborts)
  if (!unix_path.empty()) ::unlink(unix_path.c_str());
  MUOND_LOG(INFO) << "muond stopped";
  return 0;
}

}  // namespace
}  // namespace muond::server

int main(int argc, char** argv) { return muond::server::Run(argc, argv); }
