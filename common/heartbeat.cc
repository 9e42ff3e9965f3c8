#include "common/heartbeat.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace muond::common {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Heartbeat::Heartbeat(std::string name) : name_(std::move(name)), last_ns_(NowNs()) {
  Heartbeats::Default().Add(this);
}

Heartbeat::~Heartbeat() { Heartbeats::Default().Remove(this); }

void Heartbeat::Beat() { last_ns_.store(NowNs(), std::memory_order_relaxed); }

void Heartbeat::SetBusy(bool busy) {
  if (busy && !busy_.load(std::memory_order_relaxed)) Beat();  // busy from now, not since idle
  busy_.store(busy, std::memory_order_relaxed);
}

void Heartbeat::StallPointForTesting() {
  Heartbeats& all = Heartbeats::Default();
  if (!all.stall_armed_.load(std::memory_order_relaxed)) return;
  {
    absl::MutexLock lock(&all.mu_);
    if (all.stall_name_ != name_ || NowNs() < all.stall_at_ns_) return;
  }
  MUOND_LOG(WARNING) << "test hook MUOND_TEST_STALL: the " << name_ << " stops for good";
  while (true) std::this_thread::sleep_for(std::chrono::hours(1));
}

void Heartbeats::ArmStallForTesting(const std::string& name, absl::Duration delay) {
  absl::MutexLock lock(&mu_);
  stall_name_ = name;
  stall_at_ns_ = NowNs() + absl::ToInt64Nanoseconds(delay);
  stall_armed_.store(true, std::memory_order_relaxed);
}

Heartbeats& Heartbeats::Default() {
  static Heartbeats* beats = new Heartbeats();
  return *beats;
}

void Heartbeats::Add(Heartbeat* h) {
  absl::MutexLock lock(&mu_);
  parts_.push_back(h);
}

void Heartbeats::Remove(Heartbeat* h) {
  absl::MutexLock lock(&mu_);
  parts_.erase(std::remove(parts_.begin(), parts_.end(), h), parts_.end());
}

std::vector<std::string> Heartbeats::Stale(absl::Duration max_age) const {
  const int64_t now = NowNs();
  const int64_t limit = absl::ToInt64Nanoseconds(max_age);
  std::vector<std::string> stale;
  absl::MutexLock lock(&mu_);
  for (const Heartbeat* h : parts_) {
    const int64_t age = now - h->last_beat_ns();
    if (h->busy() && age > limit) {
      stale.push_back(absl::StrFormat("%s (%.1f s)", h->name(), static_cast<double>(age) / 1e9));
    }
  }
  return stale;
}

}  // namespace muond::common
