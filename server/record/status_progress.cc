#include "server/record/status_progress.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/time/clock.h"

namespace muond::server {

OperationProgress::Handle::~Handle() {
  if (!ended_) End(absl::AbortedError("abandoned"));
}

void OperationProgress::Handle::End(const absl::Status& status) {
  if (ended_) return;
  ended_ = true;
  owner_->End(id_, status);
}

OperationProgress& OperationProgress::Default() {
  static OperationProgress* progress = new OperationProgress();
  return *progress;
}

std::unique_ptr<OperationProgress::Handle> OperationProgress::Begin(const std::string& job_id,
                                                                    const std::string& kind,
                                                                    const std::string& target,
                                                                    uint64_t bytes_total) {
  auto done = std::make_shared<std::atomic<uint64_t>>(0);
  absl::MutexLock lock(&mu_);
  Entry e;
  e.report.id = next_id_++;
  e.report.job_id = job_id;
  e.report.kind = kind;
  e.report.target = target;
  e.report.bytes_total = bytes_total;
  e.report.started_unix_ms = absl::ToUnixMillis(absl::Now());
  e.done = done;
  const uint64_t id = e.report.id;
  jobs_[job_id].push_back(std::move(e));
  return std::unique_ptr<Handle>(new Handle(this, id, std::move(done)));
}

void OperationProgress::End(uint64_t id, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  for (auto job = jobs_.begin(); job != jobs_.end(); ++job) {
    auto& entries = job->second;
    for (auto at = entries.begin(); at != entries.end(); ++at) {
      Entry& e = *at;
      if (e.report.id != id) continue;
      e.report.bytes_done = e.done->load(std::memory_order_relaxed);
      e.report.done = true;
      e.report.ended_unix_ms = absl::ToUnixMillis(absl::Now());
      e.report.error = status.ok() ? "" : std::string(status.message());
      if (e.forget_on_end) {
        entries.erase(at);
        if (entries.empty()) jobs_.erase(job);
        return;
      }
      // Keep the newest kFinishedKept finished ones of this job.
      size_t finished = 0;
      for (const Entry& f : entries) finished += f.report.done ? 1 : 0;
      for (auto it = entries.begin(); finished > kFinishedKept && it != entries.end();) {
        if (it->report.done) {
          it = entries.erase(it);
          --finished;
        } else {
          ++it;
        }
      }
      TrimIdleJobs();
      return;
    }
  }
}

OperationReport OperationProgress::Snapshot(const Entry& e) {
  OperationReport r = e.report;
  if (!r.done) r.bytes_done = e.done->load(std::memory_order_relaxed);
  return r;
}

std::vector<OperationReport> OperationProgress::ForJob(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  std::vector<OperationReport> out;
  const auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return out;
  for (const Entry& e : it->second) out.push_back(Snapshot(e));
  return out;
}

std::vector<OperationReport> OperationProgress::All() const {
  absl::MutexLock lock(&mu_);
  std::vector<OperationReport> out;
  for (const auto& [job, entries] : jobs_) {
    for (const Entry& e : entries) out.push_back(Snapshot(e));
  }
  return out;
}

void OperationProgress::Forget(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  const auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  auto& entries = it->second;
  for (auto e = entries.begin(); e != entries.end();) {
    if (e->report.done) {
      e = entries.erase(e);
    } else {
      e->forget_on_end = true;
      ++e;
    }
  }
  if (entries.empty()) jobs_.erase(it);
}

size_t OperationProgress::jobs() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

void OperationProgress::TrimIdleJobs() {
  std::vector<std::pair<int64_t, std::string>> idle;  // (last end, job)
  for (const auto& [job, entries] : jobs_) {
    int64_t last = 0;
    bool running = false;
    for (const Entry& e : entries) {
      running |= !e.report.done;
      last = std::max(last, e.report.ended_unix_ms);
    }
    if (!running) idle.emplace_back(last, job);
  }
  if (idle.size() <= kIdleJobsKept) return;
  std::sort(idle.begin(), idle.end());
  for (size_t i = 0; i + kIdleJobsKept < idle.size(); ++i) jobs_.erase(idle[i].second);
}

void OperationProgress::Prune(const std::set<std::string>& present) {
  absl::MutexLock lock(&mu_);
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    if (present.count(it->first) == 0) {
      auto& entries = it->second;
      for (auto e = entries.begin(); e != entries.end();) {
        e = e->report.done ? entries.erase(e) : std::next(e);
      }
    }
    it = it->second.empty() ? jobs_.erase(it) : std::next(it);
  }
}

}  // namespace muond::server
