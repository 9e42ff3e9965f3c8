// muond: one optimizer-offload daemon per node. main wires the rooms together and nothing else:
// ops (configuration, signals, metrics, service manager), device (the compute backend), jobs (the
// registry of jobs and their executor) and api (the listeners clients reach). See server/README.md.
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/heartbeat.h"
#include "common/logging.h"
#include "server/api/api_server.h"
#include "server/api/peer_identity.h"
#include "server/api/tls_config.h"
#include "server/device/device.h"
#include "server/device/device_streams.h"
#include "server/engine/compute_executor.h"
#include "server/engine/step_observer.h"
#include "server/jobs/job_registry.h"
#include "server/ops/metrics_collector.h"
#include "server/ops/metrics_http.h"
#include "server/ops/sd_notify.h"
#include "server/ops/status_json.h"
#include "server/ops/status_page.h"
#include "server/ops/stop_signal.h"
#include "server/optim/adamw.h"
#include "server/optim/cpu_isa.h"
#include "server/optim/muon_math.h"
#include "server/record/daemon_config.h"
#include "server/storage/durable_file.h"

#ifndef MUOND_VERSION
#define MUOND_VERSION "0.0.0"
#endif

namespace muond::server {
namespace {

// What a failed start prints, and the exit code: 2 for a bad flag or file, 1 otherwise.
struct Failure {
  int code;
  std::string message;
};

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "muond: %s\n", message.c_str());
  return code;
}

int Fail(const Failure& f) { return Fail(f.code, f.message); }

Failure FromStatus(const absl::Status& s) {
  return {s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1, std::string(s.message())};
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
        {"mkdir", durable::IoPoint::kMkdir},       {"open", durable::IoPoint::kOpen},
        {"write", durable::IoPoint::kWrite},       {"fsync", durable::IoPoint::kFsyncFile},
        {"fsyncdir", durable::IoPoint::kFsyncDir}, {"rename", durable::IoPoint::kRename}};
    auto it = points.find(parts[0]);
    if (it == points.end())
      return absl::InvalidArgumentError(absl::StrCat("unknown point ", parts[0]));
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

// The watchdog test's stall, from $MUOND_TEST_STALL=PART:MS: the part of the daemon named PART
// ("compute executor", "job registry", "shm event loop", "metrics http loop", ...) stops for good
// MS milliseconds after start (common/heartbeat.h). Test-hook builds only.
absl::Status ArmStall() {
#ifndef MUOND_TEST_HOOKS
  return absl::OkStatus();
#else
  const char* env = std::getenv("MUOND_TEST_STALL");
  if (env == nullptr || *env == '\0') return absl::OkStatus();
  const std::string spec = env;
  const size_t colon = spec.rfind(':');
  int ms = 0;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(spec.substr(colon + 1), &ms) ||
      ms < 0 || ms > 600000) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", spec, "' is not PART:MS (MS a whole number in 0..600000)"));
  }
  common::Heartbeats::Default().ArmStallForTesting(spec.substr(0, colon), absl::Milliseconds(ms));
  MUOND_LOG(WARNING) << "stall armed: the " << spec.substr(0, colon) << " stops in " << ms << " ms";
  return absl::OkStatus();
#endif
}

// A chaos run's hold, from $`name` (milliseconds, 1..600000): `arm` gets it, the log says
// `what` holds that long. Unset or empty: nothing armed.
absl::Status ArmHold(const char* name, void (*arm)(int), const char* what) {
#ifndef MUOND_TEST_HOOKS
  (void)name, (void)arm, (void)what;
  return absl::OkStatus();  // a release build has no fault hooks
#else
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return absl::OkStatus();
  int ms = 0;
  if (!absl::SimpleAtoi(env, &ms) || ms < 1 || ms > 600000) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", env, "' is not a whole number of milliseconds in 1..600000"));
  }
  arm(ms);
  MUOND_LOG(WARNING) << "hold armed: " << what << " holds " << ms << " ms";
  return absl::OkStatus();
#endif
}

