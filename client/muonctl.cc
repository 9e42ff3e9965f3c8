// muonctl: command-line control of a muond daemon. See `muonctl --help`.
//
// Exit codes: 0 success; 1..16 the gRPC status code of the failure (3 INVALID_ARGUMENT, 5 NOT_FOUND,
// 6 ALREADY_EXISTS, 7 PERMISSION_DENIED, 9 FAILED_PRECONDITION, 14 UNAVAILABLE, 16
// UNAUTHENTICATED, ...), whether it came from the daemon or from a local file; 64 usage error.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "client/client.h"
#include "client/muonctl_util.h"
#include "client/progress_display.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/layout.h"
#include "common/paths.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace muond::client {
namespace {

constexpr int kUsageExit = 64;

constexpr char kUsage[] =
    "Usage: muonctl [--address ADDR] [--tls-ca F] [--tls-cert F --tls-key F] COMMAND [options]\n"
    "\n"
    "Commands:\n"
    "  health                               print SERVING when the daemon serves (exit 0)\n"
    "  job create --spec job.json [--token-file F]\n"
    "       [--restore-from JOB [--restore-token-file F2] [--restore-generation G |\n"
    "        --restore-step S]]\n"
    "                                       create a job; its token goes to F (mode 0600), or\n"
    "                                       is printed when no file is given. --restore-from:\n"
    "                                       its momentum and next step come from a checkpoint\n"
    "                                       of job JOB (token from F2, else $MUOND_JOB_TOKEN);\n"
    "                                       world size and ZeRO stage may differ\n"
    "  job create --spec job.json --import-dir DIR [--token-file F]\n"
    "                                       create a job whose whole optimizer state and next\n"
    "                                       step come from the exports in DIR (checkpoint\n"
    "                                       export of every node's job, one step): each tensor\n"
    "                                       of the job by name; other nodes, world size and\n"
    "                                       ZeRO stage than the exporting jobs' may be used\n"
    "  job list [--token-file F]            list the jobs (never their tokens); other users'\n"
    "                                       jobs show id, sizes and state only (MATRICES -)\n"
    "                                       unless F (or $MUOND_JOB_TOKEN) holds their token\n"
    "  plan JOB.json NODES...               the ownership plan of the job over NODES nodes\n"
    "                                       (tensors per node, FLOPs and bytes max/mean); local\n"
    "  job show --job ID [--token-file F]   print a job's status\n"
    "  job delete --job ID [--token-file F] delete a job and its state\n"
    "  job reset --job ID [--step N] [--token-file F]\n"
    "                                       zero the momentum, clear a fence, expect step N (0)\n"
    "  checkpoint save --job ID [--token-file F]\n"
    "                                       write a checkpoint generation; returns once it is\n"
    "                                       durable on disk\n"
    "  checkpoint load --job ID [--generation G | --step S] [--token-file F]\n"
    "                                       load generation G, the newest at step S, or the\n"
    "                                       newest good one; clears a fence\n"
    "  checkpoint list --job ID [--token-file F]\n"
    "                                       the job's generations, newest first\n"
    "  checkpoint export --job ID --dir DIR [--generation G | --step S] [--dtype held|float32]\n"
    "                    [--token-file F]\n"
    "                                       write the job's whole optimizer state (live, or of\n"
    "                                       generation G / the newest at step S) by tensor name\n"
    "                                       into DIR as ID.safetensors + ID.manifest.json;\n"
    "                                       several nodes' jobs export into one DIR; arrays as\n"
    "                                       the job holds them (default) or decoded to float32\n"
    "  step --job ID --rank R --step T --grads IN.safetensors --out OUT.safetensors\n"
    "       [--token-file F] [--transport auto|shm|grpc]\n"
    "       [--lr GROUP=VALUE ... [--wd GROUP=VALUE ...] [--grad-divisor X]]\n"
    "       [--max-logits LOGITS.safetensors]\n"
    "                                       push one step and write the update; auto: shared\n"
    "                                       memory when the daemon is on this host, else gRPC.\n"
    "                                       Apply-mode jobs: --lr for every parameter group,\n"
    "                                       --wd (default: the group's weight_decay) and\n"
    "                                       --grad-divisor (default 1) optional; OUT receives\n"
    "                                       the rank's new parameters in the param dtype.\n"
    "                                       Jobs with qk_clip: --max-logits, one float32 tensor\n"
    "                                       per pair named by its q tensor, q_heads values (the\n"
    "                                       largest attention logit of each query head)\n"
    "  params init --job ID --rank R --params IN.safetensors [--token-file F]\n"
    "       [--transport auto|shm|grpc]\n"
    "                                       upload rank R's initial parameters (apply mode);\n"
    "                                       IN is laid out as that rank's step --grads file,\n"
    "                                       float32 or the param dtype\n"
    "  export --job ID --out OUT.safetensors [--dtype float32|bfloat16|float16]\n"
    "       [--token-file F]\n"
    "                                       write the master weights of an apply-mode job,\n"
    "                                       every tensor whole under its name (a model file;\n"
    "                                       written to a temporary name, then renamed)\n"
    "  status [--json] [--metrics-address HOST:PORT|off]\n"
    "                                       backend and device, jobs (world size, ranks attached,\n"
    "                                       step, fenced, memory, last checkpoint); --json for\n"
    "                                       scripts\n"
    "  top [--interval S] [--iterations N] [--metrics-address HOST:PORT|off]\n"
    "                                       per-job step rates and phase times, refreshed every\n"
    "                                       S seconds (1) until interrupted or N refreshes\n"
    "\n"
    "ADDR is unix:///path, HOST:PORT (plaintext TCP) or tls://HOST:PORT (default:\n"
    "$MUOND_ADDRESS, else the daemon's default socket). tls:// verifies the daemon's certificate\n"
    "against --tls-ca FILE (else $MUOND_TLS_CA, else gRPC's default roots) and presents\n"
    "--tls-cert FILE --tls-key FILE (else $MUOND_TLS_CERT, $MUOND_TLS_KEY) for mutual TLS.\n"
    "Job commands read the token from --token-file, else from $MUOND_JOB_TOKEN. A token file\n"
    "must be a regular file, not a symbolic link, readable by its owner only (mode 0600 or\n"
    "0400); job create writes it 0600, replacing the file atomically.\n"
    "status and top read daemon-wide figures and phase times from the daemon's metrics endpoint:\n"
    "--metrics-address, else $MUOND_METRICS_ADDRESS, else 127.0.0.1:9464.\n"
    "Exit codes: 0 ok, 1-16 the gRPC status code of the failure, 64 usage error.\n";

int Usage(const std::string& why) {
  std::fprintf(stderr, "muonctl: %s (see muonctl --help)\n", why.c_str());
  return kUsageExit;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "muonctl: %s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
               std::string(s.message()).c_str());
  return static_cast<int>(s.code());
}

