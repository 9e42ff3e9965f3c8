// The daemon's limits: every size or count a client can make the daemon hold is bounded by one of
// these, checked before anything is allocated. Each is a flag and a config key (`muond --help`),
// exported as muond_limit{limit="<key>"}, and every refusal names the limit (its flag), the value
// asked for and the value allowed.
//
// Defaults are derived from the machine where a fixed number would be wrong on some node (state
// memory: half of physical memory). Plain value type; thread-compatible.
#ifndef MUOND_SERVER_RECORD_DAEMON_LIMITS_H_
#define MUOND_SERVER_RECORD_DAEMON_LIMITS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace muond::server {

// --step-window-bytes unless given.
inline constexpr uint64_t kDefaultStepWindowBytes = uint64_t{256} << 20;

struct DaemonLimits {
  // Bytes all jobs may hold, each job's JobFootprint (state, tables, step buffers and
  // shared-memory regions, a save's copy, gathered matrices; sized from the spec at admission);
  // 0 = unlimited. Default: half of physical memory.
  uint64_t max_state_bytes = 0;
  int max_jobs = 64;
  int max_world_size = 4096;
  int max_tensors_per_job = 65536;
  // Shard spans of one job over all ranks (ZeRO-3 makes world_size x tensors of them).
  uint64_t max_spans_per_job = uint64_t{1} << 20;
  // The shared-memory data plane: attached plus pending connections, and how long a connection
  // may take to send its attach request.
  int max_shm_sessions = 256;
  double shm_attach_timeout_seconds = 5;
  // Of those, connections not attached yet from one peer uid / one peer pid (0: a quarter of
  // max_shm_sessions / half the per-uid bound; ShmLimits).
  int max_shm_pending_per_uid = 0;
  int max_shm_pending_per_pid = 0;
  // Connections to the metrics endpoint open at once (the oldest idle one is shed beyond it).
  int max_metrics_connections = 1024;
  // A job's step timeout when its spec sets none (counted from the first rank's entry).
  int step_timeout_seconds = 600;
  // A two-phase step (many nodes) computed and neither committed nor aborted by the trainer is
  // dropped (state unchanged, not fenced) this long after it was prepared.
  int prepare_timeout_seconds = 300;
  // A job's step window when its spec sets none (server/engine/state_buffers.h: the state a step
  // computes before it is sealed; at least the job's largest tensor's, at most its whole state).
  uint64_t step_window_bytes = kDefaultStepWindowBytes;
};

// The defaults for this machine (max_state_bytes = physical memory / 2).
DaemonLimits DefaultDaemonLimits();

// True for a config key / flag name (without "--") that sets a limit.
bool IsLimitKey(const std::string& key);
// Applies one limit option. INVALID_ARGUMENT "<where>: <key>=\"<value>\": <why>" when malformed.
absl::Status ApplyLimit(DaemonLimits& limits, const std::string& key, const std::string& value,
                        const std::string& where);
// The --help lines of the limit flags.
std::string LimitsUsage();
// (key, value) of every limit, for muond_limit and the start-up log line.
std::vector<std::pair<std::string, double>> LimitValues(const DaemonLimits& limits,
                                                        uint64_t gather_budget_bytes);

// Physical memory of this machine in bytes (sysconf), 0 if unknown.
uint64_t PhysicalMemoryBytes();

}  // namespace muond::server

#endif  // MUOND_SERVER_RECORD_DAEMON_LIMITS_H_