// The chaos run's commit hold: every commit sleeps after the store flipped (server/jobs/job.h
// SetCommitHoldForTesting).
absl::Status ArmCommitHold() {
  return ArmHold("MUOND_TEST_COMMIT_HOLD_MS", SetCommitHoldForTesting, "every commit");
}

// The chaos run's in-place hold: a step holds in the middle of an in-place update
// (server/jobs/job.h SetInPlaceHoldForTesting).
absl::Status ArmInPlaceHold() {
  return ArmHold("MUOND_TEST_INPLACE_HOLD_MS", SetInPlaceHoldForTesting,
                 "a step in the middle of an in-place update");
}

// The commit-window test's fault, from $MUOND_TEST_COMMIT_FAULT=POINT:SIGNAL:STEP (POINT commit or
// committed, SIGNAL KILL or TERM; server/api/muond_service.h SetCommitFaultForTesting).
absl::Status ArmCommitFault() {
#ifndef MUOND_TEST_HOOKS
  return absl::OkStatus();  // a release build has no fault hooks
#else
  const char* env = std::getenv("MUOND_TEST_COMMIT_FAULT");
  if (env == nullptr || *env == '\0') return absl::OkStatus();
  const std::vector<std::string> parts = absl::StrSplit(env, ':');
  int64_t step = -1;
  if (parts.size() != 3 || (parts[0] != "commit" && parts[0] != "committed") ||
      (parts[1] != "KILL" && parts[1] != "TERM") || !absl::SimpleAtoi(parts[2], &step) ||
      step < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", env, "' is not POINT:SIGNAL:STEP (POINT commit|committed, SIGNAL KILL|TERM)"));
  }
  SetCommitFaultForTesting(parts[0], parts[1] == "KILL" ? SIGKILL : SIGTERM, step);
  MUOND_LOG(WARNING) << "commit fault armed: " << env;
  return absl::OkStatus();
#endif
}

// The load_state_dict test's kill, from $MUOND_TEST_IMPORT_FAULT=KILL:N: the N-th job creation
// that reads an import_dir SIGKILLs the daemon in the middle (server/jobs/job_registry.h
// SetImportKillForTesting).
absl::Status ArmImportFault() {
#ifndef MUOND_TEST_HOOKS
  return absl::OkStatus();  // a release build has no fault hooks
#else
  const char* env = std::getenv("MUOND_TEST_IMPORT_FAULT");
  if (env == nullptr || *env == '\0') return absl::OkStatus();
  const std::vector<std::string> parts = absl::StrSplit(env, ':');
  int nth = 0;
  if (parts.size() != 2 || parts[0] != "KILL" || !absl::SimpleAtoi(parts[1], &nth) || nth < 1) {
    return absl::InvalidArgumentError(absl::StrCat("'", env, "' is not KILL:N (N >= 1)"));
  }
  JobRegistry::SetImportKillForTesting(nth);
  MUOND_LOG(WARNING) << "import fault armed: " << env;
  return absl::OkStatus();
#endif
}

// The compute device and its streams for `config` (DESIGN.md section 6).
absl::StatusOr<std::unique_ptr<DeviceStreams>> OpenDevice(const DaemonConfig& config, int threads) {
  // cpu and simulated are always built; GPU backends plug in via OpenBackend.
  auto opened = device::OpenBackend(config.backend, threads, config.simulated);
  if (!opened.ok()) {
    return absl::Status(opened.status().code(), absl::StrCat("--backend ", config.backend, ": ",
                                                             opened.status().message()));
  }
  // Device memory (GPU backends) is bounded by the gather budget: the gathered gradients and
  // momentum of the batches in flight plus Newton-Schulz scratch (up to about twice that again).
  opened->device->SetMemoryLimit(
      static_cast<size_t>(std::max<uint64_t>(3 * config.gather_budget_bytes, uint64_t{1} << 30)));
  MUOND_LOG(INFO) << "backend " << opened->why;
  auto streams =
      DeviceStreams::Create(std::move(opened->device), opened->why, config.serial_schedule);
  if (!streams.ok()) {
    return absl::InternalError(
        absl::StrCat("--backend ", config.backend, ": ", streams.status().message()));
  }
  return streams;
}

