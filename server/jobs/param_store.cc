#include "server/jobs/param_store.h"

#include <algorithm>

namespace muond::server {

ParamStore::ParamStore(const common::JobSpec& spec, device::Device* device) : device_(device) {
  for (const common::MatrixSpec& m : spec.matrices) {
    first_.push_back(buf_[0].size());
    const int slots = m.optimizer == common::Optimizer::kAdamW ? 3 : 2;
    slots_.push_back(slots);
    numel_.push_back(static_cast<size_t>(m.numel()));
    for (int s = 0; s < slots; ++s) {
      for (int b = 0; b < 2; ++b) {
        buf_[b].emplace_back(numel_.back(), 0.0f);
        std::vector<float>& v = buf_[b].back();
        pinned_[b].push_back(device_->RegisterHost(v.data(), v.size() * sizeof(float)));
        bytes_ += v.size() * sizeof(float);
      }
    }
  }
  steps_.assign(spec.matrices.size(), 0);
}

ParamStore::~ParamStore() {
  for (int b = 0; b < 2; ++b) {
    for (size_t a = 0; a < buf_[b].size(); ++a) {
      if (pinned_[b][a]) {
        device_->UnregisterHost(buf_[b][a].data(), buf_[b][a].size() * sizeof(float));
      }
    }
  }
}

ParamStore::Lock::Lock(ParamStore& store) : store_(store) { store_.mu_.Lock(); }

ParamStore::Lock::~Lock() { store_.mu_.Unlock(); }

void ParamStore::Lock::Preserve() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (preserved_) return;
  store_.PreserveForSnapshot();
  preserved_ = true;
}

float* ParamStore::Lock::mutable_front(uint32_t t, int slot) {
  Preserve();
  return store_.FrontArray(store_.first_[t] + slot).data();
}

void ParamStore::Lock::set_steps(uint32_t t, int64_t steps) { store_.steps_[t] = steps; }

void ParamStore::Lock::Flip() {
  Preserve();
  store_.parity_ = 1 - store_.parity_;
  for (size_t t = 0; t < store_.slots_.size(); ++t) {
    if (store_.slots_[t] == 3) ++store_.steps_[t];
  }
}

void ParamStore::Lock::ZeroOptimizerState() {
  for (uint32_t t = 0; t < store_.slots_.size(); ++t) {
    for (int s = 1; s < store_.slots_[t]; ++s) {
      float* d = mutable_front(t, s);
      std::fill(d, d + store_.numel_[t], 0.0f);
    }
    store_.steps_[t] = 0;
  }
}

void ParamStore::Lock::BeginSnapshot() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto snap = std::make_unique<Snapshot>();
  snap->copied.assign(store_.buf_[0].size(), false);
  snap->saved.resize(store_.buf_[0].size());
  snap->steps = store_.steps_;
  store_.snapshot_ = std::move(snap);
}

void ParamStore::PreserveForSnapshot() {
  if (snapshot_ == nullptr) return;
  for (size_t a = 0; a < snapshot_->copied.size(); ++a) {
    if (!snapshot_->copied[a] && snapshot_->saved[a].empty()) snapshot_->saved[a] = FrontArray(a);
  }
}

void ParamStore::CopyForSnapshot(uint32_t t, int slot, std::vector<float>* out) {
  absl::MutexLock lock(&mu_);
  const size_t a = first_[t] + slot;
  if (!snapshot_->saved[a].empty()) {
    *out = std::move(snapshot_->saved[a]);
    snapshot_->saved[a] = std::vector<float>();
  } else {
    out->assign(FrontArray(a).begin(), FrontArray(a).end());
  }
  snapshot_->copied[a] = true;
}

std::vector<int64_t> ParamStore::SnapshotSteps() {
  absl::MutexLock lock(&mu_);
  return snapshot_->steps;
}

void ParamStore::EndSnapshot() {
  absl::MutexLock lock(&mu_);
  snapshot_.reset();
}

}  // namespace muond::server
