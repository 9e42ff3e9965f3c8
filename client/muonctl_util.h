// Helpers shared by muonctl's commands: parsed arguments, files, tokens.
#ifndef MUOND_CLIENT_MUONCTL_UTIL_H_
#define MUOND_CLIENT_MUONCTL_UTIL_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"

namespace muond::client {

struct Args {
  std::vector<std::string> words;            // command words
  std::map<std::string, std::string> flags;  // --key value (the last value of a repeated flag)
  // Every value of the flags that may repeat (--lr, --wd), in the order given.
  std::map<std::string, std::vector<std::string>> repeated;
  bool help = false;  // --help or -h
};

// Parses muonctl's arguments (argv without argv[0]): "--key value" or "--key=value" flags
// (--json takes no value), everything else command words. INVALID_ARGUMENT, a usage error, for
// a flag without its value or a flag muonctl does not know. Stops at --help.
absl::StatusOr<Args> ParseArgs(const std::vector<std::string>& argv);

// `muonctl step`'s apply-mode flags: --lr GROUP=VALUE and --wd GROUP=VALUE (each repeatable; the
// group name is everything before the last '=') and --grad-divisor X. nullopt when none is
// given. INVALID_ARGUMENT naming the flag for a value that is not GROUP=NUMBER or a divisor that
// is not a number; the values themselves are checked against the job by ResolveStepHyper.
absl::StatusOr<std::optional<StepHyper>> StepHyperFlags(const Args& a);

// The whole file; NOT_FOUND / PERMISSION_DENIED naming `what` and the path.
absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& what);
// Writes the token to a new file (mode 0600, fsynced) in the directory of `path`, then renames
// it over `path`: atomic, and an existing symbolic link at `path` is replaced, never followed.
absl::Status WriteTokenFile(const std::string& path, const std::string& token);
// Reads a token file, stripped of surrounding whitespace. Opened with O_NOFOLLOW; refused with
// PERMISSION_DENIED naming the path and the reason when it is a symbolic link, not a regular
// file, or readable or writable by group or others (mode & 077); NOT_FOUND when missing.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);
// The token for a job command: --token-file, else $MUOND_JOB_TOKEN, else "" (the daemon then
// answers UNAUTHENTICATED).
absl::StatusOr<std::string> Token(const Args& a);
// INVALID_ARGUMENT when the flag is missing or not an integer.
absl::StatusOr<int64_t> IntFlag(const Args& a, const std::string& name);

// The job a command acts on (--job) and its token (see Token).
struct JobAccess {
  std::string job_id;
  std::string token;
};
// INVALID_ARGUMENT "<command> needs --job" when --job is missing; Token()'s errors otherwise.
absl::StatusOr<JobAccess> JobAndToken(const Args& a, const std::string& command);

// A checkpoint generation chosen by --<prefix>generation G (G >= 1) or by the step it was saved
// at, --<prefix>step S (S >= 0); neither: the caller's default (the newest good generation).
struct GenerationChoice {
  std::optional<int64_t> generation;
  std::optional<int64_t> step;
};
// INVALID_ARGUMENT naming `command` for both flags, and naming the flag for a value out of range.
absl::StatusOr<GenerationChoice> ChosenGeneration(const Args& a, const std::string& command,
                                                  const std::string& prefix);

// `muonctl step`: pushes one step of one rank from a safetensors file and writes the update.
absl::Status CmdStep(Client& client, const Args& a);
// `muonctl params init`: uploads one rank's initial parameters of an apply-mode job from a
// safetensors file laid out as that rank's `step --grads` file (muonctl_apply.cc).
absl::Status CmdParams(Client& client, const Args& a);
// `muonctl export`: the master weights of an apply-mode job as a safetensors model file.
absl::Status CmdExport(Client& client, const Args& a);
// `muonctl status [--json]`: the daemon and its jobs (muonctl_status.cc).
absl::Status CmdStatus(Client& client, const Args& a);
// `muonctl checkpoint save|load|list` (muonctl_checkpoint.cc).
absl::Status CmdCheckpoint(Client& client, const Args& a);
// `muonctl top [--iterations N] [--interval S]`: refreshes per-job step rates and phase times.
absl::Status CmdTop(Client& client, const Args& a);
// `muonctl plan JOB.json NODES...`: the ownership plan over nodes, no daemon (muonctl_plan.cc).
absl::Status CmdPlan(const Args& a);

}  // namespace muond::client

#endif  // MUOND_CLIENT_MUONCTL_UTIL_H_
