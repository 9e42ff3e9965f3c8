#include "server/jobs/trainer_clock.h"

#include <algorithm>

#include "server/record/optimizer_metrics.h"

namespace muond::server {

void TrainerClock::Released(int64_t step, absl::Time first_in, absl::Time last_in, int grpc_ranks,
                            absl::Time now) {
  absl::MutexLock lock(&mu_);
  step_ = step;
  first_in_ = first_in;
  // A step whose data came in before it began (a gradient-less apply step, say) waits from its
  // start.
  last_in_ = std::max(first_in, last_in);
  owed_ = std::max(0, grpc_ranks);
  if (owed_ == 0) Record(now);
}

void TrainerClock::Sent(int64_t step, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (step != step_ || owed_ <= 0) return;
  if (--owed_ == 0) Record(now);
}

void TrainerClock::Record(absl::Time now) {
  Times t;
  t.step = step_;
  t.visible_seconds = absl::ToDoubleSeconds(now - first_in_);
  t.wait_seconds = absl::ToDoubleSeconds(now - last_in_);
  last_ = t;
  step_ = -1;
  RecordTrainerTime(job_, t.visible_seconds, t.wait_seconds);
}

std::optional<TrainerClock::Times> TrainerClock::last() const {
  absl::MutexLock lock(&mu_);
  return last_;
}

}  // namespace muond::server
