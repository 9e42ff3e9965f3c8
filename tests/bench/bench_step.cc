// `muond-bench step`: one Muon step of a Qwen3-0.6B-like layer set (hidden 1024, intermediate 3072,
// 16 q heads and 8 kv heads of head_dim 128) pushed through a real muond by 1, 2 and 4 ZeRO-2
// ranks (one thread and one connection per rank), against the in-process whole-matrix update of
// the same matrices measured in the same run. ratio = daemon step time / in-process time: the cost
// of offloading to the daemon (transport, reassembly, return) over the bare math.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "server/optim/muon_math.h"
#include "tests/bench/bench.h"

namespace muond::bench {
namespace {

// Offloading may cost at most 10% over the bare in-process math (the pipelined device layer's
// target; 15% before it): the data moved (gradient in, update out) is a few hundred MB against
// several seconds of Newton-Schulz on the CPU.
constexpr double kTarget = 1.10;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The flags of `muond-bench step`.
struct StepOptions {
  std::vector<int64_t> ranks;
  int layers = 0;
  int steps = 0;
  int threads = 0;
  common::DType dtype = common::DType::kBFloat16;
  std::string backend;
};

// Parses the flags into *options; returns -1 to go on, or the exit code after printing the usage
// (--help: 0) or an error (2).
int ParseStepOptions(int argc, char** argv, StepOptions* options) {
  auto flags = ParseFlags(argc, argv, {"ranks", "layers", "dtype", "steps", "threads", "backend"});
  if (!flags.ok() || flags->count("help")) {
    std::fprintf(flags.ok() ? stdout : stderr,
                 "%s%susage: muond-bench step [--ranks 1,2,4] [--layers 2] [--dtype bfloat16]\n"
                 "                        [--steps 1] [--threads N] [--backend cpu]\n"
                 "  --steps    timed steps per configuration (after one warm-up step)\n"
                 "  --backend  the daemon's --backend (cpu, cuda, auto, ...); the baseline is\n"
                 "             always the in-process CPU update\n",
                 flags.ok() ? "" : std::string(flags.status().message()).c_str(),
                 flags.ok() ? "" : "\n");
    return flags.ok() ? 0 : 2;
  }
  auto get = [&](const char* k, const char* d) {
    return flags->count(k) ? flags->at(k) : std::string(d);
  };
  StepOptions& o = *options;
  auto ranks = ParsePositiveList("ranks", get("ranks", "1,2,4"));
  o.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto dtype = common::ParseDType(get("dtype", "bfloat16"));
  if (!ranks.ok() || !dtype.ok() || !absl::SimpleAtoi(get("layers", "2"), &o.layers) ||
      o.layers < 1 || !absl::SimpleAtoi(get("steps", "1"), &o.steps) || o.steps < 1 ||
      (flags->count("threads") &&
       (!absl::SimpleAtoi(flags->at("threads"), &o.threads) || o.threads < 1))) {
    std::fprintf(stderr, "muond-bench step: bad flags (see --help)\n");
    return 2;
  }
  o.ranks = *std::move(ranks);
  o.dtype = *dtype;
  o.backend = get("backend", "cpu");
  return -1;
}

// `total` normal random gradient elements of `dtype`, one matrix after another.
std::string RandomGradients(uint64_t total, common::DType dtype) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> grad32(total);
  for (float& g : grad32) g = normal(rng);
  std::string grads(total * common::DTypeSize(dtype), '\0');
  common::FromFloat32(grad32.data(), total, dtype, grads.data());
  return grads;
}

// The baseline: seconds per step of the whole-matrix update of every matrix of `spec` in this
// process (one warm-up step, then `steps` timed). Prints the error and returns nullopt on failure.
std::optional<double> InProcessStepSeconds(const common::JobSpec& spec, common::DType dtype,
                                           const std::string& grads, int steps) {
  const size_t esize = common::DTypeSize(dtype);
  std::vector<std::vector<float>> momentum;
  for (const auto& m : spec.matrices) momentum.emplace_back(m.numel(), 0.0f);
  double baseline = 0;
  for (int s = 0; s <= steps; ++s) {
    const auto t0 = Clock::now();
    uint64_t at = 0;
    std::vector<float> g;
    for (size_t i = 0; i < spec.matrices.size(); ++i) {
      const uint64_t n = spec.matrices[i].numel();
      g.resize(n);
      common::ToFloat32(dtype, grads.data() + at * esize, n, g.data());
      absl::Status st =
          server::MuonUpdate(spec.muon, spec.matrices[i], g.data(), momentum[i].data(), g.data());
      if (!st.ok()) {
        std::fprintf(stderr, "muond-bench step: %s\n", std::string(st.message()).c_str());
        return std::nullopt;
      }
      std::string out(n * esize, '\0');
      common::FromFloat32(g.data(), n, dtype, out.data());
      at += n;
    }
    if (s > 0) baseline += Seconds(t0, Clock::now()) / steps;
  }
  return baseline;
}

// Seconds per step of job `spec` over `world` ZeRO ranks of the daemon at `address` (one thread
// and one connection per rank; one warm-up step, then `steps` timed); the job is deleted after.
// Prints the errors and returns nullopt on failure.
std::optional<double> DaemonStepSeconds(client::Client& client, const std::string& address,
                                        const common::JobSpec& spec, int64_t world,
                                        const std::string& grads, size_t esize, int steps) {
  common::JobSpec job = spec;
  job.job_id = absl::StrCat("bench-", world);
  job.world_size = static_cast<int>(world);
  job.zero_stage = world == 1 ? 0 : 2;
  auto token = client.CreateJob(job);
  if (!token.ok()) {
    std::fprintf(stderr, "muond-bench step: %s\n", std::string(token.status().message()).c_str());
    return std::nullopt;
  }
  const uint64_t part = common::RankBufferElements(job, 0);
  std::string padded(part * world * esize, '\0');
  std::copy(grads.begin(), grads.end(), padded.begin());
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::unique_ptr<client::RankSession>> sessions;
  for (int r = 0; r < world; ++r) {
    clients.push_back(*client::Client::Connect(address));
    sessions.push_back(*clients.back()->Attach(job.job_id, r, *token));
  }
  std::vector<std::string> outs(world, std::string(part * esize, '\0'));
  double daemon_time = 0;
  for (int s = 0; s <= steps; ++s) {
    absl::Notification go;
    std::vector<absl::Status> status(world);
    std::vector<std::thread> ts;
    for (int r = 0; r < world; ++r) {
      ts.emplace_back([&, r] {
        go.WaitForNotification();
        status[r] =
            sessions[r]->StepBuffer(s, padded.data() + r * part * esize, outs[r].data()).status();
      });
    }
    const auto t0 = Clock::now();
    go.Notify();
    for (auto& t : ts) t.join();
    bool failed = false;
    for (const auto& st : status) {
      if (!st.ok()) {
        std::fprintf(stderr, "muond-bench step: %s\n", std::string(st.message()).c_str());
        failed = true;
      }
    }
    if (failed) return std::nullopt;
    if (s > 0) daemon_time += Seconds(t0, Clock::now()) / steps;
  }
  sessions.clear();
  (void)client.DeleteJob(job.job_id, *token);
  return daemon_time;
}

}  // namespace

