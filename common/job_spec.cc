// job.json parsing and writing, and what a JobSpec derives from its fields. Parsing checks types
// and field names (so a typo such as "momentun" is an error rather than a silent default); the
// values are checked by ValidateJobSpec (job_spec_validate.cc).
#include "common/job_spec.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/job_spec_json.h"
#include "common/json_depth.h"
#include "common/layout.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace muond::common {
namespace {

using json_fields::CheckKnownFields;
using json_fields::FieldError;
using json_fields::Json;
using json_fields::ReadEnum;
using json_fields::ReadInt;
using json_fields::ReadInt64;
using json_fields::ReadString;

absl::Status ParseMuon(const Json& muon, MuonConfig* config) {
  if (!muon.is_object()) return FieldError("muon", "expected an object");
  RETURN_IF_ERROR(CheckKnownFields(
      muon, "muon.",
      {"momentum", "nesterov", "ns_method", "ns_steps", "compute_dtype", "scale_mode",
       "fp32_iterations"}));
  if (const auto it = muon.find("momentum"); it != muon.end()) {
    if (!it->is_number()) return FieldError("muon.momentum", "expected a number");
    config->momentum = it->get<double>();
  }
  if (const auto it = muon.find("nesterov"); it != muon.end()) {
    if (!it->is_boolean()) return FieldError("muon.nesterov", "expected true or false");
    config->nesterov = it->get<bool>();
  }
  RETURN_IF_ERROR(ReadEnum(muon, "ns_method", "muon.ns_method", ParseNsMethod, &config->ns_method));
  RETURN_IF_ERROR(ReadInt(muon, "ns_steps", "muon.ns_steps", &config->ns_steps));
  RETURN_IF_ERROR(
      ReadInt(muon, "fp32_iterations", "muon.fp32_iterations", &config->fp32_iterations));
  RETURN_IF_ERROR(
      ReadEnum(muon, "compute_dtype", "muon.compute_dtype", ParseDType, &config->compute_dtype));
  return ReadEnum(muon, "scale_mode", "muon.scale_mode", ParseScaleMode, &config->scale_mode);
}

absl::Status ParseMatrix(const Json& matrix, const std::string& path, MatrixSpec* spec) {
  if (!matrix.is_object()) return FieldError(path, "expected an object");
  RETURN_IF_ERROR(CheckKnownFields(matrix, path + ".", {"name", "shape", "num_heads", "dtype",
                                                       "optimizer", "group", "param_dtype",
                                                       "rows"}));
  if (matrix.find("name") == matrix.end()) return FieldError(path + ".name", "missing");
  RETURN_IF_ERROR(ReadString(matrix, "name", path + ".name", &spec->name));
  const auto shape = matrix.find("shape");
  if (shape == matrix.end()) return FieldError(path + ".shape", "missing");
  bool shape_ok = shape->is_array();
  if (shape_ok) {
    for (const Json& d : *shape) {
      // Unsigned in nlohmann means non-negative; dims beyond int64 are refused as well.
      if (!d.is_number_unsigned() || d.get<uint64_t>() == 0 ||
          d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        shape_ok = false;
        break;
      }
      spec->shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    }
  }
  if (!shape_ok) return FieldError(path + ".shape", "expected an array of positive integers");
  RETURN_IF_ERROR(ReadInt64(matrix, "num_heads", path + ".num_heads", &spec->num_heads));
  RETURN_IF_ERROR(ReadEnum(matrix, "dtype", path + ".dtype", ParseDType, &spec->dtype));
  RETURN_IF_ERROR(json_fields::ParseTensorRowsField(matrix, path, spec));
  return json_fields::ParseTensorApplyFields(matrix, path, spec);
}

// "layout": [[{"matrix": name, "offset": n, "length": n}, ...] per rank]
absl::Status ParseLayout(const Json& layout, const std::vector<MatrixSpec>& matrices,
                         std::vector<std::vector<LayoutSpan>>* out) {
  if (!layout.is_array() || layout.empty()) {
    return FieldError("layout", "expected a non-empty array with one array of spans per rank");
  }
  for (size_t r = 0; r < layout.size(); ++r) {
    const std::string rpath = absl::StrCat("layout[", r, "]");
    if (!layout[r].is_array()) return FieldError(rpath, "expected an array of spans");
    std::vector<LayoutSpan> spans;
    for (size_t i = 0; i < layout[r].size(); ++i) {
      const Json& j = layout[r][i];
      const std::string path = absl::StrCat(rpath, "[", i, "]");
      if (!j.is_object()) return FieldError(path, "expected an object");
      RETURN_IF_ERROR(CheckKnownFields(j, path + ".", {"matrix", "offset", "length"}));
      std::string name;
      if (j.find("matrix") == j.end()) return FieldError(path + ".matrix", "missing");
      RETURN_IF_ERROR(ReadString(j, "matrix", path + ".matrix", &name));
      auto m = std::find_if(matrices.begin(), matrices.end(),
                            [&](const MatrixSpec& ms) { return ms.name == name; });
      if (m == matrices.end()) {
        return FieldError(path + ".matrix", absl::StrCat("no matrix named '", name, "'"));
      }
      int64_t offset = -1, length = -1;
      RETURN_IF_ERROR(ReadInt64(j, "offset", path + ".offset", &offset));
      RETURN_IF_ERROR(ReadInt64(j, "length", path + ".length", &length));
      if (offset < 0) return FieldError(path + ".offset", "expected an integer >= 0");
      if (length < 1) return FieldError(path + ".length", "expected an integer >= 1");
      spans.push_back({static_cast<uint32_t>(m - matrices.begin()), static_cast<uint64_t>(offset),
                       static_cast<uint64_t>(length)});
    }
    out->push_back(std::move(spans));
  }
  return absl::OkStatus();
}

}  // namespace

