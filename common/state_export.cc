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

absl::Status ParseArray(const Json& t, const std::string& where, size_t i, Array* a) {
  const std::string at = absl::StrCat(where, ": tensors[", i, "]");
  if (!t.is_object() || !t.contains("name") || !t["name"].is_string() || !t.contains("tensor") ||
      !t["tensor"].is_string() || !t.contains("shape") || !t["shape"].is_array() ||
      !t.contains("data_offsets") || !t["data_offsets"].is_array() ||
      t["data_offsets"].size() != 2 || !t.contains("crc32c") || !t["crc32c"].is_number_unsigned() ||
      t.value("dtype", "") != "float32") {
    return Damaged(at, "needs name, tensor, dtype \"float32\", shape, data_offsets, crc32c");
  }
  a->name = t["name"].get<std::string>();
  a->tensor = t["tensor"].get<std::string>();
  uint64_t numel = 1;
  for (const Json& d : t["shape"]) {
    if (!d.is_number_integer() || d.get<int64_t>() <= 0 ||
        numel >
            std::numeric_limits<uint64_t>::max() / 8 / static_cast<uint64_t>(d.get<int64_t>())) {
      return Damaged(at, absl::StrCat("tensor '", a->name, "': bad shape ", t["shape"].dump()));
    }
    a->shape.push_back(d.get<int64_t>());
    numel *= static_cast<uint64_t>(d.get<int64_t>());
  }
  for (const Json& o : t["data_offsets"]) {
    if (!o.is_number_unsigned()) return Damaged(at, "data_offsets are not offsets");
  }
  a->begin = t["data_offsets"][0].get<uint64_t>();
  a->end = t["data_offsets"][1].get<uint64_t>();
  if (t["crc32c"].get<uint64_t>() > 0xffffffffu) return Damaged(at, "crc32c beyond 32 bits");
  a->crc32c = static_cast<uint32_t>(t["crc32c"].get<uint64_t>());
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

uint64_t ArrayBytes(const Array& a) { return a.numel() * sizeof(float); }

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
    header[a.name] = {{"dtype", "F32"}, {"shape", a.shape}, {"data_offsets", {a.begin, a.end}}};
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
                            {"dtype", "float32"},
                            {"shape", a.shape},
                            {"data_offsets", {a.begin, a.end}},
                            {"crc32c", a.crc32c}});
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
  if (j.value("format", "") != kFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": not a muond state export (format is not \"", kFormat, "\")"));
  }
  if (!j.contains("format_version") || j["format_version"] != kFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": format_version is not ", kFormatVersion));
  }
  if (!j.contains("checksum") || !j["checksum"].is_number_unsigned() ||
      j["checksum"].get<uint64_t>() != Checksum(j)) {
    return Damaged(where, "manifest checksum mismatch (the file was changed or damaged)");
  }
  Manifest m;
  try {
    m.job_id = j.at("job").get<std::string>();
    m.global_job_id = j.at("global_job_id").get<std::string>();
    m.node = j.at("node").get<int>();
    m.nodes = j.at("nodes").get<int>();
    auto mode = ParseJobMode(j.at("mode").get<std::string>());
    if (!mode.ok()) return Damaged(where, std::string(mode.status().message()));
    m.mode = *mode;
    m.step = j.at("step").get<int64_t>();
    m.generation = j.at("generation").get<int64_t>();
    m.payload = j.at("payload").get<std::string>();
    m.payload_bytes = j.at("payload_bytes").get<uint64_t>();
    if (m.mode == JobMode::kApply) {
      m.tensor_steps = j.at("tensor_steps").get<std::map<std::string, int64_t>>();
    }
    if (!j.at("tensors").is_array()) return Damaged(where, "tensors is not a list");
  } catch (const Json::exception& e) {
    return Damaged(where, absl::StrCat("a field is missing or of the wrong type (", e.what(), ")"));
  }
  if (!NameOk(m.payload) || m.step < 0) {
    return Damaged(where, "payload must be a file name of the same directory, step >= 0");
  }
  for (size_t i = 0; i < j["tensors"].size(); ++i) {
    Array a;
    RETURN_IF_ERROR(ParseArray(j["tensors"][i], where, i, &a));
    m.arrays.push_back(std::move(a));
  }
  RETURN_IF_ERROR(CheckManifest(m, where, PayloadHeader(m).size()));
  return m;
}

}  // namespace muond::common::state_export
