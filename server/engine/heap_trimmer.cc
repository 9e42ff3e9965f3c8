#include "server/engine/heap_trimmer.h"

#include <malloc.h>

namespace muond::server {

HeapTrimmer& HeapTrimmer::Get() {
  // Leaked on purpose: the thread may be waiting when the process exits.
  static HeapTrimmer* trimmer = new HeapTrimmer();
  return *trimmer;
}

HeapTrimmer::HeapTrimmer() : thread_([this] { Loop(); }) { thread_.detach(); }

HeapTrimmer::Activity::Activity() { Get().Begin(); }

HeapTrimmer::Activity::~Activity() { Get().End(); }

void HeapTrimmer::Begin() {
  absl::MutexLock lock(&mu_);
  ++active_;
}

void HeapTrimmer::End() {
  absl::MutexLock lock(&mu_);
  --active_;
  pending_ = true;
}

uint64_t HeapTrimmer::trims() const {
  absl::MutexLock lock(&mu_);
  return trims_;
}

uint64_t HeapTrimmer::settle_trims() const {
  absl::MutexLock lock(&mu_);
  return settle_trims_;
}

bool HeapTrimmer::WaitIdleTrimmed(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return active_ == 0 && !pending_ && !trimming_;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void HeapTrimmer::Loop() {
  auto due = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_ && active_ == 0; };
  auto busy = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ > 0; };
  absl::MutexLock lock(&mu_);
  while (true) {
    if (settle_round_ > 0) {
      // Settling: trim again unless a step begins first (its end trims and settles anew).
      absl::Duration wait = kSettle;
      for (int i = settle_round_; i < kSettleRounds; ++i) wait *= 3;
      if (mu_.AwaitWithTimeout(absl::Condition(&busy), wait)) {
        settle_round_ = 0;
        continue;
      }
      --settle_round_;
      mu_.Unlock();
      ::malloc_trim(0);
      mu_.Lock();
      ++settle_trims_;
      continue;
    }
    mu_.Await(absl::Condition(&due));
    // A step that begins within kQuiet postpones the trim to its end.
    if (mu_.AwaitWithTimeout(absl::Condition(&busy), kQuiet)) continue;
    pending_ = false;
    trimming_ = true;
    mu_.Unlock();
    ::malloc_trim(0);
    mu_.Lock();
    trimming_ = false;
    ++trims_;
    settle_round_ = kSettleRounds;
  }
}

}  // namespace muond::server
