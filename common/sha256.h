// SHA-256 (OpenSSL's libcrypto): the daemon stores job tokens only as their hash.
#ifndef MUOND_COMMON_SHA256_H_
#define MUOND_COMMON_SHA256_H_

#include <string>
#include <string_view>

namespace muond::common {

// The 32-byte digest of `data`.
std::string Sha256(std::string_view data);

}  // namespace muond::common

#endif  // MUOND_COMMON_SHA256_H_