// Apply mode (DESIGN.md 4b): the groups, AdamW's constants, clipping and the initial weights.
void PrintApplyStatus(const v1::JobStatus& st, const common::JobSpec& spec) {
  std::printf("mode: apply\n");
  for (const common::ParamGroup& g : spec.groups) {
    std::printf("group: %s lr=%g weight_decay=%g\n", g.name.c_str(), g.lr, g.weight_decay);
  }
  std::printf("adamw: betas=[%g, %g] eps=%g\nmax_grad_norm: %g\n", spec.adamw.beta1,
              spec.adamw.beta2, spec.adamw.eps, spec.max_grad_norm);
  if (!spec.init_from.empty()) std::printf("init_from: %s\n", spec.init_from.c_str());
  std::printf("weights_complete: %s%s%s\n", st.weights_complete() ? "yes" : "no",
              st.weights_complete() ? "" : " - missing ranks ",
              absl::StrJoin(st.ranks_missing_weights(), ", ").c_str());
  std::printf("last_grad_norm: %g\nclip_redo_steps: %llu\n", st.last_grad_norm(),
              static_cast<unsigned long long>(st.clip_redo_steps()));
}

// How the job's matrices are split between its ranks, in words ("" when the spec is not valid).
std::string LayoutText(const v1::JobSpec& spec, const absl::StatusOr<common::JobSpec>& spec_or) {
  std::string layout;
  if (spec.layout_size() > 0) {
    layout = "explicit";
  } else if (spec.zero_stage() == 0) {
    layout = "whole matrices (zero_stage 0)";
  } else if (spec_or.ok()) {
    layout = absl::StrCat("zero_stage ", spec.zero_stage(),
                          spec.zero_stage() == 3 ? ", chunks per matrix" : ", partition of ",
                          spec.zero_stage() == 3 ? ""
                                                 : absl::StrCat(common::RankBufferElements(*spec_or, 0),
                                                                " elements per rank"));
  }
  return layout;
}

