// The metrics an operator of an optimizer service needs and no optimizer shows (README,
// Prometheus): Newton-Schulz time by shape class, the orthogonality of the update, the pipeline's
// pressure (matrices waiting for the device, gather budget in use, pinned memory by kind) and the
// step's time as the trainer sees it. Declared in common::DefaultRegistry() beside
// server/record/daemon_metrics.h's families, with the same label conventions (`muond_job`).
//
// Events are recorded where they happen (Record*); the pressure gauges are set by the daemon's
// collector at each scrape (SetJobPressure) from the job's report. A deleted job's series go at
// the first scrape after it (RemoveJobsNotIn).
//
// Thread-safety: every function is thread-safe; a short mutex orders the creation of per-job
// series against their removal.
#ifndef MUOND_SERVER_RECORD_OPTIMIZER_METRICS_H_
#define MUOND_SERVER_RECORD_OPTIMIZER_METRICS_H_

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace muond::server {

// One matrix's share of its batch's device time (server/engine/step_observer.h):
// muond_newton_schulz_seconds{muond_job,shape,dtype,backend}.
void RecordNewtonSchulz(const std::string& job, const std::string& shape, const std::string& dtype,
                        const std::string& backend, double seconds);

// A sampled step's worst orthogonality so far (muond_update_orthogonality{muond_job}), and the
// seconds the measurement of one matrix took (muond_orthogonality_check_seconds_total and
// muond_orthogonality_checks_total{muond_job}).
void RecordOrthogonality(const std::string& job, double value, double seconds);

// A committed step as its trainer saw it: from its first gradient byte to its last update byte
// out (muond_step_trainer_visible_seconds{muond_job}), and the part of that after its last
// gradient byte arrived (muond_step_trainer_wait_seconds{muond_job}).
void RecordTrainerTime(const std::string& job, double visible_seconds, double wait_seconds);

// A committed step of a QK-Clip job (DESIGN.md 4e): the query heads it clipped
// (muond_qk_clip_heads_clipped_total{muond_job}) and its largest per-head max attention logit
// (muond_qk_max_logit{muond_job}).
void RecordQkClip(const std::string& job, int heads_clipped, double max_logit);

// What is waiting and held in the job's pipeline at a scrape.
struct JobPressure {
  uint64_t matrices_waiting = 0;     // complete matrices not yet taken by the device
  uint64_t gather_in_use_bytes = 0;  // of the gather budget, in batches assembled or in flight
  // Host memory pinned for the job, by kind.
  uint64_t momentum_bytes = 0;        // update mode's momentum, apply mode's Muon momentum
  uint64_t masters_bytes = 0;         // apply mode's fp32 master weights
  uint64_t moments_bytes = 0;         // apply mode's AdamW m and v
  uint64_t session_region_bytes = 0;  // the job's shared-memory sessions' regions (mlock)
  uint64_t staging_bytes = 0;         // the pipeline's staging registered with the device
  // Host bytes the job holds by kind (server/jobs/job_report.h's JobMemory: the names and bytes),
  // and what admission reserved for it, all kinds.
  std::vector<std::pair<std::string, uint64_t>> memory;
  uint64_t footprint_bytes = 0;
};
// muond_job_matrices_waiting, muond_job_gather_in_use_bytes, muond_job_pinned_bytes{kind},
// muond_job_memory_bytes{kind} and muond_job_footprint_bytes.
void SetJobPressure(const std::string& job, const JobPressure& pressure);

// Removes every series of this file of the jobs not in `present`.
void RemoveJobsNotIn(const std::set<std::string>& present);

}  // namespace muond::server

#endif  // MUOND_SERVER_RECORD_OPTIMIZER_METRICS_H_
