// Reader and writer for the safetensors format: an 8-byte little-endian header length N, N bytes of
// JSON header ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}),
// then the raw little-endian tensor data.
//
// The reader checks everything a hostile or truncated file can get wrong (header length beyond the
// file, malformed JSON, unknown dtype, negative or overflowing shapes, offsets outside the data or
// not matching dtype x shape, overlapping tensors) and returns INVALID_ARGUMENT naming the tensor and
// the problem. Objects are immutable after construction and safe to share between threads.
#ifndef MUOND_COMMON_SAFETENSORS_H_
#define MUOND_COMMON_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace muond::common {

struct TensorInfo {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  uint64_t data_begin = 0;  // offset into the data section
  uint64_t data_end = 0;
  int64_t numel() const;
};

// A parsed safetensors file that owns its bytes.
class SafetensorsFile {
 public:
  // Parses and validates `bytes` (the whole file).
  static absl::StatusOr<SafetensorsFile> Parse(std::string bytes);
  // Reads `path` and parses it; NOT_FOUND / PERMISSION_DENIED / INVALID_ARGUMENT name the path.
  static absl::StatusOr<SafetensorsFile> ReadFile(const std::string& path);

  // Tensors in the order of the header.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr when absent.
  const TensorInfo* Find(std::string_view name) const;
  // The raw bytes of a tensor of this file.
  std::string_view Data(const TensorInfo& info) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string bytes_;
  size_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write; `data` must hold exactly numel * DTypeSize(dtype) bytes.
struct TensorRef {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::string_view data;
};

// Serializes tensors (in the given order) and metadata into safetensors bytes.
// INVALID_ARGUMENT for duplicate or empty names or a data size that does not match the shape.
absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<TensorRef>& tensors, const std::map<std::string, std::string>& metadata = {});

// Serializes and writes to `path` through a temporary file in the same directory, fsync and rename,
// so a reader never sees a half-written file. The directory is reached without following a
// symbolic link in any component (common/no_follow.h; PERMISSION_DENIED naming the link), and
// the temporary file is created new, never through a link. Errors name the path and the call.
absl::Status WriteSafetensorsFile(const std::string& path, const std::vector<TensorRef>& tensors,
                                  const std::map<std::string, std::string>& metadata = {});

}  // namespace muond::common

#endif  // MUOND_COMMON_SAFETENSORS_H_