// Where the job runs: its backend, world, layout and multi-node part.
void PrintPlacement(const v1::JobStatus& st, const absl::StatusOr<common::JobSpec>& spec_or) {
  const v1::JobSpec& spec = st.spec();
  std::printf("job: %s\nbackend: %s\n", spec.job_id().c_str(), st.backend().c_str());
  if (!st.cpu_math().empty()) std::printf("cpu_isa: %s\n", st.cpu_math().c_str());
  std::printf("world_size: %d\n", spec.world_size());
  const std::string layout = LayoutText(spec, spec_or);
  std::printf("zero_stage: %d\nlayout: %s\n", spec.zero_stage(), layout.c_str());
  if (spec.has_multinode()) {  // DESIGN.md 4c: this node's part of a multi-node job
    std::printf("global_job: %s\nnode: %d of %d (steps two-phase)\n",
                spec.multinode().global_job_id().c_str(), spec.multinode().node(),
                spec.multinode().nodes());
    if (st.has_step_prepared()) {
      std::printf("step_prepared: %lld\n", static_cast<long long>(st.step_prepared()));
    }
  }
}

// Who owns the job and how its steps, memory and checkpoints stand.
void PrintProgress(const v1::JobStatus& st) {
  std::printf("owner: %s\n", st.owner().empty() ? "unknown" : st.owner().c_str());
  std::printf("step_timeout_seconds: %d\n", st.step_timeout_seconds());
  std::printf("next_step: %lld\n", static_cast<long long>(st.next_step()));
  if (st.has_step_in_flight()) {
    std::printf("step_in_flight: %lld\n", static_cast<long long>(st.step_in_flight()));
  } else {
    std::printf("step_in_flight: none\n");
  }
  std::printf("steps_completed: %lld\nsteps_refused: %lld\nsteps_aborted: %lld\n",
              static_cast<long long>(st.steps_completed()),
              static_cast<long long>(st.steps_refused()),
              static_cast<long long>(st.steps_aborted()));
  std::printf("fenced: %s%s%s\n", st.fenced() ? "yes" : "no", st.fenced() ? " - " : "",
              st.fence_reason().c_str());
  std::printf("momentum_bytes: %llu\ngather_budget_bytes: %llu\ngather_peak_bytes: %llu\n",
              static_cast<unsigned long long>(st.momentum_bytes()),
              static_cast<unsigned long long>(st.gather_budget_bytes()),
              static_cast<unsigned long long>(st.gather_peak_bytes()));
  // Host bytes by kind, held now and reserved at admission (README, "Memory").
  uint64_t held = 0, reserved = 0;
  for (const v1::MemoryUse& m : st.memory()) {
    held += m.bytes();
    reserved += m.footprint_bytes();
  }
  if (st.memory_size() > 0) {
    std::printf("memory_bytes: %llu footprint_bytes: %llu\n", static_cast<unsigned long long>(held),
                static_cast<unsigned long long>(reserved));
  }
  for (const v1::MemoryUse& m : st.memory()) {
    std::printf("memory: %s bytes=%llu footprint_bytes=%llu\n", m.kind().c_str(),
                static_cast<unsigned long long>(m.bytes()),
                static_cast<unsigned long long>(m.footprint_bytes()));
  }
  std::printf("transport_copy_bytes: %llu\nlast_step_device_seconds: %.6f\n",
              static_cast<unsigned long long>(st.transport_copy_bytes()),
              st.last_step_device_seconds());
  std::printf("checkpoints: %s every=%llu keep=%d last_step=%s\n", st.checkpoint_dir().c_str(),
              static_cast<unsigned long long>(st.spec().checkpoint_every_steps()),
              st.spec().checkpoint_keep(),
              st.has_last_checkpoint_step() ? std::to_string(st.last_checkpoint_step()).c_str()
                                            : "none");
}

