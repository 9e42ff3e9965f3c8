#include "common/names.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/utf8.h"

#include <algorithm>

namespace muond::common {
namespace {

bool IsIdHead(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

bool IsIdChar(char c) { return IsIdHead(c) || c == '.' || c == '_' || c == '-'; }

}  // namespace

std::string Quoted(absl::string_view value) {
  std::string out = "'";
  const size_t n = std::min(value.size(), kMaxQuotedBytes);
  // Bytes of invalid UTF-8 are escaped too: the message must stay valid text.
  const bool utf8 = IsValidUtf8(std::string_view(value.data(), value.size()));
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c == 0x7f || c == '\\' || c == '\'' || (c >= 0x80 && !utf8)) {
      absl::StrAppendFormat(&out, "\\x%02x", c);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  out.push_back('\'');
  if (value.size() > n) absl::StrAppend(&out, "... (", value.size(), " bytes)");
  return out;
}

absl::Status ValidateJobId(absl::string_view id, absl::string_view field) {
  if (id.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " is empty"));
  if (id.size() > kMaxJobIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, " ", Quoted(id), " is longer than ",
                                                   kMaxJobIdBytes, " bytes"));
  }
  bool ok = IsIdHead(id[0]);
  for (char c : id) ok = ok && IsIdChar(c);
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " ", Quoted(id),
        " must match [A-Za-z0-9][A-Za-z0-9._-]{0,127} (a letter or digit first, no '/')"));
  }
  return absl::OkStatus();
}

absl::Status ValidateTensorName(absl::string_view name, absl::string_view field) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " is empty"));
  if (name.size() > kMaxTensorNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, " ", Quoted(name), " is longer than ",
                                                   kMaxTensorNameBytes, " bytes"));
  }
  if (!IsValidUtf8(std::string_view(name.data(), name.size()))) {
    return absl::InvalidArgumentError(absl::StrCat(field, " ", Quoted(name), " is not UTF-8"));
  }
  for (char c : name) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " ", Quoted(name), " holds a control character"));
    }
  }
  return absl::OkStatus();
}

}  // namespace muond::common
