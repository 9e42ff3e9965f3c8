#include "server/engine/compute_executor.h"

#include "server/optim/muon_math.h"

namespace muond::server {

ComputeExecutor::ComputeExecutor(int math_threads)
    : worker_([this, math_threads] { Loop(math_threads); }) {}

ComputeExecutor::~ComputeExecutor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  worker_.join();
}

void ComputeExecutor::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
  heartbeat_.SetBusy(true);
}

size_t ComputeExecutor::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

bool ComputeExecutor::HasWorkOrStopping() const { return stopping_ || !queue_.empty(); }

void ComputeExecutor::Loop(int math_threads) {
  // LibTorch's OpenMP pool size is per OS thread: set it on the thread that computes.
  SetMathThreads(math_threads);
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      if (queue_.empty()) heartbeat_.SetBusy(false);  // idle: nothing to show progress on
      mu_.Await(absl::Condition(this, &ComputeExecutor::HasWorkOrStopping));
      if (queue_.empty()) return;  // stopping, and everything submitted has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    heartbeat_.Beat();
    heartbeat_.StallPointForTesting();
    task();
    heartbeat_.Beat();
  }
}

}  // namespace muond::server
