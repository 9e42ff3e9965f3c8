// What a job's deletion ends besides its steps (issue 32, item 6): everything that holds the job
// between steps registers how to let go of it, and Fire() tells them all once. A shared-memory
// session is ended on its server's event loop, a gRPC stream blocked in Read is cancelled
// (ServerContext::TryCancel), an export in progress is cancelled the same way; each then drops
// its reference and the job's memory goes back to the system.
//
// Thread-safe. A hook runs exactly once, when Fire() is called (or at once, in Register, when it
// was called already), and never after its Registration was destroyed: hooks run under the list's
// lock, so a hook must not block and must not call back into the job; it only tells its owner
// (posts to a loop, cancels a call). Registrations may outlive the list (they share its state).
#ifndef MUOND_SERVER_JOBS_DELETION_HOOKS_H_
#define MUOND_SERVER_JOBS_DELETION_HOOKS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace muond::server {

class DeletionHooks {
 private:
  struct State {
    absl::Mutex mu;
    bool fired ABSL_GUARDED_BY(mu) = false;
    uint64_t next ABSL_GUARDED_BY(mu) = 0;
    std::map<uint64_t, std::function<void()>> hooks ABSL_GUARDED_BY(mu);
  };

 public:
  // Unregisters its hook when destroyed (movable, one owner).
  class Registration {
   public:
    Registration() = default;
    Registration(Registration&& other) noexcept : state_(std::move(other.state_)), id_(other.id_) {}
    Registration& operator=(Registration&& other) noexcept {
      if (this != &other) {
        Reset();
        state_ = std::move(other.state_);
        id_ = other.id_;
      }
      return *this;
    }
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;
    ~Registration() { Reset(); }
    // Unregisters now: once this returns the hook is not running and never runs.
    void Reset() {
      if (state_ == nullptr) return;
      absl::MutexLock lock(&state_->mu);
      state_->hooks.erase(id_);
      state_.reset();
    }

   private:
    friend class DeletionHooks;
    Registration(std::shared_ptr<State> state, uint64_t id) : state_(std::move(state)), id_(id) {}
    std::shared_ptr<State> state_;
    uint64_t id_ = 0;
  };

  DeletionHooks() = default;
  DeletionHooks(const DeletionHooks&) = delete;
  DeletionHooks& operator=(const DeletionHooks&) = delete;

  // Registers `end`; when Fire() already ran, `end` runs now (in this thread) and the returned
  // registration is empty.
  Registration Register(std::function<void()> end) {
    absl::MutexLock lock(&state_->mu);
    if (state_->fired) {
      end();
      return Registration();
    }
    const uint64_t id = state_->next++;
    state_->hooks.emplace(id, std::move(end));
    return Registration(state_, id);
  }

  // Runs every registered hook once (later registrations run at once); idempotent.
  void Fire() {
    absl::MutexLock lock(&state_->mu);
    if (state_->fired) return;
    state_->fired = true;
    for (auto& [id, end] : state_->hooks) end();
    state_->hooks.clear();
  }

  // Hooks registered and not yet run or unregistered (tests, the log).
  size_t size() const {
    absl::MutexLock lock(&state_->mu);
    return state_->hooks.size();
  }

 private:
  const std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_DELETION_HOOKS_H_
