// The argument checks of Stream::Convert (device.h), shared by every backend. Header-only: the
// GPU backends are libraries of their own that must not depend on muond_server.
#ifndef MUOND_SERVER_DEVICE_CONVERT_CHECK_H_
#define MUOND_SERVER_DEVICE_CONVERT_CHECK_H_

#include <cstddef>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "server/device/device.h"

namespace muond::server::device {

// OK when Stream::Convert may convert `elements` values of `from` at src into `to` at dst.
inline absl::Status CheckConvert(const DeviceBuffer& src, common::DType from,
                                 const DeviceBuffer& dst, common::DType to, size_t elements) {
  if (from != to && from != common::DType::kFloat32 && to != common::DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat("convert ", std::string(common::DTypeName(from)),
                                                   " to ", std::string(common::DTypeName(to)),
                                                   ": one side must be float32"));
  }
  const size_t in_size = common::DTypeSize(from), out_size = common::DTypeSize(to);
  if (elements > std::numeric_limits<size_t>::max() / 4 || elements * in_size > src.size() ||
      elements * out_size > dst.size()) {
    return absl::OutOfRangeError(absl::StrCat("convert of ", elements, " elements overruns a ",
                                              src.size(), "-byte source or a ", dst.size(),
                                              "-byte destination"));
  }
  if (elements > 0 && (src.data() == nullptr || dst.data() == nullptr)) {
    return absl::InvalidArgumentError("convert with a null device address");
  }
  if (elements > 0 && src.data() == dst.data()) {
    return absl::InvalidArgumentError("convert in place (source and destination are one buffer)");
  }
  return absl::OkStatus();
}

}  // namespace muond::server::device

#endif  // MUOND_SERVER_DEVICE_CONVERT_CHECK_H_
