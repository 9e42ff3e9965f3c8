// The daemon's compute queue: one worker thread that runs Muon work items in submission order.
//
// One thread per compute device keeps LibTorch's intra-op pool (the CPU backend's parallelism)
// from being oversubscribed by concurrent jobs, and gives every job FIFO fairness. Thread-safe.
#ifndef MUOND_SERVER_ENGINE_COMPUTE_EXECUTOR_H_
#define MUOND_SERVER_ENGINE_COMPUTE_EXECUTOR_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/heartbeat.h"

namespace muond::server {

class ComputeExecutor {
 public:
  // Starts the worker; it sets LibTorch's thread count to `math_threads` for itself.
  explicit ComputeExecutor(int math_threads);
  // Runs the tasks already submitted, then joins the worker.
  ~ComputeExecutor();
  ComputeExecutor(const ComputeExecutor&) = delete;
  ComputeExecutor& operator=(const ComputeExecutor&) = delete;

  // Enqueues `task`; it runs on the worker thread. Tasks must not block on other tasks.
  void Submit(std::function<void()> task);
  // Tasks waiting to run (not counting the one running).
  size_t queue_depth() const;

 private:
  void Loop(int math_threads);
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  // Busy while a task is queued or running; beaten as tasks start and end (the watchdog ping
  // stops when the worker is stuck in a task or on a lock, common/heartbeat.h).
  common::Heartbeat heartbeat_{"compute executor"};
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_COMPUTE_EXECUTOR_H_
