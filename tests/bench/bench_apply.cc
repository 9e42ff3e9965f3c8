// `muond-bench apply`: one apply-mode step (DESIGN.md 4b) of a Qwen3-0.6B-like model through a
// real muond, against the same Muon + AdamW update done in this process, measured in the same run.
//
// The model: --layers transformer layers of hidden 1024 (q_proj [2048,1024], k_proj and v_proj
// [1024,1024], o_proj [1024,2048], gate/up [3072,1024], down [1024,3072] as Muon tensors; the two
// layer norms [1024] and q_norm/k_norm [128] as AdamW), a --vocab x 1024 embedding and a separate
// output head, and the final norm (AdamW). bf16 parameters and bf16 gradients.
//
// Daemon path (what a trainer in apply mode does): per rank (ZeRO stage 2 flat partitions over
// shared memory, one thread and one connection per rank) SetHyper, write the partition's bf16
// gradients into GradientView, StepInPlace, copy the new bf16 parameters out of UpdateView into the
// model (for 2 ranks the copy stands for the all-gather). The trainer holds no optimizer state.
//
// In-process path (what trainers do today): fp32 masters in the process; the bf16 gradients cast
// to fp32; torch::optim::AdamW (LibTorch's per-parameter loop, i.e. foreach off) on the AdamW
// tensors; the Muon update in LibTorch ops (M <- lerp(M, G, 1-beta), nesterov U <- lerp(G, M,
// beta), Newton-Schulz: the job's default standard schedule, 5 steps, fp32; scale sqrt(max(1,
// r/c)); W <- W*(1-lr*wd) - lr*U); then every master cast to the bf16 parameters.
//
// Both use the same thread count (the daemon's --threads, LibTorch's intra-op threads) and start
// from the same bf16 parameters; after the same number of steps the bench also reports how many
// bf16 parameters the two paths agree on (they do the same math in a different order).
//
// ratio = daemon seconds per step (median) / in-process seconds per step (median), of the world-1
// configuration: one trainer process against one in-process optimizer doing the same total work.
// (World 2 is printed beside it; with both ranks in one process it measures the same daemon work
// plus a second rank's rendezvous.)
#include "tests/bench/bench_apply.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "common/status_macros.h"
#include "server/optim/muon_math.h"
#include "tests/bench/bench.h"

namespace muond::bench {
namespace {

// The target: offloading the whole optimizer may cost at most 5% over doing it in the trainer
// process (the ratio is the daemon over the in-process step).
constexpr double kTarget = 1.05;
using apply::InProcess;
using apply::kAdamLr;
using apply::kAdamWd;
using apply::kBeta1;
using apply::kBeta2;
using apply::kEps;
using apply::KernelSeconds;
using apply::kMuonLr;
using apply::kMuonWd;
using apply::kNumParts;
using apply::kParts;
using apply::Measured;

struct Options {
  std::vector<int64_t> ranks;
  int64_t layers = 2;
  int64_t vocab = 32000;
  int64_t warmup = 1;
  int64_t steps = 2;
  int threads = 1;
  std::string backend;                    // "": the daemon's default
  std::vector<std::string> daemon_flags;  // more muond flags (diagnostics)
  bool kernel = false;                    // also time muond's Muon kernel in this process
  common::StateStorage state;             // how the job holds its state (--state-dtype)
};

absl::StatusOr<Options> ParseOptions(int argc, char** argv) {
  auto flags = ParseFlags(argc, argv,
                          {"ranks", "layers", "vocab", "warmup", "steps", "threads", "backend",
                           "daemon-flags", "kernel", "state-dtype"});
  if (!flags.ok()) return flags.status();
  if (flags->count("help")) return absl::CancelledError("help");
  Options o;
  auto ranks = ParsePositiveList("ranks", flags->count("ranks") ? flags->at("ranks") : "1,2");
  if (!ranks.ok()) return ranks.status();
  o.ranks = *std::move(ranks);
  int64_t threads = std::max(1u, std::thread::hardware_concurrency());
  for (auto [name, v] : std::vector<std::pair<const char*, int64_t*>>{{"layers", &o.layers},
                                                                      {"vocab", &o.vocab},
                                                                      {"warmup", &o.warmup},
                                                                      {"steps", &o.steps},
                                                                      {"threads", &threads}}) {
    auto it = flags->find(name);
    if (it == flags->end()) continue;
    if (!absl::SimpleAtoi(it->second, v) || *v < (std::string(name) == "warmup" ? 0 : 1) ||
        *v > 1000000) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " '", it->second, "'"));
    }
  }
  o.threads = static_cast<int>(std::min<int64_t>(threads, 1024));
  if (flags->count("backend")) o.backend = flags->at("backend");
  if (flags->count("kernel")) {
    if (flags->at("kernel") != "true" && flags->at("kernel") != "false") {
      return absl::InvalidArgumentError("--kernel: true or false");
    }
    o.kernel = flags->at("kernel") == "true";
  }
  if (flags->count("state-dtype")) {
    auto dtype = common::ParseStateDType(flags->at("state-dtype"));
    if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat("--state-dtype: ",
                                                                    dtype.status().message()));
    o.state = {*dtype, *dtype};
  }
  if (flags->count("daemon-flags")) {
    o.daemon_flags = absl::StrSplit(flags->at("daemon-flags"), ' ', absl::SkipEmpty());
  }
  return o;
}

