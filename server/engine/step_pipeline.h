// The step engine of a job (DESIGN.md section 6): as matrices become complete, takes them in
// batches under the gather budget, assembles each whole matrix in fp32 on the host, copies it to
// the device with its committed momentum, runs the Muon update there and writes the update back;
// up to DeviceStreams::kDepth batches are in flight on the three streams (copy-in, compute,
// writeback), ordered by events. Each update is then scattered into the ranks' output spans.
//
// Direct copies (step_pipeline_direct.cc): on a device with memory of its own (CUDA, Level Zero:
// Device::DirectHostCopies), a matrix whose every owner span lies in the ranks' shared-memory
// regions registered with the device (at attach, server/api/shm_attach.cc) is not assembled on
// the host at all: each owner's gradient span is copied by DMA straight from its region into the
// matrix's device buffer at the span's offset (one asynchronous copy per span, on the copy-in
// stream), widened to fp32 on the device when the gradient dtype is narrower, and after Muon the
// update is narrowed on the device and each span copied straight into the owner's update region
// (writeback stream). Such a matrix uses no host staging; on the device it holds the fp32
// gradient and momentum as before plus, for a 16-bit gradient, its raw copy (2 bytes an element,
// reused for the narrowed update), so the gather budget still counts 8 bytes an element.
// Apply mode's Muon tensors go direct the same way in, the gradient widened and scaled (divisor,
// clip coefficient) on the device; the host only reads their raw gradients (ReadDirectGradient:
// the norm, the checks, the clipping CRCs), the device writes the new momentum back to the
// ParamStore's back buffer, and the fp32 update comes back into host staging, where the masters
// are applied. Everything else takes the staged path: host devices (cpu, simulated), gRPC ranks,
// regions whose registration failed, apply mode's AdamW tensors and the transport probe.
//
// In place (Device::ComputesInHostMemory, the cpu backend): the kernel runs on the host staging
// itself, reading the committed momentum where it is stored and writing the new momentum straight
// into the store's back buffer (MuonKernelItem::momentum_out); nothing is copied in or back, and
// the gather budget counts 4 bytes an element (the staging).
//
// Update mode: the device computes the new momentum next to the update, and the writeback copies
// it into the MomentumStore's back buffer (MomentumStore::next) beside the update; the commit
// flips the store. The momentum committed is thus the one the update was computed from, from the
// gradient as the device read it once (a shared-memory peer that rewrites its region before the
// commit changes nothing), and a refused step leaves the committed momentum bit-identical.
//
// Apply mode (DESIGN.md 4b, apply_step.h): AdamW tensors never go to the device; they run on the
// host threads right after their batch's Muon tensors were enqueued (so with a GPU they overlap
// its Newton-Schulz), and Muon tensors are applied to the masters when their batch is retired
// (while the next batches compute). Everything reads the ParamStore's committed front and writes
// the step window or, once sealed, the front in place. With max_grad_norm the clip is decided at
// the seal (a norm pass over the gradients not computed yet) before anything is written in place;
// when it clips, the tensors computed before it are queued again with the clip coefficient
// (recomputed from the same front: the serial result, bit for bit; step_pipeline_clip.cc).
//
// Runs on the ComputeExecutor's thread (the device streams are used from there only). It reads the
// job's layout and momentum (unchanged while a step computes) and the StepState under the job's
// lock; it calls back into the job only through Sink.
#ifndef MUOND_SERVER_ENGINE_STEP_PIPELINE_H_
#define MUOND_SERVER_ENGINE_STEP_PIPELINE_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "server/device/device_streams.h"
#include "server/engine/apply_step.h"
#include "server/engine/job_layout.h"
#include "server/engine/momentum_store.h"
#include "server/engine/param_store.h"
#include "server/engine/step_observer.h"
#include "server/engine/step_state.h"

namespace muond::server {

class StepPipeline {
 public:
  // What the pipeline needs of the job that runs it.
  class Sink {
   public:
    virtual ~Sink() = default;
    // The device failed the step (it is refused; the store is untouched). Called with the job's
    // lock held, unless the step already ended.
    virtual void DeviceFailed(StepState& state, const absl::Status& status) = 0;
    // Every matrix succeeded: commit the step (without the job's lock held).
    virtual void Commit(StepState& state) = 0;
  };

