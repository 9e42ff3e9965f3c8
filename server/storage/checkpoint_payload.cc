#include "server/storage/checkpoint_payload.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/crc32c.h"
#include "common/json_depth.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "server/optim/state_codec.h"
#include "server/storage/durable_file.h"

namespace muond::server::checkpoint {
namespace {

using durable::ErrnoStatus;
using durable::Fd;
using durable::IoPoint;
using Json = nlohmann::json;

// Reads exactly n bytes at `offset`; DATA_LOSS when the file ends first.
absl::Status PreadAll(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r =
        ::pread(fd, p, std::min<size_t>(n, size_t{64} << 20), static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return ReadError(errno, "read", path);
    }
    if (r == 0) return absl::DataLossError(absl::StrCat(path, ": truncated at byte ", offset));
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

// The payload's size from fstat, DATA_LOSS unless it is the manifest's payload_bytes.
absl::StatusOr<uint64_t> PayloadSize(int fd, const std::string& path, uint64_t manifest_bytes) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat", path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size != manifest_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", size, " bytes, the manifest says ",
                                            manifest_bytes, " (truncated or replaced)"));
  }
  return size;
}

// The safetensors header of a payload: its JSON object and where the tensor data starts.
struct PayloadHeader {
  Json json;  // tensor name -> {"dtype", "shape", "data_offsets"}, and "__metadata__"
  uint64_t data_start = 0;
};

// Reads the header (an 8-byte length, then JSON) of a payload of `size` bytes and checks it
// against the manifest's payload_header_crc32c. DATA_LOSS when it does not fit, does not match or
// is not a JSON object.
absl::StatusOr<PayloadHeader> ReadPayloadHeader(int fd, const std::string& path, uint64_t size,
                                                const Json& manifest) {
  uint64_t header_len = 0;
  if (size < 8) return absl::DataLossError(absl::StrCat(path, ": truncated header"));
  RETURN_IF_ERROR(PreadAll(fd, &header_len, 8, 0, path));
  if (header_len > kMaxHeaderBytes || 8 + header_len > size) {
    return absl::DataLossError(absl::StrCat(path, ": bad header length ", header_len));
  }
  std::string header(header_len, '\0');
  RETURN_IF_ERROR(PreadAll(fd, header.data(), header_len, 8, path));
  const auto want_crc = manifest.find("payload_header_crc32c");
  if (want_crc == manifest.end() || !want_crc->is_number_unsigned() ||
      common::Crc32c(header.data(), header.size()) != want_crc->get<uint32_t>()) {
    return absl::DataLossError(absl::StrCat(path, ": header checksum mismatch"));
  }
  PayloadHeader out;
  bool too_deep = false;
  out.json = common::ParseJsonWithDepthLimit<Json>(header, &too_deep);
  if (out.json.is_discarded() || !out.json.is_object() || too_deep) {
    return absl::DataLossError(
        absl::StrCat(path, ": header is not valid JSON", too_deep ? " (nested too deep)" : ""));
  }
  out.data_start = 8 + header_len;
  return out;
}

// Where one tensor's data lies in the payload, the CRC32C the manifest gives for it, and how it
// is held there.
struct TensorRead {
  uint64_t offset;
  uint32_t crc;
  uint64_t bytes;
  common::StateDType dtype;
  StateRole role;
};

// The safetensors dtype of an array held as `dtype`.
const char* SafetensorsDType(common::StateDType dtype) {
  switch (dtype) {
    case common::StateDType::kBFloat16:
      return "BF16";
    case common::StateDType::kInt8:
      return "U8";
    case common::StateDType::kFloat32:
      break;
  }
  return "F32";
}

// The safetensors shape of array `t` as stored: its own, or (int8) its bytes.
std::vector<int64_t> StoredShape(const StateTensor& t) {
  if (t.dtype != common::StateDType::kInt8) return t.shape;
  return {static_cast<int64_t>(t.stored_bytes())};
}

