#include "server/jobs/momentum_store.h"

#include <algorithm>

#include "common/parallel_for.h"

namespace muond::server {

MomentumStore::MomentumStore(const common::JobSpec& spec, device::Device* device)
    : device_(device) {
  const size_t n = spec.matrices.size();
  // Apply mode keeps its momentum in the job's ParamStore.
  const bool none = spec.transport_probe || spec.mode == common::JobMode::kApply;
  for (int b = 0; b < 2; ++b) {
    buf_[b].resize(n);
    pinned_[b].assign(n, false);
    for (size_t m = 0; m < n && !none; ++m) {
      std::vector<float>& v = buf_[b][m];
      v.assign(static_cast<size_t>(spec.matrices[m].numel()), 0.0f);
      pinned_[b][m] = device_->RegisterHost(v.data(), v.size() * sizeof(float));
      if (b == 0) bytes_ += v.size() * sizeof(float);
    }
  }
}

MomentumStore::~MomentumStore() {
  for (int b = 0; b < 2; ++b) {
    for (size_t m = 0; m < buf_[b].size(); ++m) {
      if (pinned_[b][m]) {
        device_->UnregisterHost(buf_[b][m].data(), buf_[b][m].size() * sizeof(float));
      }
    }
  }
}

MomentumStore::Lock::Lock(MomentumStore& store) : store_(store) { store_.mu_.Lock(); }

MomentumStore::Lock::~Lock() { store_.mu_.Unlock(); }

void MomentumStore::Lock::Preserve() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (preserved_) return;
  store_.PreserveForSnapshot();
  preserved_ = true;
}

float* MomentumStore::Lock::mutable_data(uint32_t m) {
  Preserve();
  return store_.Front(m).data();
}

void MomentumStore::Lock::Zero() {
  for (uint32_t m = 0; m < store_.matrices(); ++m) {
    float* d = mutable_data(m);
    std::fill(d, d + store_.numel(m), 0.0f);
  }
}

void MomentumStore::Lock::Flip() {
  // The old front becomes the back, which the next step overwrites.
  Preserve();
  store_.parity_ = 1 - store_.parity_;
}

void MomentumStore::Lock::BeginSnapshot() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  store_.snapshot_ = std::make_unique<Snapshot>();
  store_.snapshot_->copied.assign(store_.matrices(), false);
  store_.snapshot_->saved.resize(store_.matrices());
}

void MomentumStore::PreserveForSnapshot() {
  if (snapshot_ == nullptr) return;
  // The whole momentum the writer has not copied yet, on the commit's critical path: over the
  // CPUs, a matrix per task (each task allocates and fills its own copy).
  std::vector<size_t> todo;
  uint64_t bytes = 0;
  for (size_t m = 0; m < matrices(); ++m) {
    if (snapshot_->copied[m] || !snapshot_->saved[m].empty()) continue;
    todo.push_back(m);
    bytes += numel(m) * sizeof(float);
  }
  Snapshot& snapshot = *snapshot_;
  common::ParallelFor(todo.size(), 2 * bytes,
                      [&](size_t k) { snapshot.saved[todo[k]] = Front(todo[k]); });
}

void MomentumStore::CopyForSnapshot(uint32_t m, std::vector<float>* out) {
  absl::MutexLock lock(&mu_);
  if (!snapshot_->saved[m].empty()) {
    *out = std::move(snapshot_->saved[m]);
    snapshot_->saved[m] = std::vector<float>();
  } else {
    *out = Front(m);
  }
  snapshot_->copied[m] = true;
}

void MomentumStore::EndSnapshot() {
  absl::MutexLock lock(&mu_);
  snapshot_.reset();
}

}  // namespace muond::server
