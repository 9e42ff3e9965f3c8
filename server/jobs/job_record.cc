#include "server/jobs/job_record.h"

#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/json_depth.h"
#include "common/names.h"
#include "nlohmann/json.hpp"

namespace muond::server {
namespace {

using Json = nlohmann::json;

// What a value is, for a message: its JSON, cut to 40 characters.
std::string Shown(const Json& v) {
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

absl::Status Damaged(const std::string& path, const std::string& what) {
  return absl::DataLossError(absl::StrCat(path, ": ", what));
}

// "key 'K' is V, not WANT" (or "has no key 'K' (WANT)" when it is missing).
absl::Status BadKey(const std::string& path, const Json& object, const std::string& key,
                    const std::string& want) {
  const auto it = object.find(key.substr(key.rfind('.') + 1));
  if (it == object.end()) return Damaged(path, absl::StrCat("has no key '", key, "' (", want, ")"));
  return Damaged(path, absl::StrCat("key '", key, "' is ", Shown(*it), ", not ", want));
}

// The JSON object of `text`, or DATA_LOSS naming `path`.
absl::StatusOr<Json> ParseObject(std::string_view text, const std::string& path) {
  bool too_deep = false;
  Json j = common::ParseJsonWithDepthLimit<Json>(text, &too_deep);
  if (too_deep) {
    return Damaged(path, absl::StrCat("nested deeper than ", common::kMaxJsonDepth, " levels"));
  }
  if (j.is_discarded() || !j.is_object()) return Damaged(path, "not a JSON object");
  return j;
}

// The member `key` of `object` when it is the string `want`.
bool IsString(const Json& object, const char* key, const char* want) {
  const auto it = object.find(key);
  return it != object.end() && it->is_string() && it->get_ref<const std::string&>() == want;
}

// The member `key` of `object` when it is an integer in [lo, hi].
bool IntegerIn(const Json& object, const char* key, int64_t lo, int64_t hi, int64_t* out) {
  const auto it = object.find(key);
  if (it == object.end()) return false;
  if (it->is_number_unsigned()) {
    const uint64_t v = it->get<uint64_t>();
    if (v > static_cast<uint64_t>(hi)) return false;
    *out = static_cast<int64_t>(v);
  } else if (it->is_number_integer()) {
    *out = it->get<int64_t>();
  } else {
    return false;
  }
  return *out >= lo && *out <= hi;
}

}  // namespace

absl::StatusOr<JobRecord> ParseJobRecord(std::string_view text, const std::string& path,
                                         const std::string& name) {
  auto parsed = ParseObject(text, path);
  if (!parsed.ok()) return parsed.status();
  const Json& record = *parsed;
  if (!IsString(record, "format", "muond-job")) {
    return BadKey(path, record, "format", "\"muond-job\" (not a muond job record)");
  }
  JobRecord r;
  const auto spec_it = record.find("spec");
  if (spec_it == record.end() || !spec_it->is_object()) {
    return BadKey(path, record, "spec", "a job spec (an object)");
  }
  auto spec =
      common::ParseJobSpecJson(spec_it->dump(-1, ' ', false, Json::error_handler_t::replace));
  if (!spec.ok()) {
    return Damaged(path, absl::StrCat("key 'spec': ", spec.status().message()));
  }
  if (spec->job_id != name) {
    return Damaged(path, absl::StrCat("key 'spec' names job ", common::Quoted(spec->job_id),
                                      ", its directory ", common::Quoted(name)));
  }
  r.spec = *std::move(spec);
  const auto hash = record.find("token_sha256");
  bool hex =
      hash != record.end() && hash->is_string() && hash->get_ref<const std::string&>().size() == 64;
  if (hex) {
    for (char c : hash->get_ref<const std::string&>()) hex = hex && absl::ascii_isxdigit(c);
  }
  if (!hex) return BadKey(path, record, "token_sha256", "64 hex digits");
  r.token_sha256 = absl::HexStringToBytes(hash->get_ref<const std::string&>());
  if (const auto owner = record.find("owner"); owner != record.end()) {
    if (!owner->is_object()) return BadKey(path, record, "owner", "an object");
    if (owner->contains("uid") &&
        !IntegerIn(*owner, "uid", -1, std::numeric_limits<uint32_t>::max(), &r.owner_uid)) {
      return BadKey(path, *owner, "owner.uid", "a uid (an integer; -1: none)");
    }
    if (const auto d = owner->find("description"); d != owner->end()) {
      if (!d->is_string()) return BadKey(path, *owner, "owner.description", "a string");
      r.owner_description = d->get<std::string>();
    }
  }
  return r;
}

absl::StatusOr<ResetRecord> ParseResetRecord(std::string_view text, const std::string& path) {
  auto parsed = ParseObject(text, path);
  if (!parsed.ok()) return parsed.status();
  const Json& j = *parsed;
  if (!IsString(j, "format", "muond-reset")) {
    return BadKey(path, j, "format", "\"muond-reset\" (not a muond reset record)");
  }
  ResetRecord r;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  if (!IntegerIn(j, "next_step", 0, kMax, &r.next_step)) {
    return BadKey(path, j, "next_step", "a step (an integer >= 0)");
  }
  if (!IntegerIn(j, "after_generation", 0, kMax, &r.after_generation)) {
    return BadKey(path, j, "after_generation", "a generation (an integer >= 0)");
  }
  return r;
}

}  // namespace muond::server
