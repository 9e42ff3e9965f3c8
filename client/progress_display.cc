#include "client/progress_display.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace muond::client {
namespace {

std::string Clock(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  if (s >= 3600) return absl::StrFormat("%d:%02d:%02d", s / 3600, s / 60 % 60, s % 60);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

std::string Size(double n) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (n >= 1024 && i < 4) {
    n /= 1024;
    ++i;
  }
  return i == 0 ? absl::StrFormat("%.0f B", n) : absl::StrFormat("%.1f %s", n, kUnits[i]);
}

std::string Amount(const std::string& unit, double n) {
  return unit == "bytes" ? Size(n) : absl::StrFormat("%.0f %s", n, unit);
}

std::string Rate(const std::string& unit, double per_second) {
  if (!(per_second > 0)) return "-";
  if (unit == "bytes") return absl::StrCat(Size(per_second), "/s");
  return absl::StrFormat("%.2f %s/s", per_second, unit);
}

struct Figures {
  double fraction = 0;  // 0..1
  double rate = 0;      // units per second, 0 when unknown
  std::string left;     // "M:SS" or "-"
};

Figures Compute(uint64_t done, uint64_t total, double elapsed) {
  Figures f;
  const uint64_t shown = total > 0 ? std::min(done, total) : done;
  f.fraction = total > 0 ? static_cast<double>(shown) / static_cast<double>(total) : 0;
  f.rate = elapsed > 0 && shown > 0 ? static_cast<double>(shown) / elapsed : 0;
  f.left = f.rate > 0 && total > 0 ? Clock(static_cast<double>(total - shown) / f.rate) : "-";
  return f;
}

}  // namespace

std::string PlainProgressLine(const std::string& what, const std::string& unit, uint64_t done,
                              uint64_t total, double elapsed_seconds, bool final) {
  const Figures f = Compute(done, total, elapsed_seconds);
  const uint64_t shown = total > 0 ? std::min(done, total) : done;
  return absl::StrFormat(
      "progress: %s: %d/%d %s (%.1f%%), %s, %s", what, shown, total, unit, 100 * f.fraction,
      Rate(unit, f.rate),
      final ? absl::StrCat("done in ", Clock(elapsed_seconds)) : absl::StrCat(f.left, " left"));
}

std::string TerminalProgressLine(const std::string& what, const std::string& unit, uint64_t done,
                                 uint64_t total, double elapsed_seconds, int width) {
  const Figures f = Compute(done, total, elapsed_seconds);
  const int filled = static_cast<int>(std::floor(f.fraction * width));
  return absl::StrFormat("%s  [%s%s]  %5.1f%%  %s / %s  %s  %s left", what,
                         std::string(filled, '#'), std::string(width - filled, '-'),
                         100 * f.fraction, Amount(unit, static_cast<double>(std::min(done, total))),
                         Amount(unit, static_cast<double>(total)), Rate(unit, f.rate), f.left);
}

ProgressDisplay::ProgressDisplay(std::string what, std::string unit, FILE* out, bool tty)
    : what_(std::move(what)),
      unit_(std::move(unit)),
      out_(out),
      tty_(tty),
      start_(Clock::now()),
      last_drawn_(start_) {}

bool ProgressDisplay::StderrIsTerminal() { return isatty(STDERR_FILENO) == 1; }

void ProgressDisplay::Update(uint64_t done, uint64_t total) {
  // A complete count is left to Finish, which draws it once.
  if (finished_ || (total > 0 && done >= total)) return;
  const Clock::time_point now = Clock::now();
  const auto every = tty_ ? std::chrono::milliseconds(100) : std::chrono::milliseconds(1000);
  if (drawn_ && now - last_drawn_ < every) return;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  if (tty_) {
    std::fprintf(out_, "\r%s\033[K",
                 TerminalProgressLine(what_, unit_, done, total, elapsed).c_str());
  } else {
    std::fprintf(out_, "%s\n",
                 PlainProgressLine(what_, unit_, done, total, elapsed, false).c_str());
  }
  std::fflush(out_);
  drawn_ = true;
  last_drawn_ = now;
}

void ProgressDisplay::Finish(uint64_t done, uint64_t total) {
  if (finished_) return;
  finished_ = true;
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  if (tty_) {
    std::fprintf(out_, "\r%s\033[K\n",
                 TerminalProgressLine(what_, unit_, done, total, elapsed).c_str());
  } else {
    std::fprintf(out_, "%s\n", PlainProgressLine(what_, unit_, done, total, elapsed, true).c_str());
  }
  std::fflush(out_);
}

void ProgressDisplay::Abandon() {
  if (finished_) return;
  finished_ = true;
  if (tty_ && drawn_) {
    std::fputs("\n", out_);
    std::fflush(out_);
  }
}

namespace {

// The watched operation among `ops`: the first of its kind and target not in `before`.
const v1::OperationProgress* Find(const std::vector<v1::OperationProgress>& ops,
                                  const OperationWatch& w, const std::set<uint64_t>& before) {
  for (const v1::OperationProgress& o : ops) {
    if (o.kind() == w.kind && o.target() == w.target && before.count(o.id()) == 0) return &o;
  }
  return nullptr;
}

}  // namespace

absl::Status RunWithProgress(Client& client, const OperationWatch& watch,
                             const std::function<absl::Status()>& call) {
  std::set<uint64_t> before;
  absl::StatusOr<std::vector<v1::OperationProgress>> ops =
      client.GetProgress(watch.job_id, watch.token);
  if (!ops.ok()) return call();  // an older daemon, or the job cannot be read: no progress
  for (const v1::OperationProgress& o : *ops) before.insert(o.id());
  std::future<absl::Status> result = std::async(std::launch::async, call);
  ProgressDisplay display(watch.what, "bytes", stderr, ProgressDisplay::StderrIsTerminal());
  // The operation can end before the call returns (a restore is followed by the new job's first
  // save): it is finished on the display as soon as the daemon says it ended.
  bool finished = false;
  auto show = [&](const v1::OperationProgress& o, bool call_ok) {
    if (o.done()) {
      if (o.error().empty() && call_ok) {
        display.Finish(o.bytes_done(), o.bytes_total());
      } else {
        display.Abandon();
      }
      finished = true;
    } else if (o.bytes_done() > 0) {
      display.Update(o.bytes_done(), o.bytes_total());
    }
  };
  while (result.wait_for(std::chrono::milliseconds(200)) != std::future_status::ready) {
    if (finished) continue;
    ops = client.GetProgress(watch.job_id, watch.token);
    const v1::OperationProgress* o = ops.ok() ? Find(*ops, watch, before) : nullptr;
    if (o != nullptr) show(*o, true);
  }
  absl::Status status = result.get();
  if (finished) return status;
  ops = client.GetProgress(watch.job_id, watch.token);
  const v1::OperationProgress* o = ops.ok() ? Find(*ops, watch, before) : nullptr;
  if (o != nullptr) show(*o, status.ok());
  return status;
}

}  // namespace muond::client
