// Heartbeats: what the systemd watchdog ping proves. Each part of the daemon whose standstill
// would leave it up but useless (the event loops, the compute executor, the job registry) owns a
// Heartbeat and beats it as it makes progress; SdWatchdog pings WATCHDOG=1 only while every
// heartbeat is fresh, so a deadlock in any of them stops the pings and systemd restarts the
// daemon.
//
// A part that has nothing to do is not stale: a loop beats on every wake-up (its waits are
// bounded, kMaxWait), the executor only counts while a task is queued or running (SetBusy).
//
// Test hook (armed by muond's main from $MUOND_TEST_STALL=NAME:MS in MUOND_TEST_HOOKS builds):
// the part named NAME stops for good MS milliseconds after arming, at its StallPointForTesting,
// to show that the pings stop.
//
// Thread-safety: everything is thread-safe; Beat and SetBusy are relaxed atomic stores.
#ifndef MUOND_COMMON_HEARTBEAT_H_
#define MUOND_COMMON_HEARTBEAT_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace muond::common {

class Heartbeat {
 public:
  // How long a loop that owns a heartbeat may wait without waking (and beating).
  static constexpr absl::Duration kMaxWait = absl::Milliseconds(500);

  // Registers with Heartbeats::Default() under `name` ("shm event loop", "compute executor",
  // "job registry", ...); fresh from now.
  explicit Heartbeat(std::string name);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  void Beat();
  // While not busy the part is not expected to beat (an idle executor).
  void SetBusy(bool busy);
  // Test hook: blocks this thread forever when ArmStallForTesting named this part and its delay
  // has passed; a no-op otherwise.
  void StallPointForTesting();

  const std::string& name() const { return name_; }
  int64_t last_beat_ns() const { return last_ns_.load(std::memory_order_relaxed); }
  bool busy() const { return busy_.load(std::memory_order_relaxed); }

 private:
  const std::string name_;
  std::atomic<int64_t> last_ns_;
  std::atomic<bool> busy_{true};
};

class Heartbeats {
 public:
  static Heartbeats& Default();
  // The parts whose last beat is older than `max_age` while busy, with how long ago they beat
  // ("shm event loop (12.0 s)"); empty when all are fresh.
  std::vector<std::string> Stale(absl::Duration max_age) const ABSL_LOCKS_EXCLUDED(mu_);
  // Test hook: the part named `name` stops `delay` from now (Heartbeat::StallPointForTesting).
  void ArmStallForTesting(const std::string& name, absl::Duration delay) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class Heartbeat;
  void Add(Heartbeat* h) ABSL_LOCKS_EXCLUDED(mu_);
  void Remove(Heartbeat* h) ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  std::vector<Heartbeat*> parts_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stall_armed_{false};
  std::string stall_name_ ABSL_GUARDED_BY(mu_);
  int64_t stall_at_ns_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace muond::common

#endif  // MUOND_COMMON_HEARTBEAT_H_