void PrintHelp() {
  std::printf(
      "usage: muond-bench apply [--ranks 1,2] [--layers 2] [--vocab 32000] [--warmup 1]\n"
      "                         [--steps 2] [--threads N] [--backend NAME]\n"
      "                         [--daemon-flags 'FLAGS'] [--kernel true]\n"
      "                         [--state-dtype float32|bfloat16|int8]\n"
      "  One apply-mode step of a Qwen3-0.6B-like model (bf16 params and grads) through muond\n"
      "  over shared memory, against the same Muon + AdamW update in this process (LibTorch).\n"
      "  --warmup/--steps  untimed and timed steps per configuration (medians reported; the\n"
      "                    defaults take about 3 minutes on 2 cores, a step ~15-20 s)\n"
      "  --threads         the daemon's --threads and LibTorch's threads (default: all CPUs)\n"
      "  --backend         the daemon's --backend (default: the daemon's own default)\n"
      "  --daemon-flags    more muond flags, space-separated (e.g. '--serial-schedule true')\n"
      "  --state-dtype     how the job holds Muon's momentum and AdamW's moments (job.json\n"
      "                    \"state\"; default float32; the in-process side stays fp32)\n"
      "  --kernel true     also time muond's Muon kernel (server::MuonUpdateSameShape, every\n"
      "                    same-shape group batched) in this process: the Newton-Schulz phase\n"
      "                    without the daemon's pipeline around it\n"
      "Last line: result: apply ratio=<daemon s/step / in-process s/step, world 1> "
      "target=1.05\n");
}

// The job: every tensor in model order, bf16 gradients and parameters, groups "muon" and "adamw".
common::JobSpec ModelSpec(int64_t layers, int64_t vocab) {
  common::JobSpec spec;
  spec.mode = common::JobMode::kApply;
  spec.groups = {{"muon", kMuonLr, kMuonWd}, {"adamw", kAdamLr, kAdamWd}};
  spec.adamw = {kBeta1, kBeta2, kEps};
  const int64_t hidden = 1024, inter = 3072, q = 16 * 128, kv = 8 * 128, head_dim = 128;
  auto add = [&](std::string name, std::vector<int64_t> shape, common::Optimizer opt) {
    common::MatrixSpec m;
    m.name = std::move(name);
    m.shape = std::move(shape);
    m.dtype = common::DType::kBFloat16;
    m.param_dtype = common::DType::kBFloat16;
    m.optimizer = opt;
    m.group = opt == common::Optimizer::kMuon ? "muon" : "adamw";
    spec.matrices.push_back(std::move(m));
  };
  const auto kMuon = common::Optimizer::kMuon, kAdamW = common::Optimizer::kAdamW;
  add("model.embed_tokens.weight", {vocab, hidden}, kAdamW);
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "input_layernorm.weight", {hidden}, kAdamW);
    add(p + "self_attn.q_proj.weight", {q, hidden}, kMuon);
    add(p + "self_attn.k_proj.weight", {kv, hidden}, kMuon);
    add(p + "self_attn.v_proj.weight", {kv, hidden}, kMuon);
    add(p + "self_attn.o_proj.weight", {hidden, q}, kMuon);
    add(p + "self_attn.q_norm.weight", {head_dim}, kAdamW);
    add(p + "self_attn.k_norm.weight", {head_dim}, kAdamW);
    add(p + "post_attention_layernorm.weight", {hidden}, kAdamW);
    add(p + "mlp.gate_proj.weight", {inter, hidden}, kMuon);
    add(p + "mlp.up_proj.weight", {inter, hidden}, kMuon);
    add(p + "mlp.down_proj.weight", {hidden, inter}, kMuon);
  }
  add("model.norm.weight", {hidden}, kAdamW);
  add("lm_head.weight", {vocab, hidden}, kAdamW);
  return spec;
}

