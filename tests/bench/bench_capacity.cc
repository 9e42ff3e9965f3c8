// `muond-bench capacity`: the host bytes per parameter that muond costs, as a new user sees them
// with `ps`/`top`: the growth of the resident peaks (VmHWM) of the daemon and of the trainer rank
// that talks to it, per parameter of the job.
//
// One measurement (a "run"): a fresh muond with its defaults (its own socket and state directory,
// as the other daemon benchmarks start it), one job of --small-matrices or --large-matrices
// --dim x --dim matrices (bf16 parameters and gradients), one rank (world size 1, ZeRO stage 2)
// over shared memory. The rank streams: each matrix's gradients are written into the shared
// gradient buffer and posted as a part at once (RankSession::PostPart), and each matrix's result
// is copied out as the daemon's progress words announce it (PartsProgress), as muon_offload's
// streaming optimizer does. Before the job is created both peaks are reset (`echo 5 >
// /proc/PID/clear_refs` sets VmHWM to the current RSS) and read; the job's initial weights are
// uploaded (apply mode), --steps steps run, and both peaks are read again. growth = (muond VmHWM
// after - before) + (rank VmHWM after - before). Every run is a child process of this one (a
// fresh rank: nothing freed by an earlier run hides in its heap), which starts its own daemon.
// What a GPU would hold on the trainer's side (the gradients produced, the parameters the results
// go to) is one matrix each here, allocated before the reset: the rank's growth is muond's part
// (its shared-memory regions, the client library's buffers).
//
// The figure: slope = (growth_large - growth_small) / (params_large - params_small), so the fixed
// costs (the daemon's threads and pools, gRPC) drop out. Beside it the in-process reference:
// ZeRO-Offload with Muon holds 12 B/param on the host in apply mode (fp32 master, momentum and
// gradient), 4 in update mode (fp32 momentum); with AdamW tensors 16 for those (master, m, v,
// gradient).
//
// Rows (kRows): apply and update mode; apply with delay=1 (driven as muon_offload's
// DelayedUpdates drives it: step t waits for t-1's results, then posts its gradients whole);
// apply with every 2nd tensor AdamW; nodes2, two daemons each holding a two-phase node job of every
// 2nd matrix (CommitStep after each step) and one rank process attached to both, per node per
// owned parameter; int8, apply mode with the momentum held int8 (job.json "state"); clip, apply
// mode with max_grad_norm 1. The AdamW and clip rows are table rows only (no target).
//
// Per run it also prints muond's VmRSS, VmLck and RssShmem at the end, the rank's RssShmem, and
// what GetJob reports (momentum_bytes, gather_peak_bytes); after the table, JobStatus.memory's
// kinds (held at the end / reserved at admission) as slopes between the two runs.
//
// Note on the sum: the shared-memory regions are mapped by both processes, so a page both touched
// counts in both VmHWM (as it does for a user adding up RSS). The Pss column (/proc/PID/
// smaps_rollup at the end of the run minus before) counts such a page once.
#include <fcntl.h>
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/status_macros.h"
#include "tests/bench/bench.h"

