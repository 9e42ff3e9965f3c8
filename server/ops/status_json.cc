#include "server/ops/status_json.h"

#include <sys/resource.h>

#include <map>
#include <set>

#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "server/api/shm_server.h"
#include "server/jobs/job_registry.h"
#include "server/record/status_history.h"
#include "server/record/status_progress.h"

namespace muond::server {
namespace {

using Json = nlohmann::json;
using SharedSessions = std::map<std::pair<std::string, int>, uint64_t>;

Json DaemonJson(const StatusInfo& info, const JobRegistry& jobs, const ShmServer* shm,
                int64_t now_ms) {
  Json limits = Json::object();
  for (const auto& [key, value] : info.limits) limits[key] = value;
  Json d = {{"version", info.version},
            {"backend", info.backend},
            {"backend_why", info.backend_why},
            {"device", info.device},
            {"cpu_math", info.cpu_math},
            {"metrics_address", info.metrics_address},
            {"start_unix_ms", info.start_unix_ms},
            {"uptime_seconds", static_cast<double>(now_ms - info.start_unix_ms) / 1000.0},
            {"limits", limits},
            {"jobs", jobs.List().size()},
            {"state_bytes", jobs.state_bytes()},
            {"momentum_bytes", jobs.momentum_bytes()},
            {"compute_queue_depth", jobs.compute_queue_depth()}};
  const ShmServer::Usage usage = shm != nullptr ? shm->usage() : ShmServer::Usage();
  d["shm_sessions"] = usage.sessions;
  d["pinned_bytes"] = usage.pinned_bytes;
  rlimit limit{};
  d["memlock_limit_bytes"] = nullptr;
  if (getrlimit(RLIMIT_MEMLOCK, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    d["memlock_limit_bytes"] = static_cast<uint64_t>(limit.rlim_cur);
  }
  return d;
}

Json RanksJson(const JobReport& r, const SharedSessions& shared) {
  Json ranks = Json::array();
  for (const RankReport& rank : r.ranks) {
    std::string transport = "";
    if (rank.attached) {
      const auto it = shared.find({r.spec.job_id, rank.rank});
      transport = it != shared.end() && it->second == rank.session_id ? "shm" : "grpc";
    }
    ranks.push_back({{"rank", rank.rank},
                     {"attached", rank.attached},
                     {"transport", transport},
                     {"in_step", rank.in_step}});
  }
  return ranks;
}

Json RecentStepsJson(const std::string& job_id) {
  Json steps = Json::array();
  for (const StepSample& s : StepHistory::Default().Steps(job_id)) {
    steps.push_back(
        {{"step", s.step},
         {"unix_ms", s.unix_ms},
         {"seconds", s.seconds},
         {"phases", std::vector<double>(s.phase_seconds.begin(), s.phase_seconds.end())}});
  }
  return steps;
}

// What the operators see beyond the counters (server/record/optimizer_metrics.h): Newton-Schulz time
// by shape class, the newest orthogonality sample, the trainer's view of the newest step, and the
// pipeline's pressure.
Json ObservationsJson(const JobReport& r, uint64_t session_region_bytes) {
  Json shapes = Json::array();
  for (const JobReport::ShapeTime& t : r.newton_schulz) {
    shapes.push_back({{"shape", t.shape},
                      {"per_step", t.per_step},
                      {"matrices", t.matrices},
                      {"seconds", t.seconds},
                      {"mean_seconds", t.matrices > 0 ? t.seconds / t.matrices : 0.0}});
  }
  Json o = {{"newton_schulz", std::move(shapes)},
            {"orthogonality", nullptr},
            {"trainer", nullptr},
            {"matrices_waiting", r.matrices_waiting},
            {"gather_in_use_bytes", r.gather_in_use_bytes},
            {"pinned_bytes",
             {{"momentum", r.pinned_momentum_bytes},
              {"masters", r.pinned_masters_bytes},
              {"moments", r.pinned_moments_bytes},
              {"session_regions", session_region_bytes},
              {"staging", r.pinned_staging_bytes}}}};
  if (r.orthogonality_step) {
    o["orthogonality"] = {{"step", *r.orthogonality_step},
                          {"value", r.orthogonality},
                          {"matrices", r.orthogonality_matrices}};
  }
  o["qk_clip"] = nullptr;
  if (r.spec.qk_clip.enabled()) {
    o["qk_clip"] = {{"threshold", r.spec.qk_clip.threshold},
                    {"pairs", r.spec.qk_clip.pairs.size()},
                    {"heads_clipped", r.qk_heads_clipped},
                    {"max_logit", r.qk_max_logit ? Json(*r.qk_max_logit) : Json(nullptr)}};
  }
  if (r.trainer_step) {
    o["trainer"] = {{"step", *r.trainer_step},
                    {"visible_seconds", r.trainer_visible_seconds},
                    {"wait_seconds", r.trainer_wait_seconds}};
  }
  return o;
}

// Host bytes by kind (job_report.h): held now and reserved at admission.
Json MemoryJson(const JobReport& r) {
  Json m = Json::object();
  const auto held = MemoryKinds(r.memory);
  const auto footprint = MemoryKinds(r.footprint);
  for (size_t k = 0; k < held.size(); ++k) {
    m[held[k].first] = {{"bytes", held[k].second}, {"footprint_bytes", footprint[k].second}};
  }
  return m;
}

Json JobJson(const JobReport& r, const SharedSessions& shared, uint64_t session_region_bytes,
             int64_t now_ms) {
  const bool apply = r.spec.mode == common::JobMode::kApply;
  int attached = 0;
  for (const RankReport& rank : r.ranks) attached += rank.attached ? 1 : 0;
  // Whoever reaches the metrics address reads this: ids, sizes and state only; no owner, spec,
  // paths or session ids (ListJobs shows those to the job's owner and token holders).
  Json j = {{"id", r.spec.job_id},
            {"mode", std::string(common::JobModeName(r.spec.mode))},
            {"world_size", r.spec.world_size},
            {"zero_stage", r.spec.zero_stage},
            {"tensors", r.spec.matrices.size()},
            {"ranks_attached", attached},
            {"ranks", RanksJson(r, shared)},
            {"next_step", r.next_step},
            {"step_in_flight", nullptr},
            {"steps_completed", r.steps_completed},
            {"steps_refused", r.steps_refused},
            {"steps_skipped", r.steps_skipped},
            {"steps_aborted", r.steps_aborted},
            {"fenced", r.fenced},
            {"fence_reason", r.fence_reason},
            {"state_bytes", r.momentum_bytes},
            {"state_kind", apply ? "masters + optimizer state" : "momentum"},
            {"memory", MemoryJson(r)},
            {"memory_bytes", r.memory.total()},
            {"footprint_bytes", r.footprint.total()},
            {"checkpoint", nullptr},
            {"recent_steps", RecentStepsJson(r.spec.job_id)},
            {"optimizer", ObservationsJson(r, session_region_bytes)}};
  if (r.step_in_flight) j["step_in_flight"] = *r.step_in_flight;
  if (r.last_checkpoint_step) {
    j["checkpoint"] = {
        {"step", *r.last_checkpoint_step},
        {"unix_ms", r.last_checkpoint_unix_ms},
        {"age_seconds", static_cast<double>(now_ms - r.last_checkpoint_unix_ms) / 1000.0}};
  }
  return j;
}

Json OperationsJson() {
  Json ops = Json::array();
  for (const OperationReport& o : OperationProgress::Default().All()) {
    ops.push_back({{"job", o.job_id},
                   {"kind", o.kind},
                   {"target", o.target},
                   {"bytes_done", o.bytes_done},
                   {"bytes_total", o.bytes_total},
                   {"started_unix_ms", o.started_unix_ms},
                   {"ended_unix_ms", o.ended_unix_ms},
                   {"done", o.done},
                   {"error", o.error}});
  }
  return ops;
}

}  // namespace

StatusSource::StatusSource(const JobRegistry* jobs, const ShmServer* shm, StatusInfo info)
    : jobs_(jobs), shm_(shm), info_(std::move(info)) {}

void StatusSource::SetMetricsAddress(const std::string& address) {
  absl::MutexLock lock(&mu_);
  info_.metrics_address = address;
}

std::string StatusSource::Render() const {
  StatusInfo info;
  {
    absl::MutexLock lock(&mu_);
    info = info_;
  }
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  const SharedSessions shared = shm_ != nullptr ? shm_->shared_sessions() : SharedSessions();
  const ShmServer::Usage usage = shm_ != nullptr ? shm_->usage() : ShmServer::Usage();
  const std::map<std::string, uint64_t>& regions = usage.pinned_bytes_by_job;
  Json jobs = Json::array();
  std::set<std::string> present;
  for (const auto& job : jobs_->List()) {
    JobReport r = job->Report();
    present.insert(r.spec.job_id);
    r.memory.buffers += usage.region_bytes(r.spec.job_id);
    const auto region = regions.find(r.spec.job_id);
    jobs.push_back(
        JobJson(r, shared, region != regions.end() ? region->second : uint64_t{0}, now_ms));
  }
  StepHistory::Default().Prune(present);
  OperationProgress::Default().Prune(present);
  Json broken = Json::array();
  for (const JobRegistry::BrokenJob& b : jobs_->Broken()) {
    broken.push_back({{"directory", b.directory}, {"reason", b.reason}});
  }
  Json out = {{"format", "muond-status"},
              {"format_version", 1},
              {"now_unix_ms", now_ms},
              {"daemon", DaemonJson(info, *jobs_, shm_, now_ms)},
              {"phases", std::vector<std::string>(std::begin(StepHistory::kPhaseNames),
                                                  std::end(StepHistory::kPhaseNames))},
              {"jobs", std::move(jobs)},
              {"broken_jobs", std::move(broken)},
              {"operations", OperationsJson()}};
  return out.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace muond::server
