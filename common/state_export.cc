#include "common/state_export.h"

#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/json_depth.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace muond::common::state_export {
namespace {

using Json = nlohmann::json;

absl::Status Damaged(const std::string& where, const std::string& what) {
  return absl::DataLossError(absl::StrCat(where, ": ", what));
}

// The checksummed form: the JSON without "checksum", dumped compactly.
uint32_t Checksum(Json j) {
  j.erase("checksum");
  const std::string text = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  return Crc32c(text.data(), text.size());
}

bool NameOk(const std::string& s) {
  return !s.empty() && s.find('/') == std::string::npos && s != "." && s != ".." &&
         s.find('\0') == std::string::npos;
}

// What a value is, for a message: its JSON, cut to 40 characters.
std::string Shown(const Json& v) {
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

// The error for member `key` of `j` (at `where`; `prefix` + `key` in the message, e.g.
// "tensors[3].") that is missing or not `want`.
absl::Status BadKey(const Json& j, const std::string& where, const std::string& prefix,
                    const std::string& key, const std::string& want) {
  const auto it = j.find(key);
  if (it == j.end()) {
    return Damaged(where, absl::StrCat("has no key '", prefix, key, "' (", want, ")"));
  }
  return Damaged(where, absl::StrCat("key '", prefix, key, "' is ", Shown(*it), ", not ", want));
}

// The fields of a manifest, each read after its type was checked (nlohmann's get<T>() and
// value() throw on another type): an error names the file and the key.
absl::Status GetString(const Json& j, const std::string& where, const std::string& prefix,
                       const std::string& key, std::string* out) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return BadKey(j, where, prefix, key, "a string");
  *out = it->get<std::string>();
  return absl::OkStatus();
}

absl::Status GetInt(const Json& j, const std::string& where, const std::string& prefix,
                    const std::string& key, int64_t lo, int64_t hi, int64_t* out) {
  const auto it = j.find(key);
  const std::string want = absl::StrCat("an integer in [", lo, ", ", hi, "]");
  if (it == j.end()) return BadKey(j, where, prefix, key, want);
  if (it->is_number_unsigned()) {
    if (it->get<uint64_t>() > static_cast<uint64_t>(hi)) return BadKey(j, where, prefix, key, want);
    *out = static_cast<int64_t>(it->get<uint64_t>());
  } else if (it->is_number_integer()) {
    *out = it->get<int64_t>();
  } else {
    return BadKey(j, where, prefix, key, want);
  }
  if (*out < lo || *out > hi) return BadKey(j, where, prefix, key, want);
  return absl::OkStatus();
}

absl::Status GetUnsigned(const Json& j, const std::string& where, const std::string& prefix,
                         const std::string& key, uint64_t* out) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned()) {
    return BadKey(j, where, prefix, key, "an unsigned integer");
  }
  *out = it->get<uint64_t>();
  return absl::OkStatus();
}

// "dtype" and, for int8, "map" and "block".
absl::Status ParseDType(const Json& t, const std::string& where, const std::string& at, Array* a) {
  std::string dtype;
  RETURN_IF_ERROR(GetString(t, where, at, "dtype", &dtype));
  auto parsed = ParseStateDType(dtype);
  if (!parsed.ok()) {
    return BadKey(t, where, at, "dtype", "\"float32\", \"bfloat16\" or \"int8\"");
  }
  a->dtype = *parsed;
  if (a->dtype != StateDType::kInt8) return absl::OkStatus();
  std::string map;
  RETURN_IF_ERROR(GetString(t, where, at, "map", &map));
  if (map != "linear" && map != "log") {
    return BadKey(t, where, at, "map", "\"linear\" or \"log\"");
  }
  a->non_negative = map == "log";
  int64_t block = 0;
  RETURN_IF_ERROR(GetInt(t, where, at, "block", static_cast<int64_t>(kStateBlock),
                         static_cast<int64_t>(kStateBlock), &block));
  return absl::OkStatus();
}

