// muond-bench multinode: many-node step time with emulated nodes (network namespaces joined by
// rate-limited veth pairs) against the README's model of network and compute, measured by
// tests/bench/multinode_netns_bench.py (its module comment has the model). This subcommand runs
// that script with this build's daemon and client library; the script prints the table and the
// line `result: multinode ratio=<measured / modelled step time> target=1.2`. Needs root (network
// namespaces); exits 77 (skipped) where they cannot be made.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tests/bench/bench.h"

namespace muond::bench {

int RunMultinodeBench(int argc, char** argv) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string dir = n > 0 ? std::string(self, n) : std::string("./muond-bench");
  dir = dir.substr(0, dir.rfind('/') + 1);
  std::vector<std::string> args = {"/usr/bin/python3",
                                   MUOND_SOURCE_DIR "/tests/bench/multinode_netns_bench.py",
                                   "--muond", dir + "muond"};
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  if (std::getenv("MUOND_CLIENT_LIB") == nullptr) {
    setenv("MUOND_CLIENT_LIB", MUOND_CLIENT_LIB_PATH, 1);
  }
  std::vector<char*> raw;
  for (std::string& a : args) raw.push_back(a.data());
  raw.push_back(nullptr);
  std::fflush(nullptr);
  execv(raw[0], raw.data());
  std::perror("muond-bench multinode: cannot run /usr/bin/python3");
  return 1;
}

}  // namespace muond::bench