// /metrics: the collector of the daemon's and jobs' series and the HTTP endpoint serving them.
struct Observability {
  std::unique_ptr<DaemonMetricsCollector> collector;
  std::unique_ptr<StatusSource> status;  // the status page's JSON; outlives the server
  std::unique_ptr<MetricsServer> server;
};

absl::StatusOr<Observability> StartMetrics(const DaemonConfig& config, const std::string& backend,
                                           const std::string& backend_why, JobRegistry* registry,
                                           const ApiServer& api) {
  Observability o;
  if (config.metrics_address == "off") return o;
  std::vector<std::pair<std::string, double>> limits =
      LimitValues(config.limits, config.gather_budget_bytes);
  if (api.max_connections() > 0) {
    limits.emplace_back("max_connections", static_cast<double>(api.max_connections()));
  }
  const std::string device = backend == "cpu" || backend == "simulated" ? CpuModelName() : backend;
  StatusInfo status;
  status.version = MUOND_VERSION;
  status.backend = backend;
  status.backend_why = backend_why;
  status.device = device;
  status.cpu_math = DescribeCpuMathPath(CurrentCpuMathPath());
  status.start_unix_ms = absl::ToUnixMillis(absl::Now());
  status.limits = limits;
  o.collector = std::make_unique<DaemonMetricsCollector>(
      registry, api.shm(),
      DaemonInfo{MUOND_VERSION, backend, device, CpuIsaName(CurrentCpuMathPath().isa),
                 Bf16ModeName(CurrentCpuMathPath()), config.limits.max_state_bytes,
                 std::move(limits)});
  const std::string address =
      config.metrics_address.empty() ? kDefaultMetricsAddress : config.metrics_address;
  MetricsServerOptions options;
  options.max_connections = static_cast<size_t>(config.limits.max_metrics_connections);
  // The status page (/ and /api/v1/status).
  o.status = std::make_unique<StatusSource>(registry, api.shm(), std::move(status));
  options.pages = StatusPages([source = o.status.get()] { return source->Render(); });
  auto started = MetricsServer::Start(address, &common::DefaultRegistry(), options);
  if (started.ok()) {
    o.server = *std::move(started);
    o.status->SetMetricsAddress(o.server->address());
    MUOND_LOG(INFO) << "metrics on http://" << o.server->address()
                    << "/metrics; status page http://" << o.server->address() << "/";
  } else if (config.metrics_address.empty()) {
    MUOND_LOG(ERROR) << "serving without metrics: " << started.status().message()
                     << " (set --metrics-address or metrics-address = off)";
  } else {
    return absl::UnavailableError(absl::StrCat("--metrics-address: ", started.status().message()));
  }
  return o;
}

// Serves until SIGTERM/SIGINT, then drains the steps in flight, saves the jobs that changed and
// stops the listeners.
void ServeUntilStopped(const DaemonConfig& config, JobRegistry& registry,
                       std::unique_ptr<ApiServer> api, Observability observability) {
  if (absl::Status s = SdNotify(absl::StrCat("READY=1\nSTATUS=serving on ", config.listen));
      !s.ok()) {
    MUOND_LOG(WARNING) << "systemd notification: " << s;
  }
  {
    SdWatchdog watchdog;  // WATCHDOG=1 at half of $WATCHDOG_USEC while serving
    const int sig = WaitForStopSignal();
    (void)SdNotify("STOPPING=1\nSTATUS=draining steps in flight");
    MUOND_LOG(INFO) << "received " << strsignal(sig) << "; draining steps in flight (grace "
                    << config.shutdown_grace_seconds << " s)";
    const absl::Duration grace =
        absl::Milliseconds(static_cast<int64_t>(config.shutdown_grace_seconds * 1000));
    (void)api->Drain(absl::Now() + grace);
    // Every job's momentum to disk (after draining; no step runs now), unless unchanged.
    registry.SaveChangedJobs();
  }
  observability.server.reset();  // no scrape reads the registry or shm after this
  observability.collector.reset();
  api.reset();  // ends the shared-memory sessions, removes the socket
  MUOND_LOG(INFO) << "muond stopped";
}

