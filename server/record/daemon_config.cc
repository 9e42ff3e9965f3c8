#include "server/record/daemon_config.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/paths.h"
#include "common/status_macros.h"
#include "server/optim/cpu_isa.h"

namespace muond::server {
namespace {

// One option being applied: a flag or config-file key, its value, and where it was given ("--key"
// or "FILE:LINE"), for the error messages.
struct Option {
  const std::string& key;
  const std::string& value;
  const std::string& where;

  // INVALID_ARGUMENT: <where>: <key>="<value>": <why>
  absl::Status Invalid(const std::string& why) const {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", key, "=\"", value, "\": ", why));
  }
};

// Value forms shared by several options.
absl::Status SetBool(const Option& o, bool* out) {
  if (o.value != "true" && o.value != "false") return o.Invalid("expected true or false");
  *out = o.value == "true";
  return absl::OkStatus();
}

absl::Status SetString(const Option& o, std::string* out) {
  *out = o.value;
  return absl::OkStatus();
}

// A simulated-backend rate or latency: a number in [0, 1e9], 0 only where `zero_ok`.
absl::Status SetSimulatedNumber(const Option& o, bool zero_ok, double* out) {
  double v = 0;
  if (!absl::SimpleAtod(o.value, &v) || !(v >= 0) || v > 1e9 || (!zero_ok && v == 0)) {
    return o.Invalid("expected a positive number");
  }
  *out = v;
  return absl::OkStatus();
}

// Serving: where the API and the metrics listen, how many peers, how a stop ends, what is logged.
absl::Status SetListen(const Option& o, DaemonConfig& c) {
  std::string unused;
  absl::Status s = ParseListenAddress(o.value, &unused);
  if (!s.ok()) return o.Invalid(std::string(s.message()));
  c.listen = o.value;
  return absl::OkStatus();
}

absl::Status SetStateDir(const Option& o, DaemonConfig& c) {
  if (o.value.empty() || o.value[0] != '/') return o.Invalid("must be an absolute path");
  c.state_dir = o.value;
  return absl::OkStatus();
}

absl::Status SetShmSocket(const Option& o, DaemonConfig& c) {
  if (o.value != "off" && (o.value.empty() || o.value[0] != '/')) {
    return o.Invalid("expected an absolute path or off");
  }
  c.shm_socket = o.value;
  return absl::OkStatus();
}

absl::Status SetMetricsAddress(const Option& o, DaemonConfig& c) {
  if (o.value != "off") {
    std::string unix_path;
    absl::Status s = ParseListenAddress(o.value, &unix_path);
    if (!s.ok() || !unix_path.empty()) return o.Invalid("expected HOST:PORT or off");
  }
  c.metrics_address = o.value;
  return absl::OkStatus();
}

absl::Status SetMaxConnections(const Option& o, DaemonConfig& c) {
  if (!absl::SimpleAtoi(o.value, &c.max_connections) || c.max_connections > 1000000) {
    return o.Invalid("expected a count in [0, 1000000]");
  }
  return absl::OkStatus();
}

absl::Status SetShutdownGrace(const Option& o, DaemonConfig& c) {
  if (!absl::SimpleAtod(o.value, &c.shutdown_grace_seconds) || !(c.shutdown_grace_seconds >= 0) ||
      c.shutdown_grace_seconds > 3600) {
    return o.Invalid("expected seconds in [0, 3600]");
  }
  return absl::OkStatus();
}

absl::Status SetStreamIdle(const Option& o, DaemonConfig& c) {
  if (!absl::SimpleAtod(o.value, &c.stream_idle_seconds) || !(c.stream_idle_seconds > 0) ||
      c.stream_idle_seconds > 86400) {
    return o.Invalid("expected seconds in (0, 86400]");
  }
  return absl::OkStatus();
}

absl::Status SetLogLevel(const Option& o, DaemonConfig& c) {
  const std::string& v = o.value;
  if (v != "debug" && v != "info" && v != "warning" && v != "error") {
    return o.Invalid("expected debug, info, warning or error");
  }
  c.log_level = v;
  return absl::OkStatus();
}

// Compute: the threads, how much a job gathers at once, the simulated backend's faults.
absl::Status SetThreads(const Option& o, DaemonConfig& c) {
  if (!absl::SimpleAtoi(o.value, &c.threads) || c.threads < 0 || c.threads > 1024) {
    return o.Invalid("expected an integer in [0, 1024]");
  }
  return absl::OkStatus();
}

