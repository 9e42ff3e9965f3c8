// Checkpoints of a job's momentum (DESIGN.md section 7): one directory of generations per job.
//
// The room server/storage owns what is on disk: this format and its verification (the payload in
// checkpoint_payload.h), and the durable file operations with their fault hooks
// (durable_file.h) that job records and checkpoints are written with. It calls only common/;
// server/jobs calls it (CheckpointWriter, the registry's job records).
//
// A generation is a directory `gen-<G>` (G zero-padded to 12 digits) holding
//   momentum.safetensors  the state of every tensor, whole (independent of world size and ZeRO
//                         stage), in spec order (StateTensors): update mode, each matrix's
//                         momentum under the matrix's name; apply mode (DESIGN.md 4b), per tensor
//                         "master/<name>", then "momentum/<name>" (Muon) or "exp_avg/<name>" and
//                         "exp_avg_sq/<name>" (AdamW). Each array as the job holds it (spec
//                         "state", server/optim/state_codec.h): float32 ("F32", its shape);
//                         bfloat16 ("BF16", its shape: the bf16 values); int8 ("U8", one dimension
//                         of its bytes: the StateBlocks fp32 scales, then one code per element);
//                         the masters always float32;
//   manifest.json         {"format": "muond-checkpoint", "format_version": 1, "generation": G,
//                          "step": S (the job's next step at the snapshot), "created_unix_ms",
//                          "job": the job spec (job.json form, Muon config included),
//                          "payload": "momentum.safetensors", "payload_bytes",
//                          "payload_header_crc32c": CRC32C of the safetensors header JSON,
//                          "tensors": [{"name", "shape", "dtype": "float32" | "bfloat16" |
//                                       "int8", int8 only: "map": "linear" | "log" and
//                                       "block": 2048, "data_offsets": [begin, end], "crc32c"}],
//                          apply mode only: "tensor_steps": [AdamW step count per job tensor],
//                          "checksum": CRC32C of this JSON without "checksum" (compact dump)}.
// Written into `gen-<G>.tmp`, each file fsynced, the directory fsynced, renamed to `gen-<G>`, and
// the job directory fsynced: a generation directory either is complete and durable or does not
// exist under its final name. The newest `keep` generations are kept.
//
// Load verifies the manifest checksum, the payload's header against the manifest, its size and
// every tensor's CRC32C. A generation that fails is set aside (renamed `gen-<G>.broken`) and, when
// the newest good one was asked for, the previous one is tried; none good -> DATA_LOSS naming the
// paths.
//
// Thread-compatible: one writer or loader at a time per directory (the Job serializes them).
#ifndef MUOND_SERVER_STORAGE_CHECKPOINT_H_
#define MUOND_SERVER_STORAGE_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_spec.h"

namespace muond::server::checkpoint {

struct GenerationInfo {
  int64_t generation = -1;
  int64_t step = -1;
  int64_t created_unix_ms = 0;
  uint64_t bytes = 0;   // payload bytes
  std::string path;     // the generation's directory
  std::string problem;  // empty when the manifest reads fine (List does not verify the payload)
};

// What to load: a generation, the newest generation saved at a step, or (both < 0) the newest
// good one.
struct Selector {
  int64_t generation = -1;
  int64_t step = -1;
  // Called (from several threads at once) with the bytes of each tensor read and verified, for
  // progress reports; may be empty.
  std::function<void(uint64_t bytes)> on_bytes_read;
};

struct Loaded {
  GenerationInfo info;
  common::JobSpec spec;                   // the spec the generation was written with
  std::vector<std::string> names;         // state tensor names, in payload order
  std::vector<std::vector<float>> data;   // per name, its values (decoded to fp32: encoding
                                          // them again gives the held bytes back, bit for bit)
  std::vector<int64_t> tensor_steps;      // apply mode: per job tensor, its AdamW step count
  std::vector<std::string> set_aside;     // paths renamed .broken on the way
};

// One array of a generation's payload.
struct StateTensor {
  std::string name;
  std::vector<int64_t> shape;
  uint32_t tensor = 0;  // its job tensor (index into spec.matrices)
  // How the job holds it (spec "state"): the masters fp32, Muon's momentum momentum_dtype,
  // AdamW's moments adamw_dtype (the second moment non-negative: the logarithmic int8 map).
  common::StateDType dtype = common::StateDType::kFloat32;
  bool non_negative = false;
  uint64_t numel() const;
  uint64_t stored_bytes() const { return common::StoredStateBytes(dtype, numel()); }
};
// The arrays a generation of `spec` holds, in payload order (see above). Apply mode: slot 0 is the
// master, slot 1 the momentum (Muon) or exp_avg (AdamW), slot 2 exp_avg_sq.
std::vector<StateTensor> StateTensors(const common::JobSpec& spec);
std::string StateArrayName(const common::MatrixSpec& tensor, int slot);

// State tensor `m` (StateTensors order), copied into `out` as the job holds it: resized to
// StoredWords(dtype, numel) 32-bit words (fp32: the values; server/optim/state_codec.h), whose
// first stored_bytes() the payload stores as they are. Called once per array, in order, from the
// writing thread.
using MatrixSource = std::function<absl::Status(size_t m, std::vector<float>* out)>;

class Store {
 public:
  // `dir`: the job's checkpoint directory (created on first write). keep >= 1.
  Store(std::string dir, int keep);

  const std::string& dir() const { return dir_; }

  // Writes generation (newest + 1) of `spec` at `step`, taking each state tensor from `source`
  // (and, in apply mode, the AdamW step counts from `tensor_steps`). On any
  // failure (source, write, fsync, rename, disk full) returns the error naming the path and call,
  // removes the partial temporary directory, and leaves every earlier generation untouched.
  absl::StatusOr<GenerationInfo> Write(const common::JobSpec& spec, int64_t step,
                                       const MatrixSource& source,
                                       const std::vector<int64_t>& tensor_steps = {});
  // Generations by name, newest first, with their manifests' step (payloads not verified).
  // Temporary directories of interrupted writes are removed on the way.
  absl::StatusOr<std::vector<GenerationInfo>> List() const;
  // Loads and verifies. NOT_FOUND when no generation matches; DATA_LOSS when the chosen one (or,
  // for the newest, every one) is corrupt, naming the paths, each set aside as `.broken`.
  absl::StatusOr<Loaded> Load(const Selector& selector);

 private:
  const std::string dir_;
  const int keep_;
};

}  // namespace muond::server::checkpoint

#endif  // MUOND_SERVER_STORAGE_CHECKPOINT_H_