// What a daemon configuration measured besides the step times.
struct DaemonExtra {
  std::map<std::string, double> phase_per_step;  // empty: no metrics
  uint64_t daemon_state_bytes = 0;               // JobStatus.momentum_bytes
  std::string backend;                           // JobStatus.backend
};

// `world` ZeRO-2 ranks over shared memory (see the top comment). Prints the error and returns
// nullopt on failure; the job is deleted after.
std::optional<Measured> ThroughDaemon(client::Client& client, const std::string& address,
                                      pid_t daemon, const std::string& metrics, common::JobSpec job,
                                      int world, const torch::Tensor& params0,
                                      const torch::Tensor& grads, int64_t warmup, int64_t steps,
                                      DaemonExtra* extra) {
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "muond-bench apply: %s\n", std::string(s.message()).c_str());
    return std::nullopt;
  };
  job.job_id = absl::StrCat("bench-apply-", world);
  job.world_size = world;
  job.zero_stage = 2;
  auto token = client.CreateJob(job);
  if (!token.ok()) return fail(token.status());
  std::vector<uint64_t> start;  // of each tensor in the flat model
  uint64_t total = 0;
  for (const auto& m : job.matrices) {
    start.push_back(total);
    total += static_cast<uint64_t>(m.numel());
  }
  constexpr size_t kEsize = 2;  // bf16 gradients and parameters
  Measured out;
  out.params = params0.clone();
  char* model = static_cast<char*>(out.params.data_ptr());
  const char* grad = static_cast<const char*>(grads.data_ptr());
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::unique_ptr<client::RankSession>> sessions;
  std::vector<std::vector<uint64_t>> param_at(world);
  client::StepHyper hyper;
  hyper.lr = {{"muon", kMuonLr}, {"adamw", kAdamLr}};
  for (int r = 0; r < world; ++r) {
    auto c = client::Client::Connect(address);
    if (!c.ok()) return fail(c.status());
    clients.push_back(*std::move(c));
    auto s = clients.back()->Attach(job.job_id, r, *token, false, client::Transport::kShm);
    if (!s.ok()) return fail(s.status());
    sessions.push_back(*std::move(s));
    client::RankSession& session = *sessions.back();
    std::string flat(session.buffer_elements() * kEsize, '\0');
    for (size_t i = 0; i < session.spans().size(); ++i) {
      const common::ShardSpan& span = session.spans()[i];
      std::memcpy(flat.data() + span.rank_offset * kEsize,
                  model + (start[span.matrix] + span.offset) * kEsize, span.length * kEsize);
      auto p = session.ParamByteOffset(i);
      if (!p.ok()) return fail(p.status());
      param_at[r].push_back(*p);
    }
    if (auto st = session.InitParamsBuffer(flat.data(), /*float32=*/false); !st.ok()) {
      return fail(st);
    }
  }
  // One rank's part of a step, as its trainer would do it.
  auto rank_step = [&](int r, int64_t t) -> absl::Status {
    client::RankSession& session = *sessions[r];
    RETURN_IF_ERROR(session.SetHyper(hyper));
    ASSIGN_OR_RETURN(client::RankSession::View in, session.GradientView(t));
    for (const common::ShardSpan& span : session.spans()) {
      std::memcpy(in.data + span.rank_offset * kEsize,
                  grad + (start[span.matrix] + span.offset) * kEsize, span.length * kEsize);
    }
    RETURN_IF_ERROR(session.StepInPlace(t).status());
    ASSIGN_OR_RETURN(client::RankSession::View upd, session.UpdateView(t));
    for (size_t i = 0; i < session.spans().size(); ++i) {
      const common::ShardSpan& span = session.spans()[i];
      std::memcpy(model + (start[span.matrix] + span.offset) * kEsize, upd.data + param_at[r][i],
                  span.length * kEsize);
    }
    return absl::OkStatus();
  };
  std::map<std::string, double> before;
  double cpu0 = 0;
  for (int64_t t = 0; t < warmup + steps; ++t) {
    if (t == warmup) {
      before = PhaseSums(metrics, job.job_id);
      cpu0 = CpuSeconds(daemon);
    }
    absl::Notification go;
    std::vector<absl::Status> status(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        go.WaitForNotification();
        status[r] = rank_step(r, t);
      });
    }
    const auto t0 = Clock::now();
    go.Notify();
    for (auto& th : threads) th.join();
    const double seconds = Since(t0);
    for (const absl::Status& st : status) {
      if (!st.ok()) return fail(st);
    }
    if (t >= warmup) out.seconds.push_back(seconds);
  }
  out.cpu_seconds = CpuSeconds(daemon) - cpu0;
  const std::map<std::string, double> after = PhaseSums(metrics, job.job_id);
  if (!before.empty() && !after.empty()) {
    for (const auto& [name, sum] : after)
      extra->phase_per_step[name] = (sum - before[name]) / steps;
  }
  if (auto st = client.GetJob(job.job_id, *token); st.ok()) {
    extra->daemon_state_bytes = st->momentum_bytes();
    extra->backend = st->backend();
  }
  sessions.clear();
  (void)client.DeleteJob(job.job_id, *token);
  return out;
}

