// The typed reads of job.json fields shared by job_spec.cc and job_spec_apply.cc: every error is
// INVALID_ARGUMENT "job.json: <path>: <problem>". Internal to common/.
#ifndef MUOND_COMMON_JOB_SPEC_JSON_H_
#define MUOND_COMMON_JOB_SPEC_JSON_H_

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace muond::common::json_fields {

using Json = nlohmann::ordered_json;

inline absl::Status FieldError(absl::string_view path, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("job.json: ", path, ": ", problem));
}

inline absl::Status CheckKnownFields(const Json& object, absl::string_view prefix,
                                     std::initializer_list<std::string_view> known) {
  for (const auto& [key, value] : object.items()) {
    bool found = false;
    for (std::string_view k : known) found = found || key == k;
    if (!found) {
      return absl::InvalidArgumentError(
          absl::StrCat("job.json: unknown field '", prefix, key, "'"));
    }
  }
  return absl::OkStatus();
}

// Each Read* leaves *out unchanged when the field is absent (the default applies).
inline absl::Status ReadString(const Json& object, const char* key, absl::string_view path,
                               std::string* out) {
  const auto it = object.find(key);
  if (it == object.end()) return absl::OkStatus();
  if (!it->is_string()) return FieldError(path, "expected a string");
  *out = it->get<std::string>();
  return absl::OkStatus();
}

inline absl::Status ReadInt64(const Json& object, const char* key, absl::string_view path,
                              int64_t* out) {
  const auto it = object.find(key);
  if (it == object.end()) return absl::OkStatus();
  if (it->is_number_unsigned()) {
    const uint64_t v = it->get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return FieldError(path, absl::StrCat(v, " is out of range"));
    }
    *out = static_cast<int64_t>(v);
    return absl::OkStatus();
  }
  if (!it->is_number_integer()) return FieldError(path, "expected an integer");
  *out = it->get<int64_t>();
  return absl::OkStatus();
}

inline absl::Status ReadInt(const Json& object, const char* key, absl::string_view path, int* out) {
  int64_t v = *out;
  RETURN_IF_ERROR(ReadInt64(object, key, path, &v));
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
    return FieldError(path, absl::StrCat(v, " is out of range"));
  }
  *out = static_cast<int>(v);
  return absl::OkStatus();
}

// Reads an enum-valued string field through its parser, e.g. ParseNsMethod.
template <typename T, typename ParseFn>
inline absl::Status ReadEnum(const Json& object, const char* key, absl::string_view path,
                             ParseFn parse, T* out) {
  if (object.find(key) == object.end()) return absl::OkStatus();
  std::string name;
  RETURN_IF_ERROR(ReadString(object, key, path, &name));
  auto value = parse(name);
  if (!value.ok()) return FieldError(path, value.status().message());
  *out = *value;
  return absl::OkStatus();
}

// A finite number.
inline absl::Status ReadDouble(const Json& object, const char* key, absl::string_view path,
                               double* out) {
  const auto it = object.find(key);
  if (it == object.end()) return absl::OkStatus();
  if (!it->is_number()) return FieldError(path, "expected a number");
  *out = it->get<double>();
  return absl::OkStatus();
}

}  // namespace muond::common::json_fields

namespace muond::common {
struct JobSpec;
struct MatrixSpec;
namespace json_fields {
// Apply mode (job_spec_apply.cc): the job-level fields of `root` (mode, groups, adamw,
// max_grad_norm, init_from), a tensor's (optimizer, group, param_dtype), and their canonical JSON.
absl::Status ParseApplyFields(const Json& root, JobSpec* spec);
absl::Status ParseTensorApplyFields(const Json& tensor, const std::string& path, MatrixSpec* spec);
void WriteApplyFields(const JobSpec& spec, Json* root);
// QK-Clip (job_spec_qk_clip.cc): the "qk_clip" block, written only when it has pairs.
absl::Status ParseQkClipField(const Json& root, JobSpec* spec);
void WriteQkClipField(const JobSpec& spec, Json* root);
// Many nodes (job_spec_multinode.cc): the "multinode" block, written only when present.
absl::Status ParseMultiNodeField(const Json& root, JobSpec* spec);
void WriteMultiNodeField(const JobSpec& spec, Json* root);
// How the state is held (job_spec_state.cc): the "state" block, written only when compressed.
absl::Status ParseStateField(const Json& root, JobSpec* spec);
void WriteStateField(const JobSpec& spec, Json* root);
// A tensor's "rows" (rows of a tensor split across nodes), written only when present.
absl::Status ParseTensorRowsField(const Json& tensor, const std::string& path, MatrixSpec* spec);
void WriteTensorRowsField(const MatrixSpec& m, Json* tensor);
}  // namespace json_fields
}  // namespace muond::common

#endif  // MUOND_COMMON_JOB_SPEC_JSON_H_
