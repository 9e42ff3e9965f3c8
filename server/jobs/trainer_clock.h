// The step as its trainer sees it: from the step's first gradient byte in (StepState::start) to
// its last update byte out, and the part of that after its last gradient byte arrived
// (StepState::last_input) — the time the trainer waits on the optimizer.
//
// When is the last update byte out: a shared-memory rank has its results in its region when they
// are released (the commit, or a multi-node step's prepare: its completion is posted then); a gRPC
// rank when the service has written its last update message (Sent). So a step whose ranks are
// all on shared memory is timed at the release, and one with gRPC ranks when the last of them was
// sent its update. A step whose gRPC rank never receives its update (the client went away) is not
// timed; a replay of it that does receive counts as that rank's delivery.
//
// Thread-safety: thread-safe (its own mutex, never held while calling out except to the metrics).
#ifndef MUOND_SERVER_JOBS_TRAINER_CLOCK_H_
#define MUOND_SERVER_JOBS_TRAINER_CLOCK_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace muond::server {

class TrainerClock {
 public:
  explicit TrainerClock(std::string job) : job_(std::move(job)) {}

  // Step `step`'s results were released at `now`; `grpc_ranks` of its ranks still have to be sent
  // theirs. Records the step at once when there is none.
  void Released(int64_t step, absl::Time first_in, absl::Time last_in, int grpc_ranks,
                absl::Time now = absl::Now()) ABSL_LOCKS_EXCLUDED(mu_);
  // A gRPC rank was sent its whole update of step `step`. Records the step when it was the last.
  void Sent(int64_t step, absl::Time now = absl::Now()) ABSL_LOCKS_EXCLUDED(mu_);

  struct Times {
    int64_t step = 0;
    double visible_seconds = 0;
    double wait_seconds = 0;
  };
  // The newest step timed.
  std::optional<Times> last() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Record(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string job_;
  mutable absl::Mutex mu_;
  // The released step waiting for its gRPC ranks' deliveries.
  int64_t step_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Time first_in_ ABSL_GUARDED_BY(mu_);
  absl::Time last_in_ ABSL_GUARDED_BY(mu_);
  int owed_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<Times> last_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_TRAINER_CLOCK_H_
