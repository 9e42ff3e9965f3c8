// One call of StepPipeline::Drain (step_pipeline.h), internal to the engine room.
//
// The loop (Go, step_pipeline.cc) takes a batch of ready matrices under the batch target and the
// gather budget (TakeLocked, step_pipeline_take.cc), prepares each of its matrices on the matrix's path (Prepare), enqueues the batch on
// the three device streams (Enqueue: copy-in, compute, writeback), and retires batches oldest
// first (Retire: wait for the writeback, deliver the results, give the buffers back, announce).
// When nothing is left it decides the step (Finish: refuse on a device error, or commit).
//
// Each matrix takes one path, chosen when its batch is prepared (ChoosePath), and each path is
// one file:
//   kStaged   assembled in fp32 on the host, copied to the device and its update copied back
//             (step_pipeline_staged.cc);
//   kInPlace  assembled on the host; the kernel reads the staging and the committed momentum
//             where they are and writes the new momentum into the store's back buffer, nothing
//             copied (Device::ComputesInHostMemory, the cpu backend; step_pipeline_staged.cc);
//   kDirect   copied straight between the ranks' registered regions and the device
//             (step_pipeline_direct.cc);
//   kHost     apply mode's AdamW tensors: assembled and stepped on the host threads while the
//             device runs the batch's Muon tensors (step_pipeline_apply.cc).
// What becomes of the results depends on the mode: update mode scatters the updates into the
// ranks' spans (ScatterToRanks, step_pipeline_staged.cc); apply mode applies them to the masters
// and carries absent tensors (step_pipeline_apply.cc). Global clipping, both modes' redo and the
// re-read check, is step_pipeline_clip.cc. The transport probe's echo is step_pipeline.cc. A job
// whose momentum is held compressed gives the device paths its fp32 decoding per matrix and
// encodes what they write back (step_pipeline_held.cc).
#ifndef MUOND_SERVER_ENGINE_STEP_PIPELINE_RUN_H_
#define MUOND_SERVER_ENGINE_STEP_PIPELINE_RUN_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "server/device/device.h"
#include "server/engine/step_pipeline.h"

namespace muond::server {

// The path of one matrix through a step (see above).
enum class MatrixPath : uint8_t { kStaged, kInPlace, kDirect, kHost };

struct StepPipeline::Batch {
  std::vector<uint32_t> matrices;
  std::vector<MatrixPath> path;             // per matrix
  std::vector<std::vector<float>> staging;  // per matrix: the gradient, then the update (host)
  // Per matrix, when the job holds its momentum compressed (StepPipeline::MomentumHeld): the
  // committed momentum decoded to fp32, which the device reads and overwrites with the new one;
  // the retirement encodes that into the store (step_pipeline_held.cc). Else empty.
  std::vector<std::vector<float>> momentum;
  // The indices into `matrices` that run on the device (every path but kHost); the buffers below
  // are per device matrix, in this order.
  std::vector<size_t> on_device;
  std::vector<device::DeviceBuffer> grad;  // the fp32 gradient, then the update
  std::vector<device::DeviceBuffer> mom;   // the committed momentum, then the new one
  // kInPlace: the store's back buffer that receives the new momentum (`grad` is then a view of
  // the staging and `mom` of the committed momentum); else empty.
  std::vector<device::DeviceBuffer> mom_out;
  // kDirect with a 16-bit gradient (or, in apply mode, a scaled fp32 one): the gradient as it
  // came (update mode: then the update narrowed for the ranks); else empty.
  std::vector<device::DeviceBuffer> raw;
  std::shared_ptr<device::Event> written;  // the writeback is complete (null: no device work)
  // Per matrix: its state is updated in place (the step is sealed), else into the step window.
  std::vector<uint8_t> in_place;
  bool begin_step = false;  // the step's first batch: the state store begins the step

  MatrixPath device_path(size_t k) const { return path[on_device[k]]; }
};

class StepPipeline::Run {
 public:
  Run(StepPipeline& p, StepState& state);
  // Drains: returns when no matrix is ready and nothing is in flight.
  void Go();