// The state directory is the daemon user's alone (0700 / 0600): a looser directory or file left
// by an older muond or an operator is repaired here, one log line each; one that cannot be (owned
// by another user) stops the start.
absl::Status MakeStatePrivate(const std::string& state_dir) {
  int repaired = 0;
  absl::Status s = durable::RestrictToOwner(
      state_dir, [&repaired](const std::string& path, mode_t before, mode_t after) {
        ++repaired;
        MUOND_LOG(WARNING) << "state directory: " << path << " was open to others (mode "
                           << absl::StrFormat("%04o", before) << "); repaired to "
                           << absl::StrFormat("%04o", after);
      });
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("--state-dir ", state_dir,
                                               ": cannot make it private to the daemon's user (",
                                               s.message(), "); fix its owner or mode"));
  }
  if (repaired > 0) {
    MUOND_LOG(WARNING) << "state directory " << state_dir << ": " << repaired
                       << " paths made private to the daemon's user (directories 0700, files "
                          "0600)";
  }
  return absl::OkStatus();
}

// Everything after the configuration: the device, the jobs, the listeners, metrics; then serves.
int Serve(const DaemonConfig& config) {
  // Who may connect and create jobs: TLS for TCP, allow-lists for CreateJob.
  auto transport = ServerTransportFor(config);
  if (!transport.ok()) return Fail(2, std::string(transport.status().message()));
  if (!transport->warning.empty()) MUOND_LOG(WARNING) << transport->warning;
  auto access = AccessPolicy::Create(config.allow_uids, config.allow_groups, transport->mutual_tls,
                                     ::geteuid());
  if (!access.ok()) return Fail(2, std::string(access.status().message()));
  const int threads =
      config.threads > 0 ? config.threads : std::max(1u, std::thread::hardware_concurrency());
  SetMathThreads(threads);
  auto devices = OpenDevice(config, threads);
  if (!devices.ok()) return Fail(FromStatus(devices.status()));
  const std::string backend = (*devices)->device->name();
  if (absl::Status s = durable::MakeDirs(config.state_dir, durable::kPrivateDirMode); !s.ok()) {
    return Fail(1, absl::StrCat("--state-dir: ", s.message()));
  }
  if (absl::Status s = MakeStatePrivate(config.state_dir); !s.ok()) {
    return Fail(1, std::string(s.message()));
  }
  auto unix_path = ApiServer::Prepare(config);
  if (!unix_path.ok()) return Fail(FromStatus(unix_path.status()));
  // Declared before the registry: destroyed after it, once every queued task ran.
  ComputeExecutor executor(threads);
  JobRegistry registry((*devices)->why, config.limits, config.gather_budget_bytes, &executor,
                       devices->get(), config.state_dir);
  if (config.limits.max_state_bytes == 0) {
    MUOND_LOG(WARNING) << "--max-state-bytes 0: job state is not limited";
  }
  if (absl::Status s = ArmCheckpointFault(); !s.ok()) {
    return Fail(2, absl::StrCat("MUOND_TEST_CHECKPOINT_FAULT: ", s.message()));
  }
  if (absl::Status s = ArmCommitHold(); !s.ok()) {
    return Fail(2, absl::StrCat("MUOND_TEST_COMMIT_HOLD_MS: ", s.message()));
  }
  if (absl::Status s = ArmInPlaceHold(); !s.ok()) {
    return Fail(2, absl::StrCat("MUOND_TEST_INPLACE_HOLD_MS: ", s.message()));
  }
  if (absl::Status s = ArmCommitFault(); !s.ok()) {
    return Fail(2, absl::StrCat("MUOND_TEST_COMMIT_FAULT: ", s.message()));
  }
  if (absl::Status s = ArmStall(); !s.ok()) {
    return Fail(2, absl::StrCat("MUOND_TEST_STALL: ", s.message()));
  }
  if (absl::Status s = ArmImportFault(); !s.ok()) {
    return Fail(2, absl::StrCat("MUOND_TEST_IMPORT_FAULT: ", s.message()));
  }
  if (absl::Status s = registry.Restore(); !s.ok()) {
    return Fail(1, absl::StrCat("--state-dir ", config.state_dir, ": ", s.message()));
  }
  auto api = ApiServer::Start(config, *unix_path, *transport, access->get(), &registry);
  if (!api.ok()) return Fail(FromStatus(api.status()));
  MUOND_LOG(INFO) << "muond " << MUOND_VERSION << " serving on " << config.listen
                  << (*api)->PortSuffix() << "; backend " << backend << ", " << threads
                  << " compute threads, gather budget " << config.gather_budget_bytes
                  << " bytes, state " << config.state_dir
                  << ((*api)->shm() ? absl::StrCat("; shared memory on ", (*api)->shm_path()) : "");
  // Logged once serving (a daemon that fails to start prints its one error line only).
  MUOND_LOG(INFO) << "cpu math " << DescribeCpuMathPath(CurrentCpuMathPath()) << "; AdamW "
                  << AdamWAutoPathName();
  auto observability = StartMetrics(config, backend, (*devices)->why, &registry, **api);
  if (!observability.ok()) return Fail(1, std::string(observability.status().message()));
  ServeUntilStopped(config, registry, *std::move(api), *std::move(observability));
  return 0;
}