// "  world W: backend B; daemon holds N B of optimizer state; muond metrics per timed step ...".
std::string DaemonNote(int64_t world, const DaemonExtra& extra) {
  std::string line = absl::StrCat(
      "  world ", world, ": backend ", extra.backend.substr(0, extra.backend.find(' ')),
      "; daemon holds ", extra.daemon_state_bytes, " B of optimizer state; ");
  if (extra.phase_per_step.empty()) return line + "phases: metrics unavailable";
  // The phases are busy seconds of stages that may run concurrently (they can overlap); AdamW
  // runs on the pipeline's thread between them and is in none.
  double phases = 0;
  absl::StrAppend(&line, "muond metrics per timed step (s): step ",
                  absl::StrFormat("%.3f", extra.phase_per_step.at("step")), ";");
  for (const char* p : kPhases) {
    phases += extra.phase_per_step.at(p);
    absl::StrAppend(&line, " ", p, " ", absl::StrFormat("%.3f", extra.phase_per_step.at(p)));
  }
  return absl::StrCat(line, "; phases sum ", absl::StrFormat("%.3f", phases));
}

// The 1-minute load average (/proc/loadavg), or -1: other work on the machine skews every number.
double LoadAverage() {
  double load = -1;
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &load) != 1) load = -1;
    std::fclose(f);
  }
  return load;
}

// "N of M bf16 parameters identical (x%), max |diff| y" between two flat bf16 models.
std::string Agreement(const torch::Tensor& a, const torch::Tensor& b) {
  const int64_t same = a.eq(b).sum().item<int64_t>();
  const double max_diff =
      (a.to(torch::kFloat32) - b.to(torch::kFloat32)).abs().max().item<double>();
  return absl::StrCat(same, " of ", a.numel(), " bf16 parameters identical (",
                      absl::StrFormat("%.3f", 100.0 * same / a.numel()), "%), max |diff| ",
                      absl::StrFormat("%.3g", max_diff));
}

}  // namespace

