// The state store of a job: the fp32 Muon momentum of every matrix, in host memory registered
// (pinned) with the compute device from allocation on, and the copy-on-write bookkeeping that lets
// a checkpoint writer copy a consistent snapshot while later steps change the store.
//
// Every matrix has two buffers (as apply mode's ParamStore). The front holds the committed
// momentum; the step in flight has the device write each matrix's new momentum, the one its update
// was computed from, into the back (next(); without a lock: nothing else writes the back, and the
// front does not change while a step computes); the commit flips the store. So the commit copies
// and re-reads nothing (the gradients are read once, by the step), and a refused or aborted step
// leaves the front bit-identical. Memory cost: the momentum twice (JobFootprint counts both).
//
// Changes of the front (commit's flip, reset, load) go through a MomentumStore::Lock, which first
// hands a snapshot in progress the old values of every matrix the writer has not copied yet
// (copied over the CPUs: it delays the commit that overtakes a save). The compute tasks of the
// step in flight read the front without a lock: it changes only between steps.
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
  // Zeroed momentum for every matrix of `spec` (none for a transport probe or an apply-mode job),
  // both buffers registered with `device` where it allows. `device` must outlive the store.
  MomentumStore(const common::JobSpec& spec, device::Device* device);
  ~MomentumStore();
  MomentumStore(const MomentumStore&) = delete;
  MomentumStore& operator=(const MomentumStore&) = delete;

  // Bytes of the momentum (one buffer per matrix: what a checkpoint holds; 0 for a transport
  // probe). The store holds twice that. What a spec will hold before anything is allocated is
  // JobFootprint::state_bytes (server/jobs/job_footprint.h).
  uint64_t bytes() const { return bytes_; }
  size_t matrices() const { return buf_[0].size(); }
  // Matrix m's committed momentum (numel(m) floats). Read without a lock only between changes.
  const float* data(uint32_t m) const { return buf_[parity_][m].data(); }
  // Where the step in flight writes matrix m's new momentum (the back buffer); the commit's
  // Flip makes it the committed one. REQUIRES: the step in flight is the only writer.
  float* next(uint32_t m) { return buf_[1 - parity_][m].data(); }
  size_t numel(uint32_t m) const { return buf_[0][m].size(); }

  // Exclusive access for a change of the store, or for starting a snapshot.
  class ABSL_SCOPED_LOCKABLE Lock {
   public:
    explicit Lock(MomentumStore& store) ABSL_EXCLUSIVE_LOCK_FUNCTION(store.mu_);
    ~Lock() ABSL_UNLOCK_FUNCTION();
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
    // Writable committed momentum of matrix m; the first call preserves the snapshot in progress.
    float* mutable_data(uint32_t m);
    void Zero();
    // Commits the step whose new momentum was written into next() for every matrix: the back
    // buffers become the front.
    void Flip();
    // Starts the snapshot a checkpoint writer copies (see CopyForSnapshot). One at a time.
    void BeginSnapshot();

   private:
    void Preserve();
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
  std::vector<float>& Front(size_t m) { return buf_[parity_][m]; }

  device::Device* const device_;
  std::vector<std::vector<float>> buf_[2];  // per matrix, two buffers
  std::vector<bool> pinned_[2];
  // The front's buffer index. Changes only under mu_ between steps (Flip).
  int parity_ = 0;
  uint64_t bytes_ = 0;
  absl::Mutex mu_;
  std::unique_ptr<Snapshot> snapshot_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_MOMENTUM_STORE_H_
