// systemd's service notification protocol (sd_notify(3)), without libsystemd: a datagram of
// newline-separated "KEY=VALUE" assignments sent to the AF_UNIX socket named by $NOTIFY_SOCKET (a
// path, or an abstract socket when it starts with '@'). Used for Type=notify units:
//   READY=1     once the sockets are bound and state is loaded;
//   STATUS=...  a one-line status that `systemctl status` shows;
//   STOPPING=1  when shutdown begins;
//   WATCHDOG=1  liveness pings, within WatchdogSec ($WATCHDOG_USEC).
// Outside systemd ($NOTIFY_SOCKET unset) every call is a no-op.
//
// Thread-safety: SdNotify and SdWatchdogInterval are thread-safe (they read the environment, which
// must not be modified concurrently). SdWatchdog is created and destroyed by one thread.
#ifndef MUOND_SERVER_OPS_SD_NOTIFY_H_
#define MUOND_SERVER_OPS_SD_NOTIFY_H_

#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace muond::server {

// Sends `state` (e.g. "READY=1\nSTATUS=serving") to $NOTIFY_SOCKET. OK without sending anything
// when the variable is unset or empty. INVALID_ARGUMENT for a value that is not an absolute path or
// '@'-name (or too long); UNAVAILABLE when the datagram cannot be sent (the error named).
absl::Status SdNotify(const std::string& state);

// The interval systemd expects watchdog pings within: $WATCHDOG_USEC, if set to a positive
// integer and $WATCHDOG_PID is unset or this process's id; otherwise zero (no watchdog).
absl::Duration SdWatchdogInterval();

// Sends "WATCHDOG=1" every `interval / 2` from its own thread until destroyed, when `interval` is
// positive (SdWatchdogInterval() by default); does nothing otherwise. A ping is sent only while
// every part of the daemon that beats a common::Heartbeat (event loops, compute executor, job
// registry) beat within max(interval / 2, 2 x Heartbeat::kMaxWait): a deadlocked part stops the
// pings, and systemd restarts the daemon (the first skipped ping is logged, naming the part).
// Send errors are logged once.
class SdWatchdog {
 public:
  explicit SdWatchdog(absl::Duration interval = SdWatchdogInterval());
  // Stops the thread (promptly: it waits on a condition, not a sleep).
  ~SdWatchdog();
  SdWatchdog(const SdWatchdog&) = delete;
  SdWatchdog& operator=(const SdWatchdog&) = delete;

  bool active() const { return thread_.joinable(); }

 private:
  void Loop(absl::Duration period);

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_OPS_SD_NOTIFY_H_
