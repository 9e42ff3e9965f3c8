// The payload of a checkpoint generation, momentum.safetensors (format: checkpoint.h): laid out
// from the job spec, written from a MatrixSource, and read back with every check against the
// generation's manifest. Internal to server/storage: the Store (checkpoint.cc) writes the manifest
// around it and decides what a failure does to the generation.
//
// Thread-compatible: each call works on its own file and the caller's objects.
#ifndef MUOND_SERVER_STORAGE_CHECKPOINT_PAYLOAD_H_
#define MUOND_SERVER_STORAGE_CHECKPOINT_PAYLOAD_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "common/job_spec.h"
#include "nlohmann/json.hpp"
#include "server/storage/checkpoint.h"

namespace muond::server::checkpoint {

// The manifest's "format" and the payload's __metadata__ "format".
inline constexpr char kFormat[] = "muond-checkpoint";
// The largest safetensors header, and manifest, that is read.
inline constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

// Reading a file of a complete generation: a missing file or an I/O error is damage to the
// generation (DATA_LOSS), not a passing condition; any other error is the call's (ErrnoStatus).
absl::Status ReadError(int err, const char* call, const std::string& path);

// The payload's layout, from the spec's shapes: the safetensors header text (padded to a multiple
// of 8 bytes) and the manifest's tensor entries, whose "crc32c" WritePayload fills in.
struct PayloadLayout {
  std::string header_text;
  nlohmann::json tensors = nlohmann::json::array();
  uint64_t data_bytes = 0;  // the tensors' data after the header

  uint64_t payload_bytes() const { return 8 + header_text.size() + data_bytes; }
};

// The layout of generation info.generation at info.step of `spec`.
PayloadLayout LayOutPayload(const common::JobSpec& spec, const GenerationInfo& info);

// Creates `path` (which must not exist) with the payload: header length, header, each matrix from
// `source` in spec order, then fsyncs it; records each tensor's CRC32C in layout->tensors.
// INTERNAL when `source` gives a matrix of the wrong size; `source`'s own errors as they are;
// durable_file.h's errors naming the call and the path.
absl::Status WritePayload(const std::string& path, const common::JobSpec& spec,
                          const MatrixSource& source, PayloadLayout* layout);

// Reads the payload at `path` into out->names and out->data, checking it against `manifest` (read
// from `manifest_path`, checksum verified): its size against out->info.bytes (the manifest's
// payload_bytes), its header against payload_header_crc32c, every tensor's name, shape and offsets
// against the header, and each tensor's CRC32C. DATA_LOSS naming the path and what differs;
// other I/O errors as ErrnoStatus gives them. `on_bytes_read` (may be empty) is called with the
// bytes of each tensor once read and verified, from several threads at once.
absl::Status ReadPayload(const std::string& path, const nlohmann::json& manifest,
                         const std::string& manifest_path, Loaded* out,
                         const std::function<void(uint64_t)>& on_bytes_read = {});

}  // namespace muond::server::checkpoint

#endif  // MUOND_SERVER_STORAGE_CHECKPOINT_PAYLOAD_H_
