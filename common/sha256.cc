#include "common/sha256.h"

#include <openssl/evp.h>

#include <cstdlib>

namespace muond::common {

std::string Sha256(std::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // EVP_Digest fails only on allocation failure inside OpenSSL.
  if (EVP_Digest(data.data(), data.size(), digest, &len, EVP_sha256(), nullptr) != 1) std::abort();
  return std::string(reinterpret_cast<const char*>(digest), len);
}

}  // namespace muond::common
