// `muond-bench orthogonality`: what measuring the orthogonality of updates costs
// (--orthogonality-every, server/engine/step_observer.h). A real muond runs a Qwen3-0.6B-like layer
// set with --orthogonality-every 1, so that every step measures its sample (up to 4 Muon
// matrices); its own metrics then give the seconds spent measuring
// (muond_orthogonality_check_seconds_total) and the step time (muond_step_duration_seconds), both
// from the same steps. At the default --orthogonality-every 100 the measurement runs on one step in
// 100, so its cost per step is a hundredth of a sampled step's:
//   ratio = check seconds per sampled step / (100 x step seconds without the check).
// Target: under 1% of step time (0.01).
#include <sys/types.h>

#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/metrics_scrape.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "tests/bench/bench.h"

namespace muond::bench {
namespace {

constexpr double kTarget = 0.01;
constexpr int kDefaultEvery = 100;

struct Options {
  int layers = 2;
  int steps = 4;
  int threads = 0;
  common::DType dtype = common::DType::kBFloat16;
};

int ParseOptions(int argc, char** argv, Options* o) {
  auto flags = ParseFlags(argc, argv, {"layers", "steps", "threads", "dtype"});
  if (!flags.ok() || flags->count("help")) {
    std::fprintf(flags.ok() ? stdout : stderr,
                 "%s%susage: muond-bench orthogonality [--layers 2] [--steps 4] [--threads N]\n"
                 "                                 [--dtype bfloat16]\n"
                 "  Runs --steps steps (after one warm-up) of a Qwen3-0.6B-like layer set through\n"
                 "  a muond with --orthogonality-every 1 and prints the measurement's cost at the\n"
                 "  default --orthogonality-every %d as a fraction of the step time.\n",
                 flags.ok() ? "" : std::string(flags.status().message()).c_str(),
                 flags.ok() ? "" : "\n", kDefaultEvery);
    return flags.ok() ? 0 : 2;
  }
  auto get = [&](const char* k, const char* d) {
    return flags->count(k) ? flags->at(k) : std::string(d);
  };
  o->threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto dtype = common::ParseDType(get("dtype", "bfloat16"));
  if (!dtype.ok() || !absl::SimpleAtoi(get("layers", "2"), &o->layers) || o->layers < 1 ||
      !absl::SimpleAtoi(get("steps", "4"), &o->steps) || o->steps < 1 ||
      (flags->count("threads") &&
       (!absl::SimpleAtoi(flags->at("threads"), &o->threads) || o->threads < 1))) {
    std::fprintf(stderr, "muond-bench orthogonality: bad flags (see --help)\n");
    return 2;
  }
  o->dtype = *dtype;
  return -1;
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "muond-bench orthogonality: %s\n", what.c_str());
  return 1;
}

}  // namespace

int RunOrthogonalityBench(int argc, char** argv) {
  Options o;
  if (const int code = ParseOptions(argc, argv, &o); code >= 0) return code;
  common::JobSpec spec = Qwen3LikeLayers(o.layers, o.dtype);
  spec.job_id = "bench-orthogonality";
  spec.world_size = 1;
  uint64_t total = 0;
  for (const auto& m : spec.matrices) total += static_cast<uint64_t>(m.numel());
  const size_t esize = common::DTypeSize(o.dtype);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> grad32(total);
  for (float& g : grad32) g = normal(rng);
  std::string grads(common::RankBufferElements(spec, 0) * esize, '\0');
  common::FromFloat32(grad32.data(), total, o.dtype, grads.data());
  std::string out(grads.size(), '\0');

  const std::string dir = MakeTempDir("muond-bench-orthogonality");
  const std::string metrics = absl::StrCat("127.0.0.1:", FreePort());
  std::string address;
  const pid_t daemon =
      StartDaemon(dir, o.threads, &address,
                  {"--backend", "cpu", "--metrics-address", metrics, "--orthogonality-every", "1"});
  auto stop = [&] { StopDaemon(daemon, dir); };
  auto client = client::Client::Connect(address);
  if (!client.ok() || !WaitHealthy(**client)) {
    stop();
    return Fail("muond did not start");
  }
  auto token = (*client)->CreateJob(spec);
  if (!token.ok()) {
    stop();
    return Fail(std::string(token.status().message()));
  }
  auto session = (*client)->Attach(spec.job_id, 0, *token);
  if (!session.ok()) {
    stop();
    return Fail(std::string(session.status().message()));
  }
  std::printf(
      "muond-bench orthogonality: %zu matrices (%d layers), %llu elements, %s, %d threads, "
      "%d timed steps\n",
      spec.matrices.size(), o.layers, static_cast<unsigned long long>(total),
      std::string(common::DTypeName(o.dtype)).c_str(), o.threads, o.steps);
  // The warm-up step (0) is sampled too; its numbers are taken out by reading the metrics before
  // and after the timed steps.
  auto read = [&](double* check, double* checks, double* step, double* count) {
    auto samples = client::ScrapeMetrics(metrics);
    if (!samples.ok()) return false;
    const std::map<std::string, std::string> job{{"muond_job", spec.job_id}};
    *check = client::FindSample(*samples, "muond_orthogonality_check_seconds_total", job, 0);
    *checks = client::FindSample(*samples, "muond_orthogonality_checks_total", job, 0);
    *step = client::FindSample(*samples, "muond_step_duration_seconds_sum", job, 0);
    *count = client::FindSample(*samples, "muond_step_duration_seconds_count", job, 0);
    return true;
  };
  double check0 = 0, checks0 = 0, step0 = 0, count0 = 0, check1 = 0, checks1 = 0, step1 = 0,
         count1 = 0;
  for (int s = 0; s <= o.steps; ++s) {
    auto done = (*session)->StepBuffer(s, grads.data(), out.data());
    if (!done.ok()) {
      stop();
      return Fail(std::string(done.status().message()));
    }
    if (s == 0 && !read(&check0, &checks0, &step0, &count0)) {
      stop();
      return Fail("cannot scrape " + metrics);
    }
  }
  const bool scraped = read(&check1, &checks1, &step1, &count1);
  session->reset();
  stop();
  if (!scraped || count1 - count0 != o.steps) return Fail("cannot read the steps' metrics");
  const double steps = count1 - count0;
  const double check_per_step = (check1 - check0) / steps;
  const double step_seconds = (step1 - step0) / steps;
  const double without = step_seconds - check_per_step;
  const double every1 = check_per_step / without;
  const double ratio = check_per_step / (kDefaultEvery * without);
  std::printf("%-34s %12s\n", "", "seconds");
  std::printf("%-34s %12.4f\n", "step, measuring every step", step_seconds);
  std::printf("%-34s %12.4f  (%.0f matrices a step)\n", "measurement per sampled step",
              check_per_step, (checks1 - checks0) / steps);
  std::printf("%-34s %12.4f\n", "step without the measurement", without);
  std::printf("cost at --orthogonality-every 1:   %.4f of the step\n", every1);
  std::printf("cost at --orthogonality-every %d: %.6f of the step\n", kDefaultEvery, ratio);
  std::printf("result: orthogonality ratio=%.6f target=%.2f\n", ratio, kTarget);
  return 0;
}

}  // namespace muond::bench
