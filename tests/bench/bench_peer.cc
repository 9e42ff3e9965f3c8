// `muond-bench peer`: muond's Muon step against what users run today, measured in the same run.
//
// The peer: the usual in-process Muon update (DeepSpeed's muon_update/zeropower_via_newtonschulz5)
// in plain LibTorch ops, one 2-D matrix at a time, on --threads intra-op threads: the gradient cast
// to fp32, momentum.lerp_(grad, 1-beta), nesterov u = grad.lerp_(momentum, beta), X = u.bfloat16()
// (u.float() for fp32), transposed when rows > cols, X / (||X|| + 1e-7), five iterations of
// A = X X^T; B = b A + c (A A); X = a X + B X with (3.4445, -4.7750, 2.0315), transposed back,
// scaled by sqrt(max(1, r/c)). The peer has no gram method.
// muond: a real daemon (the binary next to muond-bench, --threads N), one rank over shared memory,
// a job of the same matrices (stage 0): the flat gradient buffer in, the update out through
// RankSession::StepBuffer (both copies count).
//
// The matrices: --layers layers of `muond-bench step`'s Qwen3-0.6B-like set (q 2048x1024, k and v
// 1024x1024, o 1024x2048, gate and up 3072x1024, down 1024x3072); normal random gradients (fixed
// seed) rounded to bf16 values, in bf16 for the bf16 configurations and fp32 for the fp32 ones:
// the same numbers, so one float64 reference serves all.
//
// Per configuration, the peer's and muond's steps in turn (both see the same load): median seconds
// per step over --steps after --warmup, and the relative Frobenius error (worst matrix) of the
// first step's update from zero momentum against float64 (the fp32 lerps, then DESIGN.md 3's NS
// and scale in float64). ratio = worst muond/peer over the standard configurations. Exit 1 unless
// every muond error is finite and within DESIGN.md 3's bound (fp32 1e-4, bf16 5e-2, 2e-2 with
// fp32_iterations >= 2) or no worse than the peer's.
//
// Both sides run on every x86-64 machine: --cpu-isa (auto) is this process's CPU path and the
// daemon's. The header prints the peer's path (LibTorch's bf16 products: oneDNN's bf16 kernels with
// AVX-512 BF16 or AMX, its slow fallback without) and muond's (its muond_build_info labels: bf16
// native, or emulated on fp32 products).
#include "tests/bench/bench_peer.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client.h"
#include "client/metrics_scrape.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "server/optim/cpu_isa.h"
#include "tests/bench/bench.h"