// The optimizer's configuration and the job's matrices (apply mode: its parameters, update
// mode with max_grad_norm: its clipping).
void PrintOptimizer(const v1::JobStatus& st, const common::JobSpec& spec) {
  const common::MuonConfig& m = spec.muon;
  const std::string fp32_iterations =
      m.fp32_iterations == 0 ? "" : absl::StrCat(" fp32_iterations=", m.fp32_iterations);
  std::printf(
      "muon: momentum=%g nesterov=%s ns_method=%s ns_steps=%d compute_dtype=%s "
      "scale_mode=%s%s\n",
      m.momentum, m.nesterov ? "true" : "false",
      std::string(common::NsMethodName(m.ns_method)).c_str(), m.ns_steps,
      std::string(common::DTypeName(m.compute_dtype)).c_str(),
      std::string(common::ScaleModeName(m.scale_mode)).c_str(), fp32_iterations.c_str());
  if (spec.state.compressed()) {  // README "Memory", "Compressed state"
    std::printf("state: momentum_dtype=%s adamw_dtype=%s\n",
                std::string(common::StateDTypeName(spec.state.momentum)).c_str(),
                std::string(common::StateDTypeName(spec.state.adamw)).c_str());
  }
  const bool apply = spec.mode == common::JobMode::kApply;
  for (const common::MatrixSpec& ms : spec.matrices) {
    const std::string apply_fields =
        !apply ? ""
               : absl::StrCat(" param_dtype=", std::string(common::DTypeName(ms.param_dtype)),
                              " optimizer=", std::string(common::OptimizerName(ms.optimizer)),
                              " group=", ms.group);
    std::printf("matrix: %s shape=[%s] num_heads=%lld dtype=%s%s\n", ms.name.c_str(),
                absl::StrJoin(ms.shape, ", ").c_str(), static_cast<long long>(ms.num_heads),
                std::string(common::DTypeName(ms.dtype)).c_str(), apply_fields.c_str());
  }
  if (apply) PrintApplyStatus(st, spec);
  if (spec.clips_outside_share()) {  // update mode's clipping
    std::printf("max_grad_norm: %g\nlast_grad_norm: %g\nclip_redo_steps: %llu\n",
                spec.max_grad_norm, st.last_grad_norm(),
                static_cast<unsigned long long>(st.clip_redo_steps()));
  }
}

void PrintRanks(const v1::JobStatus& st) {
  for (const v1::RankStatus& r : st.ranks()) {
    std::printf("rank: %d attached=%s elements=%llu%s\n", r.rank(), r.attached() ? "yes" : "no",
                static_cast<unsigned long long>(r.elements()),
                !st.has_step_in_flight() ? ""
                : r.finished_pushing()   ? " step=pushed"
                : r.in_step()            ? " step=pushing"
                                         : " step=not-begun");
  }
}

void PrintStatus(const v1::JobStatus& st) {
  const absl::StatusOr<common::JobSpec> spec_or = common::JobSpecFromProto(st.spec());
  PrintPlacement(st, spec_or);
  PrintProgress(st);
  if (spec_or.ok()) PrintOptimizer(st, *spec_or);
  PrintRanks(st);
}

// The --restore-* flags of `job create`: the checkpoint of another job to start from, if any.
absl::StatusOr<std::optional<v1::RestoreFrom>> RestoreFromFlags(const Args& a) {
  if (a.flags.count("restore-from") == 0) {
    for (const char* flag : {"restore-token-file", "restore-generation", "restore-step"}) {
      if (a.flags.count(flag) != 0) {
        return absl::InvalidArgumentError(absl::StrCat("--", flag, " needs --restore-from"));
      }
    }
    return std::nullopt;
  }
  v1::RestoreFrom restore;
  restore.set_job_id(a.flags.at("restore-from"));
  // The source job's token: --restore-token-file, else $MUOND_JOB_TOKEN (never --token-file,
  // which is where the new job's token goes).
  Args source = a;
  source.flags.erase("token-file");
  if (a.flags.count("restore-token-file") != 0) {
    source.flags["token-file"] = a.flags.at("restore-token-file");
  }
  ASSIGN_OR_RETURN(std::string source_token, Token(source));
  restore.set_token(source_token);
  ASSIGN_OR_RETURN(const GenerationChoice choice, ChosenGeneration(a, "job create", "restore-"));
  if (choice.generation) restore.set_generation(*choice.generation);
  if (choice.step) restore.set_step(*choice.step);
  return restore;
}

