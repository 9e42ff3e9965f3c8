#include "server/engine/momentum_store.h"

#include <algorithm>

namespace muond::server {
namespace {

// Apply mode keeps its momentum in the job's ParamStore; a transport probe has none.
std::vector<StateBuffers::Form> MatrixForms(const common::JobSpec& spec) {
  std::vector<StateBuffers::Form> forms;
  if (spec.transport_probe || spec.mode == common::JobMode::kApply) return forms;
  for (const common::MatrixSpec& m : spec.matrices) {
    forms.push_back({static_cast<size_t>(m.numel()), spec.state.momentum, StateRole::kSigned});
  }
  return forms;
}

}  // namespace

MomentumStore::MomentumStore(const common::JobSpec& spec, device::Device* device,
                             uint64_t window_bytes)
    : buffers_(MatrixForms(spec), device, window_bytes) {
  for (size_t m = 0; m < buffers_.arrays(); ++m) bytes_ += buffers_.words(m) * sizeof(float);
}

void MomentumStore::Lock::Zero() {
  for (uint32_t m = 0; m < store_.matrices(); ++m) {
    float* d = mutable_data(m);
    std::fill(d, d + store_.buffers_.words(m), 0.0f);  // zeros in every form
  }
}

}  // namespace muond::server
