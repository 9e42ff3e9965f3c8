// What a job's step pipeline measures for its operators beyond the phase times, the series no other
// optimizer has (README, Prometheus):
//
//  - Newton-Schulz time per shape class. A batch's device compute time (the device's compute busy
//    time from the previous batch's retirement to this one's) is attributed to its Muon matrices in
//    proportion to their Newton-Schulz FLOPs (NewtonSchulzFlops): the device runs a batch's
//    matrices as one call (same shapes batched, shapes interleaved on the CPU), so a matrix has no
//    time of its own, only a share. On a device that runs one batch at a time (the cpu backend) the
//    batch times are exact; where batches overlap on the streams (GPUs) the split between adjacent
//    batches is approximate and the total exact. A shape class is the matrix's shape ("1024x4096";
//    "8x128x64" for 3-D), one per distinct shape of the job up to kMaxShapeClasses (the classes
//    with the most FLOPs in the job); the rest share the class "other". Each matrix is one
//    observation of muond_newton_schulz_seconds{muond_job,shape,dtype,backend} (dtype: the job's
//    Newton-Schulz compute dtype).
//  - Orthogonality of the update: on steps that are multiples of OrthogonalityEvery(), a sample of
//    up to kOrthogonalitySample Muon matrices (a different part of the model on each sampled step,
//    so every matrix is visited) has ||U Uᵀ - I||_F / sqrt(r) of its orthogonalized direction
//    measured (server/optim/orthogonality.h); the step's worst value is
//    muond_update_orthogonality{muond_job}. Only matrices whose update passes through host staging
//    in fp32 are measured (not those a GPU copies straight into the ranks' regions).
//
// Thread-safety: Attribute and Measure are called from the step pipeline's thread; the readers
// (ShapeTimes, LastOrthogonality) from any thread.
#ifndef MUOND_SERVER_ENGINE_STEP_OBSERVER_H_
#define MUOND_SERVER_ENGINE_STEP_OBSERVER_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"

namespace muond::server {

// The daemon's --orthogonality-every (default 100; 0 turns the measurement off). Process-wide,
// set once at start (tests set it too).
void SetOrthogonalityEvery(int64_t every);
int64_t OrthogonalityEvery();

class StepObserver {
 public:
  static constexpr size_t kMaxShapeClasses = 32;
  static constexpr size_t kOrthogonalitySample = 4;

  // `backend`: the device's name, for the metric's label.
  StepObserver(const common::JobSpec& spec, std::string backend);

  // The device spent `compute_seconds` on a batch whose Muon matrices (computed on the device)
  // are `matrices`: shares it among them by FLOPs, records them, and adds them to ShapeTimes.
  void Attribute(const std::vector<uint32_t>& matrices, double compute_seconds)
      ABSL_LOCKS_EXCLUDED(mu_);

  // True when step `step` measures matrix m's orthogonality.
  bool Samples(int64_t step, uint32_t m) const;
  // Measures matrix m's update (fp32, as the device returned it) of step `step`.
  void Measure(int64_t step, uint32_t m, const float* update) ABSL_LOCKS_EXCLUDED(mu_);

  // Newton-Schulz time per shape class since the job was created, by class in the job's order.
  struct ShapeTime {
    std::string shape;
    uint64_t per_step = 0;  // Muon matrices of the class in one step
    uint64_t matrices = 0;  // matrices computed so far (a clipped step's redo counts again)
    double seconds = 0;
  };
  std::vector<ShapeTime> ShapeTimes() const ABSL_LOCKS_EXCLUDED(mu_);

  // The newest sampled step's worst value, and how many matrices it measured.
  struct Orthogonality {
    int64_t step = 0;
    double value = 0;
    int matrices = 0;
  };
  std::optional<Orthogonality> LastOrthogonality() const ABSL_LOCKS_EXCLUDED(mu_);

  // The class label of matrix m ("other" beyond kMaxShapeClasses).
  const std::string& ShapeClassOf(uint32_t m) const { return classes_[class_of_[m]]; }

 private:
  const common::JobSpec& spec_;
  const std::string backend_;
  const std::string dtype_;
  std::vector<std::string> classes_;  // labels, "other" last when used
  std::vector<size_t> class_of_;      // per matrix, its class (Muon matrices only)
  std::vector<double> flops_;         // per matrix, NewtonSchulzFlops (0 for AdamW)
  std::vector<uint32_t> muon_;        // the job's Muon matrices, in order
  std::vector<size_t> muon_index_;    // per matrix, its index in muon_
  mutable absl::Mutex mu_;
  std::vector<ShapeTime> times_ ABSL_GUARDED_BY(mu_);  // per class
  std::optional<Orthogonality> orthogonality_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_STEP_OBSERVER_H_