common::JobSpec Qwen3LikeLayers(int layers, common::DType dtype) {
  common::JobSpec spec;
  spec.muon.compute_dtype = dtype;
  const int64_t hidden = 1024, inter = 3072, q = 16 * 128, kv = 8 * 128;
  for (int l = 0; l < layers; ++l) {
    const std::string p = absl::StrCat("layers.", l, ".");
    for (auto [name, rows, cols] :
         std::vector<std::tuple<std::string, int64_t, int64_t>>{{"self_attn.q_proj", q, hidden},
                                                                {"self_attn.k_proj", kv, hidden},
                                                                {"self_attn.v_proj", kv, hidden},
                                                                {"self_attn.o_proj", hidden, q},
                                                                {"mlp.gate_proj", inter, hidden},
                                                                {"mlp.up_proj", inter, hidden},
                                                                {"mlp.down_proj", hidden, inter}}) {
      common::MatrixSpec m;
      m.name = p + name;
      m.shape = {rows, cols};
      m.dtype = dtype;
      spec.matrices.push_back(m);
    }
  }
  return spec;
}

int RunStepBench(int argc, char** argv) {
  StepOptions options;
  if (const int exit_code = ParseStepOptions(argc, argv, &options); exit_code >= 0) {
    return exit_code;
  }
  const common::DType dtype = options.dtype;
  const int steps = options.steps;
  common::JobSpec spec = Qwen3LikeLayers(options.layers, dtype);
  uint64_t total = 0;
  for (const auto& m : spec.matrices) total += static_cast<uint64_t>(m.numel());
  const size_t esize = common::DTypeSize(dtype);
  const std::string grads = RandomGradients(total, dtype);
  std::printf(
      "muond-bench step: %zu matrices (%d layers), %llu elements, %s gradients and "
      "compute, %d threads, %d timed steps\n",
      spec.matrices.size(), options.layers, static_cast<unsigned long long>(total),
      std::string(common::DTypeName(dtype)).c_str(), options.threads, steps);

  server::SetMathThreads(options.threads);
  const std::optional<double> baseline = InProcessStepSeconds(spec, dtype, grads, steps);
  if (!baseline) return 1;

  const std::string dir = MakeTempDir("muond-bench-step");
  std::string address;
  const pid_t daemon = StartDaemon(dir, options.threads, &address, {"--backend", options.backend});
  auto client = client::Client::Connect(address);
  const bool up = client.ok() && WaitHealthy(**client);
  int code = 0;
  double worst_ratio = 0;
  std::printf("%6s %14s %14s %8s\n", "ranks", "daemon s/step", "in-proc s/step", "ratio");
  for (int64_t world : options.ranks) {
    if (!up) {
      std::fprintf(stderr, "muond-bench step: muond did not start\n");
      code = 1;
      break;
    }
    const std::optional<double> daemon_time =
        DaemonStepSeconds(**client, address, spec, world, grads, esize, steps);
    if (!daemon_time) {
      code = 1;
      break;
    }
    const double ratio = *daemon_time / *baseline;
    worst_ratio = std::max(worst_ratio, ratio);
    std::printf("%6lld %14.3f %14.3f %8.3f\n", static_cast<long long>(world), *daemon_time,
                *baseline, ratio);
  }
  StopDaemon(daemon, dir);
  if (code != 0) return code;
  std::printf("result: step ratio=%.3f target=%.3f\n", worst_ratio, kTarget);
  return 0;
}

}  // namespace muond::bench
