// The state store of a job: the fp32 Muon momentum of every matrix, in host memory registered
// (pinned) with the compute device from allocation on, and the copy-on-write bookkeeping that lets
// a checkpoint writer copy a consistent snapshot while later steps change the store.
//
// Changes (commit, reset, load) go through a MomentumStore::Lock, which first hands a snapshot in
// progress the old values of every matrix the writer has not copied yet (copied over the CPUs:
// it delays the commit that overtakes a save). The compute tasks of the step in flight read the
// store without a lock: it changes only between steps.
// Lock order: a job's checkpoint lock (CheckpointWriter::Exclusive), then this store's lock, then
// the ParamStore's (apply mode), then the job's own lock.
#ifndef MUOND_SERVER_JOBS_MOMENTUM_STORE_H_
#define MUOND_SERVER_JOBS_MOMENTUM_STORE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "server/device/device.h"

namespace muond::server {

class MomentumStore {
 public:
  // Zeroed momentum for every matrix of `spec` (none for a transport probe), registered with
  // `device` where it allows (see pinned()). `device` must outlive the store.
  MomentumStore(const common::JobSpec& spec, device::Device* device);
  ~MomentumStore();
  MomentumStore(const MomentumStore&) = delete;
  MomentumStore& operator=(const MomentumStore&) = delete;

  // Bytes of momentum held (0 for a transport probe). What a spec will hold before anything is
  // allocated is JobFootprint::state_bytes (server/jobs/job_footprint.h).
  uint64_t bytes() const { return bytes_; }
  size_t matrices() const { return momentum_.size(); }
  // Matrix m's momentum (numel(m) floats). Read without a lock only between changes (see above).
  const float* data(uint32_t m) const { return momentum_[m].data(); }
  size_t numel(uint32_t m) const { return momentum_[m].size(); }

  // Exclusive access for a change of the store, or for starting a snapshot.
  class ABSL_SCOPED_LOCKABLE Lock {
   public:
    explicit Lock(MomentumStore& store) ABSL_EXCLUSIVE_LOCK_FUNCTION(store.mu_);
    ~Lock() ABSL_UNLOCK_FUNCTION();
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
    // Writable momentum of matrix m; the first call preserves the snapshot in progress.
    float* mutable_data(uint32_t m);
    void Zero();
    // Starts the snapshot a checkpoint writer copies (see CopyForSnapshot). One at a time.
    void BeginSnapshot();

   private:
    MomentumStore& store_;
    bool preserved_ = false;
  };

  // The snapshot's value of matrix m into *out (the live store when no change overtook it).
  void CopyForSnapshot(uint32_t m, std::vector<float>* out) ABSL_LOCKS_EXCLUDED(mu_);
  void EndSnapshot() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Snapshot {
    std::vector<bool> copied;               // per matrix: the writer has it
    std::vector<std::vector<float>> saved;  // per matrix: its value at the snapshot, if overtaken
  };
  void PreserveForSnapshot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  device::Device* const device_;
  std::vector<std::vector<float>> momentum_;
  std::vector<bool> pinned_;
  uint64_t bytes_ = 0;
  absl::Mutex mu_;
  std::unique_ptr<Snapshot> snapshot_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_MOMENTUM_STORE_H_
