#include "server/api/stream_guard.h"

#include <grpcpp/server_context.h>
#include <time.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace muond::server {
namespace {

constexpr int64_t kRefusalLogIntervalNs = int64_t{10} * 1000 * 1000 * 1000;

}  // namespace

int64_t StreamGuard::Lease::NowNs() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

StreamGuard::Lease::~Lease() { guard_->Release(this); }

std::string StreamGuard::Lease::CancelReason() const {
  if (!cancelled_.load()) return "";
  if (cancelled_idle_.load()) {
    return absl::StrCat("the client sent or read nothing for ",
                        absl::FormatDuration(guard_->idle_limit()),
                        " (--stream-idle-seconds): the stream was cancelled");
  }
  return "muond is shutting down: the stream was cancelled";
}

std::string StreamGuard::Lease::HowEnded() const {
  if (cancelled()) return absl::StrCat(": ", CancelReason());
  return ctx_->IsCancelled() ? " (cancelled)" : "";
}

StreamGuard::StreamGuard(const Options& options) : options_(options) {
  watchdog_ = std::thread([this] { Watch(); });
}

StreamGuard::~StreamGuard() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  watchdog_.join();
}

absl::StatusOr<std::unique_ptr<StreamGuard::Lease>> StreamGuard::Admit(grpc::ServerContext* ctx,
                                                                       const std::string& job_id,
                                                                       int world_size,
                                                                       const std::string& rpc) {
  return AdmitKind(ctx, job_id, world_size, /*watch=*/false, rpc);
}

absl::StatusOr<std::unique_ptr<StreamGuard::Lease>> StreamGuard::AdmitWatch(
    grpc::ServerContext* ctx, const std::string& job_id, int world_size) {
  return AdmitKind(ctx, job_id, world_size, /*watch=*/true, "WatchSession");
}

absl::StatusOr<std::unique_ptr<StreamGuard::Lease>> StreamGuard::AdmitKind(
    grpc::ServerContext* ctx, const std::string& job_id, int world_size, bool watch,
    const std::string& rpc) {
  const size_t ranks = static_cast<size_t>(std::max(world_size, 1));
  const size_t job_bound = (watch ? 1 : 2) * ranks + kStreamsPerJobSlack;
  const size_t all_bound = watch ? options_.max_watches : options_.max_streams;
  absl::MutexLock lock(&mu_);
  std::array<size_t, 2>& of_job = per_job_[job_id];
  size_t& mine = of_job[watch ? 1 : 0];
  const size_t all = watch ? watches_ : leases_.size() - watches_;
  std::string refused;
  if (mine >= job_bound && watch) {
    refused =
        absl::StrCat("job '", job_id, "' holds ", mine, " session watches, as many as a job of ",
                     world_size, " rank(s) may (1 per rank + ", kStreamsPerJobSlack,
                     "); a rank's session needs one, held by its client library");
  } else if (mine >= job_bound) {
    refused = absl::StrCat("job '", job_id, "' holds ", mine,
                           " streams (Step, InitParams, exports), as many as a job of ", world_size,
                           " rank(s) may (2 per rank + ", kStreamsPerJobSlack,
                           "); end one or wait for the idle ones to be cancelled "
                           "(--stream-idle-seconds)");
  } else if (all >= all_bound) {
    refused = absl::StrCat("muond holds ", all,
                           watch ? " session watches" : " streams (Step, InitParams, exports)",
                           " of all jobs, as many as it serves at once; retry later");
  }
  if (!refused.empty()) {
    if (of_job[0] == 0 && of_job[1] == 0) per_job_.erase(job_id);
    ++refused_since_log_;
    const int64_t now = Lease::NowNs();
    if (now - last_refusal_log_ns_ >= kRefusalLogIntervalNs) {
      MUOND_LOG(WARNING) << rpc << ": refused " << refused_since_log_
                         << " stream(s) since the last warning; the latest: " << refused;
      last_refusal_log_ns_ = now;
      refused_since_log_ = 0;
    }
    return absl::ResourceExhaustedError(absl::StrCat(rpc, ": ", refused));
  }
  ++mine;
  if (watch) ++watches_;
  std::unique_ptr<Lease> lease(new Lease(this, ctx, job_id, rpc, ctx->peer()));
  lease->watch_ = watch;
  leases_.emplace(lease.get(), true);
  return lease;
}

