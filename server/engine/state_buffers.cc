#include "server/engine/state_buffers.h"

#include <algorithm>
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

namespace {

std::vector<StateBuffers::Form> Fp32(const std::vector<size_t>& numel) {
  std::vector<StateBuffers::Form> forms;
  for (size_t n : numel) forms.push_back({n, common::StateDType::kFloat32, StateRole::kSigned});
  return forms;
}

std::vector<size_t> Words(const std::vector<StateBuffers::Form>& forms) {
  std::vector<size_t> words;
  for (const StateBuffers::Form& f : forms) words.push_back(StoredWords(f.dtype, f.numel));
  return words;
}

}  // namespace

StateBuffers::StateBuffers(const std::vector<size_t>& numel, device::Device* device,
                           uint64_t window_bytes)
    : StateBuffers(Fp32(numel), device, window_bytes) {}

StateBuffers::StateBuffers(const std::vector<Form>& forms, device::Device* device,
                           uint64_t window_bytes)
    : device_(device), forms_(forms), words_(Words(forms)), window_bytes_(window_bytes) {
  for (size_t n : words_) {
    front_.push_back(std::make_unique<Buffer>(n, /*zeroed=*/true, /*pin=*/true, device_));
    back_.push_back(two_copies() ? std::make_unique<Buffer>(n, true, true, device_) : nullptr);
  }
  spare_.resize(words_.size());
  target_.assign(words_.size(), Target::kNone);
}

StateBuffers::~StateBuffers() = default;