namespace muond::bench {
namespace {

// muond must take at most 65% of the time of the usual in-process update.
constexpr double kTargetRatio = 0.65;
using peer::Bf16Normals;
using peer::Gradients;
using peer::kNsSteps;
using peer::MakeGradients;
using peer::PeerStep;
using peer::ReferenceUpdates;
using peer::ScalarTypeOf;
using peer::WorstRelError;

struct PeerConfig {
  const char* name;
  common::DType dtype;  // compute dtype, and the gradients' dtype
  common::NsMethod method;
};

constexpr PeerConfig kConfigs[] = {
    {"fp32-standard", common::DType::kFloat32, common::NsMethod::kStandard},
    {"bf16-standard", common::DType::kBFloat16, common::NsMethod::kStandard},
    {"fp32-gram", common::DType::kFloat32, common::NsMethod::kGram},
    {"bf16-gram", common::DType::kBFloat16, common::NsMethod::kGram},
};

// DESIGN.md 3's accuracy contract.
double Bound(common::DType dtype, int fp32_iterations) {
  if (dtype == common::DType::kFloat32) return 1e-4;
  return fp32_iterations >= 2 ? 2e-2 : 5e-2;
}

constexpr const char* kUsage =
    "usage: muond-bench peer [--threads N] [--steps 3] [--warmup 1] [--layers 2]\n"
    "                        [--configs fp32-standard,bf16-standard,fp32-gram,bf16-gram]\n"
    "                        [--fp32-iterations 0] [--cpu-isa auto]\n"
    "  muond (one rank over shared memory) vs the usual in-process LibTorch Muon: median s/step\n"
    "  and the first step's relative Frobenius error against float64 (worst matrix).\n"
    "  --threads          daemon --threads and LibTorch threads (default: all hardware threads)\n"
    "  --steps            timed steps of each (median reported)\n"
    "  --warmup           untimed steps of each before them\n"
    "  --layers           layers of 7 matrices\n"
    "  --configs          which of the four configurations (the peer has no gram: n/a)\n"
    "  --fp32-iterations  muond's muon.fp32_iterations for bf16 compute\n"
    "  --cpu-isa          auto, avx2, avx512 or amx: the CPU path of both sides (muond --cpu-isa)\n"
    "Last line: result: peer ratio=<worst muond/peer, standard configs> target=0.65\n";

struct PeerOptions {
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int steps = 3;
  int warmup = 1;
  int layers = 2;
  int fp32_iterations = 0;
  std::string cpu_isa = "auto";
  std::vector<PeerConfig> configs;
};

// *out <- the flag's value when given; false (the error printed) unless an integer in [min, max].
bool ParseInt(const std::map<std::string, std::string>& flags, const char* name, int min, int max,
              int* out) {
  if (flags.count(name) == 0) return true;
  if (absl::SimpleAtoi(flags.at(name), out) && *out >= min && *out <= max) return true;
  std::fprintf(stderr, "muond-bench peer: --%s must be an integer in [%d, %d]\n", name, min, max);
  return false;
}

// Parses the flags into *options; returns -1 to go on, or the exit code after printing the usage
// (--help: 0) or an error (2).
int ParsePeerOptions(int argc, char** argv, PeerOptions* options) {
  auto flags = ParseFlags(argc, argv,
                          {"threads", "steps", "warmup", "layers", "configs", "fp32-iterations",
                           "cpu-isa"});
  if (!flags.ok()) {
    std::fprintf(stderr, "muond-bench peer: %s\n%s", std::string(flags.status().message()).c_str(),
                 kUsage);
    return 2;
  }
  if (flags->count("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  PeerOptions& o = *options;
  constexpr int kMax = 1 << 20;
  if (!ParseInt(*flags, "threads", 1, kMax, &o.threads) ||
      !ParseInt(*flags, "steps", 1, kMax, &o.steps) ||
      !ParseInt(*flags, "warmup", 0, kMax, &o.warmup) ||
      !ParseInt(*flags, "layers", 1, kMax, &o.layers) ||
      !ParseInt(*flags, "fp32-iterations", 0, kNsSteps, &o.fp32_iterations)) {
    return 2;
  }
  if (flags->count("cpu-isa")) o.cpu_isa = flags->at("cpu-isa");
  const std::string names = flags->count("configs")
                                ? flags->at("configs")
                                : "fp32-standard,bf16-standard,fp32-gram,bf16-gram";
  for (const std::string& name : SplitList(names)) {
    const auto it = std::find_if(std::begin(kConfigs), std::end(kConfigs),
                                 [&](const PeerConfig& c) { return name == c.name; });
    if (it == std::end(kConfigs)) {
      std::fprintf(stderr, "muond-bench peer: --configs: unknown configuration '%s'\n%s",
                   name.c_str(), kUsage);
      return 2;
    }
    o.configs.push_back(*it);
  }
  if (o.configs.empty()) {
    std::fprintf(stderr, "muond-bench peer: --configs is empty\n");
    return 2;
  }
  return -1;
}

// The CPU path of each side: this process's (the peer's LibTorch products) and the daemon's, from
// its muond_build_info labels.
void PrintPaths(const std::string& metrics) {
  const server::CpuMathPath& path = server::CurrentCpuMathPath();
  std::printf("peer path: %s; LibTorch bf16 products %s; fp32 on the system BLAS (%s)\n",
              server::CpuIsaName(path.isa),
              path.bf16_native ? "on oneDNN's bf16 kernels"
                               : "without bf16 instructions (LibTorch's fallback kernels)",
              BlasCoreName().c_str());
  std::string isa = "?", bf16 = "?";
  if (auto samples = client::ScrapeMetrics(metrics); samples.ok()) {
    for (const client::MetricSample& s : *samples) {
      if (s.name != "muond_build_info") continue;
      if (auto it = s.labels.find("cpu_isa"); it != s.labels.end()) isa = it->second;
      if (auto it = s.labels.find("cpu_bf16"); it != s.labels.end()) bf16 = it->second;
    }
  }
  std::printf("muond path: %s; bf16 %s\n", isa.c_str(),
              bf16 == "native"     ? "native (oneDNN bf16 products)"
              : bf16 == "emulated" ? "emulated (fp32 products rounded to bf16 at each op)"
                                   : bf16.c_str());
}

// The matrices of `muond-bench step`: per layer q, k, v, o, gate, up, down.
std::vector<common::MatrixSpec> LayerMatrices(int layers) {
  using Shape = std::tuple<const char*, int64_t, int64_t>;
  const int64_t hidden = 1024, inter = 3072, q = 16 * 128, kv = 8 * 128;
  const Shape shapes[] = {{"self_attn.q_proj", q, hidden},  {"self_attn.k_proj", kv, hidden},
                          {"self_attn.v_proj", kv, hidden}, {"self_attn.o_proj", hidden, q},
                          {"mlp.gate_proj", inter, hidden}, {"mlp.up_proj", inter, hidden},
                          {"mlp.down_proj", hidden, inter}};
  std::vector<common::MatrixSpec> out;
  for (int l = 0; l < layers; ++l) {
    for (const auto& [name, rows, cols] : shapes) {
      common::MatrixSpec m;
      m.name = absl::StrCat("layers.", l, ".", name);
      m.shape = {rows, cols};
      out.push_back(m);
    }
  }
  return out;
}

// Cuts the rank's flat update buffer back into one tensor per matrix.
std::vector<at::Tensor> Unflatten(std::string& flat, const client::RankSession& session,
                                  common::DType dtype) {
  const int64_t n = static_cast<int64_t>(flat.size() / common::DTypeSize(dtype));
  const at::Tensor all = at::from_blob(flat.data(), {n}, ScalarTypeOf(dtype));
  std::vector<at::Tensor> out;
  for (const common::MatrixSpec& m : session.spec().matrices) {
    out.push_back(at::zeros(m.shape, ScalarTypeOf(dtype)));
  }
  for (const common::ShardSpan& s : session.spans()) {
    out[s.matrix]
        .view({-1})
        .narrow(0, s.offset, s.length)
        .copy_(all.narrow(0, s.rank_offset, s.length));
  }
  return out;
}

// A fresh job of one rank attached over shared memory, and its update buffer.
struct MuondRun {
  client::Client* client = nullptr;
  std::string job_id, token;
  std::unique_ptr<client::RankSession> session;
  std::string out;
  int64_t next_step = 0;

  ~MuondRun() {
    session.reset();
    if (client != nullptr && !token.empty()) (void)client->DeleteJob(job_id, token);
  }
};

absl::Status StartMuondRun(client::Client& client, const common::JobSpec& job,
                           const Gradients& grads, MuondRun* run) {
  run->client = &client;
  run->job_id = job.job_id;
  absl::StatusOr<std::string> token = client.CreateJob(job);
  if (!token.ok()) return token.status();
  run->token = *token;
  auto session = client.Attach(job.job_id, 0, *token, false, client::Transport::kShm);
  if (!session.ok()) return session.status();
  run->session = *std::move(session);
  if (run->session->buffer_elements() * common::DTypeSize(grads.dtype) != grads.flat.size()) {
    return absl::InternalError("the rank's buffer is not the matrices back to back");
  }
  run->out.assign(grads.flat.size(), '\0');
  run->next_step = run->session->next_step_at_attach();
  return absl::OkStatus();
}

// One row of the table.
struct Row {
  PeerConfig config = kConfigs[0];
  std::optional<double> peer_s, peer_err;
  double muond_s = 0, muond_err = 0;
  std::map<std::string, double> phases;  // muond's busy seconds per timed step; empty: no metrics
  // CPU seconds (user + system, all threads) per timed step: this process for the peer, the
  // daemon for muond. Less sensitive to a shared machine's load than wall time.
  double peer_cpu = 0, muond_cpu = 0;
};

// The daemon of the run: its metrics endpoint and process.
struct DaemonRef {
  std::string metrics;
  pid_t pid = 0;
};

std::string Cell(const std::optional<double>& v, const char* format) {
  if (!v) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof(buf), format, *v);
  return buf;
}

void PrintRow(const Row& r) {
  const std::optional<double> ratio =
      r.peer_s ? std::optional(r.muond_s / *r.peer_s) : std::nullopt;
  std::printf("%-14s  %8s  %8.3f  %10s  %15s  %16.3e\n", r.config.name,
              Cell(r.peer_s, "%.3f").c_str(), r.muond_s, Cell(ratio, "%.3f").c_str(),
              Cell(r.peer_err, "%.3e").c_str(), r.muond_err);
  if (!r.phases.empty()) {
    std::printf("  muond phases per step (s): step %.3f;", r.phases.at("step"));
    for (const char* p : kPhases) std::printf(" %s %.3f", p, r.phases.at(p));
    std::printf("\n");
  }
  std::printf("  cpu s/step: peer %s, muond %.3f\n",
              r.peer_s ? absl::StrFormat("%.3f", r.peer_cpu).c_str() : "n/a", r.muond_cpu);
  std::fflush(stdout);
}

// Prints the error check of each row; true when every muond error passes.
bool CheckErrors(const std::vector<Row>& rows, int fp32_iterations) {
  bool all_ok = true;
  for (const Row& r : rows) {
    const double bound = Bound(r.config.dtype, fp32_iterations);
    const bool finite = std::isfinite(r.muond_err);
    const bool within = finite && r.muond_err < bound;
    const bool no_worse = finite && r.peer_err && r.muond_err <= *r.peer_err;
    const bool ok = within || no_worse;
    all_ok = all_ok && ok;
    std::printf(
        "error check %-14s muond %.3e: %s DESIGN bound %.0e; %s -> %s\n", r.config.name,
        r.muond_err, within ? "within" : "NOT within", bound,
        !r.peer_err ? "no peer" : (no_worse ? "no worse than the peer" : "worse than the peer"),
        ok ? "ok" : "FAIL");
  }
  return all_ok;
}

// Measures one configuration: the peer (standard method only) and muond step by step in turn, so
// that both see the same load of the shared machine. Prints the error and returns nullopt when
// muond fails.
std::optional<Row> MeasureConfig(client::Client& client, const PeerConfig& config,
                                 const std::vector<common::MatrixSpec>& matrices,
                                 const Gradients& grads, const std::vector<at::Tensor>& ref,
                                 const DaemonRef& daemon, const PeerOptions& o) {
  common::JobSpec job;
  job.job_id = absl::StrCat("peer-", config.name);
  job.muon.compute_dtype = config.dtype;
  job.muon.ns_method = config.method;
  job.muon.ns_steps = kNsSteps;
  job.muon.fp32_iterations = o.fp32_iterations;
  job.matrices = matrices;
  for (common::MatrixSpec& m : job.matrices) m.dtype = grads.dtype;
  const bool with_peer = config.method == common::NsMethod::kStandard;  // the peer has no gram
  std::vector<at::Tensor> momenta;
  for (const at::Tensor& g : grads.tensors) momenta.push_back(at::zeros(g.sizes(), at::kFloat));
  MuondRun muond;
  absl::Status status = StartMuondRun(client, job, grads, &muond);
  Row row;
  row.config = config;
  std::vector<double> peer_times, muond_times;
  std::map<std::string, double> before;
  for (int s = 0; status.ok() && s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) before = PhaseSums(daemon.metrics, job.job_id);
    const bool timed = s >= o.warmup;
    auto t0 = Clock::now();
    double cpu0 = CpuSeconds(0);
    if (with_peer) {
      std::vector<at::Tensor> updates = PeerStep(grads, momenta, job.muon.momentum, config.dtype);
      if (timed) peer_times.push_back(Since(t0));
      if (timed) row.peer_cpu += (CpuSeconds(0) - cpu0) / o.steps;
      if (s == 0) row.peer_err = WorstRelError(updates, ref);
    }
    t0 = Clock::now();
    cpu0 = CpuSeconds(daemon.pid);
    status = muond.session->StepBuffer(muond.next_step + s, grads.flat.data(), muond.out.data())
                 .status();
    if (timed) muond_times.push_back(Since(t0));
    if (timed) row.muond_cpu += (CpuSeconds(daemon.pid) - cpu0) / o.steps;
    if (s == 0 && status.ok()) {
      row.muond_err = WorstRelError(Unflatten(muond.out, *muond.session, grads.dtype), ref);
    }
  }
  if (!status.ok()) {
    std::fprintf(stderr, "muond-bench peer: %s: %s\n", config.name, status.ToString().c_str());
    return std::nullopt;
  }
  if (with_peer) row.peer_s = Median(peer_times);
  row.muond_s = Median(muond_times);
  const std::map<std::string, double> after = PhaseSums(daemon.metrics, job.job_id);
  if (!before.empty() && !after.empty() && o.steps > 0) {
    for (const auto& [name, sum] : after) row.phases[name] = (sum - before.at(name)) / o.steps;
  }
  return row;
}

}  // namespace

int RunPeerBench(int argc, char** argv) {
  PeerOptions o;
  if (const int exit_code = ParsePeerOptions(argc, argv, &o); exit_code >= 0) return exit_code;
  if (const int exit_code = SetBenchCpuIsa("peer", o.cpu_isa, argc, argv); exit_code >= 0) {
    return exit_code;
  }
  c10::InferenceMode no_autograd;
  at::set_num_threads(o.threads);
  if (!server::CurrentCpuMathPath().bf16_native) {
    // LibTorch picks oneDNN's bf16 matmul from the CPU's flags, not from oneDNN's cap: with the
    // path forced narrower than the CPU it would call a primitive oneDNN no longer has. Off, its
    // bf16 products take the fallback kernels an AVX2 machine runs.
    at::globalContext().setUserEnabledMkldnn(false);
  }
  const std::vector<common::MatrixSpec> matrices = LayerMatrices(o.layers);
  uint64_t total = 0;
  for (const auto& m : matrices) total += static_cast<uint64_t>(m.numel());
  const std::vector<float> normals = Bf16Normals(total);
  const double beta = common::MuonConfig().momentum;
  std::printf(
      "muond-bench peer: %zu matrices (%d layers), %llu elements, threads=%d, warmup=%d, "
      "steps=%d (median), ns_steps=%d, fp32_iterations=%d, momentum=%.2f nesterov\n",
      matrices.size(), o.layers, static_cast<unsigned long long>(total), o.threads, o.warmup,
      o.steps, kNsSteps, o.fp32_iterations, beta);

  const std::string dir = MakeTempDir("muond-bench-peer");
  std::string address;
  DaemonRef ref_daemon;
  ref_daemon.metrics = absl::StrCat("127.0.0.1:", FreePort());
  const pid_t daemon =
      StartDaemon(dir, o.threads, &address,
                  {"--backend", "cpu", "--metrics-address", ref_daemon.metrics, "--cpu-isa", o.cpu_isa});
  ref_daemon.pid = daemon;
  auto client = client::Client::Connect(address);
  if (!client.ok() || !WaitHealthy(**client)) {
    std::fprintf(stderr, "muond-bench peer: muond did not start\n");
    StopDaemon(daemon, dir);
    return 1;
  }
  PrintPaths(ref_daemon.metrics);
  // One float64 reference serves every configuration: the fp32 and bf16 gradients hold the
  // same (bf16-representable) values, hence the same momentum input.
  std::map<common::DType, Gradients> grads;
  for (const PeerConfig& config : o.configs) {
    if (grads.count(config.dtype) == 0) {
      grads.emplace(config.dtype, MakeGradients(normals, matrices, config.dtype));
    }
  }
  const auto t0 = Clock::now();
  const std::vector<at::Tensor> ref = ReferenceUpdates(grads.begin()->second, beta);
  std::printf("float64 reference: %.1f s\n", Since(t0));
  std::printf("%-14s  %8s  %8s  %10s  %15s  %16s\n", "configuration", "peer s", "muond s",
              "muond/peer", "rel. error peer", "rel. error muond");
  std::vector<Row> rows;
  for (const PeerConfig& config : o.configs) {
    const std::optional<Row> row =
        MeasureConfig(**client, config, matrices, grads.at(config.dtype), ref, ref_daemon, o);
    if (!row) {
      StopDaemon(daemon, dir);
      return 1;
    }
    rows.push_back(*row);
    PrintRow(rows.back());
  }
  StopDaemon(daemon, dir);
  const bool errors_ok = CheckErrors(rows, o.fp32_iterations);
  std::optional<double> ratio;
  for (const Row& r : rows) {
    if (r.peer_s) ratio = std::max(ratio.value_or(0.0), r.muond_s / *r.peer_s);
  }
  std::printf("result: peer ratio=%s target=%g\n", Cell(ratio, "%.3f").c_str(), kTargetRatio);
  return errors_ok ? 0 : 1;
}

}  // namespace muond::bench
