#include "server/record/status_history.h"

namespace muond::server {

StepHistory& StepHistory::Default() {
  static StepHistory* history = new StepHistory();
  return *history;
}

void StepHistory::Record(const std::string& job_id, int64_t created_unix_ms,
                         const StepSample& sample) {
  absl::MutexLock lock(&mu_);
  JobSteps& job = jobs_[job_id];
  if (job.created_unix_ms != created_unix_ms) {
    job.steps.clear();
    job.created_unix_ms = created_unix_ms;
  }
  job.steps.push_back(sample);
  while (job.steps.size() > kStepsKept) job.steps.pop_front();
}

std::vector<StepSample> StepHistory::Steps(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  const auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return {};
  return std::vector<StepSample>(it->second.steps.begin(), it->second.steps.end());
}

void StepHistory::Prune(const std::set<std::string>& present) {
  absl::MutexLock lock(&mu_);
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    it = present.count(it->first) == 0 ? jobs_.erase(it) : std::next(it);
  }
}

void StepHistory::Forget(const std::string& job_id, int64_t created_unix_ms) {
  absl::MutexLock lock(&mu_);
  const auto it = jobs_.find(job_id);
  if (it != jobs_.end() && it->second.created_unix_ms == created_unix_ms) jobs_.erase(it);
}

size_t StepHistory::jobs() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

}  // namespace muond::server
