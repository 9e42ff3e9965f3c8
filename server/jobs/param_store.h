// Apply mode's state store (DESIGN.md 4b): per job tensor, in fp32 host memory registered (pinned)
// with the compute device, the master weights W and the optimizer state (Muon: momentum M; AdamW:
// m, v and the step count).
//
// Every array has two buffers. The front holds the committed state; the step in flight computes
// the next state from the front into the back (without a lock: nothing else writes the back, and
// the front does not change while a step computes), and its commit flips the store (one parity for
// all arrays: every tensor takes part in every step). So a refused or aborted step leaves the front
// bit-identical, and a step whose global gradient clipping triggers is recomputed from the same
// front. Memory cost of that choice: the state twice (the alternative, recomputing the state at
// commit, would run AdamW and the Muon apply twice per step and still need the new W staged).
//
// Changes of the front (commit, reset, load, initial weights) go through a ParamStore::Lock, which
// first hands a snapshot in progress (checkpoint, export) the old values of every array it has not
// copied yet, as MomentumStore does. Lock order: the job's CheckpointWriter::Exclusive, then this
// lock, then the job's own lock.
#ifndef MUOND_SERVER_JOBS_PARAM_STORE_H_
#define MUOND_SERVER_JOBS_PARAM_STORE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "server/device/device.h"

namespace muond::server {

class ParamStore {
 public:
  // The arrays of a tensor: kMaster, then kMomentum (Muon) or kExpAvg and kExpAvgSq (AdamW).
  enum Slot : int { kMaster = 0, kMomentum = 1, kExpAvg = 1, kExpAvgSq = 2 };

  // Zeroed state for every tensor of `spec` (an apply-mode spec), registered with `device` where
  // it allows. `device` must outlive the store.
  ParamStore(const common::JobSpec& spec, device::Device* device);
  ~ParamStore();
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  // Bytes held, both buffers.
  uint64_t bytes() const { return bytes_; }
  size_t tensors() const { return first_.size(); }
  // 2 for a Muon tensor, 3 for an AdamW tensor.
  int slots(uint32_t t) const { return slots_[t]; }
  size_t numel(uint32_t t) const { return numel_[t]; }
  // The committed array (numel(t) floats). Read without a lock only between changes.
  const float* front(uint32_t t, int slot) const { return buf_[parity_][first_[t] + slot].data(); }
  // Where the step in flight writes the array's next value.
  float* back(uint32_t t, int slot) { return buf_[1 - parity_][first_[t] + slot].data(); }
  // The committed AdamW step count of tensor t (0 for Muon tensors).
  int64_t steps(uint32_t t) const { return steps_[t]; }

  class ABSL_SCOPED_LOCKABLE Lock {
   public:
    explicit Lock(ParamStore& store) ABSL_EXCLUSIVE_LOCK_FUNCTION(store.mu_);
    ~Lock() ABSL_UNLOCK_FUNCTION();
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
    // Writable committed array; the first change preserves the snapshot in progress.
    float* mutable_front(uint32_t t, int slot);
    void set_steps(uint32_t t, int64_t steps);
    // Commits the step computed into the back buffers: they become the front; every AdamW
    // tensor's step count goes up by one.
    void Flip();
    // Zeroes the optimizer state (momentum, moments, step counts); the masters stay.
    void ZeroOptimizerState();
    // Starts the snapshot CopyForSnapshot reads. One at a time.
    void BeginSnapshot();

   private:
    void Preserve();
    ParamStore& store_;
    bool preserved_ = false;
  };

  // The snapshot's value of array (t, slot) into *out.
  void CopyForSnapshot(uint32_t t, int slot, std::vector<float>* out) ABSL_LOCKS_EXCLUDED(mu_);
  // The step counts at the snapshot (per tensor).
  std::vector<int64_t> SnapshotSteps() ABSL_LOCKS_EXCLUDED(mu_);
  void EndSnapshot() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Snapshot {
    std::vector<bool> copied;               // per array
    std::vector<std::vector<float>> saved;  // per array: its value at the snapshot, if overtaken
    std::vector<int64_t> steps;
  };
  void PreserveForSnapshot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<float>& FrontArray(size_t a) { return buf_[parity_][a]; }

  device::Device* const device_;
  std::vector<size_t> first_;  // per tensor: its first array
  std::vector<int> slots_;
  std::vector<size_t> numel_;
  std::vector<std::vector<float>> buf_[2];  // per array, two buffers
  std::vector<bool> pinned_[2];
  // The front's buffer index. Changes only under mu_ between steps (Flip).
  int parity_ = 0;
  std::vector<int64_t> steps_;
  uint64_t bytes_ = 0;
  absl::Mutex mu_;
  std::unique_ptr<Snapshot> snapshot_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_PARAM_STORE_H_
