// The arrays of a job's state store (update mode's MomentumStore, apply mode's ParamStore),
// in host memory registered (pinned) with the compute device, and the snapshot that lets a
// checkpoint writer copy them at one step boundary while later steps run.
//
// One copy of the state (the default; README "Memory"). Every array has one committed buffer, the
// front. A step writes an array's next value either
//   - in place, into the front, once the step is sealed (every gradient in and checked, nothing
//     left that may refuse it but a device error or a crash: the pipeline decides, StepPipeline
//     ::Run::TakeLocked), or
//   - before the seal, into the array's back buffer, taken from a bounded step window
//     (`window_bytes`; the pipeline reserves window bytes per matrix and waits for the seal when
//     they run out), which the commit swaps in (Lock::Flip: no copy).
// The pipeline says which per array and step (Plan), before anything is written. A step that
// fails before writing in place leaves the front bit-identical; one that wrote in place cannot be
// undone (the job is fenced and reloads its newest checkpoint: StepState::in_place). Window buffers
// of the arrays a step used stay as the next step's (same arrays, the same streaming order); the
// others are freed at the commit, so the window never holds more than one step reserved.
//
// Two copies (window_bytes == kTwoCopies): every array has its back allocated up front and is
// never written in place, as the jobs that roll a committed step back need: the two-phase commit
// of many nodes (Flip(keep_back) and Unflip). Global clipping needs no second copy: the clip is
// decided at the seal, before anything is written in place, and only what was computed before
// it (in the window, the front intact) is recomputed (step_pipeline_clip.cc).
//
// Snapshots without copies on the step's path: a snapshot refers to the front buffers of the
// moment it began, and the writer copies each array from there on its own thread
// (CopyForSnapshot). A window swap makes such a buffer a back, which a later step would write;
// Plan hands a buffer the writer still needs to the snapshot (it keeps the memory until the writer
// copied it) and gives the store a fresh one. Before an in-place write of an array the snapshot
// still needs, Plan hands the front over and continues on a copy of it: copy-on-write per array,
// so a save never stalls steps and costs at most one more copy of the arrays the writer had not
// reached. When the writer is done with a handed buffer it replaces an unpinned window buffer of
// the array (pinned memory reused), else it is freed: the store never holds more than its state
// and its window once the save is over. A change of the front itself (Lock::mutable_front: reset,
// load, initial weights) hands the snapshot the buffer in the same way.
//
// Thread-safety: front() is read without a lock only between changes of that array (a step reads
// an array before it writes it in place; changes take the Lock between steps); Plan, back(),
// CopyForSnapshot and EndSnapshot take the lock briefly. At most one snapshot at a time.
#ifndef MUOND_SERVER_ENGINE_STATE_BUFFERS_H_
#define MUOND_SERVER_ENGINE_STATE_BUFFERS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/device/device.h"
#include "server/optim/state_codec.h"

namespace muond::server {

class StateBuffers {
 public:
  // window_bytes for a store of two copies (see above).
  static constexpr uint64_t kTwoCopies = ~uint64_t{0};

  // How array a is held: numel elements as `dtype` (server/optim/state_codec.h: fp32, bf16 or
  // int8 with the map of `role`), in StoredWords(dtype, numel) 32-bit words.
  struct Form {
    size_t numel = 0;
    common::StateDType dtype = common::StateDType::kFloat32;
    StateRole role = StateRole::kSigned;
  };
  // Zeroed arrays (zero bytes are zeros in every form), registered with `device` where it
  // allows; with kTwoCopies their back buffers too. `device` must outlive the buffers.
  StateBuffers(const std::vector<Form>& forms, device::Device* device,
               uint64_t window_bytes = kTwoCopies);
  // fp32 arrays of numel[a] elements.
  StateBuffers(const std::vector<size_t>& numel, device::Device* device,
               uint64_t window_bytes = kTwoCopies);
  ~StateBuffers();
  StateBuffers(const StateBuffers&) = delete;
  StateBuffers& operator=(const StateBuffers&) = delete;

  size_t arrays() const { return words_.size(); }
  // Array a's form, and the 32-bit words it is held in (its buffers' size).
  const Form& form(size_t a) const { return forms_[a]; }
  size_t numel(size_t a) const { return forms_[a].numel; }
  size_t words(size_t a) const { return words_[a]; }
  // The committed value of array a, as held (fp32: the values). Read without a lock only
  // between changes.
  const float* front(size_t a) const { return front_[a]->data.get(); }
  bool two_copies() const { return window_bytes_ == kTwoCopies; }
  // The step window's bytes (kTwoCopies: a whole second copy).
  uint64_t window_bytes() const { return window_bytes_; }

