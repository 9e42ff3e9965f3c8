#include "server/engine/momentum_store.h"

#include <algorithm>

namespace muond::server {
namespace {

// Apply mode keeps its momentum in the job's ParamStore; a transport probe has none.
std::vector<size_t> MatrixSizes(const common::JobSpec& spec) {
  std::vector<size_t> numel;
  if (spec.transport_probe || spec.mode == common::JobMode::kApply) return numel;
  for (const common::MatrixSpec& m : spec.matrices) numel.push_back(static_cast<size_t>(m.numel()));
  return numel;
}

}  // namespace

MomentumStore::MomentumStore(const common::JobSpec& spec, device::Device* device,
                             uint64_t window_bytes)
    : buffers_(MatrixSizes(spec), device, window_bytes) {
  for (size_t m = 0; m < buffers_.arrays(); ++m) bytes_ += buffers_.numel(m) * sizeof(float);
}

void MomentumStore::Lock::Zero() {
  for (uint32_t m = 0; m < store_.matrices(); ++m) {
    float* d = mutable_data(m);
    std::fill(d, d + store_.numel(m), 0.0f);
  }
}

}  // namespace muond::server
