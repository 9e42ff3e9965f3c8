// Returns the heap's free memory to the OS when no step is running.
//
// The daemon sets glibc's mmap threshold to its maximum (32 MiB, server/main.cc), so the buffers
// of a step (ours and LibTorch's, oneDNN's packing buffers included: hundreds of allocations of
// MiBs per step) are reused from the heap within the step instead of being mapped, zero-filled
// page by page and unmapped at every allocation. What the step freed stays resident until the
// daemon is idle: then HeapTrimmer runs malloc_trim(0), which gives back the free pages of every
// arena. Resident memory between steps is therefore what the jobs hold, as with per-allocation
// mmap, and during a step at most the step's working set.
//
// Every StepState (and every handler that holds a job's buffers: exports, InitParams, DeleteJob)
// holds an Activity; when the last one ends and none begins for kQuiet, a background thread
// trims. What is freed after that trim by threads that are not ours (gRPC's buffers of a
// cancelled stream, freed after its handler returned, later still on a loaded machine) is caught
// by kSettleRounds settling trims, kSettle, 3 * kSettle and 9 * kSettle apart, each skipped when
// an activity began in between (its end starts the series anew). Trimming while a step runs is
// harmless (it only costs page faults later); this just keeps it out of the way.
#ifndef MUOND_SERVER_ENGINE_HEAP_TRIMMER_H_
#define MUOND_SERVER_ENGINE_HEAP_TRIMMER_H_

#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace muond::server {

class HeapTrimmer {
 public:
  // Idle time after the last step ends before the trim (steps that follow each other closely,
  // as the ranks of one trainer step do, share one trim).
  static constexpr absl::Duration kQuiet = absl::Milliseconds(20);
  // Idle time after a trim before the first settling trim; each further one waits 3 times the
  // wait before it.
  static constexpr absl::Duration kSettle = absl::Milliseconds(500);
  static constexpr int kSettleRounds = 3;

  // The process's trimmer (started on first use, never destroyed).
  static HeapTrimmer& Get();

  // One step in flight, from construction to destruction.
  class Activity {
   public:
    Activity();
    ~Activity();
    Activity(const Activity&) = delete;
    Activity& operator=(const Activity&) = delete;
  };

  // Trims done so far (for tests).
  uint64_t trims() const;
  // Settling trims done so far (for tests).
  uint64_t settle_trims() const;
  // Blocks until no step is in flight and a trim has run since the last one ended, or `timeout`
  // passes; true on the former (for tests).
  bool WaitIdleTrimmed(absl::Duration timeout) const;

 private:
  HeapTrimmer();
  void Begin();
  void End();
  void Loop();

  mutable absl::Mutex mu_;
  int64_t active_ ABSL_GUARDED_BY(mu_) = 0;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;   // a step ended after the last trim began
  bool trimming_ ABSL_GUARDED_BY(mu_) = false;  // malloc_trim is running
  int settle_round_ ABSL_GUARDED_BY(mu_) = 0;   // settling trims left after the last trim
  uint64_t trims_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t settle_trims_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_HEAP_TRIMMER_H_