void StreamGuard::Release(Lease* lease) {
  absl::MutexLock lock(&mu_);
  leases_.erase(lease);
  if (lease->watch_) --watches_;
  auto it = per_job_.find(lease->job_id_);
  if (it == per_job_.end()) return;
  --it->second[lease->watch_ ? 1 : 0];
  if (it->second[0] == 0 && it->second[1] == 0) per_job_.erase(it);
}

void StreamGuard::BeginShutdown() {
  absl::MutexLock lock(&mu_);
  size_t cancelled = 0;
  for (auto& [lease, unused] : leases_) {
    // A stream the handler works on (e.g. one that just read its StepBegin) decides itself: it
    // joins a step in flight or is refused.
    const bool waiting = lease->waiting_since_ns_.load() != 0;
    if (!waiting || lease->in_step_.load() || lease->cancelled_.load()) continue;
    Cancel(lease, /*idle=*/false);
    ++cancelled;
  }
  if (cancelled > 0) {
    MUOND_LOG(INFO) << "shutdown: cancelled " << cancelled
                    << " stream(s) waiting for their client and not in a step";
  }
}

void StreamGuard::CancelAll() {
  absl::MutexLock lock(&mu_);
  for (auto& [lease, unused] : leases_) {
    if (!lease->cancelled_.load()) Cancel(lease, /*idle=*/false);
  }
}

size_t StreamGuard::active() const {
  absl::MutexLock lock(&mu_);
  return leases_.size();
}

void StreamGuard::Cancel(Lease* lease, bool idle) {
  lease->cancelled_at_ns_ = Lease::NowNs();
  lease->cancelled_idle_.store(idle);
  lease->cancelled_.store(true);
  lease->ctx_->TryCancel();  // ends a blocked Read or Write; the handler returns
}

void StreamGuard::Watch() {
  const absl::Duration tick =
      std::clamp(options_.idle_limit / 4, absl::Milliseconds(50), absl::Milliseconds(500));
  const int64_t limit_ns = absl::ToInt64Nanoseconds(options_.idle_limit);
  const int64_t close_ns = absl::ToInt64Nanoseconds(kCloseAfterCancel);
  absl::MutexLock lock(&mu_);
  auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop), tick)) {
    const int64_t now = Lease::NowNs();
    size_t cancelled = 0;
    std::string example;
    for (auto& [lease, unused] : leases_) {
      const int64_t since = lease->waiting_since_ns_.load();
      if (since != 0 && lease->cancelled_.load() && !lease->connection_closed_ &&
          now - lease->cancelled_at_ns_ >= close_ns && options_.close_connection) {
        // Cancelled, and its Read or Write still has not returned: the client reads nothing.
        lease->connection_closed_ = true;
        const bool closed = options_.close_connection(lease->peer_);
        MUOND_LOG(WARNING) << lease->rpc_ << " of job '" << lease->job_id_ << "' from "
                           << lease->peer_ << " still blocked "
                           << absl::FormatDuration(kCloseAfterCancel) << " after it was cancelled: "
                           << (closed ? "closed its connection" : "its connection is not known");
      }
      if (since == 0 || now - since < limit_ns || lease->cancelled_.load()) continue;
      Cancel(lease, /*idle=*/true);
      cancelled_idle_total_.fetch_add(1);
      if (cancelled++ == 0) example = absl::StrCat(lease->rpc_, " of job '", lease->job_id_, "'");
    }
    if (cancelled > 0) {
      MUOND_LOG(WARNING) << "cancelled " << cancelled << " stream(s) idle for "
                         << absl::FormatDuration(options_.idle_limit)
                         << " (--stream-idle-seconds), e.g. " << example;
    }
  }
}

}  // namespace muond::server