uint64_t StateBuffers::pinned_bytes(size_t a) const {
  absl::MutexLock lock(&mu_);
  uint64_t bytes = 0;
  for (const Buffer* b : {front_[a].get(), back_[a].get(), spare_[a].get()}) {
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
  for (size_t a = 0; a < words_.size(); ++a) {
    h.front += bytes(front_[a]);
    h.back += bytes(back_[a]);
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
  auto fresh = std::make_unique<Buffer>(words_[a], /*zeroed=*/false, /*pin=*/false, device_);
  if (keep) {
    std::memcpy(fresh->data.get(), (*slot)->data.get(), words_[a] * sizeof(float));
    cost_.change_copied += words_[a] * sizeof(float);
  } else {
    cost_.step_handed_over += words_[a] * sizeof(float);
  }
  snapshot_->handed[a] = std::exchange(*slot, std::move(fresh));
}

void StateBuffers::Release(size_t a, std::unique_ptr<Buffer> buffer) {
  if (buffer == nullptr) return;
  if (two_copies()) {
    if (spare_[a] == nullptr) spare_[a] = std::move(buffer);
    return;
  }
  // One copy: a pinned buffer replaces an unpinned window buffer that the step in flight does not
  // write (the same bytes); else it is freed. Kept as a window buffer the array has not, it would
  // be held beyond the step window (a save that overlapped in-place steps releases every array's
  // old front).
  if (back_[a] != nullptr && target_[a] == Target::kNone && back_[a]->registered == nullptr &&
      buffer->registered != nullptr && !SnapshotNeeds(a, *back_[a])) {
    back_[a] = std::move(buffer);
  }
}

void StateBuffers::Drop(size_t a, std::unique_ptr<Buffer>* slot) {
  if (*slot == nullptr) return;
  if (SnapshotNeeds(a, **slot)) {
    snapshot_->handed[a] = std::move(*slot);
  } else {
    slot->reset();
  }
}

float* StateBuffers::WindowBuffer(size_t a) {
  std::unique_ptr<Buffer>& slot = back_[a];
  if (slot == nullptr) {
    slot = spare_[a] != nullptr
               ? std::move(spare_[a])
               : std::make_unique<Buffer>(words_[a], /*zeroed=*/false, /*pin=*/true, device_);
  }
  if (SnapshotNeeds(a, *slot)) HandOver(a, &slot, /*keep=*/false);
  return slot->data.get();
}

bool StateBuffers::NoneInPlace(StateBuffers* s) {
  return std::none_of(s->target_.begin(), s->target_.end(),
                      [](Target t) { return t == Target::kInPlace; });
}

void StateBuffers::BeginStep() {
  absl::MutexLock lock(&mu_);
  target_.assign(words_.size(), Target::kNone);
}

void StateBuffers::DropWindow() {
  absl::MutexLock lock(&mu_);
  target_.assign(words_.size(), Target::kNone);
  if (two_copies()) return;
  for (size_t a = 0; a < words_.size(); ++a) Drop(a, &back_[a]);
}

void StateBuffers::Plan(size_t a, bool in_place) {
  absl::MutexLock lock(&mu_);
  if (!in_place || two_copies()) {
    target_[a] = Target::kWindow;
    WindowBuffer(a);
    return;
  }
  target_[a] = Target::kInPlace;
  // Copy-on-write for a save in progress: it keeps the committed buffer, the step writes a copy.
  if (SnapshotNeeds(a, *front_[a])) HandOver(a, &front_[a], /*keep=*/true);
}

float* StateBuffers::back(size_t a) {
  absl::MutexLock lock(&mu_);
  if (target_[a] == Target::kInPlace) return front_[a]->data.get();
  target_[a] = Target::kWindow;
  return WindowBuffer(a);
}

StateBuffers::SnapshotCost StateBuffers::snapshot_cost() const {
  absl::MutexLock lock(&mu_);
  return cost_;
}

StateBuffers::Lock::Lock(StateBuffers& buffers) : buffers_(buffers) { buffers_.mu_.Lock(); }

StateBuffers::Lock::Lock(StateBuffers& buffers, AtStepBoundary) : buffers_(buffers) {
  buffers_.mu_.LockWhen(absl::Condition(&StateBuffers::NoneInPlace, &buffers_));
}

StateBuffers::Lock::~Lock() { buffers_.mu_.Unlock(); }

float* StateBuffers::Lock::mutable_front(size_t a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::unique_ptr<Buffer>& slot = buffers_.front_[a];
  if (buffers_.SnapshotNeeds(a, *slot)) buffers_.HandOver(a, &slot, /*keep=*/true);
  return slot->data.get();
}

void StateBuffers::Lock::Unflip() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  StateBuffers& s = buffers_;
  for (size_t a : s.flipped_) std::swap(s.front_[a], s.back_[a]);
  s.flipped_.clear();
}

void StateBuffers::Lock::Flip(bool keep_back) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  StateBuffers& s = buffers_;
  s.flipped_.clear();
  for (size_t a = 0; a < s.arrays(); ++a) {
    if (s.target_[a] != Target::kWindow) continue;
    std::swap(s.front_[a], s.back_[a]);
    s.flipped_.push_back(a);
  }
  if (!keep_back) {
    for (size_t a = 0; a < s.arrays(); ++a) {
      std::unique_ptr<Buffer>& back = s.back_[a];
      if (back == nullptr) continue;
      if (!s.two_copies() && s.target_[a] != Target::kWindow) {
        // One copy: the window keeps the buffers of the arrays this step used (the next step
        // most likely uses the same), nothing else.
        s.Drop(a, &back);
        continue;
      }
      // A spare goes back in place of an unpinned back buffer (whose value the next step
      // overwrites) that the snapshot does not need.
      if (s.spare_[a] == nullptr || back->registered != nullptr || s.SnapshotNeeds(a, *back)) {
        continue;
      }
      back = std::move(s.spare_[a]);
    }
  }
  s.target_.assign(s.arrays(), Target::kNone);
}

void StateBuffers::Lock::BeginSnapshot() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  StateBuffers& s = buffers_;
  auto snap = std::make_unique<Snapshot>();
  for (size_t a = 0; a < s.arrays(); ++a) snap->data.push_back(s.front(a));
  snap->copied.assign(s.arrays(), false);
  snap->handed.resize(s.arrays());
  s.snapshot_ = std::move(snap);
}

void StateBuffers::CopyForSnapshot(size_t a, std::vector<float>* out, bool held) {
  const float* src = nullptr;
  {
    absl::MutexLock lock(&mu_);
    src = snapshot_->data[a];
  }
  // Outside the lock: the buffer at `src` is neither written nor freed while the snapshot needs
  // it (a change hands it over to the snapshot instead).
  const Form& f = forms_[a];
  if (held) {
    out->assign(src, src + words_[a]);
  } else {
    out->resize(f.numel);
    DecodeStoredAll(f.dtype, f.role, src, f.numel, out->data());
  }
  absl::MutexLock lock(&mu_);
  snapshot_->copied[a] = true;
  cost_.writer_copied += words_[a] * sizeof(float);
  Release(a, std::move(snapshot_->handed[a]));
}

void StateBuffers::EndSnapshot() {
  absl::MutexLock lock(&mu_);
  for (size_t a = 0; a < arrays(); ++a) Release(a, std::move(snapshot_->handed[a]));
  snapshot_.reset();
}

}  // namespace muond::server
