#include "server/record/daemon_limits.h"

#include <unistd.h>

#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec.h"

namespace muond::server {

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

DaemonLimits DefaultDaemonLimits() {
  DaemonLimits l;
  l.max_state_bytes = PhysicalMemoryBytes() / 2;
  return l;
}

bool IsLimitKey(const std::string& key) {
  return key == "max-state-bytes" || key == "max-momentum-bytes" || key == "max-jobs" ||
         key == "max-world-size" || key == "max-tensors-per-job" || key == "max-spans-per-job" ||
         key == "max-shm-sessions" || key == "shm-attach-timeout-seconds" ||
         key == "max-shm-pending-per-uid" || key == "max-shm-pending-per-pid" ||
         key == "step-timeout-seconds" || key == "max-metrics-connections" ||
         key == "prepare-timeout-seconds" || key == "step-window-bytes";
}

absl::Status ApplyLimit(DaemonLimits& l, const std::string& key, const std::string& value,
                        const std::string& where) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", key, "=\"", value, "\": ", why));
  };
  auto count = [&](int lo, int hi, int* out) {
    int v = 0;
    if (!absl::SimpleAtoi(value, &v) || v < lo || v > hi) {
      return bad(absl::StrCat("expected an integer in [", lo, ", ", hi, "]"));
    }
    *out = v;
    return absl::OkStatus();
  };
  if (key == "max-state-bytes" || key == "max-momentum-bytes") {
    if (!absl::SimpleAtoi(value, &l.max_state_bytes)) return bad("expected a byte count");
  } else if (key == "max-jobs") {
    return count(1, 1 << 20, &l.max_jobs);
  } else if (key == "max-world-size") {
    return count(1, common::kMaxWorldSize, &l.max_world_size);
  } else if (key == "max-tensors-per-job") {
    return count(1, 1 << 24, &l.max_tensors_per_job);
  } else if (key == "max-spans-per-job") {
    if (!absl::SimpleAtoi(value, &l.max_spans_per_job) || l.max_spans_per_job == 0 ||
        l.max_spans_per_job > (uint64_t{1} << 32)) {
      return bad("expected an integer in [1, 4294967296]");
    }
  } else if (key == "max-shm-sessions") {
    return count(1, 1 << 20, &l.max_shm_sessions);
  } else if (key == "max-shm-pending-per-uid") {
    return count(0, 1 << 20, &l.max_shm_pending_per_uid);
  } else if (key == "max-shm-pending-per-pid") {
    return count(0, 1 << 20, &l.max_shm_pending_per_pid);
  } else if (key == "shm-attach-timeout-seconds") {
    double v = 0;
    if (!absl::SimpleAtod(value, &v) || !(v > 0) || v > 3600) {
      return bad("expected seconds in (0, 3600]");
    }
    l.shm_attach_timeout_seconds = v;
  } else if (key == "max-metrics-connections") {
    return count(1, 1 << 20, &l.max_metrics_connections);
  } else if (key == "step-timeout-seconds") {
    return count(1, common::kMaxStepTimeoutSeconds, &l.step_timeout_seconds);
  } else if (key == "step-window-bytes") {
    if (!absl::SimpleAtoi(value, &l.step_window_bytes) || l.step_window_bytes == 0 ||
        l.step_window_bytes > (uint64_t{1} << 62)) {
      return bad("expected a byte count in [1, 4611686018427387904]");
    }
  } else if (key == "prepare-timeout-seconds") {
    return count(1, common::kMaxStepTimeoutSeconds, &l.prepare_timeout_seconds);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(where, ": unknown option '", key, "'"));
  }
  return absl::OkStatus();
}

std::string LimitsUsage() {
  return absl::StrCat(
      "Limits (checked before anything is allocated; a request beyond one is refused with\n"
      "RESOURCE_EXHAUSTED or INVALID_ARGUMENT naming the limit; each is exported as\n"
      "muond_limit{limit=\"KEY\"}):\n"
      "  --max-state-bytes N     bytes all jobs may hold, each counted at admission: its fp32\n"
      "                          state, layout tables, step buffers and shared-memory regions,\n"
      "                          a save's copy of the state and its gathered matrices.\n"
      "                          0 = unlimited. Default: half of physical memory (",
      PhysicalMemoryBytes() / 2,
      " here).\n"
      "  --max-momentum-bytes N  the same limit (older name).\n"
      "  --max-jobs N            jobs on this daemon. Default: 64\n"
      "  --max-world-size N      ranks of one job. Default: 4096\n"
      "  --max-tensors-per-job N tensors (matrices) of one job. Default: 65536\n"
      "  --max-spans-per-job N   shard spans of one job over all ranks (ZeRO-3: world size x\n"
      "                          tensors). Default: 1048576\n"
      "  --max-shm-sessions N    shared-memory connections (attached and attaching). Default: 256\n"
      "  --max-shm-pending-per-uid N  of those, connections not attached yet from one user, so\n"
      "                          that one user's idle connections cannot refuse another's attach.\n"
      "                          Default: 0 (a quarter of --max-shm-sessions)\n"
      "  --max-shm-pending-per-pid N  the same per process. Default: 0 (half the per-user bound)\n"
      "  --shm-attach-timeout-seconds S  a shared-memory connection must attach within S.\n"
      "                          Default: 5\n"
      "  --max-metrics-connections N  connections to the metrics endpoint at once; beyond it the\n"
      "                          oldest idle one is closed. Default: 1024\n"
      "  --step-timeout-seconds S  a job's step timeout unless its spec sets one: S after the\n"
      "                          first rank entered a step, ranks that have not pushed their part\n"
      "                          abort it (named) and the job is fenced. Default: 600\n"
      "  --prepare-timeout-seconds S  a multi-node job's step that was computed (prepared) and\n"
      "                          neither committed nor aborted by the trainer within S is "
      "dropped:\n"
      "                          state unchanged, the step expected again. Default: 300\n"
      "  --step-window-bytes N   a job's step window unless its spec sets one: the next state of\n"
      "                          the tensors a step computes before it is sealed (at least the\n"
      "                          job's largest tensor's, at most its whole state); when it is\n"
      "                          full, compute waits for the seal. Default: 268435456 (256 MiB)\n");
}

std::vector<std::pair<std::string, double>> LimitValues(const DaemonLimits& l,
                                                        uint64_t gather_budget_bytes) {
  return {{"max_state_bytes", static_cast<double>(l.max_state_bytes)},
          {"max_jobs", l.max_jobs},
          {"max_world_size", l.max_world_size},
          {"max_tensors_per_job", l.max_tensors_per_job},
          {"max_spans_per_job", static_cast<double>(l.max_spans_per_job)},
          {"max_shm_sessions", l.max_shm_sessions},
          {"shm_attach_timeout_seconds", l.shm_attach_timeout_seconds},
          {"max_shm_pending_per_uid", l.max_shm_pending_per_uid},
          {"max_shm_pending_per_pid", l.max_shm_pending_per_pid},
          {"step_timeout_seconds", l.step_timeout_seconds},
          {"step_window_bytes", static_cast<double>(l.step_window_bytes)},
          {"prepare_timeout_seconds", l.prepare_timeout_seconds},
          {"max_metrics_connections", l.max_metrics_connections},
          {"gather_budget_bytes", static_cast<double>(gather_budget_bytes)}};
}

}  // namespace muond::server
