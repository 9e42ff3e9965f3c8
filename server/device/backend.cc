// Backend selection (--backend): the host devices are always built; the GPU backends are compiled
// in when their toolchains were found (MUOND_HAVE_CUDA / MUOND_HAVE_LEVEL_ZERO) and chosen at run
// time.
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/device/device.h"

namespace muond::server::device {
namespace {

struct GpuBackend {
  const char* name;
  absl::StatusOr<std::unique_ptr<Device>> (*open)(int ordinal);
};

std::vector<GpuBackend> CompiledGpuBackends() {
  std::vector<GpuBackend> b;
#ifdef MUOND_HAVE_CUDA
  b.push_back({"cuda", &OpenCudaDevice});
#endif
#ifdef MUOND_HAVE_LEVEL_ZERO
  b.push_back({"level_zero", &OpenLevelZeroDevice});
#endif
  return b;
}

}  // namespace

absl::StatusOr<BackendChoice> OpenBackend(const std::string& name, int cpu_threads,
                                          const SimulatedOptions& simulated) {
  BackendChoice c;
  const std::vector<GpuBackend> gpus = CompiledGpuBackends();
  if (name == "cpu") {
    c.device = NewHostDevice(cpu_threads, nullptr);
    c.why = "cpu (asked for)";
    return c;
  }
  if (name == "simulated") {
    if (!(simulated.copy_gbps > 0) || !(simulated.compute_gflops > 0) ||
        !(simulated.copy_latency_us >= 0)) {
      return absl::InvalidArgumentError(
          "simulated backend: bandwidth and rate must be > 0, latency >= 0");
    }
    c.device = NewHostDevice(cpu_threads, &simulated);
    c.why = absl::StrCat("simulated (asked for: ", simulated.copy_gbps, " GB/s copies, ",
                         simulated.copy_latency_us, " us latency, ", simulated.compute_gflops,
                         " GFLOP/s)");
    return c;
  }
  if (name == "auto") {
    std::vector<std::string> reasons;
    for (const GpuBackend& gpu : gpus) {
      auto dev = gpu.open(0);
      if (dev.ok()) {
        c.device = *std::move(dev);
        c.why = absl::StrCat(c.device->name(), " (auto: first working GPU backend)");
        return c;
      }
      reasons.push_back(absl::StrCat(gpu.name, ": ", dev.status().message()));
    }
    c.device = NewHostDevice(cpu_threads, nullptr);
    c.why = reasons.empty()
                ? std::string("cpu (auto: no GPU backend is compiled into this muond)")
                : absl::StrCat("cpu (auto: no working GPU; ", absl::StrJoin(reasons, "; "), ")");
    return c;
  }
  for (const GpuBackend& gpu : gpus) {
    if (name != gpu.name) continue;
    auto dev = gpu.open(0);
    if (!dev.ok()) {
      return absl::UnavailableError(absl::StrCat(name, " backend: ", dev.status().message()));
    }
    c.device = *std::move(dev);
    c.why = absl::StrCat(c.device->name(), " (asked for)");
    return c;
  }
  if (name == "cuda" || name == "level_zero") {
    return absl::UnavailableError(absl::StrCat(
        "the ", name, " backend is not compiled into this muond (its toolchain was not found at "
        "build time)"));
  }
  std::vector<std::string> names = {"auto", "cpu", "simulated"};
  for (const GpuBackend& gpu : gpus) names.push_back(gpu.name);
  return absl::InvalidArgumentError(absl::StrCat("unknown backend '", name,
                                                 "' (available in this build: ",
                                                 absl::StrJoin(names, ", "), ")"));
}

}  // namespace muond::server::device
