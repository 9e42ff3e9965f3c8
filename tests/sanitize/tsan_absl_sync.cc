// ThreadSanitizer and Debian's Abseil: libabsl_synchronization is built without TSan, so TSan does
// not see absl::Mutex, CondVar, Notification, Barrier or BlockingCounter order anything (they wait
// on futexes it does not intercept), and every access guarded by one would be reported as a race.
// This library, preloaded into every process of the TSan lane (tests/sanitize/run.sh thread),
// interposes their out-of-line entry points, calls the real ones (dlsym RTLD_NEXT) and tells TSan
// the order they establish: an unlock, a wait's release of its mutex, Notify, DecrementCount and
// entering a Barrier publish (__tsan_release); a lock, the return from a wait, a seen notification
// and leaving a Barrier acquire (__tsan_acquire). That is what Abseil's own annotations do in a
// TSan build of Abseil. It adds no synchronization of its own.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace {

template <typename F>
F Real(const char* name) {
  void* f = dlsym(RTLD_NEXT, name);
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: %s not found\n", name);
    std::abort();
  }
  return reinterpret_cast<F>(f);
}

void Acquire(const void* a) { __tsan_acquire(const_cast<void*>(a)); }
void Release(const void* a) { __tsan_release(const_cast<void*>(a)); }

}  // namespace

// The TSan runtime's own entry points (sanitizer/tsan_interface.h of gcc 12 does not declare
// them): the calling thread's memory accesses are not recorded between the two.
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();

using absl::Condition;
using absl::Duration;
using absl::Mutex;
using absl::Time;

