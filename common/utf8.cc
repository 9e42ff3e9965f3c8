#include "common/utf8.h"

#include <cstddef>
#include <cstdint>

namespace muond::common {

bool IsValidUtf8(std::string_view s) {
  static constexpr uint32_t kMinForLength[] = {0, 0, 0x80, 0x800, 0x10000};
  size_t i = 0;
  while (i < s.size()) {
    const auto lead = static_cast<unsigned char>(s[i]);
    size_t len;
    uint32_t cp;
    if (lead < 0x80) {
      ++i;
      continue;
    } else if ((lead & 0xE0) == 0xC0) {
      len = 2, cp = lead & 0x1F;
    } else if ((lead & 0xF0) == 0xE0) {
      len = 3, cp = lead & 0x0F;
    } else if ((lead & 0xF8) == 0xF0) {
      len = 4, cp = lead & 0x07;
    } else {
      return false;
    }
    if (len > s.size() - i) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto cont = static_cast<unsigned char>(s[i + k]);
      if ((cont & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cont & 0x3F);
    }
    if (cp < kMinForLength[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

}  // namespace muond::common
