// The double-buffered fp32 arrays of a job's state store (update mode's MomentumStore, apply
// mode's ParamStore), in host memory registered (pinned) with the compute device, and the
// snapshot that lets a checkpoint writer copy them at one step boundary while later steps run.
//
// Every array has two buffers. The front holds the committed value; the step in flight writes the
// next value into the back (back(); nothing else writes it, and the front does not change while a
// step computes), and the commit flips every array at once (Lock::Flip). A step that is refused or
// aborted leaves the front bit-identical.
//
// Snapshots without copies on the step's path: a snapshot refers to the front buffers of the
// moment it began, and the writer copies each array from there on its own thread
// (CopyForSnapshot). After the next flip those buffers are the back, which the following step
// overwrites; so back() hands a buffer the writer still needs to the snapshot (it keeps the memory
// until the writer copied it) and gives the store a fresh one (not pinned; the step writes every
// element of it). Nothing is copied on the compute or commit thread: the cost there is one
// allocation per array the writer had not reached, and the memory at most one more copy of those
// arrays while the save lasts. When the writer is done with such a buffer it becomes the array's
// spare, and a later flip puts it (pinned) back in place of the fresh one, which is freed. A
// change of the front itself (Lock::mutable_front: reset, load, initial weights) hands the
// snapshot the buffer in the same way and continues on a copy of it: that change copies the one
// array it changes.
//
// Thread-safety: front() is read without a lock only between changes (steps read it; changes take
// the Lock between steps); back(), CopyForSnapshot and EndSnapshot take the lock briefly. At most
// one snapshot at a time.
#ifndef MUOND_SERVER_ENGINE_STATE_BUFFERS_H_
#define MUOND_SERVER_ENGINE_STATE_BUFFERS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/device/device.h"

namespace muond::server {

class StateBuffers {
 public:
  // Zeroed arrays of numel[a] floats, both buffers registered with `device` where it allows.
  // `device` must outlive the buffers.
  StateBuffers(const std::vector<size_t>& numel, device::Device* device);
  ~StateBuffers();
  StateBuffers(const StateBuffers&) = delete;
  StateBuffers& operator=(const StateBuffers&) = delete;

  size_t arrays() const { return numel_.size(); }
  size_t numel(size_t a) const { return numel_[a]; }
  // The committed value of array a. Read without a lock only between changes.
  const float* front(size_t a) const { return buf_[parity_][a]->data.get(); }
  // Where the step in flight writes array a's next value (see above); the step must write all of
  // it before the commit. Takes the lock briefly; copies nothing.
  float* back(size_t a) ABSL_LOCKS_EXCLUDED(mu_);

  // What snapshots cost, for tests and metrics: bytes copied into snapshots by the writer's own
  // calls (CopyForSnapshot), by changes of the store (mutable_front of an array the writer had not
  // copied), and bytes of buffers handed over to a snapshot by a step (back(); not copied).
  struct SnapshotCost {
    uint64_t writer_copied = 0;
    uint64_t change_copied = 0;
    uint64_t step_handed_over = 0;
  };
  SnapshotCost snapshot_cost() const ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes of array a's buffers (front, back and spare) registered (pinned) with the device.
  uint64_t pinned_bytes(size_t a) const ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes held now, all arrays, by what they are for: the committed fronts, the backs the step in
  // flight writes, spares kept for a later flip, and buffers handed to the snapshot of a save in
  // progress (the committed state it still needs after a step or a change replaced it).
  struct Held {
    uint64_t front = 0;
    uint64_t back = 0;
    uint64_t spare = 0;
    uint64_t snapshot = 0;
  };
  Held held() const ABSL_LOCKS_EXCLUDED(mu_);

  // Exclusive access for a change of the front, a flip, or the start of a snapshot.
  class ABSL_SCOPED_LOCKABLE Lock {
   public:
    explicit Lock(StateBuffers& buffers) ABSL_EXCLUSIVE_LOCK_FUNCTION(buffers.mu_);
    ~Lock() ABSL_UNLOCK_FUNCTION();
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
    // Writable committed value of array a (see above for a snapshot in progress).
    float* mutable_front(size_t a);
    // The back buffers become the front. `keep_back`: the old front stays the back, untouched,
    // so that Unflip can restore it (two-phase jobs: a committed step may be rolled back until
    // the next step writes the back); else an unpinned back may be swapped for a spare.
    void Flip(bool keep_back = false);
    // Undoes a Flip(keep_back = true): the front becomes the back again. REQUIRES: nothing wrote
    // the back since, and no snapshot began.
    void Unflip();
    // Starts the snapshot of the front. REQUIRES: none in progress.
    void BeginSnapshot();

   private:
    StateBuffers& buffers_;
  };

  // The snapshot's value of array a into *out; each array once per snapshot. Copies outside the
  // lock (a step may hand the buffer over meanwhile; its memory stays).
  void CopyForSnapshot(size_t a, std::vector<float>* out) ABSL_LOCKS_EXCLUDED(mu_);
  void EndSnapshot() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // One buffer of numel floats; unregistered and freed with it.
  struct Buffer {
    Buffer(size_t n, bool zeroed, bool pin, device::Device* device);
    ~Buffer();
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    std::unique_ptr<float[]> data;
    size_t n;
    device::Device* registered;  // null: not registered with the device
  };
  struct Snapshot {
    std::vector<const float*> data;               // per array: its front at the snapshot
    std::vector<bool> copied;                     // per array: the writer has it
    std::vector<std::unique_ptr<Buffer>> handed;  // per array: handed over by the store
  };
  // True when the snapshot still needs `buffer` (array a's, not yet copied by the writer).
  bool SnapshotNeeds(size_t a, const Buffer& buffer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves *slot to the snapshot and puts a fresh buffer in its place (a copy of it if `keep`).
  void HandOver(size_t a, std::unique_ptr<Buffer>* slot, bool keep)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A buffer the snapshot no longer needs: the array's spare (or freed).
  void Release(size_t a, std::unique_ptr<Buffer> buffer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  device::Device* const device_;
  const std::vector<size_t> numel_;
  // Per array, two buffers; the front's index. Pointers change only under mu_: the front's
  // between steps, the back's before the step writes it.
  std::vector<std::unique_ptr<Buffer>> buf_[2];
  int parity_ = 0;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Buffer>> spare_ ABSL_GUARDED_BY(mu_);  // per array (see above)
  std::unique_ptr<Snapshot> snapshot_ ABSL_GUARDED_BY(mu_);
  SnapshotCost cost_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_STATE_BUFFERS_H_