absl::Status ParseArray(const Json& t, const std::string& where, size_t i, Array* a) {
  const std::string at = absl::StrCat("tensors[", i, "].");
  if (!t.is_object())
    return Damaged(where, absl::StrCat("key 'tensors[", i, "]' is not an object"));
  RETURN_IF_ERROR(GetString(t, where, at, "name", &a->name));
  RETURN_IF_ERROR(GetString(t, where, at, "tensor", &a->tensor));
  RETURN_IF_ERROR(ParseDType(t, where, at, a));
  if (!t.contains("shape") || !t["shape"].is_array()) {
    return BadKey(t, where, at, "shape", "a list of dimensions");
  }
  if (!t.contains("data_offsets") || !t["data_offsets"].is_array() ||
      t["data_offsets"].size() != 2) {
    return BadKey(t, where, at, "data_offsets", "two offsets");
  }
  uint64_t crc = 0;
  RETURN_IF_ERROR(GetUnsigned(t, where, at, "crc32c", &crc));
  uint64_t numel = 1;
  for (const Json& d : t["shape"]) {
    if (!d.is_number_integer() || d.get<int64_t>() <= 0 ||
        numel >
            std::numeric_limits<uint64_t>::max() / 8 / static_cast<uint64_t>(d.get<int64_t>())) {
      return Damaged(where, absl::StrCat("key '", at, "shape': tensor '", a->name, "': bad shape ",
                                         Shown(t["shape"])));
    }
    a->shape.push_back(d.get<int64_t>());
    numel *= static_cast<uint64_t>(d.get<int64_t>());
  }
  for (const Json& o : t["data_offsets"]) {
    if (!o.is_number_unsigned()) return BadKey(t, where, at, "data_offsets", "two offsets");
  }
  a->begin = t["data_offsets"][0].get<uint64_t>();
  a->end = t["data_offsets"][1].get<uint64_t>();
  if (crc > 0xffffffffu) return BadKey(t, where, at, "crc32c", "a CRC32C (32 bits)");
  a->crc32c = static_cast<uint32_t>(crc);
  if (t.contains("rows")) {
    const Json& rows = t["rows"];
    if (!rows.is_object()) return BadKey(t, where, at, "rows", "an object {offset, of}");
    const std::string rat = at + "rows.";
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    RETURN_IF_ERROR(GetInt(rows, where, rat, "offset", 0, kMax, &a->row_offset));
    RETURN_IF_ERROR(GetInt(rows, where, rat, "of", 1, kMax, &a->full_rows));
    if (a->shape.empty() || a->row_offset > a->full_rows - a->shape[0]) {
      return Damaged(where, absl::StrCat("key '", at, "rows': tensor '", a->name, "': rows [",
                                         a->row_offset, ", +", a->shape.empty() ? 0 : a->shape[0],
                                         ") are not within its ", a->full_rows, " rows"));
    }
  }
  return absl::OkStatus();
}

