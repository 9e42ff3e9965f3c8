// StreamGuard: what a gRPC stream may hold of the daemon (issue 32, item 8). The synchronous gRPC
// server gives every call a thread for as long as its handler runs, and a handler blocked in
// Read (a Step or InitParams stream whose client sends nothing) or in Write (an export whose
// client stops reading) holds that thread. The guard
//   - admits streams (Step, InitParams, ExportState, ExportParams) against two bounds: the streams
//     of one job (2 x its world size + kStreamsPerJobSlack: every rank's stream, a retry or
//     takeover each) and of all jobs (Options::max_streams, below the server's thread quota so
//     that Health and unary calls always find a thread); beyond either, RESOURCE_EXHAUSTED at
//     once, naming the bound;
//   - cancels (ServerContext::TryCancel, which ends a blocked Read or Write from another thread) a
//     stream that waited for its client longer than the idle limit (--stream-idle-seconds),
//     checked by one watchdog thread; time the daemon itself spends (a step computing, waiting for
//     the other ranks) does not count;
//   - closes the connection of a stream it cancelled whose Read or Write still has not returned
//     kCloseAfterCancel later (Options::close_connection): a Write blocked on a client that
//     reads nothing at all (its socket full) does not end on cancellation alone;
//   - at shutdown cancels at once every stream that waits for its client and is not in a step
//     (BeginShutdown). Streams
//     admitted later are the service's to refuse (a rank may still join a step that other ranks
//     began, while the daemon drains).
//
// Thread-safety: thread-safe. A Lease belongs to the handler's thread; its ServerContext must
// outlive it (the guard calls TryCancel only while the lease is registered).
#ifndef MUOND_SERVER_API_STREAM_GUARD_H_
#define MUOND_SERVER_API_STREAM_GUARD_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace grpc {
class ServerContext;
}  // namespace grpc

namespace muond::server {

// Streams a job may hold beyond two per rank.
inline constexpr int kStreamsPerJobSlack = 8;
// How long a cancelled stream may stay blocked in Read or Write before its connection is closed.
inline constexpr absl::Duration kCloseAfterCancel = absl::Seconds(2);

class StreamGuard {
 public:
  struct Options {
    absl::Duration idle_limit = absl::Seconds(60);
    size_t max_streams = 384;  // all jobs together
    // WatchSession calls of all jobs together (counted apart from the streams above: a watch
    // holds its thread for its session's life, by design, and is never idle-cancelled).
    size_t max_watches = 512;
    // Closes the connection of gRPC peer `peer` (ServerContext::peer()); false when it cannot.
    // Empty: cancellation only.
    std::function<bool(const std::string& peer)> close_connection;
  };

  // One admitted stream. The idle clock runs between WaitingForClient() and Working().
  class Lease {
   public:
    ~Lease();  // unregisters (after this the guard no longer touches the context)
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

    // The handler is about to Read or Write: from now on the stream counts as idle.
    void WaitingForClient() { waiting_since_ns_.store(NowNs()); }
    // The handler got what it waited for (or works on its own): not idle.
    void Working() { waiting_since_ns_.store(0); }
    // The stream joined a step: shutdown lets it finish within the grace period.
    void InStep() { in_step_.store(true); }
    // Runs `io` (a Read or Write of the stream) with the idle clock running; returns its result.
    template <typename Io>
    bool Await(Io io) {
      WaitingForClient();
      const bool ok = io();
      Working();
      return ok;
    }
    // True when the guard cancelled the stream (idle, or shutdown), and the reason.
    bool cancelled() const { return cancelled_.load(); }
    std::string CancelReason() const;
    // For the message of a stream that ended early: ": <reason>" when the guard cancelled it,
    // " (cancelled)" when the client did, else "".
    std::string HowEnded() const;

   private:
    friend class StreamGuard;
    Lease(StreamGuard* guard, grpc::ServerContext* ctx, std::string job_id, std::string rpc,
          std::string peer)
        : guard_(guard),
          ctx_(ctx),
          job_id_(std::move(job_id)),
          rpc_(std::move(rpc)),
          peer_(std::move(peer)) {}
    static int64_t NowNs();

    StreamGuard* const guard_;
    grpc::ServerContext* const ctx_;
    const std::string job_id_;
    const std::string rpc_;
    const std::string peer_;
    bool watch_ = false;  // a WatchSession lease (set before it is registered)
    std::atomic<int64_t> waiting_since_ns_{0};
    int64_t cancelled_at_ns_ = 0;     // guarded by the guard's mu_
    bool connection_closed_ = false;  // guarded by the guard's mu_
    std::atomic<bool> in_step_{false};
    std::atomic<bool> cancelled_{false};
    std::atomic<bool> cancelled_idle_{false};
  };

  explicit StreamGuard(const Options& options);
  ~StreamGuard();  // stops the watchdog. REQUIRES: no lease alive.
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

  // Admits a stream of `rpc` on job `job_id` of `world_size` ranks. RESOURCE_EXHAUSTED naming the
  // bound when the job or the daemon holds as many streams as it may. Does not block.
  absl::StatusOr<std::unique_ptr<Lease>> Admit(grpc::ServerContext* ctx, const std::string& job_id,
                                               int world_size, const std::string& rpc);
  // Admits a WatchSession call on job `job_id`: at most one per rank plus kStreamsPerJobSlack (a
  // takeover's new watch while the old one ends) per job, and Options::max_watches in all;
  // RESOURCE_EXHAUSTED naming the bound beyond either. Its lease never counts as idle (the
  // handler never calls WaitingForClient); CancelAll ends it.
  absl::StatusOr<std::unique_ptr<Lease>> AdmitWatch(grpc::ServerContext* ctx,
                                                    const std::string& job_id, int world_size);
  // Cancels every stream that waits for its client (Read or Write) and is not in a step, now.
  void BeginShutdown();
  // Cancels every stream (the server is about to shut down at once): those still blocked
  // kCloseAfterCancel later have their connections closed, so the server's shutdown ends.
  void CancelAll();

  absl::Duration idle_limit() const { return options_.idle_limit; }
  size_t active() const;  // streams and watches
  uint64_t cancelled_idle() const { return cancelled_idle_total_.load(); }

 private:
  // Admits a lease of `rpc`, a stream or (`watch`) a session watch, against the bounds of its
  // kind for a job of `world_size` ranks and in all (the refusal's text is built only then).
  absl::StatusOr<std::unique_ptr<Lease>> AdmitKind(grpc::ServerContext* ctx,
                                                   const std::string& job_id, int world_size,
                                                   bool watch, const std::string& rpc);
  void Release(Lease* lease);
  void Watch();
  void Cancel(Lease* lease, bool idle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<Lease*, bool> leases_ ABSL_GUARDED_BY(mu_);  // value unused: an ordered set
  // Leases by job, [0] streams and [1] watches; and watches of all jobs.
  std::map<std::string, std::array<size_t, 2>> per_job_ ABSL_GUARDED_BY(mu_);
  size_t watches_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t last_refusal_log_ns_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t refused_since_log_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> cancelled_idle_total_{0};
  std::thread watchdog_;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_API_STREAM_GUARD_H_