absl::Status SetCpuIsa(const Option& o, DaemonConfig& c) {
  if (!IsCpuIsaRequest(o.value)) return o.Invalid(kCpuIsaRequestsExpected);
  c.cpu_isa = o.value;
  return absl::OkStatus();
}

absl::Status SetGatherBudget(const Option& o, DaemonConfig& c) {
  if (!absl::SimpleAtoi(o.value, &c.gather_budget_bytes) || c.gather_budget_bytes == 0) {
    return o.Invalid("expected a byte count > 0");
  }
  return absl::OkStatus();
}

absl::Status SetOrthogonalityEvery(const Option& o, DaemonConfig& c) {
  if (!absl::SimpleAtoi(o.value, &c.orthogonality_every) || c.orthogonality_every < 0 ||
      c.orthogonality_every > 1000000000) {
    return o.Invalid("expected a step count in [0, 1000000000] (0: never)");
  }
  return absl::OkStatus();
}

absl::Status SetSimFailKernel(const Option& o, DaemonConfig& c) {
  if (!absl::SimpleAtoi(o.value, &c.simulated.fail_kernel) || c.simulated.fail_kernel < 0) {
    return o.Invalid("expected an integer >= 0");
  }
  return absl::OkStatus();
}

using OptionSetter = absl::Status (*)(const Option& o, DaemonConfig& c);

// Every option but the limits (daemon_limits.h), by its flag name; `muond --help` documents them.
const std::map<std::string, OptionSetter>& OptionSetters() {
  using O = const Option&;
  using C = DaemonConfig&;
  static const auto* const setters = new std::map<std::string, OptionSetter>{
      // Serving.
      {"listen", SetListen},
      {"state-dir", SetStateDir},
      {"shm-socket", SetShmSocket},
      {"metrics-address", SetMetricsAddress},
      {"max-connections", SetMaxConnections},
      {"shutdown-grace-seconds", SetShutdownGrace},
      {"stream-idle-seconds", SetStreamIdle},
      {"log-level", SetLogLevel},
      // Compute, and the simulated backend's model.
      {"backend", [](O o, C c) { return SetString(o, &c.backend); }},
      {"cpu-isa", SetCpuIsa},
      {"threads", SetThreads},
      {"gather-budget-bytes", SetGatherBudget},
      {"serial-schedule", [](O o, C c) { return SetBool(o, &c.serial_schedule); }},
      {"orthogonality-every", SetOrthogonalityEvery},
      {"sim-copy-gbps",
       [](O o, C c) { return SetSimulatedNumber(o, false, &c.simulated.copy_gbps); }},
      {"sim-compute-gflops",
       [](O o, C c) { return SetSimulatedNumber(o, false, &c.simulated.compute_gflops); }},
      {"sim-copy-latency-us",
       [](O o, C c) { return SetSimulatedNumber(o, true, &c.simulated.copy_latency_us); }},
      {"sim-sleep", [](O o, C c) { return SetBool(o, &c.simulated.sleep); }},
      {"sim-fail-kernel", SetSimFailKernel},
      // Access: who may create jobs, TLS.
      {"allow-uids", [](O o, C c) { return SetString(o, &c.allow_uids); }},
      {"allow-groups", [](O o, C c) { return SetString(o, &c.allow_groups); }},
      {"tls-cert", [](O o, C c) { return SetString(o, &c.tls_cert); }},
      {"tls-key", [](O o, C c) { return SetString(o, &c.tls_key); }},
      {"tls-client-ca", [](O o, C c) { return SetString(o, &c.tls_client_ca); }},
      {"insecure-tcp", [](O o, C c) { return SetBool(o, &c.insecure_tcp); }},
  };
  return *setters;
}

// Applies one option (flag or config key) to the config.
absl::Status Apply(DaemonConfig& c, const std::string& key, const std::string& value,
                   const std::string& where) {
  if (IsLimitKey(key)) return ApplyLimit(c.limits, key, value, where);
  const auto it = OptionSetters().find(key);
  if (it == OptionSetters().end()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": unknown option '", key, "'"));
  }
  return it->second(Option{key, value, where}, c);
}

absl::Status ApplyFile(DaemonConfig& c, const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file ", path, ": cannot open: ", std::strerror(errno)));
  }
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const std::string where = absl::StrCat(path, ":", n);
    const size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty()) continue;
    const size_t eq = text.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": expected 'key = value'"));
    }
    std::string key(absl::StripAsciiWhitespace(text.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(text.substr(eq + 1)));
    if (key == "config") return absl::InvalidArgumentError(absl::StrCat(where, ": nested config"));
    RETURN_IF_ERROR(Apply(c, key, value, where));
  }
  return absl::OkStatus();
}