// Everything ParseManifest checks once the fields are read.
absl::Status CheckManifest(const Manifest& m, const std::string& where, uint64_t header_bytes) {
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const Array& a : m.arrays) {
    if (!names.insert(a.name).second) {
      return Damaged(where, absl::StrCat("tensor '", a.name, "' is listed twice"));
    }
    if (a.begin != offset || a.end < a.begin || a.end - a.begin != ArrayBytes(a)) {
      return Damaged(where, absl::StrCat("tensor '", a.name, "': data_offsets [", a.begin, ", ",
                                         a.end, "] do not follow its shape (", ArrayBytes(a),
                                         " bytes from ", offset, ")"));
    }
    offset = a.end;
    if (m.mode == JobMode::kApply && m.tensor_steps.count(a.tensor) == 0) {
      return Damaged(where, absl::StrCat("no step count for tensor '", a.tensor, "'"));
    }
  }
  if (m.payload_bytes != header_bytes + offset) {
    return Damaged(where, absl::StrCat("payload_bytes ", m.payload_bytes, " is not the header's ",
                                       header_bytes, " plus the tensors' ", offset));
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t Array::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

uint64_t ArrayBytes(const Array& a) { return StoredStateBytes(a.dtype, a.numel()); }

void LayOut(Manifest* m) {
  uint64_t offset = 0;
  for (Array& a : m->arrays) {
    a.begin = offset;
    a.end = offset + ArrayBytes(a);
    offset = a.end;
  }
  m->payload_bytes = PayloadHeader(*m).size() + offset;
}

std::string PayloadHeader(const Manifest& m) {
  Json header = Json::object();
  for (const Array& a : m.arrays) {
    const bool int8 = a.dtype == StateDType::kInt8;
    header[a.name] = {
        {"dtype", int8                               ? "U8"
                  : a.dtype == StateDType::kBFloat16 ? "BF16"
                                                     : "F32"},
        {"shape", int8 ? std::vector<int64_t>{static_cast<int64_t>(ArrayBytes(a))} : a.shape},
        {"data_offsets", {a.begin, a.end}}};
  }
  header["__metadata__"] = {
      {"format", kFormat}, {"job", m.job_id}, {"step", std::to_string(m.step)}};
  std::string text = header.dump(-1, ' ', false, Json::error_handler_t::replace);
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  return out + text;
}

std::string ManifestToJson(const Manifest& m) {
  Json j = {{"format", kFormat},
            {"format_version", kFormatVersion},
            {"job", m.job_id},
            {"global_job_id", m.global_job_id},
            {"node", m.node},
            {"nodes", m.nodes},
            {"mode", std::string(JobModeName(m.mode))},
            {"step", m.step},
            {"generation", m.generation},
            {"payload", m.payload},
            {"payload_bytes", m.payload_bytes},
            {"tensors", Json::array()}};
  for (const Array& a : m.arrays) {
    j["tensors"].push_back({{"name", a.name},
                            {"tensor", a.tensor},
                            {"dtype", std::string(StateDTypeName(a.dtype))},
                            {"shape", a.shape},
                            {"data_offsets", {a.begin, a.end}},
                            {"crc32c", a.crc32c}});
    if (a.dtype == StateDType::kInt8) {
      j["tensors"].back()["map"] = a.non_negative ? "log" : "linear";
      j["tensors"].back()["block"] = kStateBlock;
    }
    if (a.full_rows > 0) {
      j["tensors"].back()["rows"] = {{"offset", a.row_offset}, {"of", a.full_rows}};
    }
  }
  if (m.mode == JobMode::kApply) j["tensor_steps"] = m.tensor_steps;
  j["checksum"] = Checksum(j);
  return j.dump(1, ' ', false, Json::error_handler_t::replace) + "\n";
}

absl::StatusOr<Manifest> ParseManifest(std::string_view text, const std::string& where) {
  bool too_deep = false;
  const Json j = ParseJsonWithDepthLimit<Json>(text, &too_deep);
  if (j.is_discarded() || too_deep || !j.is_object()) {
    return Damaged(where, too_deep ? "JSON nested deeper than 64 levels" : "not a JSON object");
  }
  // Looked up, not j.value(): value() throws when a key holds another type than its default.
  const auto format = j.find("format");
  if (format == j.end() || !format->is_string() || *format != kFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": not a muond state export (key 'format' is ",
                     format == j.end() ? "missing" : Shown(*format), ", not \"", kFormat, "\")"));
  }
  const auto version = j.find("format_version");
  if (version == j.end() || !version->is_number_integer() || *version != kFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": key 'format_version' is ",
                                                   version == j.end() ? "missing" : Shown(*version),
                                                   ", not ", kFormatVersion));
  }
  const auto checksum = j.find("checksum");
  if (checksum == j.end() || !checksum->is_number_unsigned() ||
      checksum->get<uint64_t>() != Checksum(j)) {
    return Damaged(where, "manifest checksum mismatch (the file was changed or damaged)");
  }
  Manifest m;
  int64_t n = 0;
  constexpr int64_t kIntMin = std::numeric_limits<int>::min();
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();
  constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
  RETURN_IF_ERROR(GetString(j, where, "", "job", &m.job_id));
  RETURN_IF_ERROR(GetString(j, where, "", "global_job_id", &m.global_job_id));
  RETURN_IF_ERROR(GetInt(j, where, "", "node", kIntMin, kIntMax, &n));
  m.node = static_cast<int>(n);
  RETURN_IF_ERROR(GetInt(j, where, "", "nodes", kIntMin, kIntMax, &n));
  m.nodes = static_cast<int>(n);
  std::string mode_name;
  RETURN_IF_ERROR(GetString(j, where, "", "mode", &mode_name));
  auto mode = ParseJobMode(mode_name);
  if (!mode.ok()) return Damaged(where, absl::StrCat("key 'mode': ", mode.status().message()));
  m.mode = *mode;
  RETURN_IF_ERROR(GetInt(j, where, "", "step", 0, kInt64Max, &m.step));
  RETURN_IF_ERROR(GetInt(j, where, "", "generation", kInt64Min, kInt64Max, &m.generation));
  RETURN_IF_ERROR(GetString(j, where, "", "payload", &m.payload));
  RETURN_IF_ERROR(GetUnsigned(j, where, "", "payload_bytes", &m.payload_bytes));
  if (m.mode == JobMode::kApply) {
    const auto steps = j.find("tensor_steps");
    if (steps == j.end() || !steps->is_object()) {
      return BadKey(j, where, "", "tensor_steps", "an object of step counts");
    }
    for (const auto& [tensor, step] : steps->items()) {
      int64_t v = 0;
      RETURN_IF_ERROR(GetInt(*steps, where, "tensor_steps.", tensor, kInt64Min, kInt64Max, &v));
      m.tensor_steps[tensor] = v;
    }
  }
  const auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_array()) return BadKey(j, where, "", "tensors", "a list");
  if (!NameOk(m.payload)) {
    return Damaged(where, "key 'payload' must be a file name of the same directory");
  }
  for (size_t i = 0; i < tensors->size(); ++i) {
    Array a;
    RETURN_IF_ERROR(ParseArray((*tensors)[i], where, i, &a));
    m.arrays.push_back(std::move(a));
  }
  RETURN_IF_ERROR(CheckManifest(m, where, PayloadHeader(m).size()));
  return m;
}

}  // namespace muond::common::state_export