// --import-dir of `job create` as an absolute path (the daemon reads it), not with --restore-from.
absl::StatusOr<std::optional<std::string>> ImportDirFlag(
    const Args& a, const std::optional<v1::RestoreFrom>& restore) {
  auto it = a.flags.find("import-dir");
  if (it == a.flags.end()) return std::nullopt;
  if (restore) return absl::InvalidArgumentError("--import-dir and --restore-from: choose one");
  if (it->second.empty()) return absl::InvalidArgumentError("--import-dir needs a directory");
  if (it->second[0] == '/') return it->second;
  char cwd[4096];
  if (::getcwd(cwd, sizeof cwd) == nullptr) {
    return absl::InvalidArgumentError("--import-dir: the current directory is unknown");
  }
  return absl::StrCat(cwd, "/", it->second);
}

absl::Status CmdJobCreate(Client& client, const Args& a) {
  if (a.flags.count("spec") == 0) return absl::InvalidArgumentError("job create needs --spec");
  ASSIGN_OR_RETURN(std::string json, ReadFile(a.flags.at("spec"), "job spec"));
  auto spec = common::ParseJobSpecJson(json);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(a.flags.at("spec"), ": ", spec.status().message()));
  }
  ASSIGN_OR_RETURN(const std::optional<v1::RestoreFrom> restore, RestoreFromFlags(a));
  ASSIGN_OR_RETURN(const std::optional<std::string> import_dir, ImportDirFlag(a, restore));
  std::string token;
  auto create = [&]() -> absl::Status {
    if (import_dir) {
      ASSIGN_OR_RETURN(token, client.CreateJobFromExport(*spec, *import_dir));
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(token, client.CreateJob(*spec, restore ? &*restore : nullptr));
    return absl::OkStatus();
  };
  if (restore) {
    // The restore is listed under the source job (whose token this command holds).
    RETURN_IF_ERROR(RunWithProgress(
        client,
        {restore->job_id(), restore->token(), "restore", spec->job_id,
         absl::StrCat("restore job ", spec->job_id, " from ", restore->job_id())},
        create));
  } else {
    RETURN_IF_ERROR(create());
  }
  auto file = a.flags.find("token-file");
  if (file == a.flags.end()) {
    std::printf("%s\n", token.c_str());
    return absl::OkStatus();
  }
  absl::Status s = WriteTokenFile(file->second, token);
  if (!s.ok()) {
    // Without its token the job is unusable: remove it again.
    (void)client.DeleteJob(spec->job_id, token);
    return s;
  }
  std::printf("created job %s (token in %s)\n", spec->job_id.c_str(), file->second.c_str());
  return absl::OkStatus();
}

absl::Status CmdJobList(Client& client, const Args& a) {
  // A token (--token-file, $MUOND_JOB_TOKEN) shows its job's details when it is another user's.
  ASSIGN_OR_RETURN(const std::string token, Token(a));
  ASSIGN_OR_RETURN(const v1::ListJobsResponse listed, client.ListJobsWithBroken(token));
  std::printf("%-24s %5s %5s %8s %10s %8s %6s %s\n", "JOB", "WORLD", "STAGE", "MATRICES",
              "NEXT_STEP", "STEPS", "FENCED", "BACKEND");
  for (const v1::JobStatus& j : listed.jobs()) {
    // Another user's job without its token: its tensors are withheld (JobStatus.details_withheld).
    const std::string matrices =
        j.details_withheld() ? "-" : std::to_string(j.spec().matrices_size());
    std::printf("%-24s %5d %5d %8s %10lld %8lld %6s %s\n", j.spec().job_id().c_str(),
                j.spec().world_size(), j.spec().zero_stage(), matrices.c_str(),
                static_cast<long long>(j.next_step()),
                static_cast<long long>(j.steps_completed()), j.fenced() ? "yes" : "no",
                j.backend().c_str());
  }
  for (const v1::BrokenJob& b : listed.broken()) {
    std::printf("BROKEN %s: %s\n", b.directory().c_str(), b.reason().c_str());
  }
  return absl::OkStatus();
}