  // The most a batch assembles (a matrix larger than that goes alone): enough matrices per batch
  // for the device to batch their Newton-Schulz and for kDepth batches to overlap copy-in,
  // compute and writeback, and no more. Assembling further ahead buys nothing (the gradients wait
  // in the ranks' regions until a batch takes them) and costs host memory per parameter: with
  // the batch at a third of the gather budget a streamed step of a model smaller than the budget
  // held its whole fp32 gradient assembled at once (4 bytes a parameter).
  static constexpr uint64_t kBatchTargetBytes = uint64_t{64} << 20;
  // The bytes a batch aims at under `gather_budget_bytes` and `batch_target_bytes`: a third of
  // the budget (kDepth batches in flight), at most the target, at least 1.
  static uint64_t BatchBytes(uint64_t gather_budget_bytes, uint64_t batch_target_bytes) {
    return std::max<uint64_t>(
        1, std::min<uint64_t>(gather_budget_bytes / DeviceStreams::kDepth, batch_target_bytes));
  }

  // Whole-matrix bytes matrix `m` of `spec` holds while assembled, on a device that computes in
  // place in host memory (`in_host_memory`: the cpu backend) or not: the fp32 gradient, and on
  // other devices the fp32 momentum too (and its fp32 decoding when the job holds it compressed);
  // AdamW tensors (apply mode) only the gradient. What the gather budget counts, and admission
  // (JobFootprint) reserves.
  static uint64_t AssembledBytesOf(const common::JobSpec& spec, const common::MatrixSpec& m,
                                   bool in_host_memory);

  // `job_mu` is the lock that guards the job's StepState; the others must outlive the pipeline.
  // `params`: apply mode's store (null in update mode): the step then also runs AdamW tensors on
  // the host, applies the Muon updates to the masters, returns new parameters and recomputes the
  // step when global clipping triggers (server/engine/apply_step.h).
  // `batch_target_bytes`: kBatchTargetBytes, or less (tests shrink it to see its bound on a
  // small model).
  StepPipeline(const common::JobSpec& spec, const JobLayout& layout, MomentumStore& momentum,
               ParamStore* params, DeviceStreams* devices, uint64_t gather_budget_bytes,
               absl::Mutex* job_mu, Sink* sink, uint64_t batch_target_bytes = kBatchTargetBytes);
  ~StepPipeline();

  // Processes the ready matrices of `state` until none is left, then returns; commits the step
  // when its last matrix is done. Clears state.drain_queued when it returns.
  void Drain(StepState& state);

  uint64_t gather_budget_bytes() const { return gather_budget_bytes_; }
  // The most bytes assembled at once so far.
  uint64_t gather_peak_bytes() const { return gather_peak_bytes_.load(); }
  // Bytes of the gather budget in batches being assembled or in flight now.
  uint64_t gather_in_use_bytes() const { return gather_in_use_bytes_.load(); }
  // Bytes of host staging registered (pinned) with the device, in the pool or in use.
  uint64_t pinned_staging_bytes() const ABSL_LOCKS_EXCLUDED(pool_mu_);
  // Host bytes idle in the pools kept between batches and steps: staging, and the device buffers
  // of a device without memory of its own (cpu, simulated).
  uint64_t pooled_host_bytes() const ABSL_LOCKS_EXCLUDED(pool_mu_);
  // Newton-Schulz time by shape class and the orthogonality samples (step_observer.h).
  const StepObserver& observer() const { return observer_; }

 private:
  struct Batch;
  class Run;

  // AssembledBytesOf matrix m on this pipeline's device.
  uint64_t AssembledBytes(uint32_t m) const;
  // The state store (step_pipeline_buffers.cc): two copies (never written in place) and the step
  // window's bytes.
  bool StateTwoCopies() const;
  uint64_t StateWindowBytes() const;

