// Progress of long operations in muonctl (checkpoint save and load, job create --restore-from,
// export): a bar redrawn in place on a terminal, plain lines otherwise.
//
// On a terminal (tty): one line rewritten with '\r':
//   save job j  [##########----------]  50.0%  12.0 MiB / 24.0 MiB  48.0 MiB/s  0:01 left
// and a newline once finished. Otherwise, plain lines, at most one a second, and always the last:
//   progress: save job j: 12582912/25165824 bytes (50.0%), 48.0 MiB/s, 0:01 left
//   progress: save job j: 25165824/25165824 bytes (100.0%), 48.0 MiB/s, done in 0:00
// (time as M:SS, or H:MM:SS from an hour; the rate and time left read "-" until they are known).
//
// The daemon reports its side of an operation through GetProgress (server/record/status_progress.h);
// RunWithProgress calls the blocking RPC on a thread and polls it. Thread-safety: a
// ProgressDisplay is used by one thread.
#ifndef MUOND_CLIENT_PROGRESS_DISPLAY_H_
#define MUOND_CLIENT_PROGRESS_DISPLAY_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "client/client.h"

namespace muond::client {

// One line of progress as the plain form shows it (final: "done in" instead of "left"). `unit`:
// "bytes" (sizes shown in B/KiB/MiB/GiB on the terminal) or a count's name, e.g. "steps".
std::string PlainProgressLine(const std::string& what, const std::string& unit, uint64_t done,
                              uint64_t total, double elapsed_seconds, bool final);
// The terminal form of the same, without the leading '\r'. `width`: columns of the bar.
std::string TerminalProgressLine(const std::string& what, const std::string& unit, uint64_t done,
                                 uint64_t total, double elapsed_seconds, int width = 20);

class ProgressDisplay {
 public:
  using Clock = std::chrono::steady_clock;
  // Writes to `out` (not owned), as a terminal when `tty`.
  ProgressDisplay(std::string what, std::string unit, FILE* out, bool tty);
  // True when stderr is a terminal (where muonctl draws its progress).
  static bool StderrIsTerminal();
  // `done` of `total` now: drawn on a terminal (at most 10 times a second), a plain line at most
  // once a second; a complete count (done >= total) is left to Finish.
  void Update(uint64_t done, uint64_t total);
  // The last state: always drawn; ends the terminal line. Later calls do nothing.
  void Finish(uint64_t done, uint64_t total);
  // The operation failed: ends a bar drawn on the terminal (the error follows on its own line);
  // no further line. Later calls do nothing.
  void Abandon();

 private:
  const std::string what_;
  const std::string unit_;
  FILE* const out_;
  const bool tty_;
  const Clock::time_point start_;
  Clock::time_point last_drawn_;
  bool drawn_ = false;
  bool finished_ = false;
};

// Which of a job's operations to follow: GetProgress(job_id, token), the first operation of
// `kind` with `target` that was not there before the call.
struct OperationWatch {
  std::string job_id;
  std::string token;
  std::string kind;    // "save", "load", "restore"
  std::string target;  // the job being created for "restore"; else job_id
  std::string what;    // the label, e.g. "save job j"
};

// Runs `call` (a blocking RPC through `client`) on a thread and, while it runs, draws the watched
// operation's bytes on stderr (ProgressDisplay); after it returns, the final state once more when
// the operation succeeded. A daemon without GetProgress (UNIMPLEMENTED) or any other polling
// error only means no progress is drawn. A failed operation gets no final line (the caller
// prints the error). Returns `call`'s status.
absl::Status RunWithProgress(Client& client, const OperationWatch& watch,
                             const std::function<absl::Status()>& call);

}  // namespace muond::client

#endif  // MUOND_CLIENT_PROGRESS_DISPLAY_H_
