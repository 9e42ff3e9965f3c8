// The host-assembled paths of the step pipeline (step_pipeline_run.h): kStaged (the fp32 host
// staging copied to the device and the update copied back), kInPlace (the kernel runs on the
// staging and the stores themselves) and the assembly that kHost shares with them; and update
// mode's delivery of host-staged updates into the ranks' spans.
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "server/engine/step_pipeline_run.h"
#include "server/optim/grad_norm.h"

namespace muond::server {

// The owners' spans in fp32, in slices over the CPUs (large tensors are hundreds of megabytes);
// apply mode scales and sums it.
absl::Status StepPipeline::Run::AssembleOnHost(Batch& batch, size_t i) {
  const uint32_t m = batch.matrices[i];
  const common::MatrixSpec& ms = p_.spec_.matrices[m];
  const size_t n = static_cast<size_t>(ms.numel());
  const absl::Time gather_start = absl::Now();
  batch.staging[i] = p_.TakeStaging(n);
  const std::vector<JobLayout::OwnerSlice> slices = p_.layout_.OwnerSlices(m, uint64_t{1} << 20);
  const size_t esize = common::DTypeSize(ms.dtype);
  // With clipping the redo reads every gradient a second time, so the first pass notes what it
  // read and the redo checks that it reads the same (CheckReread).
  const bool crcs = p_.spec_.max_grad_norm > 0;
  // Update mode scales the gradient by the clip once it is known: the redo, or every tensor
  // computed after the norm pass (apply mode: PrepareGradient).
  const bool clip_known = state_.clip_redo || state_.clip_decided;
  const float scale = !apply_mode() && clip_known ? state_.grad_scale : 1.0f;
  std::vector<uint32_t> crc(crcs ? slices.size() : 0);
  common::ParallelFor(slices.size(), n * (esize + sizeof(float)), [&](size_t k) {
    const JobLayout::SpanRef& ref = *slices[k].ref;
    const common::ShardSpan& span = p_.layout_.spans(ref.rank)[ref.span];
    const char* raw = state_.ranks[ref.rank].span_in[ref.span] + slices[k].begin * esize;
    if (crcs) crc[k] = common::Crc32c(raw, slices[k].length * esize);
    float* dst = batch.staging[i].data() + span.offset + slices[k].begin;
    common::ToFloat32(ms.dtype, raw, slices[k].length, dst);
    if (scale != 1.0f) {
      for (uint64_t j = 0; j < slices[k].length; ++j) dst[j] *= scale;
    }
  });
  if (crcs) {
    if (absl::Status s = CheckReread(m, slices, std::move(crc)); !s.ok()) {
      refused_ = true;
      return s;
    }
  }
  if (crcs && !apply_mode() && !clip_known) {
    // Update mode: the matrix's share of the norm, from the first (unscaled) pass; after the
    // norm pass (one copy) it has it already.
    state_.sum_sq[m] = ParallelSumOfSquares(batch.staging[i].data(), n);
  }
  if (apply_mode()) {
    // A device computing in host memory writes a Muon tensor's new momentum into the back
    // buffer itself (BindInPlace gives it NextMomentum as momentum_out). A tensor updated in
    // place gets its new momentum from the device's writeback too (EnqueueWriteback): the host's
    // would overwrite the committed momentum before the device copied it in. So does momentum
    // held compressed (step_pipeline_held.cc).
    absl::Status s = p_.apply_->PrepareGradient(
        state_, m, batch.staging[i].data(), &state_.sum_sq[m],
        dev_.device->ComputesInHostMemory() || batch.in_place[i] || p_.MomentumHeld());
    if (!s.ok()) {
      refused_ = true;
      return s;
    }
  }
  state_.phase_seconds[0] += absl::ToDoubleSeconds(absl::Now() - gather_start);
  return absl::OkStatus();
}

void StepPipeline::Run::BindInPlace(Batch& batch, size_t i) {
  const uint32_t m = batch.matrices[i];
  const size_t bytes = static_cast<size_t>(p_.spec_.matrices[m].numel()) * sizeof(float);
  batch.grad.push_back(device::DeviceBuffer::HostView(batch.staging[i].data(), bytes));
  if (p_.MomentumHeld()) {  // the kernel decodes and encodes the store (EnqueueCopyIn)
    batch.mom.emplace_back();
    batch.mom_out.emplace_back();
  } else {
    batch.mom.push_back(
        device::DeviceBuffer::HostView(const_cast<float*>(p_.CommittedMomentum(m)), bytes));
    batch.mom_out.push_back(device::DeviceBuffer::HostView(p_.NextMomentum(m), bytes));
  }
  batch.raw.emplace_back();
}

absl::Status StepPipeline::Run::CopyStagedIn(Batch& batch, size_t k) {
  const std::vector<float>& staging = batch.staging[batch.on_device[k]];
  const size_t bytes = staging.size() * sizeof(float);
  RETURN_IF_ERROR(dev_.copy_in->CopyToDevice(batch.grad[k], 0, staging.data(), bytes));
  CountStaged(true, bytes, p_.StagingPinned(staging.data()));
  return absl::OkStatus();
}

absl::Status StepPipeline::Run::CopyStagedOut(Batch& batch, size_t k) {
  std::vector<float>& staging = batch.staging[batch.on_device[k]];
  const size_t bytes = staging.size() * sizeof(float);
  RETURN_IF_ERROR(dev_.writeback->CopyToHost(staging.data(), batch.grad[k], 0, bytes));
  CountStaged(false, bytes, p_.StagingPinned(staging.data()));
  return absl::OkStatus();
}

// Every owner's span of the batch, cut into slices for the CPUs (the narrowing to bf16 or fp16
// is a pass over the whole model each step). Direct matrices are in the update regions already.
void StepPipeline::Run::ScatterToRanks(Batch& b) {
  struct Scatter {
    const float* src;
    uint64_t length;
    common::DType dtype;
    char* dst;
  };
  std::vector<Scatter> slices;
  size_t bytes = 0;
  for (size_t i = 0; i < b.matrices.size(); ++i) {
    if (b.path[i] == MatrixPath::kDirect) continue;
    const uint32_t m = b.matrices[i];
    const common::DType dtype = p_.spec_.matrices[m].dtype;
    const size_t esize = common::DTypeSize(dtype);
    for (const JobLayout::OwnerSlice& piece : p_.layout_.OwnerSlices(m, uint64_t{1} << 20)) {
      const common::ShardSpan& span = p_.layout_.spans(piece.ref->rank)[piece.ref->span];
      char* out = static_cast<char*>(state_.outputs[piece.ref->rank]->spans[piece.ref->span].data);
      slices.push_back({b.staging[i].data() + span.offset + piece.begin, piece.length, dtype,
                        out + piece.begin * esize});
      bytes += piece.length * (sizeof(float) + esize);
    }
  }
  common::ParallelFor(slices.size(), bytes, [&](size_t k) {
    common::FromFloat32(slices[k].src, slices[k].length, slices[k].dtype, slices[k].dst);
  });
}

}  // namespace muond::server