int Run(int argc, char** argv) {
#ifndef MUOND_TEST_HOOKS
  // Debian's Abseil is built without NDEBUG, so every absl::Mutex (gRPC's included) runs Abseil's
  // deadlock detection: each lock taken while another is held updates a process-wide lock graph
  // under a global spinlock (measured here: 82 ns per nested lock pair instead of 12, and a lock
  // every thread shares). A release daemon turns it off; test builds (MUOND_TEST_HOOKS) keep it,
  // so the suites still report a lock-order inversion.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  // Stop signals go to a handler (any thread) and are read by the main thread; threads this
  // process starts from here on block them.
  if (absl::Status s = InstallStopSignals(); !s.ok()) return Fail(1, std::string(s.message()));
#ifdef M_MMAP_THRESHOLD
  // Resident memory must not depend on the step history, and a step must not pay page faults for
  // every buffer it allocates. glibc's default raises its mmap threshold to the size of each large
  // block freed, after which buffers stay resident in per-thread arenas in amounts that vary from
  // step to step; a low fixed threshold (every block of 256 KiB and more mapped, unmapped when
  // freed) kept memory flat but cost a fault and a zero fill per page of every buffer of every step
  // (LibTorch and oneDNN allocate per op): a third of the CPU time of a bf16 step. So: the largest
  // fixed threshold (32 MiB on 64-bit), no trimming at free, and HeapTrimmer
  // (server/engine/heap_trimmer.h) returning the free memory when no step is in flight.
  // One arena: malloc_trim gives back the free pages inside every arena but shrinks the top of the
  // main one only, and nothing trims a thread arena's top at free with this threshold, so with
  // per-thread arenas up to ~50 MiB of a deleted job's stream buffers stayed resident for good
  // (measured: after / before a 1.5 GiB job 1.03..1.15 with thread arenas, 1.002..1.006 with
  // one). Step time is unchanged within noise (muond-bench apply, world 1: ratio 0.49..0.61
  // either way); small blocks come from the per-thread caches without the arena's lock.
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
  mallopt(M_TRIM_THRESHOLD, 256 * 1024 * 1024);
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
  // Before anything runs oneDNN: a forced ISA caps it for the whole process.
  if (absl::Status s = ConfigureCpuIsa(config->cpu_isa); !s.ok()) {
    return Fail(2, std::string(s.message()));
  }
  SetOrthogonalityEvery(config->orthogonality_every);
  return Serve(*config);
}

}  // namespace
}  // namespace muond::server

int main(int argc, char** argv) { return muond::server::Run(argc, argv); }
