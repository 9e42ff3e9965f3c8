#include "server/engine/state_buffers.h"

#include <cstring>
#include <utility>

namespace muond::server {

StateBuffers::Buffer::Buffer(size_t n, bool zeroed, bool pin, device::Device* device)
    : data(zeroed ? new float[n]() : new float[n]), n(n), registered(nullptr) {
  if (pin && device->RegisterHost(data.get(), n * sizeof(float))) registered = device;
}

StateBuffers::Buffer::~Buffer() {
  if (registered != nullptr) registered->UnregisterHost(data.get(), n * sizeof(float));
}

StateBuffers::StateBuffers(const std::vector<size_t>& numel, device::Device* device)
    : device_(device), numel_(numel) {
  for (int b = 0; b < 2; ++b) {
    for (size_t n : numel_) {
      buf_[b].push_back(std::make_unique<Buffer>(n, /*zeroed=*/true, /*pin=*/true, device_));
    }
  }
  spare_.resize(numel_.size());
}

StateBuffers::~StateBuffers() = default;

uint64_t StateBuffers::pinned_bytes(size_t a) const {
  absl::MutexLock lock(&mu_);
  uint64_t bytes = 0;
  for (const Buffer* b : {buf_[0][a].get(), buf_[1][a].get(), spare_[a].get()}) {
    if (b != nullptr && b->registered != nullptr) bytes += b->n * sizeof(float);
  }
  return bytes;
}

StateBuffers::Held StateBuffers::held() const {
  absl::MutexLock lock(&mu_);
  Held h;
  auto bytes = [](const std::unique_ptr<Buffer>& b) -> uint64_t {
    return b != nullptr ? b->n * sizeof(float) : 0;
  };
  for (size_t a = 0; a < numel_.size(); ++a) {
    h.front += bytes(buf_[parity_][a]);
    h.back += bytes(buf_[1 - parity_][a]);
    h.spare += bytes(spare_[a]);
    if (snapshot_ != nullptr) h.snapshot += bytes(snapshot_->handed[a]);
  }
  return h;
}

bool StateBuffers::SnapshotNeeds(size_t a, const Buffer& buffer) const {
  return snapshot_ != nullptr && !snapshot_->copied[a] && snapshot_->handed[a] == nullptr &&
         snapshot_->data[a] == buffer.data.get();
}

void StateBuffers::HandOver(size_t a, std::unique_ptr<Buffer>* slot, bool keep) {
  // Not pinned: registering costs about as much as copying, on this (the step's) thread.
  auto fresh = std::make_unique<Buffer>(numel_[a], /*zeroed=*/false, /*pin=*/false, device_);
  if (keep) {
    std::memcpy(fresh->data.get(), (*slot)->data.get(), numel_[a] * sizeof(float));
    cost_.change_copied += numel_[a] * sizeof(float);
  } else {
    cost_.step_handed_over += numel_[a] * sizeof(float);
  }
  snapshot_->handed[a] = std::exchange(*slot, std::move(fresh));
}

void StateBuffers::Release(size_t a, std::unique_ptr<Buffer> buffer) {
  if (buffer != nullptr && spare_[a] == nullptr) spare_[a] = std::move(buffer);
}

float* StateBuffers::back(size_t a) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Buffer>& slot = buf_[1 - parity_][a];
  if (SnapshotNeeds(a, *slot)) HandOver(a, &slot, /*keep=*/false);
  return slot->data.get();
}

StateBuffers::SnapshotCost StateBuffers::snapshot_cost() const {
  absl::MutexLock lock(&mu_);
  return cost_;
}

StateBuffers::Lock::Lock(StateBuffers& buffers) : buffers_(buffers) { buffers_.mu_.Lock(); }

StateBuffers::Lock::~Lock() { buffers_.mu_.Unlock(); }

float* StateBuffers::Lock::mutable_front(size_t a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::unique_ptr<Buffer>& slot = buffers_.buf_[buffers_.parity_][a];
  if (buffers_.SnapshotNeeds(a, *slot)) buffers_.HandOver(a, &slot, /*keep=*/true);
  return slot->data.get();
}

void StateBuffers::Lock::Unflip() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  buffers_.parity_ = 1 - buffers_.parity_;
}

void StateBuffers::Lock::Flip(bool keep_back) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  StateBuffers& s = buffers_;
  s.parity_ = 1 - s.parity_;
  if (keep_back) return;
  // A spare goes back in place of an unpinned back buffer (whose value the next step overwrites)
  // that the snapshot does not need.
  for (size_t a = 0; a < s.arrays(); ++a) {
    std::unique_ptr<Buffer>& back = s.buf_[1 - s.parity_][a];
    if (s.spare_[a] == nullptr || back->registered != nullptr || s.SnapshotNeeds(a, *back)) {
      continue;
    }
    back = std::move(s.spare_[a]);
  }
}

void StateBuffers::Lock::BeginSnapshot() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  StateBuffers& s = buffers_;
  auto snap = std::make_unique<Snapshot>();
  for (size_t a = 0; a < s.arrays(); ++a) snap->data.push_back(s.front(a));
  snap->copied.assign(s.arrays(), false);
  snap->handed.resize(s.arrays());
  s.snapshot_ = std::move(snap);
}

void StateBuffers::CopyForSnapshot(size_t a, std::vector<float>* out) {
  const float* src = nullptr;
  {
    absl::MutexLock lock(&mu_);
    src = snapshot_->data[a];
  }
  // Outside the lock: the buffer at `src` is neither written nor freed while the snapshot needs
  // it (a change hands it over to the snapshot instead).
  out->assign(src, src + numel_[a]);
  absl::MutexLock lock(&mu_);
  snapshot_->copied[a] = true;
  cost_.writer_copied += numel_[a] * sizeof(float);
  Release(a, std::move(snapshot_->handed[a]));
}

void StateBuffers::EndSnapshot() {
  absl::MutexLock lock(&mu_);
  for (size_t a = 0; a < arrays(); ++a) Release(a, std::move(snapshot_->handed[a]));
  snapshot_.reset();
}

}  // namespace muond::server
