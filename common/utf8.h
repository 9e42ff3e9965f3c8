// UTF-8 validation for names that end up in JSON (safetensors headers, job.json): the JSON
// serializer cannot represent invalid UTF-8, so such names are refused where they enter.
#ifndef MUOND_COMMON_UTF8_H_
#define MUOND_COMMON_UTF8_H_

#include <string_view>

namespace muond::common {

// True when `s` is well-formed UTF-8: shortest encodings only, no surrogates, at most U+10FFFF.
bool IsValidUtf8(std::string_view s);

}  // namespace muond::common

#endif  // MUOND_COMMON_UTF8_H_
