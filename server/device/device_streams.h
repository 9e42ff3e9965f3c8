// The daemon's compute device with the three streams of the step pipeline (DESIGN.md section 6):
// copy-in (gradient + momentum to the device), compute (Muon), writeback (update to the host).
// Used only from the ComputeExecutor's thread, so it needs no lock.
#ifndef MUOND_SERVER_DEVICE_DEVICE_STREAMS_H_
#define MUOND_SERVER_DEVICE_DEVICE_STREAMS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/device/device.h"

namespace muond::server {

struct DeviceStreams {
  // Takes the device; creates its streams. `serial`: run every batch to completion before the
  // next (a forced serial schedule, for tests and comparisons).
  static absl::StatusOr<std::unique_ptr<DeviceStreams>> Create(
      std::unique_ptr<device::Device> device, std::string why, bool serial);

  std::unique_ptr<device::Device> device;
  std::string why;  // which backend and why (logged, shown in job status)
  std::unique_ptr<device::Stream> copy_in;
  std::unique_ptr<device::Stream> compute;
  std::unique_ptr<device::Stream> writeback;
  bool serial = false;
  // Batches in flight at once: copy-in of i+1, compute of i, writeback of i-1.
  static constexpr int kDepth = 3;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_DEVICE_DEVICE_STREAMS_H_
