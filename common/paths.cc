#include "common/paths.h"

#include <unistd.h>

#include <cstdlib>

namespace muond::common {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

}  // namespace

std::string DefaultListenAddress() {
  const std::string runtime = Env("XDG_RUNTIME_DIR");
  if (geteuid() == 0 || runtime.empty()) return "unix:///run/muond/muond.sock";
  return "unix://" + runtime + "/muond/muond.sock";
}

std::string DefaultStateDir() {
  if (geteuid() == 0) return "/var/lib/muond";
  const std::string state = Env("XDG_STATE_HOME");
  if (!state.empty()) return state + "/muond";
  const std::string home = Env("HOME");
  return (home.empty() ? std::string("/tmp") : home) + "/.local/state/muond";
}

std::string DefaultClientAddress() {
  const std::string env = Env("MUOND_ADDRESS");
  return env.empty() ? DefaultListenAddress() : env;
}

}  // namespace muond::common
