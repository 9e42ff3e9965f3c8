#include "server/engine/param_store.h"

#include <algorithm>

namespace muond::server {
namespace {

// Per array (tensor by tensor, slot by slot) its form; fills the per-tensor tables. The masters
// are fp32; the momentum and AdamW's moments as the job's "state" says (v: the logarithmic map).
std::vector<StateBuffers::Form> ArrayForms(const common::JobSpec& spec, std::vector<size_t>* first,
                                           std::vector<int>* slots, std::vector<size_t>* numel) {
  std::vector<StateBuffers::Form> forms;
  for (const common::MatrixSpec& m : spec.matrices) {
    first->push_back(forms.size());
    const bool adamw = m.optimizer == common::Optimizer::kAdamW;
    slots->push_back(adamw ? 3 : 2);
    const size_t n = static_cast<size_t>(m.numel());
    numel->push_back(n);
    forms.push_back({n, common::StateDType::kFloat32, StateRole::kSigned});
    if (adamw) {
      forms.push_back({n, spec.state.adamw, StateRole::kSigned});
      forms.push_back({n, spec.state.adamw, StateRole::kNonNegative});
    } else {
      forms.push_back({n, spec.state.momentum, StateRole::kSigned});
    }
  }
  return forms;
}

}  // namespace

ParamStore::ParamStore(const common::JobSpec& spec, device::Device* device, uint64_t window_bytes)
    : buffers_(ArrayForms(spec, &first_, &slots_, &numel_), device, window_bytes) {
  for (size_t a = 0; a < buffers_.arrays(); ++a) bytes_ += buffers_.words(a) * sizeof(float);
  steps_.assign(spec.matrices.size(), 0);
}

ParamStore::Pinned ParamStore::pinned_bytes() const {
  Pinned p;
  for (uint32_t t = 0; t < first_.size(); ++t) {
    p.masters += buffers_.pinned_bytes(first_[t] + kMaster);
    for (int slot = 1; slot < slots_[t]; ++slot) {
      (slots_[t] == 2 ? p.momentum : p.moments) += buffers_.pinned_bytes(first_[t] + slot);
    }
  }
  return p;
}

void ParamStore::Lock::Unflip(const std::vector<uint8_t>& absent) {
  lock_.Unflip();
  for (size_t t = 0; t < store_.slots_.size(); ++t) {
    const bool skipped = t < absent.size() && absent[t] != 0;
    if (store_.slots_[t] == 3 && !skipped) --store_.steps_[t];
  }
}

void ParamStore::Lock::Flip(const std::vector<uint8_t>& absent, bool keep_back) {
  lock_.Flip(keep_back);
  for (size_t t = 0; t < store_.slots_.size(); ++t) {
    const bool skipped = t < absent.size() && absent[t] != 0;
    if (store_.slots_[t] == 3 && !skipped) ++store_.steps_[t];
  }
}

void ParamStore::Lock::ZeroOptimizerState() {
  for (uint32_t t = 0; t < store_.slots_.size(); ++t) {
    for (int s = 1; s < store_.slots_[t]; ++s) {
      float* d = mutable_front(t, s);
      std::fill(d, d + store_.buffers_.words(store_.first_[t] + s), 0.0f);  // zeros in any form
    }
    store_.steps_[t] = 0;
  }
}

void ParamStore::Lock::BeginSnapshot() {
  lock_.BeginSnapshot();
  store_.snapshot_steps_ = store_.steps_;
}

}  // namespace muond::server
