#include "server/jobs/momentum_store.h"

#include <algorithm>

#include "common/parallel_for.h"

namespace muond::server {

MomentumStore::MomentumStore(const common::JobSpec& spec, device::Device* device)
    : device_(device) {
  const size_t n = spec.matrices.size();
  momentum_.resize(n);
  pinned_.assign(n, false);
  // Apply mode keeps its momentum in the job's ParamStore.
  const bool none = spec.transport_probe || spec.mode == common::JobMode::kApply;
  for (size_t m = 0; m < n && !none; ++m) {
    momentum_[m].assign(static_cast<size_t>(spec.matrices[m].numel()), 0.0f);
    pinned_[m] = device_->RegisterHost(momentum_[m].data(), momentum_[m].size() * sizeof(float));
    bytes_ += momentum_[m].size() * sizeof(float);
  }
}

MomentumStore::~MomentumStore() {
  for (size_t m = 0; m < momentum_.size(); ++m) {
    if (pinned_[m]) {
      device_->UnregisterHost(momentum_[m].data(), momentum_[m].size() * sizeof(float));
    }
  }
}

MomentumStore::Lock::Lock(MomentumStore& store) : store_(store) { store_.mu_.Lock(); }

MomentumStore::Lock::~Lock() { store_.mu_.Unlock(); }

float* MomentumStore::Lock::mutable_data(uint32_t m) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (!preserved_) {
    store_.PreserveForSnapshot();
    preserved_ = true;
  }
  return store_.momentum_[m].data();
}

void MomentumStore::Lock::Zero() {
  for (uint32_t m = 0; m < store_.momentum_.size(); ++m) {
    float* d = mutable_data(m);
    std::fill(d, d + store_.momentum_[m].size(), 0.0f);
  }
}

void MomentumStore::Lock::BeginSnapshot() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  store_.snapshot_ = std::make_unique<Snapshot>();
  store_.snapshot_->copied.assign(store_.momentum_.size(), false);
  store_.snapshot_->saved.resize(store_.momentum_.size());
}

void MomentumStore::PreserveForSnapshot() {
  if (snapshot_ == nullptr) return;
  // The whole momentum the writer has not copied yet, on the commit's critical path: over the
  // CPUs, a matrix per task (each task allocates and fills its own copy).
  std::vector<size_t> todo;
  uint64_t bytes = 0;
  for (size_t m = 0; m < momentum_.size(); ++m) {
    if (snapshot_->copied[m] || !snapshot_->saved[m].empty()) continue;
    todo.push_back(m);
    bytes += momentum_[m].size() * sizeof(float);
  }
  Snapshot& snapshot = *snapshot_;
  common::ParallelFor(todo.size(), 2 * bytes, [&](size_t k) {
    snapshot.saved[todo[k]].assign(momentum_[todo[k]].begin(), momentum_[todo[k]].end());
  });
}

void MomentumStore::CopyForSnapshot(uint32_t m, std::vector<float>* out) {
  absl::MutexLock lock(&mu_);
  if (!snapshot_->saved[m].empty()) {
    *out = std::move(snapshot_->saved[m]);
    snapshot_->saved[m] = std::vector<float>();
  } else {
    out->assign(momentum_[m].begin(), momentum_[m].end());
  }
  snapshot_->copied[m] = true;
}

void MomentumStore::EndSnapshot() {
  absl::MutexLock lock(&mu_);
  snapshot_.reset();
}

}  // namespace muond::server
