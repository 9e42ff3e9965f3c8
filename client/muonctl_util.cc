#include "client/muonctl_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace muond::client {

namespace {

// The flags muonctl knows; the ones in kRepeatable may be given more than once.
// clang-format off
constexpr const char* kKnownFlags[] = {
    "address", "spec", "token-file", "job", "rank", "step", "grads", "out", "next-step",
    "transport", "json", "iterations", "interval", "metrics-address", "generation",
    "restore-from", "restore-token-file", "restore-generation", "restore-step",
    "tls-ca", "tls-cert", "tls-key", "params", "lr", "wd", "grad-divisor", "dtype", "dir",
    "import-dir", "max-logits"};
// clang-format on
constexpr const char* kRepeatable[] = {"lr", "wd"};

template <size_t N>
bool Contains(const char* const (&names)[N], const std::string& name) {
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

}  // namespace

absl::StatusOr<Args> ParseArgs(const std::vector<std::string>& argv) {
  Args a;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      a.help = true;
      return a;
    }
    if (arg == "--json") {  // the one flag without a value
      a.flags["json"] = "true";
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      a.words.push_back(arg);
      continue;
    }
    std::string key = arg.substr(2), value;
    const size_t eq = key.find('=');
    if (eq != std::string::npos) {
      value = key.substr(eq + 1);
      key.resize(eq);
    } else if (i + 1 < argv.size()) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value"));
    }
    if (!Contains(kKnownFlags, key)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown option --", key));
    }
    if (Contains(kRepeatable, key)) a.repeated[key].push_back(value);
    a.flags[key] = value;
  }
  return a;
}

absl::StatusOr<std::optional<StepHyper>> StepHyperFlags(const Args& a) {
  StepHyper hyper;
  bool any = false;
  for (auto [flag, values] : {std::pair{"lr", &hyper.lr}, std::pair{"wd", &hyper.weight_decay}}) {
    const auto it = a.repeated.find(flag);
    if (it == a.repeated.end()) continue;
    for (const std::string& v : it->second) {
      any = true;
      const size_t eq = v.rfind('=');
      double x = 0;
      if (eq == std::string::npos || eq == 0 || !absl::SimpleAtod(v.substr(eq + 1), &x)) {
        return absl::InvalidArgumentError(absl::StrCat("--", flag, " takes GROUP=VALUE (e.g. --",
                                                       flag, " muon=0.02), not '", v, "'"));
      }
      values->emplace_back(v.substr(0, eq), x);
    }
  }
  if (const auto it = a.flags.find("grad-divisor"); it != a.flags.end()) {
    any = true;
    if (!absl::SimpleAtod(it->second, &hyper.grad_divisor)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--grad-divisor takes a number, not '", it->second, "'"));
    }
  }
  if (!any) return std::nullopt;
  return hyper;
}

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
  // A fresh temporary name next to the target (O_EXCL|O_NOFOLLOW: nothing planted there is
  // opened), then rename(2), which replaces a symbolic link at `path` instead of following it.
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", attempt);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("token file ", path, ": cannot create ", tmp, ": ", std::strerror(errno)));
  }
  const std::string line = token + "\n";
  bool ok = ::fchmod(fd, 0600) == 0 &&
            ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) &&
            ::fsync(fd) == 0;
  int err = errno;
  ::close(fd);
  if (ok && ::rename(tmp.c_str(), path.c_str()) != 0) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    ::unlink(tmp.c_str());
    return absl::PermissionDeniedError(
        absl::StrCat("token file ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  // O_NONBLOCK: a FIFO planted at the path must not block the open; it is refused below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP) {
      return absl::PermissionDeniedError(absl::StrCat(
          "token file ", path, ": is a symbolic link; refusing to follow it (name the file itself)"));
    }
    const std::string msg = absl::StrCat("token file ", path, ": ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::PermissionDeniedError(msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::PermissionDeniedError(
        absl::StrCat("token file ", path, ": fstat: ", std::strerror(err)));
  }
  const std::string mode = absl::StrFormat("%04o", st.st_mode & 07777);
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "token file ", path, ": not a regular file (",
        S_ISDIR(st.st_mode) ? "a directory" : "a special file", ", mode ", mode, ")"));
  }
  if ((st.st_mode & 077) != 0) {
    ::close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "token file ", path, ": mode ", mode,
        " lets group or others read or write it; chmod 600 it (a job token is a secret)"));
  }
  std::string text;
  char buf[4096];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return absl::PermissionDeniedError(
          absl::StrCat("token file ", path, ": read: ", std::strerror(err)));
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > (1u << 16)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat("token file ", path, ": larger than 64 KiB"));
    }
  }
  ::close(fd);
  return std::string(absl::StripAsciiWhitespace(text));
}

absl::StatusOr<std::string> Token(const Args& a) {
  auto it = a.flags.find("token-file");
  if (it != a.flags.end()) {
    return ReadTokenFile(it->second);
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

absl::StatusOr<JobAccess> JobAndToken(const Args& a, const std::string& command) {
  if (a.flags.count("job") == 0) {
    return absl::InvalidArgumentError(absl::StrCat(command, " needs --job"));
  }
  JobAccess access{a.flags.at("job"), ""};
  ASSIGN_OR_RETURN(access.token, Token(a));
  return access;
}

absl::StatusOr<GenerationChoice> ChosenGeneration(const Args& a, const std::string& command,
                                                  const std::string& prefix) {
  const std::string generation_flag = prefix + "generation";
  const std::string step_flag = prefix + "step";
  if (a.flags.count(generation_flag) != 0 && a.flags.count(step_flag) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(command, " takes --", generation_flag, " or --", step_flag, ", not both"));
  }
  GenerationChoice choice;
  if (a.flags.count(generation_flag) != 0) {
    ASSIGN_OR_RETURN(choice.generation, IntFlag(a, generation_flag));
    if (*choice.generation < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--", generation_flag, " ",
                                                     *choice.generation,
                                                     ": generations are numbered from 1"));
    }
  }
  if (a.flags.count(step_flag) != 0) {
    ASSIGN_OR_RETURN(choice.step, IntFlag(a, step_flag));
    if (*choice.step < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", step_flag, " ", *choice.step, " is negative"));
    }
  }
  return choice;
}

}  // namespace muond::client
