// muond's configuration: defaults, an optional config file, and command-line flags (flags win).
//
// The room server/record holds what the rooms above it are configured by and record: this
// configuration and the limits (daemon_limits.h), the Prometheus families and the Record*
// functions that update them (daemon_metrics.h, optimizer_metrics.h), the step history and the
// operation progress the status page shows (status_history.h, status_progress.h). It calls only
// the rooms below it (storage, device, optim) and common/; what reads every room to show it is
// server/ops (server/LAYERS).
//
// Config file: one `key = value` per line, keys named as the long flags without "--"
// (e.g. `listen = unix:///run/muond/muond.sock`); '#' starts a comment; unknown keys are errors.
#ifndef MUOND_SERVER_RECORD_DAEMON_CONFIG_H_
#define MUOND_SERVER_RECORD_DAEMON_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "server/device/device.h"
#include "server/record/daemon_limits.h"

namespace muond::server {

struct DaemonConfig {
  std::string listen;     // unix:///abs/path or HOST:PORT
  std::string state_dir;
  std::string shm_socket;  // "" : <listen path>.shm for unix listen addresses; "off": none
  std::string backend = "auto";
  std::string cpu_isa = "auto";  // auto, avx2, avx512 or amx (server/optim/cpu_isa.h)
  std::string log_level = "info";
  int threads = 0;        // compute threads; 0: one per CPU
  DaemonLimits limits = DefaultDaemonLimits();  // server/record/daemon_limits.h
  uint64_t gather_budget_bytes = uint64_t{1} << 30;  // per job, unless the job sets its own
  double shutdown_grace_seconds = 30;
  // A gRPC stream (Step, InitParams, exports) whose client sends or reads nothing this long is
  // cancelled (server/api/stream_guard.h).
  double stream_idle_seconds = 60;
  // The Prometheus endpoint, HOST:PORT. "": kDefaultMetricsAddress, best effort (a daemon that
  // cannot bind it logs an error and serves without metrics); "off": none. An address given
  // explicitly must bind, or muond exits 1.
  std::string metrics_address;
  device::SimulatedOptions simulated;  // --backend simulated
  bool serial_schedule = false;        // run each batch to completion before the next
  // Steps that are multiples of this measure the orthogonality of a sample of updates
  // (server/engine/step_observer.h); 0: never.
  int64_t orthogonality_every = 100;
  // Who may do what (server/api/peer_identity.h, server/api/tls_config.h). Comma-separated ids or names;
  // "" = everyone who can reach the socket may create jobs.
  std::string allow_uids;
  std::string allow_groups;
  std::string tls_cert;       // PEM server certificate (chain) for TCP listen addresses
  std::string tls_key;        // PEM private key
  std::string tls_client_ca;  // PEM CA: require and verify client certificates (mutual TLS)
  bool insecure_tcp = false;  // allow plaintext TCP on a non-loopback address
  // gRPC connections (Unix socket or TCP) held at once; 0: from RLIMIT_NOFILE.
  size_t max_connections = 0;
  bool help = false;
  bool version = false;
};

inline constexpr char kDefaultMetricsAddress[] = "127.0.0.1:9464";

// The text of `muond --help`.
std::string DaemonUsage();

// Parses argv (argv[0] is skipped). INVALID_ARGUMENT naming the flag, key or file line on error.
absl::StatusOr<DaemonConfig> ParseDaemonConfig(int argc, char** argv);

// Splits a listen address: for "unix:///p" sets *unix_path = "/p"; for HOST:PORT leaves it empty.
// INVALID_ARGUMENT for anything else (relative unix paths, missing or non-numeric port).
absl::Status ParseListenAddress(const std::string& address, std::string* unix_path);

}  // namespace muond::server

#endif  // MUOND_SERVER_RECORD_DAEMON_CONFIG_H_
