// The state store of an update-mode job: the Muon momentum of every matrix (fp32, or bf16 or int8
// as the job's "state" says: server/optim/state_codec.h), in host memory
// registered (pinned) with the compute device (StateBuffers, state_buffers.h: one copy updated in
// place once the step is sealed, the bounded step window before it, and the snapshot a checkpoint
// writer copies while later steps run).
//
// The step in flight has the device write each matrix's new momentum, the one its update was
// computed from, where next() says (in place, or the window buffer the commit swaps in). So the
// commit copies and re-reads nothing (the gradients are read once, by the step), and a step
// refused before it wrote in place leaves the front bit-identical. Memory cost: the momentum once
// plus the window (JobFootprint counts both), plus, while a save is slower than a step, one more
// buffer for each matrix the writer has not reached (state_buffers.h).
//
// Changes of the front (commit's flip, reset, load) go through a MomentumStore::Lock. The compute
// tasks of the step in flight read the front without a lock: it changes only between steps.
// Lock order: a job's checkpoint lock (CheckpointWriter::Exclusive), then this store's lock, then
// the ParamStore's (apply mode), then the job's own lock.
#ifndef MUOND_SERVER_ENGINE_MOMENTUM_STORE_H_
#define MUOND_SERVER_ENGINE_MOMENTUM_STORE_H_

#include <cstdint>
#include <vector>

#include "common/job_spec.h"
#include "server/device/device.h"
#include "server/engine/state_buffers.h"

namespace muond::server {

class MomentumStore {
 public:
  // Zeroed momentum for every matrix of `spec` (none for a transport probe or an apply-mode job),
  // both buffers registered with `device` where it allows. `device` must outlive the store.
  // `window_bytes`: StateBuffers (one copy and its step window, or StateBuffers::kTwoCopies).
  MomentumStore(const common::JobSpec& spec, device::Device* device,
                uint64_t window_bytes = StateBuffers::kTwoCopies);
  MomentumStore(const MomentumStore&) = delete;
  MomentumStore& operator=(const MomentumStore&) = delete;

  // Bytes of the momentum as held (one buffer per matrix; 0 for a transport
  // probe). What a spec will hold before anything is allocated is
  // JobFootprint::state_bytes (server/jobs/job_footprint.h).
  uint64_t bytes() const { return bytes_; }
  size_t matrices() const { return buffers_.arrays(); }
  // Matrix m's committed momentum, as held (StateBuffers::Form). Read without a lock only between
  // changes.
  const float* data(uint32_t m) const { return buffers_.front(m); }
  // Where the step in flight writes matrix m's new momentum, as held (every element of it); the
  // commit's Flip makes it the committed one. REQUIRES: the step in flight is the only writer.
  float* next(uint32_t m) { return buffers_.back(m); }
  size_t numel(uint32_t m) const { return buffers_.numel(m); }
  // How matrix m's momentum is held (fp32: data() and next() are the values).
  const StateBuffers::Form& form(uint32_t m) const { return buffers_.form(m); }
  bool two_copies() const { return buffers_.two_copies(); }
  uint64_t window_bytes() const { return buffers_.window_bytes(); }
  // A new step (StateBuffers::BeginStep).
  void BeginStep() { buffers_.BeginStep(); }
  // After a failed step (StateBuffers::DropWindow).
  void DropWindow() { buffers_.DropWindow(); }
  // How the step in flight writes matrix m's momentum (StateBuffers::Plan).
  void Plan(uint32_t m, bool in_place) { buffers_.Plan(m, in_place); }
  // Bytes of the momentum registered (pinned) with the device, all matrices.
  uint64_t pinned_bytes() const {
    uint64_t bytes = 0;
    for (size_t m = 0; m < buffers_.arrays(); ++m) bytes += buffers_.pinned_bytes(m);
    return bytes;
  }
  // Bytes held now by what they are for (StateBuffers::Held).
  StateBuffers::Held held() const { return buffers_.held(); }
  // What the snapshots cost so far (see StateBuffers::SnapshotCost).
  StateBuffers::SnapshotCost snapshot_cost() const { return buffers_.snapshot_cost(); }

  // Exclusive access for a change of the store, or for starting a snapshot.
  class Lock {
   public:
    explicit Lock(MomentumStore& store) : lock_(store.buffers_), store_(store) {}
    // Taken at a step boundary (StateBuffers::Lock::AtStepBoundary), as BeginSnapshot needs.
    Lock(MomentumStore& store, StateBuffers::Lock::AtStepBoundary at)
        : lock_(store.buffers_, at), store_(store) {}
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
    // Writable committed momentum of matrix m, as held.
    float* mutable_data(uint32_t m) { return lock_.mutable_front(m); }
    void Zero();
    // Commits the step whose new momentum was written into next() for every matrix: the back
    // buffers become the front.
    // `keep_back`: see StateBuffers::Lock::Flip.
    void Flip(bool keep_back = false) { lock_.Flip(keep_back); }
    // Undoes Flip(true).
    void Unflip() { lock_.Unflip(); }
    // Starts the snapshot a checkpoint writer copies (see CopyForSnapshot). One at a time;
    // REQUIRES: the lock taken at a step boundary.
    void BeginSnapshot() { lock_.BeginSnapshot(); }

   private:
    StateBuffers::Lock lock_;
    MomentumStore& store_;
  };

  // The snapshot's value of matrix m into *out, fp32 or (`held`) as held (on the writer's
  // thread; StateBuffers::CopyForSnapshot).
  void CopyForSnapshot(uint32_t m, std::vector<float>* out, bool held = false) {
    buffers_.CopyForSnapshot(m, out, held);
  }
  void EndSnapshot() { buffers_.EndSnapshot(); }

 private:
  StateBuffers buffers_;
  uint64_t bytes_ = 0;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_MOMENTUM_STORE_H_