// --help: where muond listens and keeps its state.
std::string EndpointUsage() {
  return absl::StrCat(
      "  --listen ADDR           unix:///abs/path/to/socket or HOST:PORT (TCP: TLS with "
      "--tls-cert,\n"
      "                          plaintext only on loopback or with --insecure-tcp). Default: ",
      common::DefaultListenAddress(),
      "\n"
      "                          (the directory is created 0750, the socket 0660).\n"
      "  --state-dir DIR         where job state and checkpoints live (directories 0700, files\n"
      "                          0600: the daemon user's alone; looser modes are repaired at\n"
      "                          start). Default: ",
      common::DefaultStateDir(),
      "\n"
      "  --shm-socket PATH|off   the node-local shared-memory data plane's socket (memfd regions\n"
      "                          passed with SCM_RIGHTS). Default: the --listen socket path +\n"
      "                          \".shm\" for unix addresses, off for TCP.\n");
}

// --help: the compute backend and how the optimizer math runs.
std::string ComputeUsage() {
  return std::string(
      "  --backend NAME          compute backend: auto, cpu, simulated, cuda or level_zero (GPU\n"
      "                          memory is limited to 3 x --gather-budget-bytes, >= 1 GiB). "
      "Default:\n"
      "                          auto (the first working GPU backend compiled in, else cpu; the\n"
      "                          log and muonctl job show say which and why).\n"
      "  --cpu-isa auto|avx2|avx512|amx  the widest CPU instructions the optimizer math may use\n"
      "                          (cpu backend Newton-Schulz, AdamW). bf16 products run on "
      "oneDNN's\n"
      "                          bf16 kernels with avx512 (AVX-512 BF16) and amx, else emulated "
      "in\n"
      "                          fp32 with the same roundings. A forced ISA may not be wider than\n"
      "                          the CPU has. Default: auto (probed at start; the log, muonctl "
      "job\n"
      "                          show, the status page and muond_build_info say which).\n"
      "  --sim-copy-gbps X       simulated backend: host<->device bandwidth in GB/s. Default: 16\n"
      "  --sim-copy-latency-us X simulated backend: latency per copy. Default: 10\n"
      "  --sim-compute-gflops X  simulated backend: Newton-Schulz rate. Default: 200\n"
      "  --sim-sleep true|false  simulated backend: also spend the modelled time. Default: false\n"
      "  --sim-fail-kernel N     simulated backend, for fault tests: the N-th kernel fails.\n"
      "  --serial-schedule true|false  run each batch's copy-in, compute and writeback to the\n"
      "                          end before the next (no overlap; for comparison). Default: false\n"
      "  --orthogonality-every N  on steps that are multiples of N, measure ||U U^T - I||_F /\n"
      "                          sqrt(r) of the orthogonalized update of a sample of up to 4 Muon\n"
      "                          matrices (a different sample each time; metric\n"
      "                          muond_update_orthogonality, the status page). 0: never.\n"
      "                          Default: 100\n");
}

// --help: the config file, threads, budgets, timeouts, metrics and logging.
std::string ServingUsage() {
  return std::string(
      "  --config FILE           read options from FILE ('key = value' lines, '#' comments);\n"
      "                          flags given on the command line override it.\n"
      "  --threads N             CPU compute threads; 0 = one per CPU. Default: 0\n"
      "  --gather-budget-bytes N  bytes of whole matrices a job assembles at once (fp32 gradient\n"
      "                          and temporary momentum, 8 bytes per element); a larger matrix is\n"
      "                          processed alone. A job may set its own. Default: 1073741824\n"
      "  --shutdown-grace-seconds S  on SIGTERM/SIGINT, how long steps in flight may run before\n"
      "                          they are cancelled. Default: 30\n"
      "  --stream-idle-seconds S  a gRPC stream (step, parameter upload, export) whose client\n"
      "                          sends or reads nothing for S seconds is cancelled; streams not\n"
      "                          in a step are cancelled at once on SIGTERM/SIGINT. Default: 60\n"
      "  --metrics-address HOST:PORT|off  Prometheus text format on http://HOST:PORT/metrics\n"
      "                          (no TLS, no auth: keep it on loopback or a trusted network).\n"
      "                          Default: 127.0.0.1:9464 (if that port is taken the daemon logs\n"
      "                          an error and serves without metrics; an address given\n"
      "                          explicitly must bind). off: no endpoint.\n"
      "  --log-level LEVEL       debug, info, warning or error. Default: info\n");
}

