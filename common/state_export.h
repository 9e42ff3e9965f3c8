// The on-disk form of a full-state export (muonctl checkpoint export; DESIGN.md 4c, re-sharding a
// job across another set of nodes): for one (node) job, the optimizer state of each of its
// tensors by name, as the job holds it (compressed state stays compressed) or in float32 on
// request, and a small manifest.
//
// In an export directory, job J writes two files, so the node jobs of one training run export
// into the same directory without touching each other's files:
//   J.safetensors     whole tensors (independent of world size, ZeRO stage and node count),
//                     named as in a checkpoint payload (server/storage/checkpoint.h): update mode
//                     each matrix's momentum under the matrix's name; apply mode "master/<t>",
//                     then "momentum/<t>" (Muon) or "exp_avg/<t>", "exp_avg_sq/<t>" (AdamW).
//                     Stored as a checkpoint stores them: float32 as F32 of the tensor's shape,
//                     bfloat16 as BF16 of its shape, int8 as one U8 array of its bytes (the
//                     ceil(numel / 2048) fp32 block scales, then one code per element). Its header
//                     is exactly PayloadHeader(manifest).
//   J.manifest.json   {"format": "muond-state-export", "format_version": 1, "job": J,
//                      "global_job_id", "node", "nodes" (multi-node jobs; else "", -1, 0),
//                      "mode": "update"|"apply", "step": the next step of the state,
//                      "generation": the checkpoint generation exported (0: the live state),
//                      "payload": "J.safetensors", "payload_bytes",
//                      "tensors": [{"name", "tensor", "dtype": "float32" | "bfloat16" |
//                                   "int8" (int8 only: "map": "linear" | "log", "block": 2048;
//                                   server/optim/state_codec.h), "shape" (the tensor's),
//                                   "data_offsets": [begin, end] (after the header), "crc32c",
//                                   "rows": {"offset", "of"} (only for rows of a tensor split
//                                   across nodes: the array holds rows [offset, offset +
//                                   shape[0]) of the tensor's `of` rows)}],
//                      "tensor_steps": {tensor: AdamW step count} (apply mode),
//                      "checksum": CRC32C of this JSON without "checksum" (compact dump)}.
// The manifest is written last: a directory entry J.manifest.json means J's export is complete.
//
// Thread-compatible free functions.
#ifndef MUOND_COMMON_STATE_EXPORT_H_
#define MUOND_COMMON_STATE_EXPORT_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"

namespace muond::common::state_export {

inline constexpr char kFormat[] = "muond-state-export";
inline constexpr int kFormatVersion = 1;
inline constexpr char kManifestSuffix[] = ".manifest.json";
inline constexpr char kPayloadSuffix[] = ".safetensors";
// The most bytes of manifests read from one directory (all together), and the most manifests.
inline constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;
inline constexpr size_t kMaxManifests = 4096;

struct Array {
  std::string name;    // "<t>" (update mode) or "master/<t>", ... (apply mode)
  std::string tensor;  // the job tensor it belongs to
  std::vector<int64_t> shape;
  StateDType dtype = StateDType::kFloat32;  // as stored
  bool non_negative = false;                // int8: the logarithmic map; else linear
  uint64_t begin = 0;  // data offsets after the payload header
  uint64_t end = 0;
  uint32_t crc32c = 0;
  int64_t row_offset = 0;  // rows [row_offset, row_offset + shape[0]) of full_rows (0: whole)
  int64_t full_rows = 0;
  uint64_t numel() const;
};

struct Manifest {
  std::string job_id;
  std::string global_job_id;  // "" unless a node job of a multi-node run
  int node = -1;
  int nodes = 0;
  JobMode mode = JobMode::kUpdate;
  int64_t step = 0;
  int64_t generation = 0;
  std::string payload;  // file name in the same directory
  uint64_t payload_bytes = 0;
  std::vector<Array> arrays;
  std::map<std::string, int64_t> tensor_steps;  // apply mode
};

// Bytes a state array occupies (StoredStateBytes of its dtype).
uint64_t ArrayBytes(const Array& a);
// Fills begin/end of every array (packed in order) and payload_bytes from the header's size.
void LayOut(Manifest* m);
// The payload's header: 8-byte little-endian length, then the safetensors JSON padded with
// spaces to a multiple of 8. REQUIRES: LayOut(m) done.
std::string PayloadHeader(const Manifest& m);
// The manifest file's text (with its checksum).
std::string ManifestToJson(const Manifest& m);
// Parses and checks a manifest read from `where` (a path, for messages): format, version,
// checksum, field types, the file names (no '/'), shapes (positive, numel without overflow),
// dtypes (int8 with its map and block 2048), data offsets (packed in order, end - begin = the
// dtype's bytes for numel, inside payload_bytes), rows within
// their tensor's, no array named twice, apply mode's step count of every tensor. DATA_LOSS (a
// damaged file) or INVALID_ARGUMENT (well-formed but not a state export of this format), naming
// `where` and what.
absl::StatusOr<Manifest> ParseManifest(std::string_view text, const std::string& where);

}  // namespace muond::common::state_export

#endif  // MUOND_COMMON_STATE_EXPORT_H_
