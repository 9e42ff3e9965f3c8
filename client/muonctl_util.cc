#include "client/muonctl_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace muond::client {

absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string msg = absl::StrCat(what, " ", path, ": ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::PermissionDeniedError(msg);
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status WriteTokenFile(const std::string& path, const std::string& token) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("token file ", path, ": ", std::strerror(errno)));
  }
  ::fchmod(fd, 0600);
  const std::string line = token + "\n";
  const bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) &&
                  ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) {
    return absl::InternalError(absl::StrCat("token file ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Token(const Args& a) {
  auto it = a.flags.find("token-file");
  if (it != a.flags.end()) {
    ASSIGN_OR_RETURN(std::string text, ReadFile(it->second, "token file"));
    return std::string(absl::StripAsciiWhitespace(text));
  }
  const char* env = std::getenv("MUOND_JOB_TOKEN");
  return env == nullptr ? std::string() : std::string(env);
}

absl::StatusOr<int64_t> IntFlag(const Args& a, const std::string& name) {
  auto it = a.flags.find(name);
  int64_t v = 0;
  if (it == a.flags.end() || !absl::SimpleAtoi(it->second, &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " needs an integer"));
  }
  return v;
}

}  // namespace muond::client
