#include "server/device/device_streams.h"

#include <utility>

namespace muond::server {

absl::StatusOr<std::unique_ptr<DeviceStreams>> DeviceStreams::Create(
    std::unique_ptr<device::Device> device, std::string why, bool serial) {
  auto c = std::make_unique<DeviceStreams>();
  auto in = device->CreateStream();
  auto compute = device->CreateStream();
  auto out = device->CreateStream();
  if (!in.ok()) return in.status();
  if (!compute.ok()) return compute.status();
  if (!out.ok()) return out.status();
  c->copy_in = *std::move(in);
  c->compute = *std::move(compute);
  c->writeback = *std::move(out);
  c->device = std::move(device);
  c->why = std::move(why);
  c->serial = serial;
  return c;
}

}  // namespace muond::server
