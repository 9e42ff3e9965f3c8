// OperationProgress: how far the daemon's long operations are (checkpoint saves, loads, and
// restores of a new job from another job's checkpoint), so that muonctl can draw progress while
// the RPC that started one blocks (GetProgress), and the status page can show it.
//
// An operation is begun with its job, kind and total bytes, advanced as bytes are done, and ended
// with its result. Finished operations are kept a while (kFinishedKept per job) so a client that
// polls after the end still sees 100%. Bounded: at most kFinishedKept finished operations per job
// beside the ones running (one save and one load at a time per job, restores per new job), and
// Prune drops the jobs that are gone.
//
// Thread-safety: all methods are thread-safe; Advance is a relaxed atomic add (safe from the
// checkpoint code's parallel readers).
#ifndef MUOND_SERVER_RECORD_STATUS_PROGRESS_H_
#define MUOND_SERVER_RECORD_STATUS_PROGRESS_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace muond::server {

// What one operation has done, at one moment.
struct OperationReport {
  uint64_t id = 0;     // unique in this process, from 1
  std::string job_id;  // the job it is listed under (a restore: the source job)
  std::string kind;    // "save", "load", "restore"
  std::string target;  // a restore: the job being created; else the job itself
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  int64_t started_unix_ms = 0;
  int64_t ended_unix_ms = 0;  // 0 while running
  bool done = false;
  std::string error;  // a failed operation's status message ("" on success or while running)
};

class OperationProgress {
 public:
  static constexpr size_t kFinishedKept = 4;

  // A running operation; End() it (the destructor ends it as "abandoned" otherwise).
  class Handle {
   public:
    ~Handle();
    Handle(const Handle&) = delete;
    Handle& operator=(const Handle&) = delete;
    // `bytes` more are done. Thread-safe.
    void Advance(uint64_t bytes) { done_->fetch_add(bytes, std::memory_order_relaxed); }
    // Ends the operation with `status`; later calls do nothing.
    void End(const absl::Status& status);

   private:
    friend class OperationProgress;
    Handle(OperationProgress* owner, uint64_t id, std::shared_ptr<std::atomic<uint64_t>> done)
        : owner_(owner), id_(id), done_(std::move(done)) {}
    OperationProgress* owner_;
    uint64_t id_;
    std::shared_ptr<std::atomic<uint64_t>> done_;
    bool ended_ = false;
  };

  // The operations of the daemon (Job checkpoint code begins them, the API and page read them).
  static OperationProgress& Default();

  std::unique_ptr<Handle> Begin(const std::string& job_id, const std::string& kind,
                                const std::string& target, uint64_t bytes_total)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The operations listed under `job_id`, oldest first.
  std::vector<OperationReport> ForJob(const std::string& job_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every operation, by job then age.
  std::vector<OperationReport> All() const ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the finished operations of jobs not in `present` (running ones stay).
  void Prune(const std::set<std::string>& present) ABSL_LOCKS_EXCLUDED(mu_);
  // Job `job_id` is gone: its finished operations are forgotten now, its running ones when they
  // end.
  void Forget(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Jobs with operations listed (tests).
  size_t jobs() const ABSL_LOCKS_EXCLUDED(mu_);
  // Beyond this many jobs whose operations all ended, the one that ended longest ago is
  // forgotten (jobs whose creation failed, e.g. an import refused, are never deleted).
  static constexpr size_t kIdleJobsKept = 256;

 private:
  struct Entry {
    OperationReport report;  // bytes_done read from `done` while running
    std::shared_ptr<std::atomic<uint64_t>> done;
    bool forget_on_end = false;  // its job is gone
  };
  void TrimIdleJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void End(uint64_t id, const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  static OperationReport Snapshot(const Entry& e);

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, std::deque<Entry>> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_RECORD_STATUS_PROGRESS_H_