namespace muond::bench {
namespace {

constexpr double kMuonLr = 0.02, kMuonWd = 0.01, kAdamLr = 3e-4, kAdamWd = 0.1;
constexpr size_t kEsize = 2;  // bf16 gradients, parameters and results

// What a row measures. `target` < 0: a table row only, no result line.
enum class Kind { kApply, kUpdate, kDelayed, kAdamW, kNodes2, kInt8, kClip };
struct Row {
  Kind kind;
  const char* flag;  // --rows name
  const char* name;  // table row and result name
  const char* what;
  double reference;  // the in-process ZeRO-Offload bytes per parameter
  double target;
};
constexpr Row kRows[] = {
    {Kind::kApply, "apply", "capacity", "apply, fp32 state, streamed", 12, 10.5},
    // The in-process offload holds an fp32 momentum whatever muond holds: 12 stays its figure.
    {Kind::kInt8, "int8", "capacity_int8", "apply, int8 momentum, streamed", 12, 7.5},
    {Kind::kUpdate, "update", "capacity_update", "update, fp32 momentum, streamed", 4, 8.5},
    {Kind::kDelayed, "delayed", "capacity_delayed", "apply, delay=1 (DPU)", 12, 12.5},
    {Kind::kAdamW, "adamw", "adamw_half", "apply, every 2nd tensor AdamW, streamed", 14, -1},
    // Global clipping (max_grad_norm 1: every step clips) decides its clip at the seal and keeps
    // one copy of the state, as the apply row does.
    {Kind::kClip, "clip", "apply_clip", "apply, max_grad_norm 1, streamed", 12, -1},
    // Issue 47's capacity_nodes2: 2 nodes emulated as 2 daemons on this machine (for memory a
    // network namespace changes nothing), per node per owned parameter.
    {Kind::kNodes2, "nodes2", "capacity_nodes2", "apply, 2 daemons, per node per owned param", 12,
     10.5},
};

struct Options {
  int64_t dim = 2048;
  int64_t small = 8;
  int64_t large = 24;
  int64_t steps = 3;
  int64_t threads = 0;  // muond --threads (each of the two daemons of nodes2 gets half)
  std::vector<const Row*> rows;
};

absl::StatusOr<Options> ParseOptions(int argc, char** argv) {
  auto flags = ParseFlags(argc, argv,
                          {"dim", "small-matrices", "large-matrices", "steps", "threads", "rows"});
  if (!flags.ok()) return flags.status();
  if (flags->count("help")) return absl::CancelledError("help");
  Options o;
  o.threads = std::max(1u, std::thread::hardware_concurrency());
  for (auto [name, v] : std::vector<std::pair<const char*, int64_t*>>{{"dim", &o.dim},
                                                                      {"small-matrices", &o.small},
                                                                      {"large-matrices", &o.large},
                                                                      {"steps", &o.steps},
                                                                      {"threads", &o.threads}}) {
    auto it = flags->find(name);
    if (it == flags->end()) continue;
    if (!absl::SimpleAtoi(it->second, v) || *v < 1 || *v > 65536) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " '", it->second, "'"));
    }
  }
  if (o.large <= o.small) {
    return absl::InvalidArgumentError("--large-matrices must be more than --small-matrices");
  }
  const std::string rows = flags->count("rows") ? flags->at("rows") : "";
  for (const Row& row : kRows) {
    if (rows.empty()) o.rows.push_back(&row);
  }
  for (const std::string& name : SplitList(rows)) {
    auto it = std::find_if(std::begin(kRows), std::end(kRows),
                           [&](const Row& r) { return name == r.flag; });
    if (it == std::end(kRows)) return absl::InvalidArgumentError("--rows: unknown row " + name);
    o.rows.push_back(it);
  }
  return o;
}

void PrintHelp() {
  std::printf(
      "usage: muond-bench capacity [--dim 2048] [--small-matrices 8] [--large-matrices 24]\n"
      "                            [--steps 3] [--threads N] [--rows apply,update,...]\n"
      "  Host bytes per parameter of muond: the growth of the daemon's and the rank's VmHWM\n"
      "  (peaks reset through /proc/PID/clear_refs before the job is created) over job creation,\n"
      "  the initial weights and --steps streamed steps of --dim x --dim bf16 Muon matrices, at\n"
      "  two job sizes; reported as the slope between them (fixed costs drop out). A fresh\n"
      "  daemon (defaults) and a fresh rank process per measurement. Quick run:\n"
      "    muond-bench capacity --dim 1024 --small-matrices 2 --large-matrices 6\n"
      "  --threads  muond --threads (default: all CPUs; nodes2's two daemons get half each)\n"
      "  --rows     any of apply, int8, update, delayed, adamw, clip, nodes2 (default: all)\n"
      "Result lines (measured slopes, B/param):\n"
      "  result: capacity ratio=<apply> target=10.5\n"
      "  result: capacity_int8 ratio=<apply, int8 momentum> target=7.5\n"
      "  result: capacity_update ratio=<update> target=8.5\n"
      "  result: capacity_delayed ratio=<apply, delay=1> target=12.5\n"
      "  result: capacity_nodes2 ratio=<apply, 2 daemons, per node per owned parameter> "
      "target=10.5\n"
      "  (adamw and clip are table rows only)\n");
}

// ---- /proc

// Bytes of the memory figures of one process (0: this one); -1 where unreadable.
struct ProcMemory {
  int64_t hwm = -1, rss = -1, lck = -1, shmem = -1, pss = -1;
};