// --help: who may connect and create jobs, and over what.
std::string AccessUsage() {
  return std::string(
      "  --allow-uids LIST       comma-separated uids or user names that may create jobs over the\n"
      "                          Unix socket (peer credentials, SO_PEERCRED). Default: empty =\n"
      "                          everyone who can open the socket. Root and the daemon's own uid\n"
      "                          always may. With an allow-list, TCP peers may create jobs only\n"
      "                          with a client certificate verified by mutual TLS.\n"
      "  --allow-groups LIST     comma-separated gids or group names; a peer whose gid or whose\n"
      "                          user's groups include one of them may create jobs.\n"
      "  --max-connections N     gRPC connections (Unix socket or TCP) held at once; more\n"
      "                          are closed at accept.\n"
      "                          0 = the open-file limit less a quarter (at least 64 kept back).\n"
      "                          Default: 0\n"
      "  --tls-cert FILE         TCP only: PEM server certificate (chain); with --tls-key the API\n"
      "                          is served over TLS.\n"
      "  --tls-key FILE          TCP only: PEM private key of --tls-cert.\n"
      "  --tls-client-ca FILE    TCP only: PEM CA; clients must present a certificate it signed\n"
      "                          (mutual TLS).\n"
      "  --insecure-tcp          allow plaintext TCP on an address that is not loopback (logged "
      "as\n"
      "                          a WARNING). Without it such a --listen is refused (exit 2);\n"
      "                          127.0.0.0/8, ::1 and localhost need no TLS.\n");
}

}  // namespace

std::string DaemonUsage() {
  return absl::StrCat(
      "Usage: muond [options]\n"
      "\n"
      "muond keeps the Muon optimizer state of training jobs on this node and computes their\n"
      "updates. Options (a config file may set the same keys, without the leading --):\n",
      EndpointUsage(), ComputeUsage(), ServingUsage(), AccessUsage(),
      "  --help                  print this help and exit\n"
      "  --version               print the version and exit\n"
      "\n",
      LimitsUsage(),
      "\n"
      "Signals: SIGTERM or SIGINT stop accepting new steps, let steps in flight finish (or cancel\n"
      "them after the grace period, which aborts them with a clear status) and exit 0.\n"
      "Exit codes: 0 clean stop, 1 runtime failure (e.g. cannot listen), 2 bad configuration.\n");
}

absl::Status ParseListenAddress(const std::string& address, std::string* unix_path) {
  unix_path->clear();
  if (absl::StartsWith(address, "unix:")) {
    if (!absl::StartsWith(address, "unix:///")) {
      return absl::InvalidArgumentError("a unix address must be unix:///absolute/path");
    }
    *unix_path = address.substr(7);
    if (unix_path->size() > 100) {
      return absl::InvalidArgumentError("unix socket path longer than 100 bytes");
    }
    return absl::OkStatus();
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError("expected unix:///path or HOST:PORT");
  }
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError("the port must be a number in [0, 65535]");
  }
  return absl::OkStatus();
}

absl::StatusOr<DaemonConfig> ParseDaemonConfig(int argc, char** argv) {
  // Pass 1 collects the flags; the config file (if any) is applied first, then the flags.
  std::vector<std::pair<std::string, std::string>> flags;
  std::string config_file;
  DaemonConfig c;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      c.help = true;
      continue;
    }
    if (arg == "--insecure-tcp") {  // a switch: no value
      flags.emplace_back("insecure-tcp", "true");
      continue;
    }
    if (arg == "--version") {
      c.version = true;
      continue;
    }
    if (!absl::StartsWith(arg, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    std::string key = arg.substr(2), value;
    const size_t eq = key.find('=');
    if (eq != std::string::npos) {
      value = key.substr(eq + 1);
      key.resize(eq);
    } else {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(arg, ": missing value"));
      value = argv[++i];
    }
    if (key == "config") {
      config_file = value;
    } else {
      flags.emplace_back(key, value);
    }
  }
  if (c.help || c.version) return c;
  if (!config_file.empty()) RETURN_IF_ERROR(ApplyFile(c, config_file));
  for (const auto& [key, value] : flags) RETURN_IF_ERROR(Apply(c, key, value, "--" + key));
  if (c.listen.empty()) c.listen = common::DefaultListenAddress();
  if (c.state_dir.empty()) c.state_dir = common::DefaultStateDir();
  return c;
}

}  // namespace muond::server