// The manifest entry's held form: "dtype" (absent in no generation muond wrote, read as
// float32), and for int8 "map" and "block". DATA_LOSS naming the tensor when they are not one
// this build reads.
absl::Status ParseHeldForm(const Json& t, const std::string& path, const std::string& name,
                           StateTensor* out) {
  const auto dtype = t.find("dtype");
  auto parsed = dtype == t.end() || !dtype->is_string()
                    ? absl::StatusOr<common::StateDType>(absl::InvalidArgumentError("not a string"))
                    : common::ParseStateDType(dtype->get<std::string>());
  if (!parsed.ok()) {
    return absl::DataLossError(absl::StrCat(path, ": tensor '", name, "': bad \"dtype\" (",
                                            parsed.status().message(), ")"));
  }
  out->dtype = *parsed;
  out->non_negative = false;
  if (out->dtype != common::StateDType::kInt8) return absl::OkStatus();
  const auto map = t.find("map");
  const auto block = t.find("block");
  if (map == t.end() || !map->is_string() || (*map != "linear" && *map != "log") ||
      block == t.end() || !block->is_number_unsigned() ||
      block->get<uint64_t>() != common::kStateBlock) {
    return absl::DataLossError(absl::StrCat(path, ": tensor '", name,
                                            "': int8 needs \"map\" linear or log and \"block\" ",
                                            common::kStateBlock));
  }
  out->non_negative = *map == "log";
  return absl::OkStatus();
}

// Checks the manifest's tensor list against the payload header (name, dtype, shape, offsets, all
// within `size` bytes) and sizes out->names and out->data for them. DATA_LOSS naming the tensor
// that differs, or the manifest when its list is malformed.
absl::StatusOr<std::vector<TensorRead>> PlanTensorReads(const std::string& manifest_path,
                                                        const std::string& path,
                                                        const Json& manifest,
                                                        const PayloadHeader& header, uint64_t size,
                                                        Loaded* out) {
  const Json& h = header.json;
  std::vector<TensorRead> reads;
  // The key being read, named in the message when nlohmann throws (a key missing or of another
  // type than read).
  std::string key = "tensors";
  auto at = [&key](const Json& j, const std::string& prefix, const char* name) -> const Json& {
    key = prefix + name;
    return j.at(name);
  };
  try {
    const Json& tensors = manifest.at("tensors");
    for (const Json& t : tensors) {
      const std::string prefix = absl::StrCat("tensors[", reads.size(), "].");
      const std::string name = at(t, prefix, "name").get<std::string>();
      const std::vector<int64_t> shape = at(t, prefix, "shape").get<std::vector<int64_t>>();
      const std::vector<uint64_t> off = at(t, prefix, "data_offsets").get<std::vector<uint64_t>>();
      const uint32_t crc = at(t, prefix, "crc32c").get<uint32_t>();
      StateTensor held;
      held.shape = shape;
      RETURN_IF_ERROR(ParseHeldForm(t, manifest_path, name, &held));
      // Each dimension positive and the product within the payload (so it cannot overflow; an
      // element is at least one byte).
      uint64_t numel = 1;
      for (int64_t d : shape) {
        if (d <= 0 || static_cast<uint64_t>(d) > size / numel) {
          return absl::DataLossError(absl::StrCat(path, ": tensor '", name, "' shape [",
                                                  absl::StrJoin(shape, ", "),
                                                  "] does not fit the payload's ", size, " bytes"));
        }
        numel *= static_cast<uint64_t>(d);
      }
      key = absl::StrCat(name, " (of the payload header ", path, ")");
      const auto it = h.find(name);
      const auto dtype = it == h.end() ? h.end() : it->find("dtype");
      if (it == h.end() || dtype == it->end() || !dtype->is_string() ||
          *dtype != SafetensorsDType(held.dtype) ||
          it->at("shape").get<std::vector<int64_t>>() != StoredShape(held) ||
          it->at("data_offsets").get<std::vector<uint64_t>>() != off || off.size() != 2 ||
          off[1] < off[0]) {
        return absl::DataLossError(
            absl::StrCat(path, ": tensor '", name, "' differs between header and manifest"));
      }
      const uint64_t bytes = held.stored_bytes();
      if (off[1] - off[0] != bytes || header.data_start + off[1] > size) {
        return absl::DataLossError(
            absl::StrCat(path, ": tensor '", name, "' has a bad size or offsets"));
      }
      out->names.push_back(name);
      out->data.emplace_back(numel);
      reads.push_back({header.data_start + off[0], crc, bytes, held.dtype,
                       held.non_negative ? StateRole::kNonNegative : StateRole::kSigned});
    }
  } catch (const Json::exception& e) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": key '", key, "': ", e.what()));
  }
  return reads;
}