// The "<field>: N kB" value of a /proc status-like text, in bytes; -1 when absent.
int64_t KbField(const std::string& text, const std::string& field) {
  const size_t at = text.find("\n" + field + ":");
  if (at == std::string::npos) return -1;
  std::istringstream in(text.substr(at + field.size() + 2));
  int64_t kb = -1;
  in >> kb;
  return kb < 0 ? -1 : kb * 1024;
}

std::string ProcFile(pid_t pid, const char* name) {
  std::ifstream in(
      absl::StrCat("/proc/", pid == 0 ? std::string("self") : std::to_string(pid), "/", name));
  return "\n" + std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

ProcMemory ReadMemory(pid_t pid) {
  const std::string status = ProcFile(pid, "status");
  ProcMemory m;
  m.hwm = KbField(status, "VmHWM");
  m.rss = KbField(status, "VmRSS");
  m.lck = KbField(status, "VmLck");
  m.shmem = KbField(status, "RssShmem");
  m.pss = KbField(ProcFile(pid, "smaps_rollup"), "Pss");
  return m;
}

// `echo 5 > /proc/PID/clear_refs`: VmHWM becomes the current RSS.
absl::Status ResetPeak(pid_t pid) {
  const std::string path =
      absl::StrCat("/proc/", pid == 0 ? std::string("self") : std::to_string(pid), "/clear_refs");
  const int fd = open(path.c_str(), O_WRONLY);
  const bool ok = fd >= 0 && write(fd, "5", 1) == 1;
  if (fd >= 0) close(fd);
  return ok ? absl::OkStatus() : absl::PermissionDeniedError("cannot write 5 to " + path);
}

// ---- one run, in a child process

// What a run measured; plain bytes, sent from the child through a pipe.
struct RunResult {
  int64_t params = 0;
  int64_t muond_growth = 0;  // VmHWM after - before, summed over the daemons
  int64_t rank_growth = 0;
  int64_t pss_growth = 0;                                 // Pss at the end - before, daemons + rank
  int64_t muond_rss = 0, muond_lck = 0, muond_shmem = 0;  // at the end, summed over the daemons
  int64_t rank_shmem = 0;
  uint64_t state_bytes = 0;  // JobStatus.momentum_bytes, summed
  uint64_t gather_peak = 0;  // JobStatus.gather_peak_bytes, the largest
  double step_seconds = 0;
  char backend[64] = {};  // JobStatus.backend's first word
  // JobStatus.memory: held now and reserved, by kind, summed over the daemons.
  static constexpr int kMaxKinds = 12;
  int kinds = 0;
  char kind[kMaxKinds][24] = {};
  uint64_t kind_bytes[kMaxKinds] = {}, kind_footprint[kMaxKinds] = {};
  char error[480] = {};
};

// Adds JobStatus.memory (MemoryUse: kind, bytes held, footprint_bytes reserved) to `r`, by kind.
void AddMemoryKinds(const v1::JobStatus& st, RunResult& r) {
  for (const v1::MemoryUse& use : st.memory()) {
    int k = 0;
    while (k < r.kinds && use.kind() != r.kind[k]) ++k;
    if (k == r.kinds) {
      if (r.kinds == RunResult::kMaxKinds) continue;
      std::snprintf(r.kind[r.kinds++], sizeof(r.kind[0]), "%s", use.kind().c_str());
    }
    r.kind_bytes[k] += use.bytes();
    r.kind_footprint[k] += use.footprint_bytes();
  }
}

// The trainer's side that a GPU would hold: one matrix of initial parameters, of gradients and of
// results, bf16 bits (the same gradients for every matrix).
struct TrainerSide {
  std::vector<uint16_t> params0, grads, device;
};

TrainerSide MakeTrainerSide(int64_t dim) {
  TrainerSide side;
  const size_t n = static_cast<size_t>(dim * dim);
  side.params0.resize(n);
  side.grads.resize(n);
  side.device.assign(n, 0);
  uint32_t x = 12345;
  auto bf16 = [&](float scale) {
    x = x * 1664525u + 1013904223u;
    const float v = scale * (static_cast<float>(x >> 8) / 16777216.0f - 0.5f);
    uint32_t bits = 0;
    std::memcpy(&bits, &v, 4);
    return static_cast<uint16_t>(bits >> 16);
  };
  for (size_t i = 0; i < n; ++i) {
    side.params0[i] = bf16(0.04f);
    side.grads[i] = bf16(0.002f);
  }
  return side;
}

// Node `node` of `nodes` (1: a single-node job): its part of `matrices` matrices, every `nodes`th.
common::JobSpec CapacityJob(Kind kind, int64_t matrices, int64_t dim, int node, int nodes) {
  common::JobSpec spec;
  spec.job_id = nodes > 1 ? absl::StrCat("capacity.node", node) : "capacity";
  spec.world_size = 1;
  spec.zero_stage = 2;
  const bool apply = kind != Kind::kUpdate;
  if (apply) {
    spec.mode = common::JobMode::kApply;
    spec.groups = {{"muon", kMuonLr, kMuonWd}};
    if (kind == Kind::kAdamW) spec.groups.push_back({"adamw", kAdamLr, kAdamWd});
    spec.adamw = {0.9, 0.95, 1e-8};
  }
  if (nodes > 1) spec.multinode = {"capacity", node, nodes};
  if (kind == Kind::kInt8) spec.state.momentum = common::StateDType::kInt8;
  if (kind == Kind::kClip) spec.max_grad_norm = 1.0;
  // As muon_offload asks (optim_spec.py): one buffer per region, the delayed mode too (step t
  // installs t-1's results before it writes its own gradients: RunSteps).
  spec.step_buffers = 1;
  for (int64_t i = node; i < matrices; i += nodes) {
    common::MatrixSpec m;
    m.name = absl::StrCat("layers.", i, ".weight");
    m.shape = {dim, dim};
    m.dtype = common::DType::kBFloat16;
    if (apply) {
      m.param_dtype = common::DType::kBFloat16;
      const bool adamw = kind == Kind::kAdamW && i % 2 == 1;
      m.optimizer = adamw ? common::Optimizer::kAdamW : common::Optimizer::kMuon;
      m.group = adamw ? "adamw" : "muon";
    }
    spec.matrices.push_back(std::move(m));
  }
  return spec;
}

// One daemon with its job and the rank attached to it.
struct Node {
  std::string dir, address, token;
  pid_t pid = -1;
  std::unique_ptr<client::Client> client;
  common::JobSpec spec;
  std::unique_ptr<client::RankSession> session;
  ProcMemory before;
};

// Where span i's result lies in the update view: apply mode's new parameters at
// ParamByteOffset(i), update mode's update at the span's place in the flat buffer.
absl::StatusOr<uint64_t> ResultOffset(client::RankSession& s, size_t i) {
  if (s.apply()) return s.ParamByteOffset(i);
  return s.spans()[i].rank_offset * kEsize;
}

absl::Status CopyResult(client::RankSession& s, const client::RankSession::View& out, size_t i,
                        TrainerSide& side) {
  ASSIGN_OR_RETURN(const uint64_t at, ResultOffset(s, i));
  const common::ShardSpan& span = s.spans()[i];
  std::memcpy(side.device.data() + span.offset, out.data + at, span.length * kEsize);
  return absl::OkStatus();
}

absl::Status InitWeights(client::RankSession& s, const TrainerSide& side) {
  ASSIGN_OR_RETURN(client::RankSession::View v, s.InitParamsView());
  for (size_t i = 0; i < s.spans().size(); ++i) {
    ASSIGN_OR_RETURN(const uint64_t at, s.ParamByteOffset(i));
    const common::ShardSpan& span = s.spans()[i];
    std::memcpy(v.data + at, side.params0.data() + span.offset, span.length * kEsize);
  }
  return s.InitParamsInPlace();
}

absl::Status SetHyper(client::RankSession& s) {
  if (!s.apply()) return absl::OkStatus();
  client::StepHyper hyper;
  for (const common::ParamGroup& g : s.spec().groups) {
    hyper.lr.push_back({g.name, g.name == "muon" ? kMuonLr : kAdamLr});
  }
  return s.SetHyper(hyper);
}

// Step t's gradients, written span by span and each posted as a part at once (`streamed`), or
// all written and posted as one last part (delay=1's whole send, as muon_offload does it).
absl::Status PostGradients(client::RankSession& s, int64_t t, const TrainerSide& side,
                           bool streamed) {
  RETURN_IF_ERROR(SetHyper(s));
  ASSIGN_OR_RETURN(client::RankSession::View in, s.GradientView(t));
  for (const common::ShardSpan& span : s.spans()) {
    std::memcpy(in.data + span.rank_offset * kEsize, side.grads.data() + span.offset,
                span.length * kEsize);
    if (streamed) {
      RETURN_IF_ERROR(s.PostPart(t, span.rank_offset * kEsize, span.length * kEsize, false));
    }
  }
  return streamed ? s.PostPart(t, 0, 0, true) : s.PostPart(t, 0, in.size, true);
}

// Step t's results: each span copied out as the daemon announces it (`early`, the streaming
// optimizer's EarlyResults), or all of them once the step ended (delay=1's install).
absl::Status CollectResults(client::RankSession& s, int64_t t, TrainerSide& side, bool early) {
  ASSIGN_OR_RETURN(client::RankSession::View out, s.UpdateView(t));
  std::vector<bool> done(s.spans().size(), false), ready;
  bool ended = !early;
  while (!ended) {
    RETURN_IF_ERROR(s.PartsProgress(t, -1, &ready, &ended));
    for (size_t i = 0; i < ready.size() && !ended; ++i) {
      if (!ready[i] || done[i]) continue;
      RETURN_IF_ERROR(CopyResult(s, out, i, side));
      done[i] = true;
    }
  }
  ASSIGN_OR_RETURN(const client::StepResult result, s.WaitParts(t));
  if (result.skipped) return absl::InternalError(absl::StrCat("step ", t, " was skipped"));
  for (size_t i = 0; i < done.size(); ++i) {
    if (!done[i]) RETURN_IF_ERROR(CopyResult(s, out, i, side));
  }
  return absl::OkStatus();
}

// Every step of the run over every node. Streamed: post all nodes, collect all, then (nodes)
// commit each node's prepared step. Delayed (one node): step t installs step t-1's results
// before it sends its own gradients, and the last step is installed at the end (drain()).
absl::Status RunSteps(std::vector<Node>& nodes, int64_t steps, bool delayed, TrainerSide& side) {
  for (int64_t t = 0; t < steps; ++t) {
    if (delayed) {
      client::RankSession& s = *nodes[0].session;
      if (t > 0) RETURN_IF_ERROR(CollectResults(s, t - 1, side, false));
      RETURN_IF_ERROR(PostGradients(s, t, side, false));
      continue;
    }
    for (Node& n : nodes) RETURN_IF_ERROR(PostGradients(*n.session, t, side, true));
    for (Node& n : nodes) RETURN_IF_ERROR(CollectResults(*n.session, t, side, true));
    if (nodes.size() < 2) continue;
    for (Node& n : nodes) RETURN_IF_ERROR(n.client->CommitStep(n.spec.job_id, n.token, t));
  }
  if (delayed) RETURN_IF_ERROR(CollectResults(*nodes[0].session, steps - 1, side, false));
  return absl::OkStatus();
}

// Starts the daemons (each its own temporary directory) and waits until they serve.
absl::Status StartNodes(std::vector<Node>& nodes, int64_t threads) {
  const int per_node = static_cast<int>(std::max<int64_t>(1, threads / nodes.size()));
  for (Node& n : nodes) {
    n.dir = MakeTempDir("muond-bench-capacity");
    // Its own metrics port (the default one may be taken, and nodes2 starts two daemons).
    n.pid = StartDaemon(n.dir, per_node, &n.address,
                        {"--metrics-address", absl::StrCat("127.0.0.1:", FreePort())});
    ASSIGN_OR_RETURN(n.client, client::Client::Connect(n.address));
    if (!WaitHealthy(*n.client)) return absl::UnavailableError("muond did not start");
  }
  return absl::OkStatus();
}

// Creates each node's job, attaches its rank over shared memory and uploads the initial weights.
absl::Status CreateJobs(std::vector<Node>& nodes, Kind kind, int64_t matrices, int64_t dim,
                        const TrainerSide& side) {
  const int count = static_cast<int>(nodes.size());
  for (int k = 0; k < count; ++k) {
    Node& n = nodes[k];
    n.spec = CapacityJob(kind, matrices, dim, k, count);
    ASSIGN_OR_RETURN(n.token, n.client->CreateJob(n.spec));
    ASSIGN_OR_RETURN(n.session,
                     n.client->Attach(n.spec.job_id, 0, n.token, false, client::Transport::kShm));
    if (n.session->apply()) RETURN_IF_ERROR(InitWeights(*n.session, side));
  }
  return absl::OkStatus();
}

// The run itself (see the top comment); fills `r` and returns its error.
absl::Status Measure(const Options& o, Kind kind, int64_t matrices, std::vector<Node>& nodes,
                     RunResult& r) {
  TrainerSide side = MakeTrainerSide(o.dim);  // before the reset: the GPU's share
  RETURN_IF_ERROR(StartNodes(nodes, o.threads));
  malloc_trim(0);
  for (Node& n : nodes) {
    RETURN_IF_ERROR(ResetPeak(n.pid));
    n.before = ReadMemory(n.pid);
  }
  RETURN_IF_ERROR(ResetPeak(0));
  const ProcMemory rank_before = ReadMemory(0);
  RETURN_IF_ERROR(CreateJobs(nodes, kind, matrices, o.dim, side));
  const Clock::time_point t0 = Clock::now();
  RETURN_IF_ERROR(RunSteps(nodes, o.steps, kind == Kind::kDelayed, side));
  r.step_seconds = Since(t0);
  const ProcMemory rank_after = ReadMemory(0);
  r.params = matrices * o.dim * o.dim;
  r.rank_growth = rank_after.hwm - rank_before.hwm;
  r.rank_shmem = rank_after.shmem;
  r.pss_growth = rank_after.pss - rank_before.pss;
  for (Node& n : nodes) {
    const ProcMemory after = ReadMemory(n.pid);
    r.muond_growth += after.hwm - n.before.hwm;
    r.pss_growth += after.pss - n.before.pss;
    r.muond_rss += after.rss;
    r.muond_lck += after.lck;
    r.muond_shmem += after.shmem;
    ASSIGN_OR_RETURN(const v1::JobStatus st, n.client->GetJob(n.spec.job_id, n.token));
    r.state_bytes += st.momentum_bytes();
    r.gather_peak = std::max<uint64_t>(r.gather_peak, st.gather_peak_bytes());
    AddMemoryKinds(st, r);
    std::snprintf(r.backend, sizeof(r.backend), "%s",
                  st.backend().substr(0, st.backend().find(' ')).c_str());
  }
  return absl::OkStatus();
}

// The child's whole life: measure, clean up, send the result.
[[noreturn]] void ChildRun(const Options& o, Kind kind, int64_t matrices, int fd) {
  RunResult r;
  std::vector<Node> nodes(kind == Kind::kNodes2 ? 2 : 1);
  const absl::Status s = Measure(o, kind, matrices, nodes, r);
  if (!s.ok()) std::snprintf(r.error, sizeof(r.error), "%s", s.ToString().c_str());
  for (Node& n : nodes) {
    n.session.reset();
    if (n.client != nullptr && !n.token.empty()) (void)n.client->DeleteJob(n.spec.job_id, n.token);
    if (n.pid > 0) StopDaemon(n.pid, n.dir);
  }
  const char* p = reinterpret_cast<const char*>(&r);
  for (size_t done = 0; done < sizeof(r);) {
    const ssize_t w = write(fd, p + done, sizeof(r) - done);
    if (w <= 0) break;
    done += static_cast<size_t>(w);
  }
  _exit(0);
}

// One run in a fresh child process (this process never talks gRPC itself, so forking is safe).
RunResult RunInChild(const Options& o, Kind kind, int64_t matrices) {
  RunResult r;
  int fds[2];
  if (pipe(fds) != 0) {
    std::snprintf(r.error, sizeof(r.error), "pipe: %s", std::strerror(errno));
    return r;
  }
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    ChildRun(o, kind, matrices, fds[1]);
  }
  close(fds[1]);
  size_t got = 0;
  char* p = reinterpret_cast<char*>(&r);
  while (pid > 0 && got < sizeof(r)) {
    const ssize_t n = read(fds[0], p + got, sizeof(r) - got);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  close(fds[0]);
  int status = 0;
  if (pid > 0) waitpid(pid, &status, 0);
  if (got != sizeof(r)) {
    r = RunResult();
    std::snprintf(r.error, sizeof(r.error), "the measuring process ended (status %d)", status);
  }
  return r;
}

// ---- the report

constexpr double kMiB = 1024.0 * 1024.0;

void PrintRun(const Row& row, int64_t matrices, int64_t steps, const RunResult& r) {
  std::printf(
      "  %-16s %3lld matrices (%lld params): growth muond %+.1f MiB + rank %+.1f MiB = %.3f "
      "B/param; Pss %+.1f MiB; muond at the end VmRSS %.1f MiB, VmLck %.1f MiB, RssShmem %.1f "
      "MiB; rank RssShmem %.1f MiB; JobStatus.momentum_bytes %llu (%.3f B/param), "
      "gather_peak_bytes %llu; backend %s; %lld steps %.1f s\n",
      row.name, static_cast<long long>(matrices), static_cast<long long>(r.params),
      r.muond_growth / kMiB, r.rank_growth / kMiB,
      static_cast<double>(r.muond_growth + r.rank_growth) / r.params, r.pss_growth / kMiB,
      r.muond_rss / kMiB, r.muond_lck / kMiB, r.muond_shmem / kMiB, r.rank_shmem / kMiB,
      static_cast<unsigned long long>(r.state_bytes), static_cast<double>(r.state_bytes) / r.params,
      static_cast<unsigned long long>(r.gather_peak), r.backend, static_cast<long long>(steps),
      r.step_seconds);
  std::fflush(stdout);
}

// A row's two runs and its slopes (B/param) between them.
struct RowRuns {
  const Row* row;
  RunResult small, large;
  double Slope(int64_t RunResult::*field) const {
    return static_cast<double>(large.*field - small.*field) / (large.params - small.params);
  }
  double muond() const { return Slope(&RunResult::muond_growth); }
  double rank() const { return Slope(&RunResult::rank_growth); }
  double total() const { return muond() + rank(); }
};

void PrintHeader(const Options& o) {
  const int64_t per = o.dim * o.dim;
  std::printf(
      "muond-bench capacity: host bytes per parameter of muond, started as the other daemon "
      "benches start it (--threads %lld, nodes2: 2 daemons with --threads %lld each; "
      "--log-level warning, a free --metrics-address; every other option its default)\n"
      "job: %lldx%lld matrices, bf16 parameters and gradients, world size 1, ZeRO stage 2, shared "
      "memory, streamed (a part per matrix posted as it is written; results copied out as the "
      "progress words announce them); %lld vs %lld matrices (%lld vs %lld parameters); %lld "
      "steps after the initial weights (apply mode)\n"
      "growth = (muond VmHWM after - before) + (rank VmHWM after - before), both peaks reset "
      "with `echo 5 > /proc/PID/clear_refs` before the job is created; a fresh daemon and rank "
      "process per run; B/param = (growth_large - growth_small) / (params_large - params_small)\n"
      "delay=1: driven as muon_offload's DelayedUpdates does it over shared memory (the C++ "
      "client has no delay option; it offers the same calls): step t waits for step t-1 and "
      "copies its results, then writes and posts its own gradients whole and returns; "
      "ShmChannel::Post of step t+1 waits for step t, so t+1's gradients cannot reach muond "
      "while t computes (the overlap is with the trainer's forward and backward)\n",
      static_cast<long long>(o.threads),
      static_cast<long long>(std::max<int64_t>(1, o.threads / 2)), static_cast<long long>(o.dim),
      static_cast<long long>(o.dim), static_cast<long long>(o.small),
      static_cast<long long>(o.large), static_cast<long long>(o.small * per),
      static_cast<long long>(o.large * per), static_cast<long long>(o.steps));
  std::fflush(stdout);
}

void PrintTable(const std::vector<RowRuns>& done) {
  std::printf("\n%-17s %-42s %9s %8s %8s %8s %10s %11s %7s\n", "row", "configuration", "B/param",
              "muond", "rank", "Pss", "JobStatus", "in-process", "target");
  for (const RowRuns& r : done) {
    const double d = static_cast<double>(r.large.params - r.small.params);
    const double state =
        (static_cast<double>(r.large.state_bytes) - static_cast<double>(r.small.state_bytes)) / d;
    const std::string target = r.row->target < 0 ? "-" : absl::StrFormat("%.1f", r.row->target);
    std::printf("%-17s %-42s %9.3f %8.3f %8.3f %8.3f %10.3f %11.1f %7s\n", r.row->name, r.row->what,
                r.total(), r.muond(), r.rank(), r.Slope(&RunResult::pss_growth), state,
                r.row->reference, target.c_str());
  }
  std::printf(
      "  B/param = muond + rank (VmHWM slopes); Pss: the same bytes with a page shared by muond "
      "and the rank counted once (at the end of the run); JobStatus: the slope of "
      "momentum_bytes; in-process: ZeRO-Offload's host bytes for the same job (apply: fp32 "
      "master + momentum + gradient; update: fp32 momentum; AdamW tensors: master + m + v + "
      "gradient)\n");
}

// JobStatus.memory by kind, as slopes: held at the end of the run / reserved at admission.
void PrintKinds(const std::vector<RowRuns>& done) {
  bool any = false;
  for (const RowRuns& r : done) any = any || r.large.kinds > 0;
  if (!any) {
    std::printf("per-kind breakdown: not available (JobStatus.memory is empty)\n");
    return;
  }
  std::printf(
      "per-kind breakdown (JobStatus.memory, B/param slopes: held at the end / reserved)\n");
  for (const RowRuns& r : done) {
    std::string line = absl::StrFormat("  %-17s", r.row->name);
    const double d = static_cast<double>(r.large.params - r.small.params);
    for (int k = 0; k < r.large.kinds; ++k) {
      int j = 0;  // the same kind in the small run (0 bytes when absent)
      while (j < r.small.kinds && std::strcmp(r.small.kind[j], r.large.kind[k]) != 0) ++j;
      const bool in_small = j < r.small.kinds;
      const double held = (static_cast<double>(r.large.kind_bytes[k]) -
                           (in_small ? static_cast<double>(r.small.kind_bytes[j]) : 0)) /
                          d;
      const double reserved = (static_cast<double>(r.large.kind_footprint[k]) -
                               (in_small ? static_cast<double>(r.small.kind_footprint[j]) : 0)) /
                              d;
      absl::StrAppend(&line, " ", r.large.kind[k], " ",
                      absl::StrFormat("%.3f/%.3f", held, reserved));
    }
    std::printf("%s\n", line.c_str());
  }
}

}  // namespace