std::string_view NsMethodName(NsMethod m) {
  switch (m) {
    case NsMethod::kStandard:
      return "standard";
    case NsMethod::kGram:
      return "gram";
    case NsMethod::kPolarExpress:
      return "polar_express";
  }
  return "unknown";
}

absl::StatusOr<NsMethod> ParseNsMethod(std::string_view name) {
  if (name == "standard") return NsMethod::kStandard;
  if (name == "gram") return NsMethod::kGram;
  if (name == "polar_express") return NsMethod::kPolarExpress;
  return absl::InvalidArgumentError(absl::StrCat("unknown ns_method '", std::string(name),
                                                 "' (accepted: standard, gram, polar_express)"));
}

std::string_view ScaleModeName(ScaleMode m) {
  switch (m) {
    case ScaleMode::kOriginal:
      return "original";
    case ScaleMode::kMatchRmsAdamw:
      return "match_rms_adamw";
    case ScaleMode::kNone:
      return "none";
  }
  return "unknown";
}

absl::StatusOr<ScaleMode> ParseScaleMode(std::string_view name) {
  if (name == "original") return ScaleMode::kOriginal;
  if (name == "match_rms_adamw") return ScaleMode::kMatchRmsAdamw;
  if (name == "none") return ScaleMode::kNone;
  return absl::InvalidArgumentError(absl::StrCat("unknown scale_mode '", std::string(name),
                                                 "' (accepted: original, match_rms_adamw, none)"));
}

int64_t MatrixSpec::numel() const {
  // Saturates instead of overflowing, so an unvalidated spec cannot wrap to a small size.
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return std::numeric_limits<int64_t>::max();
  }
  return n;
}