// Reads every tensor into out->data (sized by PlanTensorReads) and checks its CRC32C, spread over
// the CPUs (page-cache copies and CRC32C). The first failure in payload order is returned.
absl::Status ReadTensors(int fd, const std::string& path, uint64_t size,
                         const std::vector<TensorRead>& reads, Loaded* out,
                         const std::function<void(uint64_t)>& on_bytes_read) {
  std::vector<absl::Status> read_status(reads.size());
  common::ParallelFor(reads.size(), size, [&](size_t i) {
    const TensorRead& r = reads[i];
    std::vector<float>& v = out->data[i];
    // fp32 is read where it goes; a compressed array into its held words, then decoded.
    std::vector<float> held;
    const bool fp32 = r.dtype == common::StateDType::kFloat32;
    if (!fp32) held.resize(StoredWords(r.dtype, v.size()));
    float* into = fp32 ? v.data() : held.data();
    read_status[i] = PreadAll(fd, into, r.bytes, r.offset, path);
    if (!read_status[i].ok()) return;
    const uint32_t got = common::Crc32c(into, r.bytes);
    if (got != r.crc) {
      read_status[i] = absl::DataLossError(
          absl::StrFormat("%s: tensor '%s' checksum mismatch (crc32c %08x, manifest %08x)", path,
                          out->names[i], got, r.crc));
      return;
    }
    if (!fp32) DecodeStored(r.dtype, r.role, held.data(), v.size(), 0, v.size(), v.data());
    if (on_bytes_read) on_bytes_read(r.bytes);
  });
  for (const absl::Status& st : read_status) RETURN_IF_ERROR(st);
  return absl::OkStatus();
}
}  // namespace

absl::Status ReadError(int err, const char* call, const std::string& path) {
  if (err == ENOENT || err == EIO) {
    return absl::DataLossError(absl::StrCat(call, " ", path, ": ", std::strerror(err)));
  }
  return ErrnoStatus(err, call, path);
}

std::string StateArrayName(const common::MatrixSpec& tensor, int slot) {
  static constexpr const char* kMuon[] = {"master/", "momentum/"};
  static constexpr const char* kAdamW[] = {"master/", "exp_avg/", "exp_avg_sq/"};
  const bool adamw = tensor.optimizer == common::Optimizer::kAdamW;
  return absl::StrCat(adamw ? kAdamW[slot] : kMuon[slot], tensor.name);
}

uint64_t StateTensor::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::vector<StateTensor> StateTensors(const common::JobSpec& spec) {
  using common::StateDType;
  std::vector<StateTensor> out;
  for (uint32_t t = 0; t < spec.matrices.size(); ++t) {
    const common::MatrixSpec& m = spec.matrices[t];
    if (spec.mode != common::JobMode::kApply) {
      out.push_back({m.name, m.shape, t, spec.state.momentum, false});
      continue;
    }
    if (m.optimizer != common::Optimizer::kAdamW) {
      out.push_back({StateArrayName(m, 0), m.shape, t, StateDType::kFloat32, false});
      out.push_back({StateArrayName(m, 1), m.shape, t, spec.state.momentum, false});
      continue;
    }
    out.push_back({StateArrayName(m, 0), m.shape, t, StateDType::kFloat32, false});
    out.push_back({StateArrayName(m, 1), m.shape, t, spec.state.adamw, false});
    out.push_back({StateArrayName(m, 2), m.shape, t, spec.state.adamw, true});
  }
  return out;
}