  // The direct path (step_pipeline_direct.cc). Under no lock: the spans of a complete matrix do
  // not change until the step ends.
  // True when matrix m goes straight between the ranks' regions and the device (see above).
  bool Direct(const StepState& state, uint32_t m) const;
  // Enqueues on the copy-in stream one copy per owner span of m, from the owner's gradient
  // region into `dst` (the gradient dtype, at the span's element offset).
  absl::Status CopySpansIn(const StepState& state, uint32_t m, device::DeviceBuffer& dst) const;
  // Enqueues on the writeback stream one copy per owner span of m, from `src` (the gradient
  // dtype) into the owner's update region.
  absl::Status CopySpansOut(const StepState& state, uint32_t m,
                            const device::DeviceBuffer& src) const;
  // Counts bytes of the staged path (muond_step_copy_bytes_total): from or into staging that is
  // registered with the device (path="pinned_staging": DMA in place), else through the device's
  // bounce buffer (path="staged").
  static void CountStaged(bool to_device, uint64_t bytes, bool pinned = false);
  // True when host staging `data` (a buffer of TakeStaging) is registered with the device.
  bool StagingPinned(const float* data);
  // Matrix m's committed momentum (the update mode store or apply mode's front).
  const float* CommittedMomentum(uint32_t m) const;
  // The job holds Muon's momentum compressed (bf16 or int8: JobSpec::state): the device paths
  // work on an fp32 decoding per matrix (step_pipeline_held.cc).
  bool MomentumHeld() const {
    return !spec_.transport_probe && spec_.state.momentum != common::StateDType::kFloat32;
  }
  // Where matrix m's new momentum goes (the update mode store's back buffer or apply mode's
  // back), written by the kernel itself on a device that computes in host memory.
  float* NextMomentum(uint32_t m) const;

  // Buffers of retired batches kept for the next batches and steps: fresh memory every step costs
  // page faults and the kernel's zeroing of everything assembled (hundreds of megabytes a step for
  // a large model). Same-shape tensors come back every step, so buffers are matched by size. At
  // most what was ever assembled at once (the gather peak, within the budget) is kept idle: the
  // next step needs no more at once; more is freed (PoolLimit). On a device with direct host copies
  // (GPUs) a staging buffer that goes into the pool is registered with the device once, so its
  // copies from then on are DMA without the bounce buffer (apply mode always stages; update mode
  // stages what cannot go direct); one freed is unregistered first.
  std::vector<float> TakeStaging(size_t n);
  absl::StatusOr<device::DeviceBuffer> TakeDeviceBuffer(size_t bytes);
  void GiveBack(std::vector<float> staging);
  void GiveBack(device::DeviceBuffer buffer);
  uint64_t PoolLimit() const;

  const common::JobSpec& spec_;
  const JobLayout& layout_;
  MomentumStore& momentum_;
  ParamStore* const params_;
  const std::unique_ptr<ApplyStep> apply_;
  DeviceStreams* const devices_;
  const uint64_t gather_budget_bytes_;
  const uint64_t batch_target_bytes_;
  absl::Mutex* const job_mu_;
  Sink* const sink_;
  std::atomic<uint64_t> gather_peak_bytes_{0};
  std::atomic<uint64_t> gather_in_use_bytes_{0};
  StepObserver observer_;
  // Per matrix: a tensor of a QK-Clip pair, whose results are announced only at the commit (the
  // clip rescales them once every tensor is done).
  std::vector<bool> qk_withheld_;
  mutable absl::Mutex pool_mu_;
  std::multimap<size_t, std::vector<float>> staging_pool_ ABSL_GUARDED_BY(pool_mu_);
  std::multimap<size_t, device::DeviceBuffer> device_pool_ ABSL_GUARDED_BY(pool_mu_);
  uint64_t pool_bytes_ ABSL_GUARDED_BY(pool_mu_) = 0;
  // Staging registered with the device (GiveBack), by address: its bytes. In the pool or in use.
  std::map<const float*, size_t> pinned_staging_ ABSL_GUARDED_BY(pool_mu_);
};

// The chaos test's hook ($MUOND_TEST_INPLACE_HOLD_MS in a build with MUOND_TEST_HOOKS): once per
// drain, after a batch whose state was updated in place retired, the executor sleeps `ms` (0: off)
// and logs "test hook: job 'J' step T holds in the middle of an in-place update", so a SIGKILL
// lands where the state is part new, part old and nothing is committed.
void SetPipelineInPlaceHoldForTesting(int ms);

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_STEP_PIPELINE_H_
