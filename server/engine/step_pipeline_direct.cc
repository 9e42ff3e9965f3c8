// The direct path of the step pipeline (see step_pipeline.h): which matrices skip the host
// assembly, their copies straight between the ranks' registered shared-memory regions and the
// device, and the counts of bytes by path (muond_step_copy_bytes_total).
//
// Run on this machine only through the simulated device's direct mode (host memory standing in
// for device memory, tests/gpu/device_direct_copy_test.cc); on CUDA and Level Zero the same code
// enqueues DMA copies of registered memory, which the CUDA tests of that file check when a GPU is
// present (not run where this was written: no GPU).
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "common/crc32c.h"
#include "common/parallel_for.h"
#include "server/engine/step_pipeline_run.h"

namespace muond::server {
namespace {

struct CopyMetrics {
  CopyMetrics() {
    auto f = common::DefaultRegistry().AddCounter(
        "muond_step_copy_bytes_total",
        "Gradient bytes copied to the compute device and update bytes copied back, by path: "
        "direct (DMA straight from and to the ranks' registered shared-memory regions, widened "
        "and narrowed on the device), pinned_staging (the daemon's fp32 host assembly, "
        "registered with the device: DMA in place) or staged (the host assembly through the "
        "device's bounce buffer).");
    if (!f.ok()) {
      MUOND_LOG(ERROR) << "metrics: " << f.status();
      return;
    }
    const char* const kPaths[] = {"staged", "direct", "pinned_staging"};
    for (int path = 0; path < 3; ++path) {
      for (int to_device = 0; to_device < 2; ++to_device) {
        bytes[path][to_device] = &(*f)->Add(
            {{"path", kPaths[path]}, {"direction", to_device ? "to_device" : "to_host"}});
      }
    }
  }
  common::Counter* bytes[3][2] = {};  // [staged, direct, pinned_staging][to_device]
};

CopyMetrics& Metrics() {
  static auto* metrics = new CopyMetrics();
  return *metrics;
}

enum Path { kStaged = 0, kDirect = 1, kPinnedStaging = 2 };

void Count(Path path, bool to_device, uint64_t bytes) {
  common::Counter* c = Metrics().bytes[path][to_device ? 1 : 0];
  if (c != nullptr) c->Increment(static_cast<double>(bytes));
}

}  // namespace

void StepPipeline::CountStaged(bool to_device, uint64_t bytes, bool pinned) {
  Count(pinned ? kPinnedStaging : kStaged, to_device, bytes);
}

bool StepPipeline::Direct(const StepState& state, uint32_t m) const {
  if (spec_.transport_probe) return false;
  const device::Device& dev = *devices_->device;
  if (!dev.DirectHostCopies()) return false;
  // Apply mode: Muon tensors only (AdamW runs on the host). Their momentum is copied from and back
  // to the (registered) store as update mode's is, and the update comes back to the host's
  // staging (the masters are applied there), so only the gradients must lie in registered
  // regions; update mode's updates go straight into the ranks' registered update regions too.
  if (apply_ != nullptr && spec_.matrices[m].optimizer != common::Optimizer::kMuon) return false;
  // Update mode with clipping: the host sums the gradient's squares for the norm, so it is
  // assembled (staged) anyway.
  if (spec_.clips_outside_share()) return false;
  for (const JobLayout::SpanRef& ref : layout_.owners(m)) {
    const size_t bytes = layout_.SpanBytes(ref.rank, ref.span);
    const RankInput& in = state.ranks[ref.rank];
    if (ref.span >= in.span_in.size() || !dev.IsHostRegistered(in.span_in[ref.span], bytes)) {
      return false;  // a gRPC rank, or a region the device could not register
    }
    if (apply_ != nullptr) continue;
    const std::shared_ptr<RankUpdate>& out = state.outputs[ref.rank];
    if (out == nullptr || ref.span >= out->spans.size() || out->spans[ref.span].size != bytes ||
        !dev.IsHostRegistered(out->spans[ref.span].data, bytes)) {
      return false;
    }
  }
  return true;
}

absl::Status StepPipeline::CopySpansIn(const StepState& state, uint32_t m,
                                       device::DeviceBuffer& dst) const {
  const size_t esize = common::DTypeSize(spec_.matrices[m].dtype);
  uint64_t total = 0;
  for (const JobLayout::SpanRef& ref : layout_.owners(m)) {
    const common::ShardSpan& span = layout_.spans(ref.rank)[ref.span];
    const size_t bytes = span.length * esize;
    RETURN_IF_ERROR(devices_->copy_in->CopyToDevice(
        dst, span.offset * esize, state.ranks[ref.rank].span_in[ref.span], bytes));
    total += bytes;
  }
  Count(kDirect, true, total);
  return absl::OkStatus();
}

absl::Status StepPipeline::CopySpansOut(const StepState& state, uint32_t m,
                                        const device::DeviceBuffer& src) const {
  const size_t esize = common::DTypeSize(spec_.matrices[m].dtype);
  uint64_t total = 0;
  for (const JobLayout::SpanRef& ref : layout_.owners(m)) {
    const common::ShardSpan& span = layout_.spans(ref.rank)[ref.span];
    const size_t bytes = span.length * esize;
    RETURN_IF_ERROR(devices_->writeback->CopyToHost(state.outputs[ref.rank]->spans[ref.span].data,
                                                    src, span.offset * esize, bytes));
    total += bytes;
  }
  Count(kDirect, false, total);
  return absl::OkStatus();
}

// Apply mode, a Muon tensor that goes direct (its gradient is copied straight from the ranks'
// regions and widened and scaled on the device, which also writes its new momentum back): the
// host reads the raw gradient once, without assembling it, for what apply mode needs of it on
// the host: its sum of squares (in the order PrepareGradient sums, so the norm and the clip
// are the staged path's bit for bit), the finiteness and divisor checks, and under clipping the
// CRC32Cs the redo compares. The update comes back into pooled (registered) staging.
absl::Status StepPipeline::Run::ReadDirectGradient(Batch& batch, size_t i) {
  const uint32_t m = batch.matrices[i];
  const common::MatrixSpec& ms = p_.spec_.matrices[m];
  const size_t n = static_cast<size_t>(ms.numel());
  const absl::Time gather_start = absl::Now();
  const std::vector<JobLayout::OwnerSlice> slices = p_.layout_.OwnerSlices(m, uint64_t{1} << 20);
  absl::Status s = p_.apply_->CheckRawGradient(state_, m, RawPieces(m, slices), &state_.sum_sq[m]);
  if (s.ok() && p_.spec_.max_grad_norm > 0) s = CheckSlices(m, slices);
  if (!s.ok()) {
    refused_ = true;
    return s;
  }
  batch.staging[i] = p_.TakeStaging(n);  // where the update comes back
  state_.phase_seconds[0] += absl::ToDoubleSeconds(absl::Now() - gather_start);
  return absl::OkStatus();
}

// Where device matrix k of a direct batch is copied from and to the ranks: its raw buffer for a
// 16-bit gradient, else the fp32 gradient buffer itself.
device::DeviceBuffer& StepPipeline::Run::RawOrGrad(Batch& batch, size_t k) {
  return batch.raw[k].size() > 0 ? batch.raw[k] : batch.grad[k];
}

// On the compute stream, the direct matrices with a raw buffer: widens the raw gradients into
// the fp32 buffers (apply mode: scaled by the step's divisor and clip coefficient, as
// PrepareGradient scales a staged one), or (update mode) narrows the updates into the raw
// buffers. Apply mode's updates go back in fp32 (to the staging).
absl::Status StepPipeline::Run::ConvertRaw(Batch& batch, bool widen) {
  if (!widen && apply_mode()) return absl::OkStatus();
  const float scale = apply_mode() ? state_.grad_scale : 1.0f;
  for (size_t k = 0; k < batch.raw.size(); ++k) {
    if (batch.raw[k].size() == 0) continue;
    const common::MatrixSpec& ms = p_.spec_.matrices[batch.matrices[batch.on_device[k]]];
    const common::DType dtype = ms.dtype;
    const size_t n = static_cast<size_t>(ms.numel());
    RETURN_IF_ERROR(widen ? dev_.compute->Convert(batch.raw[k], dtype, batch.grad[k],
                                                  common::DType::kFloat32, n, scale)
                          : dev_.compute->Convert(batch.grad[k], common::DType::kFloat32,
                                                  batch.raw[k], dtype, n, 1.0f));
  }
  return absl::OkStatus();
}

}  // namespace muond::server