PayloadLayout LayOutPayload(const common::JobSpec& spec, const GenerationInfo& info) {
  PayloadLayout layout;
  Json header = Json::object();
  uint64_t offset = 0;
  for (const StateTensor& m : StateTensors(spec)) {
    const uint64_t bytes = m.stored_bytes();
    header[m.name] = {{"dtype", SafetensorsDType(m.dtype)},
                      {"shape", StoredShape(m)},
                      {"data_offsets", {offset, offset + bytes}}};
    Json entry = {{"name", m.name},
                  {"shape", m.shape},
                  {"dtype", std::string(common::StateDTypeName(m.dtype))},
                  {"data_offsets", {offset, offset + bytes}}};
    if (m.dtype == common::StateDType::kInt8) {
      entry["map"] = m.non_negative ? "log" : "linear";
      entry["block"] = common::kStateBlock;
    }
    layout.tensors.push_back(std::move(entry));
    offset += bytes;
  }
  header["__metadata__"] = {{"format", kFormat},
                            {"job_id", spec.job_id},
                            {"generation", std::to_string(info.generation)},
                            {"step", std::to_string(info.step)}};
  layout.header_text = header.dump();
  layout.header_text.append((8 - layout.header_text.size() % 8) % 8, ' ');
  layout.data_bytes = offset;
  return layout;
}

absl::Status WritePayload(const std::string& path, const common::JobSpec& spec,
                          const MatrixSource& source, PayloadLayout* layout) {
  Fd fd;
  RETURN_IF_ERROR(durable::OpenForWrite(path, &fd));
  const uint64_t header_len = layout->header_text.size();
  RETURN_IF_ERROR(durable::WriteAll(fd.get(), &header_len, 8, path));
  RETURN_IF_ERROR(
      durable::WriteAll(fd.get(), layout->header_text.data(), layout->header_text.size(), path));
  std::vector<float> buf;
  const std::vector<StateTensor> tensors = StateTensors(spec);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const StateTensor& t = tensors[i];
    RETURN_IF_ERROR(source(i, &buf));
    const size_t words = StoredWords(t.dtype, t.numel());
    if (buf.size() != words) {
      return absl::InternalError(absl::StrCat("checkpoint: tensor '", t.name, "' has ", buf.size(),
                                              " words, expected ", words));
    }
    const size_t bytes = t.stored_bytes();
    layout->tensors[i]["crc32c"] = common::Crc32c(buf.data(), bytes);
    RETURN_IF_ERROR(durable::WriteAll(fd.get(), buf.data(), bytes, path));
  }
  return durable::Fsync(fd.get(), IoPoint::kFsyncFile, path);
}

absl::Status ReadPayload(const std::string& path, const Json& manifest,
                         const std::string& manifest_path, Loaded* out,
                         const std::function<void(uint64_t)>& on_bytes_read) {
  const int f = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f < 0) return ReadError(errno, "open", path);
  Fd fd(f);
  ASSIGN_OR_RETURN(const uint64_t size, PayloadSize(fd.get(), path, out->info.bytes));
  ASSIGN_OR_RETURN(const PayloadHeader header, ReadPayloadHeader(fd.get(), path, size, manifest));
  ASSIGN_OR_RETURN(const std::vector<TensorRead> reads,
                   PlanTensorReads(manifest_path, path, manifest, header, size, out));
  return ReadTensors(fd.get(), path, size, reads, out, on_bytes_read);
}

}  // namespace muond::server::checkpoint
