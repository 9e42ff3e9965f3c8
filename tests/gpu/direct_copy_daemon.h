// An in-process muond for the direct-copy tests (device_direct_copy_test.cc): the daemon's own
// parts (DeviceStreams around a given device, ComputeExecutor, JobRegistry, ShmServer), wired as
// server/main.cc wires them, in the test process; ranks attach over its shared-memory socket with
// the client library's ShmChannel and step with deterministic gradients, so that two daemons (two
// devices, or the same device with and without registration) can be compared byte for byte.
// Not thread-safe; one test at a time.
#ifndef MUOND_TESTS_GPU_DIRECT_COPY_DAEMON_H_
#define MUOND_TESTS_GPU_DIRECT_COPY_DAEMON_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/api/shm_server.h"
#include "server/device/device.h"
#include "server/device/device_streams.h"
#include "server/engine/compute_executor.h"
#include "server/jobs/job_registry.h"

namespace muond::server::testing_direct {

class InProcessDaemon {
 public:
  // Takes `device`; `register_with_device`: ShmLimits::register_with_device. The state directory
  // is a fresh temporary one, removed by the destructor.
  static absl::StatusOr<std::unique_ptr<InProcessDaemon>> Start(
      std::unique_ptr<device::Device> device, bool register_with_device,
      uint64_t gather_budget_bytes = uint64_t{64} << 20);
  ~InProcessDaemon();

  // Creates a job from its job.json; returns its token.
  absl::StatusOr<std::string> CreateJob(const std::string& json);
  const std::string& shm_path() const { return shm_path_; }
  device::Device& device() { return *devices_->device; }

 private:
  InProcessDaemon() = default;
  std::string dir_;
  std::string shm_path_;
  // Destroyed in reverse: the server, the jobs, the executor, then the device (as in main.cc).
  std::unique_ptr<DeviceStreams> devices_;
  std::unique_ptr<ComputeExecutor> executor_;
  std::unique_ptr<JobRegistry> registry_;
  std::unique_ptr<ShmServer> shm_;
};

// What a run of steps returned: per step, per rank, the bytes of its update spans in the order of
// its spans; and each step's wall time (every rank's Ring, first start to last end).
struct StepResults {
  std::vector<std::vector<std::string>> updates;
  std::vector<double> seconds;
};

// Steps [0, steps) of job `job_id`: attaches every rank over `socket`, writes step t's gradients
// (Gradient(matrix, t, seed), in the matrix dtype) into each rank's buffer and rings, each rank on
// its own thread; apply mode: with the job's lr and weight decay, and step t's gradient divisor
// grad_divisor * (t + 1) (1 when grad_divisor is 1). The first error of any rank, naming the
// rank and step.
absl::StatusOr<StepResults> RunSteps(const std::string& socket, const std::string& job_id,
                                     const std::string& token, int steps, uint32_t seed,
                                     double grad_divisor = 1.0);

// Deterministic gradient values of a whole matrix for a step, in [-1, 1).
std::vector<float> Gradient(uint32_t matrix, int64_t numel, int64_t step, uint32_t seed);

// The value of `name` with exactly these labels in the default metrics registry (0 if absent).
double MetricValue(const std::string& name, const std::map<std::string, std::string>& labels);

}  // namespace muond::server::testing_direct

#endif  // MUOND_TESTS_GPU_DIRECT_COPY_DAEMON_H_
