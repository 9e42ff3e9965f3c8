// Fuzz target: muond's config file (--config FILE, server/record/daemon_config.cc and the limits of
// daemon_limits.cc), read as the daemon reads it: from a file, through ParseDaemonConfig. The
// input is the file. Properties: a refusal is INVALID_ARGUMENT naming the file (and the line for
// a bad line); an accepted file gives a listen address that ParseListenAddress accepts.
#include "server/record/daemon_config.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("muond-fuzz-config", MFD_CLOEXEC);
  FUZZ_CHECK(fd >= 0, "memfd_create");
  for (size_t done = 0; done < size;) {
    const ssize_t n = write(fd, data + done, size - done);
    FUZZ_CHECK(n > 0, "write to the memfd");
    done += static_cast<size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  std::string flag = "--config=" + path;
  char arg0[] = "muond";
  char* argv[] = {arg0, flag.data(), nullptr};
  auto config = muond::server::ParseDaemonConfig(2, argv);
  close(fd);
  if (!config.ok()) {
    FUZZ_CHECK(config.status().code() == absl::StatusCode::kInvalidArgument &&
                   config.status().message().find(path) != std::string::npos,
               config.status().ToString());
    return 0;
  }
  std::string unix_path;
  FUZZ_CHECK(muond::server::ParseListenAddress(config->listen, &unix_path).ok(),
             "accepted listen address '" + config->listen + "' does not parse");
  return 0;
}
