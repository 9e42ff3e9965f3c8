// Apply mode's state store (DESIGN.md 4b): per job tensor, in host memory registered (pinned) with
// the compute device, the fp32 master weights W and the optimizer state (Muon: momentum M; AdamW:
// m, v and the step count), fp32 or compressed as the job's "state" says (StateBuffers::Form).
//
// The arrays are StateBuffers (state_buffers.h): one copy of the state, which the step in flight
// updates in place once it is sealed, a bounded step window for the tensors computed before the
// seal (swapped in at the commit), so a refused step leaves the front bit-identical. Jobs that
// recompute a step from the same front (global gradient clipping) or roll a committed step back
// (two-phase) keep two copies (StateBuffers::kTwoCopies).
//
// Changes of the front (commit, reset, load, initial weights) go through a ParamStore::Lock. A
// snapshot (checkpoint, export) is copied by its writer while later steps run, without copies on
// the step's path (state_buffers.h). Lock order: the job's CheckpointWriter::Exclusive, then this
// lock, then the job's own lock.
#ifndef MUOND_SERVER_ENGINE_PARAM_STORE_H_
#define MUOND_SERVER_ENGINE_PARAM_STORE_H_

#include <cstdint>
#include <vector>

#include "common/job_spec.h"
#include "server/device/device.h"
#include "server/engine/state_buffers.h"

namespace muond::server {

class ParamStore {
 public:
  // The arrays of a tensor: kMaster, then kMomentum (Muon) or kExpAvg and kExpAvgSq (AdamW).
  enum Slot : int { kMaster = 0, kMomentum = 1, kExpAvg = 1, kExpAvgSq = 2 };

  // Zeroed state for every tensor of `spec` (an apply-mode spec), registered with `device` where
  // it allows. `device` must outlive the store. `window_bytes`: StateBuffers (one copy and its
  // step window, or StateBuffers::kTwoCopies).
  ParamStore(const common::JobSpec& spec, device::Device* device,
             uint64_t window_bytes = StateBuffers::kTwoCopies);
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  // Bytes of the state (one copy: what a checkpoint holds).
  uint64_t bytes() const { return bytes_; }
  bool two_copies() const { return buffers_.two_copies(); }
  uint64_t window_bytes() const { return buffers_.window_bytes(); }
  // A new step (StateBuffers::BeginStep).
  void BeginStep() { buffers_.BeginStep(); }
  // After a failed step (StateBuffers::DropWindow).
  void DropWindow() { buffers_.DropWindow(); }
  // How the step in flight writes tensor t's arrays (StateBuffers::Plan), every slot alike.
  void Plan(uint32_t t, bool in_place) {
    for (int s = 0; s < slots_[t]; ++s) buffers_.Plan(first_[t] + s, in_place);
  }
  size_t tensors() const { return first_.size(); }
  // 2 for a Muon tensor, 3 for an AdamW tensor.
  int slots(uint32_t t) const { return slots_[t]; }
  size_t numel(uint32_t t) const { return numel_[t]; }
  // How array (t, slot) is held: the masters fp32, the momentum and AdamW's moments as the job's
  // "state" says (fp32: front() and back() are the values).
  const StateBuffers::Form& form(uint32_t t, int slot) const {
    return buffers_.form(first_[t] + slot);
  }
  // The committed array, as held. Read without a lock only between changes.
  const float* front(uint32_t t, int slot) const { return buffers_.front(first_[t] + slot); }
  // Where the step in flight writes the array's next value (every element of it before the
  // commit). Thread-safe; copies nothing.
  float* back(uint32_t t, int slot) { return buffers_.back(first_[t] + slot); }
  // The committed AdamW step count of tensor t (0 for Muon tensors).
  int64_t steps(uint32_t t) const { return steps_[t]; }
  // Bytes registered (pinned) with the device, by kind: the masters, Muon's momentum, AdamW's m
  // and v.
  struct Pinned {
    uint64_t masters = 0;
    uint64_t momentum = 0;
    uint64_t moments = 0;
  };
  Pinned pinned_bytes() const;
  // Bytes held now by what they are for (StateBuffers::Held).
  StateBuffers::Held held() const { return buffers_.held(); }
  // What the snapshots cost so far (see StateBuffers::SnapshotCost).
  StateBuffers::SnapshotCost snapshot_cost() const { return buffers_.snapshot_cost(); }

  class Lock {
   public:
    explicit Lock(ParamStore& store) : lock_(store.buffers_), store_(store) {}
    // Taken at a step boundary (StateBuffers::Lock::AtStepBoundary), as BeginSnapshot needs.
    Lock(ParamStore& store, StateBuffers::Lock::AtStepBoundary at)
        : lock_(store.buffers_, at), store_(store) {}
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
    // Writable committed array, as held.
    float* mutable_front(uint32_t t, int slot) {
      return lock_.mutable_front(store_.first_[t] + slot);
    }
    void set_steps(uint32_t t, int64_t steps) { store_.steps_[t] = steps; }
    // Commits the step computed into the back buffers: they become the front; every AdamW
    // tensor's step count goes up by one, but those `absent` says were skipped (empty: none).
    // `keep_back`: see StateBuffers::Lock::Flip.
    void Flip(const std::vector<uint8_t>& absent = {}, bool keep_back = false);
    // Undoes Flip(absent, true) (the step counts too).
    void Unflip(const std::vector<uint8_t>& absent);
    // Zeroes the optimizer state (momentum, moments, step counts); the masters stay.
    void ZeroOptimizerState();
    // Starts the snapshot CopyForSnapshot reads. One at a time; REQUIRES: the lock taken at a
    // step boundary.
    void BeginSnapshot();

   private:
    StateBuffers::Lock lock_;
    ParamStore& store_;
  };

  // The snapshot's value of array (t, slot) into *out, fp32 or (`held`) as held (on the writer's
  // thread; StateBuffers::CopyForSnapshot).
  void CopyForSnapshot(uint32_t t, int slot, std::vector<float>* out, bool held = false) {
    buffers_.CopyForSnapshot(first_[t] + slot, out, held);
  }
  // The step counts at the snapshot (per tensor).
  std::vector<int64_t> SnapshotSteps() const { return snapshot_steps_; }
  void EndSnapshot() { buffers_.EndSnapshot(); }

 private:
  std::vector<size_t> first_;  // per tensor: its first array
  std::vector<int> slots_;
  std::vector<size_t> numel_;
  StateBuffers buffers_;
  // Changed under the store's lock (Lock), between steps.
  std::vector<int64_t> steps_;
  std::vector<int64_t> snapshot_steps_;  // at the last BeginSnapshot
  uint64_t bytes_ = 0;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_PARAM_STORE_H_