  // A new step: no array planned.
  void BeginStep() ABSL_LOCKS_EXCLUDED(mu_);
  // How the step in flight writes array a: in place (REQUIRES: !two_copies()) or into its window
  // buffer. Before the step writes the array; the same for the whole step. Takes the lock
  // briefly; copies only what a save in progress still needs of an array written in place.
  void Plan(size_t a, bool in_place) ABSL_LOCKS_EXCLUDED(mu_);
  // After a step that failed: one copy frees its window buffers (two copies keep their backs).
  void DropWindow() ABSL_LOCKS_EXCLUDED(mu_);
  // Where the step in flight writes array a's next value, as planned (unplanned: the window);
  // the step must write all of it before the commit. Takes the lock briefly.
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
  // Bytes held now, all arrays, by what they are for: the committed fronts, the window (back)
  // buffers, spares kept for a later step, and buffers handed to the snapshot of a save in
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
    // Taken only once no array is planned in place: the step in flight, if it was sealed and
    // writes in place, has committed or failed. The front is then the state at a step boundary
    // (part of it is not while a sealed step writes it), as the start of a snapshot needs.
    // Waits at most for a sealed step's compute. Take it before any lock the commit takes.
    struct AtStepBoundary {};
    Lock(StateBuffers& buffers, AtStepBoundary) ABSL_EXCLUSIVE_LOCK_FUNCTION(buffers.mu_);
    ~Lock() ABSL_UNLOCK_FUNCTION();
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
    // Writable committed value of array a, as held (see above for a snapshot in progress).
    float* mutable_front(size_t a);
    // Commits the step: the window buffers it wrote become the front (arrays written in place
    // already are). `keep_back`: the old fronts stay the backs, untouched, so that Unflip can
    // restore them (two-phase jobs: a committed step may be rolled back until the next step
    // writes the back); else an unpinned back may be swapped for a spare, and with one copy the
    // window buffers of arrays the step did not use are freed.
    void Flip(bool keep_back = false);
    // Undoes a Flip(keep_back = true) of a two-copy store. REQUIRES: nothing wrote the backs
    // since, and no snapshot began.
    void Unflip();
    // Starts the snapshot of the front. REQUIRES: none in progress, and the lock taken
    // AtStepBoundary.
    void BeginSnapshot();

   private:
    StateBuffers& buffers_;
  };

  // The snapshot's value of array a into *out: decoded to fp32 (form(a).numel values), or with
  // `held` as held (words(a) 32-bit words: what a checkpoint stores); each array once per
  // snapshot. Copies outside the lock (a step may hand the buffer over meanwhile; its memory
  // stays).
  void CopyForSnapshot(size_t a, std::vector<float>* out, bool held = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  void EndSnapshot() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // One buffer of n 32-bit words (an array as held); unregistered and freed with it.
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
  // A buffer the snapshot no longer needs: in place of an unpinned window buffer (two copies: the
  // array's spare), else freed.
  void Release(size_t a, std::unique_ptr<Buffer> buffer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Array a's window buffer, allocated (or a spare) when it has none, and not one the snapshot
  // still needs.
  float* WindowBuffer(size_t a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees *slot, or hands it to the snapshot when that still needs it.
  void Drop(size_t a, std::unique_ptr<Buffer>* slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  enum class Target : uint8_t { kNone, kWindow, kInPlace };
  // No array is planned in place (the condition of Lock(AtStepBoundary)).
  static bool NoneInPlace(StateBuffers* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_);

  device::Device* const device_;
  const std::vector<Form> forms_;
  const std::vector<size_t> words_;  // per array: the 32-bit words it is held in
  const uint64_t window_bytes_;
  // Per array: the committed buffer and the window (back) buffer (null: none). Pointers change
  // only under mu_: the front's between steps or before the step writes the array in place, the
  // back's before the step writes it.
  std::vector<std::unique_ptr<Buffer>> front_;
  std::vector<std::unique_ptr<Buffer>> back_;
  mutable absl::Mutex mu_;
  std::vector<Target> target_ ABSL_GUARDED_BY(mu_);   // per array, for the step in flight
  std::vector<size_t> flipped_ ABSL_GUARDED_BY(mu_);  // arrays the last Flip swapped (Unflip)
  std::vector<std::unique_ptr<Buffer>> spare_ ABSL_GUARDED_BY(mu_);  // per array (see above)
  std::unique_ptr<Snapshot> snapshot_ ABSL_GUARDED_BY(mu_);
  SnapshotCost cost_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_STATE_BUFFERS_H_