int RunCapacityBench(int argc, char** argv) {
  auto opts = ParseOptions(argc, argv);
  if (!opts.ok() && absl::IsCancelled(opts.status())) {
    PrintHelp();
    return 0;
  }
  if (!opts.ok()) {
    std::fprintf(stderr, "muond-bench capacity: %s (see --help)\n",
                 std::string(opts.status().message()).c_str());
    return 2;
  }
  const Options& o = *opts;
  PrintHeader(o);
  std::vector<RowRuns> done;
  int code = 0;
  for (const Row* row : o.rows) {
    RowRuns runs{row, RunInChild(o, row->kind, o.small), RunResult()};
    if (runs.small.error[0] == '\0') {
      PrintRun(*row, o.small, o.steps, runs.small);
      runs.large = RunInChild(o, row->kind, o.large);
    }
    const RunResult& failed = runs.small.error[0] != '\0' ? runs.small : runs.large;
    if (failed.error[0] != '\0') {
      std::printf("%s: not measured: %s\n", row->name, failed.error);
      code = 1;
      continue;
    }
    PrintRun(*row, o.large, o.steps, runs.large);
    done.push_back(runs);
  }
  PrintTable(done);
  PrintKinds(done);
  for (const RowRuns& r : done) {
    if (r.row->kind != Kind::kNodes2) continue;
    std::printf(
        "%s: 2 nodes emulated as 2 daemons on this machine, each with a "
        "two-phase node job of every 2nd matrix (CommitStep after each step), one rank process "
        "attached to both; B/param = the growth of both daemons and the rank over the parameters "
        "of both, i.e. per node per owned parameter\n",
        r.row->name);
  }
  for (const RowRuns& r : done) {
    if (r.row->target < 0) continue;
    std::printf("result: %s ratio=%.3f target=%.1f\n", r.row->name, r.total(), r.row->target);
  }
  return code;
}

}  // namespace muond::bench
