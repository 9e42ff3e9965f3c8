// How a job holds its optimizer state (job.json "state"): the dtypes' names, the block, its
// canonical JSON and its rules.
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/job_spec_json.h"

namespace muond::common {

std::string_view StateDTypeName(StateDType d) {
  switch (d) {
    case StateDType::kFloat32:
      return "float32";
    case StateDType::kBFloat16:
      return "bfloat16";
    case StateDType::kInt8:
      return "int8";
  }
  return "?";
}

absl::StatusOr<StateDType> ParseStateDType(std::string_view name) {
  for (StateDType d : {StateDType::kFloat32, StateDType::kBFloat16, StateDType::kInt8}) {
    if (name == StateDTypeName(d)) return d;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown state dtype '", std::string(name),
                   "' (expected \"float32\", \"bfloat16\" or \"int8\")"));
}

namespace json_fields {

absl::Status ParseStateField(const Json& root, JobSpec* spec) {
  const auto it = root.find("state");
  if (it == root.end()) return absl::OkStatus();
  if (!it->is_object()) return FieldError("state", "expected an object");
  RETURN_IF_ERROR(CheckKnownFields(*it, "state.", {"momentum_dtype", "adamw_dtype"}));
  for (const auto& [key, out] :
       {std::pair<const char*, StateDType*>{"momentum_dtype", &spec->state.momentum},
        {"adamw_dtype", &spec->state.adamw}}) {
    const auto field = it->find(key);
    if (field == it->end()) continue;
    const std::string path = absl::StrCat("state.", key);
    if (!field->is_string()) return FieldError(path, "expected a string");
    auto dtype = ParseStateDType(field->get<std::string>());
    if (!dtype.ok()) return FieldError(path, dtype.status().message());
    *out = *dtype;
  }
  return absl::OkStatus();
}

void WriteStateField(const JobSpec& spec, Json* root) {
  if (!spec.state.compressed()) return;  // the specs of fp32 jobs read as before
  (*root)["state"] = {{"momentum_dtype", StateDTypeName(spec.state.momentum)},
                      {"adamw_dtype", StateDTypeName(spec.state.adamw)}};
}

}  // namespace json_fields

absl::Status ValidateStateStorage(const JobSpec& spec) {
  if (!spec.state.compressed()) return absl::OkStatus();
  if (spec.transport_probe) {
    return absl::InvalidArgumentError(
        "state: a transport probe holds no optimizer state; leave state.momentum_dtype and "
        "state.adamw_dtype at \"float32\"");
  }
  if (spec.mode != JobMode::kApply && spec.state.adamw != StateDType::kFloat32) {
    return absl::InvalidArgumentError(
        absl::StrCat("state.adamw_dtype \"", std::string(StateDTypeName(spec.state.adamw)),
                     "\": an update-mode job holds no AdamW moments (only apply mode does)"));
  }
  return absl::OkStatus();
}

}  // namespace muond::common
