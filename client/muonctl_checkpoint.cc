// `muonctl checkpoint save|load|list|export` (DESIGN.md 7; export: the full state for
// re-sharding across nodes, DESIGN.md 4c).
#include <cstdio>
#include <ctime>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/muonctl_util.h"
#include "client/progress_display.h"
#include "common/status_macros.h"

namespace muond::client {
namespace {

std::string Time(int64_t unix_ms) {
  const std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm;
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

absl::Status CmdCheckpointExport(Client& client, const Args& a, const std::string& id,
                                 const std::string& token) {
  auto dir = a.flags.find("dir");
  if (dir == a.flags.end() || dir->second.empty()) {
    return absl::InvalidArgumentError("checkpoint export needs --dir DIR");
  }
  ASSIGN_OR_RETURN(const GenerationChoice choice, ChosenGeneration(a, "checkpoint export", ""));
  const auto dtype_flag = a.flags.find("dtype");
  ASSIGN_OR_RETURN(
      const bool float32,
      ParseExportStateDType(dtype_flag == a.flags.end() ? "held" : dtype_flag->second));
  ProgressDisplay display(absl::StrCat("export state of job ", id), "bytes", stderr,
                          ProgressDisplay::StderrIsTerminal());
  uint64_t done = 0, total = 0;
  auto exported = ExportStateToDir(
      client, id, token, choice.generation.value_or(0), choice.step.value_or(-1), dir->second,
      [&](uint64_t d, uint64_t t) {
        done = d;
        total = t;
        display.Update(d, t);
      },
      float32);
  if (!exported.ok()) {
    display.Abandon();
    return exported.status();
  }
  if (done > 0) display.Finish(done, total);
  const StateExportFiles& files = *exported;
  std::printf(
      "exported job %s %s at step %lld: %zu tensors, %llu bytes in %s and %s\n", id.c_str(),
      files.generation > 0 ? absl::StrCat("generation ", files.generation).c_str() : "live state",
      static_cast<long long>(files.step), files.tensors,
      static_cast<unsigned long long>(files.bytes), files.payload.c_str(), files.manifest.c_str());
  return absl::OkStatus();
}

}  // namespace

absl::Status CmdCheckpoint(Client& client, const Args& a) {
  const std::string sub = a.words.size() > 1 ? a.words[1] : "";
  if (sub != "save" && sub != "load" && sub != "list" && sub != "export") {
    return absl::InvalidArgumentError(absl::StrCat("unknown checkpoint command '", sub, "'"));
  }
  ASSIGN_OR_RETURN(const JobAccess job, JobAndToken(a, absl::StrCat("checkpoint ", sub)));
  const std::string& id = job.job_id;
  const std::string& token = job.token;
  if (sub == "save") {
    v1::CheckpointInfo info;
    RETURN_IF_ERROR(RunWithProgress(client, {id, token, "save", id, "save job " + id}, [&] {
      ASSIGN_OR_RETURN(info, client.SaveCheckpoint(id, token));
      return absl::OkStatus();
    }));
    std::printf("saved job %s generation %lld at step %lld (%llu bytes) in %s\n", id.c_str(),
                static_cast<long long>(info.generation()), static_cast<long long>(info.step()),
                static_cast<unsigned long long>(info.bytes()), info.path().c_str());
    return absl::OkStatus();
  }
  if (sub == "export") return CmdCheckpointExport(client, a, id, token);
  if (sub == "list") {
    ASSIGN_OR_RETURN(auto list, client.ListCheckpoints(id, token));
    std::printf("%-10s %10s %-20s %14s %s\n", "GENERATION", "STEP", "CREATED", "BYTES", "PATH");
    for (const v1::CheckpointInfo& g : list) {
      std::printf("%-10lld %10s %-20s %14llu %s%s\n", static_cast<long long>(g.generation()),
                  g.problem().empty() ? std::to_string(g.step()).c_str() : "?",
                  g.problem().empty() ? Time(g.created_unix_ms()).c_str() : "?",
                  static_cast<unsigned long long>(g.bytes()), g.path().c_str(),
                  g.problem().empty() ? "" : absl::StrCat(" (", g.problem(), ")").c_str());
    }
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(const GenerationChoice choice, ChosenGeneration(a, "checkpoint load", ""));
  // Neither flag: (0, -1), the newest good generation.
  const int64_t generation = choice.generation.value_or(0);
  const int64_t step = choice.step.value_or(-1);
  v1::LoadCheckpointResponse r;
  RETURN_IF_ERROR(RunWithProgress(client, {id, token, "load", id, "load job " + id}, [&] {
    ASSIGN_OR_RETURN(r, client.LoadCheckpoint(id, token, generation, step));
    return absl::OkStatus();
  }));
  for (const std::string& p : r.set_aside()) {
    std::fprintf(stderr, "muonctl: warning: corrupt generation set aside as %s\n", p.c_str());
  }
  std::printf("loaded job %s generation %lld (step %lld); next step %lld\n", id.c_str(),
              static_cast<long long>(r.loaded().generation()),
              static_cast<long long>(r.loaded().step()), static_cast<long long>(r.next_step()));
  return absl::OkStatus();
}

}  // namespace muond::client
