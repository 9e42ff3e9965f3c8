// A job's checkpoints (DESIGN.md 7): one writer per job over its checkpoint directory
// (server/storage/checkpoint.h holds the format and the durability). It writes a consistent
// snapshot of the job's MomentumStore (or ParamStore) while later steps run (StateBuffers keeps
// the snapshot's buffers intact without copies on the step's path), runs the periodic saves in the
// background, and remembers the newest generation this process wrote or loaded.
//
// Every save, load and durable reset of the job holds the writer's Exclusive lock, so at most one
// runs at a time and none interleaves with another (the lock is taken before the store's).
#ifndef MUOND_SERVER_JOBS_CHECKPOINT_WRITER_H_
#define MUOND_SERVER_JOBS_CHECKPOINT_WRITER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "server/storage/checkpoint.h"

namespace muond::server {

class CheckpointWriter {
 public:
  CheckpointWriter(std::string dir, int keep) : store_(std::move(dir), keep) {}

  class ABSL_SCOPED_LOCKABLE Exclusive {
   public:
    explicit Exclusive(CheckpointWriter& writer) ABSL_EXCLUSIVE_LOCK_FUNCTION(writer.mu_)
        : lock_(&writer.mu_) {}
    ~Exclusive() ABSL_UNLOCK_FUNCTION() {}

   private:
    absl::MutexLock lock_;
  };

  const std::string& dir() const { return store_.dir(); }

  // Writes a snapshot (begun by the caller on its store, ended by the caller after this returns)
  // as the generation of `step`: each state tensor (checkpoint::StateTensors order) from `source`,
  // apply mode's AdamW step counts from `tensor_steps`. Counts and logs the save. Blocks until it
  // is durable.
  absl::StatusOr<checkpoint::GenerationInfo> Write(const Exclusive& held, const std::string& job_id,
                                                   const common::JobSpec& spec, int64_t step,
                                                   const checkpoint::MatrixSource& source,
                                                   const std::vector<int64_t>& tensor_steps = {});
  // Bytes of the state tensors of a generation of `spec` (what a save writes and a load reads,
  // the payload header aside): the total of their progress (server/record/status_progress.h).
  static uint64_t StateBytes(const common::JobSpec& spec);
  // Reads and verifies a generation (not installed anywhere).
  absl::StatusOr<checkpoint::Loaded> Read(const Exclusive& held,
                                          const checkpoint::Selector& selector);
  absl::StatusOr<std::vector<checkpoint::GenerationInfo>> List() const { return store_.List(); }
  // The highest generation number in the directory, good or not (0: none).
  int64_t NewestGeneration() const;

  // Runs `save` on a thread of its own unless a background save is running (then it is skipped
  // and logged). `save` must keep what it uses alive.
  void SaveInBackground(const std::string& job_id, std::function<void()> save);
  // Blocks until no save of the job runs.
  void WaitForSaves();

  // The newest generation written or loaded by this process: step (-1: none) and time.
  int64_t last_step() const { return last_step_.load(); }
  int64_t last_unix_ms() const { return last_unix_ms_.load(); }
  void Remember(int64_t step, int64_t unix_ms);
  void Forget() { last_step_ = -1; }

 private:
  absl::Mutex mu_;
  checkpoint::Store store_;  // thread-compatible: used under mu_ (List is read-only)
  std::atomic<bool> background_{false};
  std::atomic<int64_t> last_step_{-1};
  std::atomic<int64_t> last_unix_ms_{0};
};

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_CHECKPOINT_WRITER_H_