 private:
  bool apply_mode() const { return p_.apply_ != nullptr; }

  // The loop and its accounting (step_pipeline.cc).
  // Under the job's lock: takes the next batch from the ready matrices. With nothing taken and
  // nothing in flight the call ends: false (the drain is over; a device error refused the step),
  // or true with an empty batch and *commit when the step's last matrix is done. *decide: true
  // with nothing taken when the step was sealed and its clip must be decided first (DecideClip).
  bool Take(Batch* batch, bool* commit, bool* decide);
  bool TakeLocked(Batch* batch, bool* commit, bool* decide)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p_.job_mu_);
  // Under the job's lock, nothing left to do: refuses the step on a device error, decides the
  // commit and accounts the device time. False ends the drain.
  bool Finish(bool* commit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p_.job_mu_);
  // Each matrix of the batch on its path: its gradient read or assembled, its device buffers.
  absl::Status Prepare(Batch& batch);
  MatrixPath ChoosePath(uint32_t m) const;
  // Takes device buffers for device matrix i of the batch (kStaged, kDirect).
  absl::Status TakeDeviceBuffers(Batch& batch, size_t i);
  // Copy-in, compute and writeback of the batch, enqueued on the three streams.
  absl::Status Enqueue(Batch& batch);
  absl::Status EnqueueCopyIn(Batch& batch, std::vector<device::MuonKernelItem>* items);
  absl::Status EnqueueWriteback(Batch& batch);
  // Waits for the oldest batch's writeback, delivers its results, gives its buffers back.
  void Retire();
  // The bytes the batch holds of the gather budget are released.
  void ReleaseBudget(const Batch& b);
  // What the operators see of a retired batch (step_observer.h).
  void Observe(const Batch& b);
  // Under the job's lock: whether matrix m (not yet taken) may go into the batch as far as the
  // state store goes, and how (*in_place); reserves its step window bytes. False: the window is
  // full before the seal, m waits for it.
  bool TakeState(uint32_t m, bool sealed, bool* in_place) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p_.job_mu_);
  // Outside the job's lock, before the batch writes anything: tells the store how each of its
  // matrices' state is written (StateBuffers::Plan).
  void PlanState(const Batch& batch);
  // The chaos test's hook (SetPipelineInPlaceHoldForTesting): once a step, after a batch updated in
  // place retired, the step holds (its state part new, part old, nothing committed).
  void HoldInPlace();
  // `matrices` are done, their owners' results in place: counted and announced.
  void MarkDone(const std::vector<uint32_t>& matrices);
  // The transport probe: each owner's span goes back as it came.
  void Echo(const Batch& batch);
  // After a device error: nothing may stay in flight without an event to wait for.
  void Abandon();
  // A batch that will not retire: its staging goes back to the pool.
  void Recycle(Batch& b);
  // The batch's host buffers (staging, momentum decodings) back to the pool.
  void GiveBackHostBuffers(Batch& b);
  void GiveBackBuffers(Batch& b);

  // Compressed momentum (step_pipeline_held.cc).
  // Device matrix i of the batch (index into `matrices`): its committed momentum decoded.
  void DecodeMomentum(Batch& batch, size_t i);
  // Where the device reads matrix i's committed momentum and writes its new one (fp32).
  const float* MomentumIn(Batch& batch, size_t i);
  float* MomentumOut(Batch& batch, size_t i);
  // The retired batch's new momenta, encoded into the store (as planned: window or in place).
  void EncodeMomentum(Batch& b);

  // kStaged, kInPlace and kHost (step_pipeline_staged.cc).
  // Assembles matrix i of the batch in fp32 on the host staging.
  absl::Status AssembleOnHost(Batch& batch, size_t i);
  // kInPlace: device matrix i's buffers are views of the staging and the stores.
  void BindInPlace(Batch& batch, size_t i);
  // kStaged: device matrix k's gradient from the staging to the device, its update back.
  absl::Status CopyStagedIn(Batch& batch, size_t k);
  absl::Status CopyStagedOut(Batch& batch, size_t k);
  // Update mode: the updates of the batch's host-staged matrices into the ranks' spans.
  void ScatterToRanks(Batch& b);

  // kDirect (step_pipeline_direct.cc).
  // Apply mode: reads the raw gradient of matrix i in place for the host's checks and sums.
  absl::Status ReadDirectGradient(Batch& batch, size_t i);
  // On the compute stream: widens the raw gradients (widen) or narrows the updates.
  absl::Status ConvertRaw(Batch& batch, bool widen);
  static device::DeviceBuffer& RawOrGrad(Batch& batch, size_t k);

  // Apply mode (step_pipeline_apply.cc).
  // The batch's tensors that no rank has a gradient of this step leave it, carried unchanged.
  void CarryAbsent(Batch& batch);
  // The batch's AdamW tensors, on the host threads.
  void HostWork(Batch& batch);
  // The retired batch's Muon updates applied to the masters.
  void ApplyToMasters(Batch& b);

  // Global clipping (step_pipeline_clip.cc).
  // Under the job's lock, every tensor done: queues again, with the clip coefficient when
  // clipping triggers, every tensor computed before the clip was known (every tensor, with two
  // copies of the state). True when it did.
  bool RedoForClipping() ABSL_EXCLUSIVE_LOCKS_REQUIRED(p_.job_mu_);
  bool RedoUpdateForClipping() ABSL_EXCLUSIVE_LOCKS_REQUIRED(p_.job_mu_);
  bool QueueAgain(float clip, float grad_scale) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p_.job_mu_);
  // The norm of the job's own gradients (every tensor's sum; update mode with the ranks' outside
  // shares) into state_.grad_norm, and its clip coefficient.
  float LocalClip() ABSL_EXCLUSIVE_LOCKS_REQUIRED(p_.job_mu_);
  // One copy of the state with clipping on: the clip is decided at the seal, before anything is
  // written in place (the tensors computed before it went to the step window with clip 1).
  bool NeedsNormPass() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(p_.job_mu_);
  // The norm pass, outside the job's lock: every tensor not read yet, its raw sum of squares and
  // the CRC32Cs of what was read; then, under the lock, the clip. When it clips, the tensors
  // computed before (to be computed again) are read again and must be what they were. A refusal
  // (apply mode's checks of the values, a gradient rewritten) refuses the step, nothing written.
  void DecideClip();
  // Tensor m's raw gradient read: its sum (`sum`) and the CRC32Cs CheckReread records or compares.
  absl::Status NormPassRead(uint32_t m, bool sum);
  // The redo refuses the step when a gradient it reads again differs from the first read.
  absl::Status CheckReread(uint32_t m, const std::vector<JobLayout::OwnerSlice>& slices,
                           std::vector<uint32_t> crc);
  // Tensor m's raw gradient in the owners' `slices` (OwnerSlices): as pieces for ApplyStep's
  // sums, and read for its CRC32Cs (CheckReread).
  std::vector<ApplyStep::RawPiece> RawPieces(
      uint32_t m, const std::vector<JobLayout::OwnerSlice>& slices) const;
  absl::Status CheckSlices(uint32_t m, const std::vector<JobLayout::OwnerSlice>& slices);

  StepPipeline& p_;
  StepState& state_;
  DeviceStreams& dev_;
  std::deque<Batch> flight_;
  absl::Status status_;
  bool refused_ = false;  // status_ is a refusal of the step's data, not a device error
  bool held_in_place_ = false;  // HoldInPlace held this drain
  // The simulated clock this call spends (every call drains what it enqueued before returning).
  const double clock_start_;
  const device::Device::BusySeconds busy_start_;
  // The device's compute busy seconds when the previous batch retired (Observe).
  double compute_seen_ = busy_start_.compute;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_STEP_PIPELINE_RUN_H_