int RunApplyBench(int argc, char** argv) {
  auto opts = ParseOptions(argc, argv);
  if (!opts.ok() && absl::IsCancelled(opts.status())) {
    PrintHelp();
    return 0;
  }
  if (!opts.ok()) {
    std::fprintf(stderr, "muond-bench apply: %s (see --help)\n",
                 std::string(opts.status().message()).c_str());
    return 2;
  }
  const Options& o = *opts;
  common::JobSpec spec = ModelSpec(o.layers, o.vocab);
  spec.state = o.state;
  int64_t total = 0, muon_total = 0;
  for (const auto& m : spec.matrices) {
    total += m.numel();
    if (m.optimizer == common::Optimizer::kMuon) muon_total += m.numel();
  }
  at::set_num_threads(o.threads);
  torch::manual_seed(7);
  const torch::Tensor params0 = (torch::randn({total}) * 0.02).to(torch::kBFloat16);
  const torch::Tensor grads = (torch::randn({total}) * 1e-3).to(torch::kBFloat16);
  std::printf(
      "muond-bench apply: %zu tensors (%lld layers, vocab %lld): %lld parameters, %lld Muon + "
      "%lld AdamW; bf16 params and grads; Muon standard NS %d steps in %s; state held as %s\n"
      "threads: in-process LibTorch %d (at::get_num_threads() = %d), muond --threads %d; "
      "%u hardware threads; %lld warm-up + %lld timed steps each, medians; load average %.2f\n",
      spec.matrices.size(), static_cast<long long>(o.layers), static_cast<long long>(o.vocab),
      static_cast<long long>(total), static_cast<long long>(muon_total),
      static_cast<long long>(total - muon_total), spec.muon.ns_steps,
      std::string(common::DTypeName(spec.muon.compute_dtype)).c_str(),
      std::string(common::StateDTypeName(spec.state.momentum)).c_str(), o.threads,
      at::get_num_threads(), o.threads, std::thread::hardware_concurrency(),
      static_cast<long long>(o.warmup), static_cast<long long>(o.steps), LoadAverage());
  std::fflush(stdout);

  const Measured base = InProcess(spec, params0, grads, o.warmup, o.steps);
  const double base_s = Median(base.seconds);
  // cores: CPU seconds of the process doing the math (this one, or muond) per timed second.
  std::printf("%-22s %5s %8s %10s %10s %10s %8s %6s %16s\n", "configuration", "ranks", "threads",
              "median s", "min s", "max s", "ratio", "cores", "trainer state B");
  auto row = [&](const char* name, const std::string& ranks, const Measured& m, double ratio) {
    double timed = 0;
    for (double x : m.seconds) timed += x;
    std::printf("%-22s %5s %8d %10.3f %10.3f %10.3f %8.3f %6.2f %16llu\n", name, ranks.c_str(),
                o.threads, Median(m.seconds), *std::min_element(m.seconds.begin(), m.seconds.end()),
                *std::max_element(m.seconds.begin(), m.seconds.end()), ratio, m.cpu_seconds / timed,
                static_cast<unsigned long long>(m.trainer_state_bytes));
    std::fflush(stdout);
  };
  row("in-process (LibTorch)", "1", base, 1.0);
  std::string parts = "  in-process parts (median s):";
  for (int p = 0; p < kNumParts; ++p) {
    absl::StrAppend(&parts, " ", kParts[p], " ", absl::StrFormat("%.3f", Median(base.parts[p])));
  }
  if (o.kernel) {
    const std::optional<double> kernel = KernelSeconds(spec, grads, o.warmup, o.steps);
    if (!kernel) return 1;
    absl::StrAppend(&parts,
                    "\n  muond's Muon kernel in this process (momentum, nesterov, NS, scale;",
                    " same-shape batches), median s: ", absl::StrFormat("%.3f", *kernel));
  }

  const std::string dir = MakeTempDir("muond-bench-apply");
  const std::string metrics = absl::StrCat("127.0.0.1:", FreePort());
  std::vector<std::string> extra_flags = {"--metrics-address", metrics};
  if (!o.backend.empty()) extra_flags.insert(extra_flags.end(), {"--backend", o.backend});
  extra_flags.insert(extra_flags.end(), o.daemon_flags.begin(), o.daemon_flags.end());
  std::string address;
  const pid_t daemon = StartDaemon(dir, o.threads, &address, extra_flags);
  auto client = client::Client::Connect(address);
  if (!client.ok() || !WaitHealthy(**client)) {
    std::fprintf(stderr, "muond-bench apply: muond did not start\n");
    StopDaemon(daemon, dir);
    return 1;
  }
  int code = 0;
  std::optional<double> result_ratio;
  int64_t result_world = 0;
  std::vector<std::string> notes;
  for (int64_t world : o.ranks) {
    DaemonExtra extra;
    std::optional<Measured> m =
        ThroughDaemon(**client, address, daemon, metrics, spec, static_cast<int>(world), params0,
                      grads, o.warmup, o.steps, &extra);
    if (!m) {
      code = 1;
      break;
    }
    const double ratio = Median(m->seconds) / base_s;
    row("muond shm (apply)", std::to_string(world), *m, ratio);
    // The world-1 configuration is the result (or the first one given, without world 1).
    if (world == 1 || !result_ratio) {
      result_ratio = ratio;
      result_world = world;
    }
    notes.push_back(DaemonNote(world, extra));
    notes.push_back(absl::StrCat("  world ", world, " vs in-process after ", o.warmup + o.steps,
                                 " steps: ", Agreement(m->params, base.params)));
  }
  StopDaemon(daemon, dir);
  std::printf("load average at the end: %.2f\n", LoadAverage());
  std::printf("%s\n", parts.c_str());
  for (const std::string& n : notes) std::printf("%s\n", n.c_str());
  if (code != 0 || !result_ratio) return code != 0 ? code : 1;
  std::printf(
      "trainer optimizer state: in-process %llu B (fp32 masters + momentum + AdamW "
      "moments), daemon path 0 B\n",
      static_cast<unsigned long long>(base.trainer_state_bytes));
  std::printf("ratio of the world-%lld configuration: daemon median / in-process median\n",
              static_cast<long long>(result_world));
  std::printf("result: apply ratio=%.3f target=%.2f\n", *result_ratio, kTarget);
  return 0;
}

}  // namespace muond::bench