namespace {

// The job-level run options: budgets, checkpoints, timeouts, buffers, probe, non-finite policy.
absl::Status ParseRunFields(const Json& root, JobSpec* out) {
  JobSpec& spec = *out;
  int64_t budget = 0;
  RETURN_IF_ERROR(ReadInt64(root, "gather_budget_bytes", "gather_budget_bytes", &budget));
  if (budget < 0) return FieldError("gather_budget_bytes", "expected an integer >= 0");
  spec.gather_budget_bytes = static_cast<uint64_t>(budget);
  int64_t window = 0;
  RETURN_IF_ERROR(ReadInt64(root, "step_window_bytes", "step_window_bytes", &window));
  if (window < 0) return FieldError("step_window_bytes", "expected an integer >= 0");
  spec.step_window_bytes = static_cast<uint64_t>(window);
  int64_t every = 0;
  RETURN_IF_ERROR(ReadInt64(root, "checkpoint_every_steps", "checkpoint_every_steps", &every));
  if (every < 0) return FieldError("checkpoint_every_steps", "expected an integer >= 0");
  spec.checkpoint_every_steps = static_cast<uint64_t>(every);
  RETURN_IF_ERROR(ReadInt(root, "checkpoint_keep", "checkpoint_keep", &spec.checkpoint_keep));
  RETURN_IF_ERROR(
      ReadInt(root, "step_timeout_seconds", "step_timeout_seconds", &spec.step_timeout_seconds));
  RETURN_IF_ERROR(ReadInt(root, "step_buffers", "step_buffers", &spec.step_buffers));
  if (const auto it = root.find("transport_probe"); it != root.end()) {
    if (!it->is_boolean()) return FieldError("transport_probe", "expected true or false");
    spec.transport_probe = it->get<bool>();
  }
  if (const auto it = root.find("nonfinite"); it != root.end()) {
    if (!it->is_string() || (*it != "refuse" && *it != "skip")) {
      return FieldError("nonfinite", "expected \"refuse\" or \"skip\"");
    }
    spec.nonfinite_skip = *it == "skip";
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<JobSpec> ParseJobSpecJson(std::string_view json) {
  bool too_deep = false;
  const Json root = ParseJsonWithDepthLimit<Json>(json, &too_deep);
  if (root.is_discarded()) return absl::InvalidArgumentError("job.json: not valid JSON");
  if (too_deep) {
    return absl::InvalidArgumentError(
        absl::StrCat("job.json: nested deeper than ", kMaxJsonDepth, " levels"));
  }
  if (!root.is_object()) return absl::InvalidArgumentError("job.json: expected a JSON object");
  RETURN_IF_ERROR(
      CheckKnownFields(root, "", {"job_id", "world_size", "zero_stage", "muon", "matrices", "layout",
                                   "gather_budget_bytes", "step_window_bytes", "transport_probe",
                                   "checkpoint_every_steps", "checkpoint_keep",
                                   "step_timeout_seconds", "step_buffers", "mode", "tensors",
                                   "groups", "adamw", "max_grad_norm", "init_from", "multinode",
                                   "nonfinite", "qk_clip", "state"}));

  JobSpec spec;
  if (root.find("job_id") == root.end()) return FieldError("job_id", "missing");
  RETURN_IF_ERROR(ReadString(root, "job_id", "job_id", &spec.job_id));
  RETURN_IF_ERROR(ReadInt(root, "world_size", "world_size", &spec.world_size));
  RETURN_IF_ERROR(ReadInt(root, "zero_stage", "zero_stage", &spec.zero_stage));
  if (const auto it = root.find("muon"); it != root.end()) {
    RETURN_IF_ERROR(ParseMuon(*it, &spec.muon));
  }
  RETURN_IF_ERROR(json_fields::ParseApplyFields(root, &spec));
  RETURN_IF_ERROR(json_fields::ParseMultiNodeField(root, &spec));
  RETURN_IF_ERROR(json_fields::ParseQkClipField(root, &spec));
  RETURN_IF_ERROR(json_fields::ParseStateField(root, &spec));
  // "tensors" (apply mode's name) or "matrices": one of the two.
  const char* key = root.find("tensors") != root.end() ? "tensors" : "matrices";
  if (root.find("tensors") != root.end() && root.find("matrices") != root.end()) {
    return FieldError("tensors", "give \"tensors\" or \"matrices\", not both");
  }
  const auto matrices = root.find(key);
  if (matrices == root.end()) return FieldError("matrices", "missing");
  if (!matrices->is_array()) return FieldError(key, "expected an array");
  for (size_t i = 0; i < matrices->size(); ++i) {
    MatrixSpec m;
    RETURN_IF_ERROR(ParseMatrix((*matrices)[i], absl::StrCat(key, "[", i, "]"), &m));
    spec.matrices.push_back(std::move(m));
  }
  FillApplyDefaults(&spec);
  RETURN_IF_ERROR(ParseRunFields(root, &spec));
  if (const auto it = root.find("layout"); it != root.end()) {
    RETURN_IF_ERROR(ParseLayout(*it, spec.matrices, &spec.explicit_layout));
    if (root.find("world_size") == root.end()) {
      spec.world_size = static_cast<int>(spec.explicit_layout.size());
    }
  }
  if (absl::Status s = ValidateJobSpec(spec); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("job.json: ", s.message()));
  }
  return spec;
}

std::string JobSpecToJson(const JobSpec& spec) {
  Json root = Json::object();
  root["job_id"] = spec.job_id;
  root["world_size"] = spec.world_size;
  root["zero_stage"] = spec.zero_stage;
  root["muon"] = {{"momentum", spec.muon.momentum},
                  {"nesterov", spec.muon.nesterov},
                  {"ns_method", NsMethodName(spec.muon.ns_method)},
                  {"ns_steps", spec.muon.ns_steps},
                  {"compute_dtype", DTypeName(spec.muon.compute_dtype)},
                  {"scale_mode", ScaleModeName(spec.muon.scale_mode)}};
  // Written only when set, so the specs of jobs that do not use it read as before.
  if (spec.muon.fp32_iterations != 0) root["muon"]["fp32_iterations"] = spec.muon.fp32_iterations;
  Json matrices = Json::array();
  for (const MatrixSpec& m : spec.matrices) {
    matrices.push_back({{"name", m.name},
                        {"shape", m.shape},
                        {"num_heads", m.num_heads},
                        {"dtype", DTypeName(m.dtype)}});
    json_fields::WriteTensorRowsField(m, &matrices.back());
  }
  root["matrices"] = std::move(matrices);
  root["gather_budget_bytes"] = spec.gather_budget_bytes;
  // Written only when set, so the specs of jobs that do not use it read as before.
  if (spec.step_window_bytes != 0) root["step_window_bytes"] = spec.step_window_bytes;
  root["transport_probe"] = spec.transport_probe;
  // Written only when set, so the specs of jobs that do not use it read as before.
  if (spec.nonfinite_skip) root["nonfinite"] = "skip";
  root["checkpoint_every_steps"] = spec.checkpoint_every_steps;
  root["checkpoint_keep"] = spec.checkpoint_keep;
  root["step_timeout_seconds"] = spec.step_timeout_seconds;
  root["step_buffers"] = spec.step_buffers;
  if (!spec.explicit_layout.empty()) {
    Json layout = Json::array();
    for (const auto& rank : spec.explicit_layout) {
      Json spans = Json::array();
      for (const LayoutSpan& s : rank) {
        spans.push_back({{"matrix", s.matrix < spec.matrices.size() ? spec.matrices[s.matrix].name
                                                                    : std::string()},
                         {"offset", s.offset},
                         {"length", s.length}});
      }
      layout.push_back(std::move(spans));
    }
    root["layout"] = std::move(layout);
  }
  json_fields::WriteApplyFields(spec, &root);
  json_fields::WriteMultiNodeField(spec, &root);
  json_fields::WriteQkClipField(spec, &root);
  json_fields::WriteStateField(spec, &root);
  // `replace` keeps this total for unvalidated specs (invalid UTF-8 in a name becomes U+FFFD);
  // a validated spec has none.
  return root.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

uint64_t JobSpec::StateBytesOf(const MatrixSpec& m) const {
  const uint64_t n = static_cast<uint64_t>(m.numel());
  if (mode != JobMode::kApply) return StoredStateBytes(state.momentum, n);
  if (m.optimizer == Optimizer::kAdamW) return 4 * n + 2 * StoredStateBytes(state.adamw, n);
  return 4 * n + StoredStateBytes(state.momentum, n);
}

absl::StatusOr<std::vector<uint8_t>> PresenceMask(const JobSpec& spec,
                                                  const std::vector<uint32_t>& absent) {
  std::vector<uint8_t> mask(absent.empty() ? 0 : spec.matrices.size(), 0);
  for (const uint32_t t : absent) {
    if (t >= mask.size()) {
      return absl::InvalidArgumentError(absl::StrCat("absent tensor index ", t, " of a job with ",
                                                     spec.matrices.size(), " tensors"));
    }
    if (mask[t] != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", spec.matrices[t].name, "' is named absent twice"));
    }
    mask[t] = 1;
  }
  return mask;
}

}  // namespace muond::common
