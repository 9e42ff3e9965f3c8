// The Device interface's own members (device.h), whatever the backend: a device buffer and a
// host registration give their memory back when they go, and a failed registration is an error
// naming the device.
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/device/device.h"

namespace muond::server::device {

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (device_ != nullptr && data_ != nullptr) device_->Free(data_, size_);
    device_ = std::exchange(o.device_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (device_ != nullptr && data_ != nullptr) device_->Free(data_, size_);
}

absl::Status Device::RegisterHostRegion(void* data, size_t bytes) {
  if (RegisterHost(data, bytes)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(name(), ": cannot register ", bytes, " bytes of host memory"));
}

absl::StatusOr<HostRegistration> HostRegistration::Register(Device& device, void* data,
                                                            size_t bytes) {
  if (data == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("registration of an empty host range");
  }
  if (absl::Status s = device.RegisterHostRegion(data, bytes); !s.ok()) return s;
  return HostRegistration(&device, data, bytes);
}

HostRegistration& HostRegistration::operator=(HostRegistration&& o) noexcept {
  if (this != &o) {
    if (device_ != nullptr) device_->UnregisterHost(data_, size_);
    device_ = std::exchange(o.device_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

HostRegistration::~HostRegistration() {
  if (device_ != nullptr) device_->UnregisterHost(data_, size_);
}

}  // namespace muond::server::device