// RET NAME(ARGS): forwards to the real NAME, with BEFORE and AFTER (which may use `r`, the result).
#define WRAP_VOID(name, params, args, before, after)        \
  extern "C" void name params {                             \
    static auto real = Real<void(*) params>(#name);         \
    before;                                                 \
    real args;                                              \
    after;                                                  \
  }
#define WRAP_BOOL(name, params, args, before, after)        \
  extern "C" bool name params {                             \
    static auto real = Real<bool(*) params>(#name);         \
    before;                                                 \
    const bool r = real args;                               \
    after;                                                  \
    return r;                                               \
  }
// The same, ignoring the accesses TSan sees during the real call. Two kinds happen there:
// - Unlock and every wait evaluate the absl::Condition functions of the mutex's waiters on the
//   calling thread, so a waiter's condition (our code, which reads the guarded state) runs on
//   whichever thread released the mutex, after that thread's Release above;
// - Debian's Abseil is built without NDEBUG, so every Lock also runs its deadlock detection, whose
//   graph (absl's own, guarded by its own spinlock) it updates with memmove, an intercepted call.
// Abseil's TSan build ignores both for the same reasons (its tsan_mutex_pre_divert annotations
// and its own instrumentation); so does this library, for every entry point of absl::Mutex and
// absl::CondVar's waits.
#define WRAP_VOID_EVAL(name, params, args, before, after)   \
  extern "C" void name params {                             \
    static auto real = Real<void(*) params>(#name);         \
    before;                                                 \
    __tsan_ignore_thread_begin();                           \
    real args;                                              \
    __tsan_ignore_thread_end();                             \
    after;                                                  \
  }
#define WRAP_BOOL_EVAL(name, params, args, before, after)   \
  extern "C" bool name params {                             \
    static auto real = Real<bool(*) params>(#name);         \
    before;                                                 \
    __tsan_ignore_thread_begin();                           \
    const bool r = real args;                               \
    __tsan_ignore_thread_end();                             \
    after;                                                  \
    return r;                                               \
  }

// absl::Mutex: Lock, ReaderLock, LockWhen*, ReaderLockWhen*, TryLock, ReaderTryLock, Unlock,
// ReaderUnlock, Await*.
WRAP_VOID_EVAL(_ZN4absl7debian35Mutex4LockEv, (Mutex* m), (m), , Acquire(m))
WRAP_VOID_EVAL(_ZN4absl7debian35Mutex10ReaderLockEv, (Mutex* m), (m), , Acquire(m))
WRAP_VOID_EVAL(_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE, (Mutex* m, const Condition& c),
          (m, c), , Acquire(m))
WRAP_VOID_EVAL(_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE,
          (Mutex* m, const Condition& c), (m, c), , Acquire(m))
WRAP_BOOL_EVAL(_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE,
          (Mutex* m, const Condition& c, Duration d), (m, c, d), , Acquire(m))
WRAP_BOOL_EVAL(_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE,
          (Mutex* m, const Condition& c, Time t), (m, c, t), , Acquire(m))
WRAP_BOOL_EVAL(_ZN4absl7debian35Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE,
          (Mutex* m, const Condition& c, Duration d), (m, c, d), , Acquire(m))
WRAP_BOOL_EVAL(_ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE,
          (Mutex* m, const Condition& c, Time t), (m, c, t), , Acquire(m))
WRAP_BOOL_EVAL(_ZN4absl7debian35Mutex7TryLockEv, (Mutex* m), (m), , if (r) Acquire(m))
WRAP_BOOL_EVAL(_ZN4absl7debian35Mutex13ReaderTryLockEv, (Mutex* m), (m), , if (r) Acquire(m))
WRAP_VOID_EVAL(_ZN4absl7debian35Mutex6UnlockEv, (Mutex* m), (m), Release(m), )
WRAP_VOID_EVAL(_ZN4absl7debian35Mutex12ReaderUnlockEv, (Mutex* m), (m), Release(m), )
WRAP_VOID_EVAL(_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE, (Mutex* m, const Condition& c), (m, c),
          Release(m), Acquire(m))
WRAP_BOOL_EVAL(_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE,
          (Mutex* m, const Condition& c, Duration d), (m, c, d), Release(m), Acquire(m))
WRAP_BOOL_EVAL(_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE,
          (Mutex* m, const Condition& c, Time t), (m, c, t), Release(m), Acquire(m))

// absl::CondVar: a wait releases its mutex and takes it again.
WRAP_VOID_EVAL(_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE, (absl::CondVar* cv, Mutex* m), (cv, m),
          Release(m), Acquire(m))
WRAP_BOOL_EVAL(_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE,
          (absl::CondVar* cv, Mutex* m, Duration d), (cv, m, d), Release(m), Acquire(m))
WRAP_BOOL_EVAL(_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE,
          (absl::CondVar* cv, Mutex* m, Time t), (cv, m, t), Release(m), Acquire(m))

// absl::Notification: Notify publishes at the flag HasBeenNotified reads (its notified_yet_, which
// HasBeenNotifiedInternal receives) and at the object, which the waits acquire.
namespace {
// notified_yet_ follows the Mutex mutex_ in Notification (absl/synchronization/notification.h).
const void* NotifiedFlag(const void* notification) {
  return static_cast<const char*>(notification) + sizeof(Mutex);
}
}  // namespace
WRAP_VOID(_ZN4absl7debian312Notification6NotifyEv, (void* n), (n),
          (Release(n), Release(NotifiedFlag(n))), )
WRAP_VOID(_ZNK4absl7debian312Notification19WaitForNotificationEv, (const void* n), (n), ,
          Acquire(n))
WRAP_BOOL(_ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE,
          (const void* n, Duration d), (n, d), , if (r) Acquire(n))
WRAP_BOOL(_ZNK4absl7debian312Notification31WaitForNotificationWithDeadlineENS0_4TimeE,
          (const void* n, Time t), (n, t), , if (r) Acquire(n))
WRAP_BOOL(_ZN4absl7debian312Notification23HasBeenNotifiedInternalEPKSt6atomicIbE,
          (const std::atomic<bool>* flag), (flag), , if (r) Acquire(flag))

// absl::Barrier and absl::BlockingCounter.
WRAP_BOOL(_ZN4absl7debian37Barrier5BlockEv, (void* b), (b), Release(b), Acquire(b))
WRAP_BOOL(_ZN4absl7debian315BlockingCounter14DecrementCountEv, (void* c), (c), Release(c), )
WRAP_VOID(_ZN4absl7debian315BlockingCounter4WaitEv, (void* c), (c), , Acquire(c))

// absl::Status: a non-inlined representation (its low bit clear: a pointer to the StatusRep,
// whose first member is the atomic reference count) is counted by inline code in our binaries
// (Ref, and Unref's fast path) and by Debian's uninstrumented libabsl_status
// (UnrefNonInlined, which deletes the rep at zero). TSan sees the first as atomics on the count's
// address and not the second, so a decrement there publishes nothing and the delete acquires
// nothing. Modelled as TSan's own atomics would: the decrement releases at the count's address,
// and the thread that may delete acquires there first.
WRAP_VOID(_ZN4absl7debian36Status15UnrefNonInlinedEm, (uintptr_t rep), (rep),
          if (rep != 0 && (rep & 1) == 0) {
            Release(reinterpret_cast<const void*>(rep));
            Acquire(reinterpret_cast<const void*>(rep));
          }, )