absl::Status CmdJobReset(Client& client, const Args& a, const JobAccess& job) {
  int64_t next = 0;
  // `--step N` (`--next-step N` is accepted too): the step the job expects next.
  for (const char* flag : {"step", "next-step"}) {
    if (a.flags.count(flag) != 0) {
      ASSIGN_OR_RETURN(next, IntFlag(a, flag));
    }
  }
  RETURN_IF_ERROR(client.ResetJob(job.job_id, job.token, next));
  std::printf("reset job %s; next step %lld\n", job.job_id.c_str(), static_cast<long long>(next));
  return absl::OkStatus();
}

absl::Status CmdJob(Client& client, const Args& a) {
  const std::string sub = a.words.size() > 1 ? a.words[1] : "";
  if (sub == "create") return CmdJobCreate(client, a);
  if (sub == "list") return CmdJobList(client, a);
  if (sub != "show" && sub != "delete" && sub != "reset") {
    return absl::InvalidArgumentError(absl::StrCat("unknown job command '", sub, "'"));
  }
  ASSIGN_OR_RETURN(const JobAccess job, JobAndToken(a, absl::StrCat("job ", sub)));
  if (sub == "show") {
    ASSIGN_OR_RETURN(v1::JobStatus st, client.GetJob(job.job_id, job.token));
    PrintStatus(st);
    return absl::OkStatus();
  }
  if (sub == "delete") {
    RETURN_IF_ERROR(client.DeleteJob(job.job_id, job.token));
    std::printf("deleted job %s\n", job.job_id.c_str());
    return absl::OkStatus();
  }
  return CmdJobReset(client, a, job);
}

int Run(int argc, char** argv) {
  auto parsed = ParseArgs(std::vector<std::string>(argv + 1, argv + argc));
  if (!parsed.ok()) return Usage(std::string(parsed.status().message()));
  const Args& a = *parsed;
  if (a.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (a.words.empty()) return Usage("missing command");
  const std::string cmd = a.words[0];
  if (cmd == "plan") {  // local: no daemon (muonctl_plan.cc)
    const absl::Status s = CmdPlan(a);
    return s.ok() ? 0 : Fail(s);
  }
  if (cmd != "health" && cmd != "job" && cmd != "step" && cmd != "status" && cmd != "top" &&
      cmd != "checkpoint" && cmd != "params" && cmd != "export") {
    return Usage(absl::StrCat("unknown command '", cmd, "'"));
  }
  if (cmd == "job" && a.words.size() < 2) return Usage("job needs a subcommand");
  if (cmd == "checkpoint" && a.words.size() < 2) {
    return Usage("checkpoint needs a subcommand (save, load, list)");
  }
  if (cmd == "params" && a.words.size() < 2) return Usage("params needs a subcommand (init)");
  const std::string address = a.flags.count("address") ? a.flags.at("address") : "";
  // TLS files: the flags, else the environment (for tls:// addresses only).
  const std::string target = address.empty() ? common::DefaultClientAddress() : address;
  TlsOptions tls = target.rfind("tls://", 0) == 0 ? TlsOptionsFromEnvironment() : TlsOptions{};
  for (auto [flag, field] : {std::pair{"tls-ca", &tls.ca_file},
                             std::pair{"tls-cert", &tls.cert_file},
                             std::pair{"tls-key", &tls.key_file}}) {
    if (a.flags.count(flag) != 0) *field = a.flags.at(flag);
  }
  auto client = Client::Connect(target, tls);
  if (!client.ok()) return Fail(client.status());
  absl::Status s;
  if (cmd == "health") {
    s = (*client)->Health();
    if (s.ok()) std::printf("SERVING\n");
  } else if (cmd == "job") {
    s = CmdJob(**client, a);
  } else if (cmd == "checkpoint") {
    s = CmdCheckpoint(**client, a);
  } else if (cmd == "status") {
    s = CmdStatus(**client, a);
  } else if (cmd == "top") {
    s = CmdTop(**client, a);
  } else if (cmd == "params") {
    s = CmdParams(**client, a);
  } else if (cmd == "export") {
    s = CmdExport(**client, a);
  } else {
    s = CmdStep(**client, a);
  }
  return s.ok() ? 0 : Fail(s);
}

}  // namespace
}  // namespace muond::client

int main(int argc, char** argv) { return muond::client::Run(argc, argv); }
