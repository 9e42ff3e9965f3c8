// `muonctl status [--json]` and `muonctl top [--iterations N] [--interval S]`: an operator's view
// of one daemon. Jobs come from ListJobs (gRPC); daemon-wide facts (version, backend and device,
// queue depth, shared-memory sessions, pinned memory) and step/phase times come from the daemon's
// metrics endpoint: --metrics-address, else $MUOND_METRICS_ADDRESS, else 127.0.0.1:9464 ("off":
// skip it). Without the endpoint those fields are shown as unknown (JSON null); the jobs are still
// listed.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/metrics_scrape.h"
#include "client/muonctl_util.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace muond::client {
namespace {

constexpr char kDefaultMetricsAddress[] = "127.0.0.1:9464";
const char* const kPhases[] = {"assembly", "copy_in", "newton_schulz", "writeback", "return"};

std::string MetricsAddress(const Args& a) {
  if (auto it = a.flags.find("metrics-address"); it != a.flags.end()) return it->second;
  if (const char* env = std::getenv("MUOND_METRICS_ADDRESS"); env != nullptr && env[0] != '\0') {
    return env;
  }
  return kDefaultMetricsAddress;
}

// The scrape, or why there is none.
struct Scrape {
  std::optional<std::vector<MetricSample>> samples;
  std::string error;
};

Scrape ScrapeFor(const Args& a) {
  Scrape s;
  const std::string address = MetricsAddress(a);
  if (address == "off") {
    s.error = "metrics endpoint disabled (--metrics-address off)";
    return s;
  }
  auto scraped = ScrapeMetrics(address);
  if (scraped.ok()) {
    s.samples = *std::move(scraped);
  } else {
    s.error = std::string(scraped.status().message());
  }
  return s;
}

// The label `label` of the first sample named `name` ("" when none).
std::string LabelOf(const Scrape& s, const std::string& name, const std::string& label) {
  if (!s.samples) return "";
  for (const MetricSample& m : *s.samples) {
    if (m.name != name) continue;
    auto it = m.labels.find(label);
    return it == m.labels.end() ? "" : it->second;
  }
  return "";
}

nlohmann::json NumberOrNull(const Scrape& s, const std::string& name,
                            const std::map<std::string, std::string>& labels = {}) {
  if (!s.samples) return nullptr;
  const double v = FindSample(*s.samples, name, labels, std::nan(""));
  if (std::isnan(v)) return nullptr;
  if (std::isinf(v)) return "unlimited";
  return v;
}

std::string Bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrFormat("%.0f %s", b, units[u]) : absl::StrFormat("%.1f %s", b, units[u]);
}

std::string JsonText(const nlohmann::json& j) {
  if (j.is_null()) return "unknown";
  if (j.is_string()) return j.get<std::string>();
  return Bytes(j.get<double>());
}

int RanksAttached(const v1::JobStatus& j) {
  int n = 0;
  for (const v1::RankStatus& r : j.ranks()) n += r.attached() ? 1 : 0;
  return n;
}

nlohmann::json StatusJson(const std::string& address, const std::string& metrics_address,
                          const std::vector<v1::JobStatus>& jobs, const Scrape& scrape) {
  nlohmann::json out;
  out["address"] = address;
  nlohmann::json daemon;
  const std::string version = LabelOf(scrape, "muond_build_info", "version");
  std::string backend = LabelOf(scrape, "muond_build_info", "backend");
  // Without the endpoint: a job's backend, "cpu (auto: why ...)", names it in its first word.
  if (backend.empty() && !jobs.empty())
    backend = jobs[0].backend().substr(0, jobs[0].backend().find(' '));
  const std::string device = LabelOf(scrape, "muond_device_info", "device");
  daemon["version"] = version.empty() ? nlohmann::json(nullptr) : nlohmann::json(version);
  daemon["backend"] = backend.empty() ? nlohmann::json(nullptr) : nlohmann::json(backend);
  daemon["device"] = device.empty() ? nlohmann::json(nullptr) : nlohmann::json(device);
  daemon["compute_queue_depth"] = NumberOrNull(scrape, "muond_compute_queue_depth");
  daemon["shm_sessions"] = NumberOrNull(scrape, "muond_shm_sessions");
  daemon["pinned_bytes"] = NumberOrNull(scrape, "muond_pinned_bytes");
  daemon["memlock_limit_bytes"] = NumberOrNull(scrape, "muond_memlock_limit_bytes");
  uint64_t momentum = 0;
  for (const v1::JobStatus& j : jobs) momentum += j.momentum_bytes();
  daemon["momentum_bytes"] = momentum;
  daemon["momentum_limit_bytes"] = NumberOrNull(scrape, "muond_momentum_limit_bytes");
  daemon["metrics_address"] = metrics_address;
  out["daemon"] = daemon;
  out["metrics_error"] = scrape.samples ? nlohmann::json(nullptr) : nlohmann::json(scrape.error);
  nlohmann::json list = nlohmann::json::array();
  for (const v1::JobStatus& j : jobs) {
    nlohmann::json job;
    job["job_id"] = j.spec().job_id();
    job["backend"] = j.backend();
    job["world_size"] = std::max(1, j.spec().world_size());
    job["zero_stage"] = j.spec().zero_stage();
    job["matrices"] = j.spec().matrices_size();
    job["ranks_attached"] = RanksAttached(j);
    nlohmann::json ranks = nlohmann::json::array();
    for (const v1::RankStatus& r : j.ranks()) {
      ranks.push_back({{"rank", r.rank()},
                       {"attached", r.attached()},
                       {"in_step", r.in_step()},
                       {"finished_pushing", r.finished_pushing()}});
    }
    job["ranks"] = ranks;
    job["next_step"] = j.next_step();
    job["step_in_flight"] =
        j.has_step_in_flight() ? nlohmann::json(j.step_in_flight()) : nlohmann::json(nullptr);
    job["steps_completed"] = j.steps_completed();
    job["steps_refused"] = j.steps_refused();
    job["steps_aborted"] = j.steps_aborted();
    job["fenced"] = j.fenced();
    job["fence_reason"] = j.fence_reason();
    job["momentum_bytes"] = j.momentum_bytes();
    job["gather_budget_bytes"] = j.gather_budget_bytes();
    job["gather_peak_bytes"] = j.gather_peak_bytes();
    job["transport_copy_bytes"] = j.transport_copy_bytes();
    // Exported by the checkpoint writer once checkpoints exist (null until then).
    job["last_checkpoint_age_seconds"] = NumberOrNull(scrape, "muond_checkpoint_newest_age_seconds",
                                                      {{"muond_job", j.spec().job_id()}});
    list.push_back(job);
  }
  out["jobs"] = list;
  return out;
}

void PrintStatusText(const nlohmann::json& s) {
  const nlohmann::json& d = s["daemon"];
  auto text = [](const nlohmann::json& j) {
    return j.is_null()     ? std::string("unknown")
           : j.is_string() ? j.get<std::string>()
                           : absl::StrCat(j.get<double>());
  };
  std::printf("muond %s at %s\n", text(d["version"]).c_str(),
              s["address"].get<std::string>().c_str());
  std::printf("backend: %s   device: %s\n", text(d["backend"]).c_str(), text(d["device"]).c_str());
  std::printf("compute queue: %s   shm sessions: %s   pinned: %s (limit %s)\n",
              text(d["compute_queue_depth"]).c_str(), text(d["shm_sessions"]).c_str(),
              JsonText(d["pinned_bytes"]).c_str(), JsonText(d["memlock_limit_bytes"]).c_str());
  std::printf(
      "momentum: %s (limit %s)\n", Bytes(d["momentum_bytes"].get<double>()).c_str(),
      d["momentum_limit_bytes"].is_null() ? "none" : JsonText(d["momentum_limit_bytes"]).c_str());
  if (!s["metrics_error"].is_null()) {
    std::printf("metrics: unavailable (%s)\n", s["metrics_error"].get<std::string>().c_str());
  }
  std::printf("\n%-24s %5s %5s %9s %7s %7s %7s %-7s %10s %21s %s\n", "JOB", "WORLD", "RANKS",
              "NEXT_STEP", "STEPS", "REFUSED", "ABORTED", "FENCED", "MOMENTUM",
              "GATHER PEAK/BUDGET", "CHECKPOINT AGE");
  for (const nlohmann::json& j : s["jobs"]) {
    const nlohmann::json& age = j["last_checkpoint_age_seconds"];
    std::printf("%-24s %5d %5d %9lld %7lld %7lld %7lld %-7s %10s %21s %s\n",
                j["job_id"].get<std::string>().c_str(), j["world_size"].get<int>(),
                j["ranks_attached"].get<int>(), j["next_step"].get<long long>(),
                j["steps_completed"].get<long long>(), j["steps_refused"].get<long long>(),
                j["steps_aborted"].get<long long>(), j["fenced"].get<bool>() ? "yes" : "no",
                Bytes(j["momentum_bytes"].get<double>()).c_str(),
                absl::StrCat(Bytes(j["gather_peak_bytes"].get<double>()), "/",
                             Bytes(j["gather_budget_bytes"].get<double>()))
                    .c_str(),
                age.is_null() ? "-" : absl::StrFormat("%.0f s", age.get<double>()).c_str());
    if (j["fenced"].get<bool>()) {
      std::printf("  fenced: %s\n", j["fence_reason"].get<std::string>().c_str());
    }
  }
  if (s["jobs"].empty()) std::printf("(no jobs)\n");
}

// One `top` observation of a job.
struct TopSample {
  int64_t steps = 0;
  double step_sum = 0, step_count = 0;
  std::map<std::string, std::pair<double, double>> phases;  // phase -> (sum, count)
};

// Mean milliseconds over the interval (delta sum / delta count); the all-time mean when nothing
// happened in it; "-" when there is no observation at all.
std::string MeanMs(double sum, double count, double prev_sum, double prev_count) {
  if (count > prev_count)
    return absl::StrFormat("%.2f", 1e3 * (sum - prev_sum) / (count - prev_count));
  if (count > 0) return absl::StrFormat("%.2f", 1e3 * sum / count);
  return "-";
}

}  // namespace

absl::Status CmdStatus(Client& client, const Args& a) {
  ASSIGN_OR_RETURN(std::vector<v1::JobStatus> jobs, client.ListJobs());
  const Scrape scrape = ScrapeFor(a);
  const nlohmann::json status = StatusJson(client.address(), MetricsAddress(a), jobs, scrape);
  if (a.flags.count("json") != 0) {
    std::printf("%s\n", status.dump(2).c_str());
  } else {
    PrintStatusText(status);
  }
  return absl::OkStatus();
}

absl::Status CmdTop(Client& client, const Args& a) {
  const std::string& address = client.address();
  int64_t iterations = 0;  // 0: until interrupted
  if (a.flags.count("iterations") != 0) {
    ASSIGN_OR_RETURN(iterations, IntFlag(a, "iterations"));
    if (iterations < 0) return absl::InvalidArgumentError("--iterations must be >= 0");
  }
  double interval = 1;
  if (auto it = a.flags.find("interval"); it != a.flags.end()) {
    char* end = nullptr;
    interval = std::strtod(it->second.c_str(), &end);
    if (end == it->second.c_str() || *end != '\0' || !(interval > 0) || interval > 3600) {
      return absl::InvalidArgumentError("--interval expects seconds in (0, 3600]");
    }
  }
  const bool tty = isatty(STDOUT_FILENO) == 1;
  std::map<std::string, TopSample> prev;
  absl::Time prev_time;
  for (int64_t i = 1; iterations == 0 || i <= iterations; ++i) {
    if (i > 1) absl::SleepFor(absl::Seconds(interval));
    ASSIGN_OR_RETURN(std::vector<v1::JobStatus> jobs, client.ListJobs());
    const absl::Time now = absl::Now();
    const Scrape scrape = ScrapeFor(a);
    if (tty) std::printf("\x1b[H\x1b[2J");  // home and clear: the view redraws in place
    std::printf("muond top - %s - %s (every %gs%s)\n", address.c_str(),
                absl::FormatTime("%H:%M:%S", now, absl::LocalTimeZone()).c_str(), interval,
                iterations > 0 ? absl::StrCat(", ", i, "/", iterations).c_str() : "");
    if (!scrape.samples) std::printf("phase times unavailable: %s\n", scrape.error.c_str());
    std::printf("%-24s %5s %9s %8s %9s %9s %9s %9s %9s %9s %6s\n", "JOB", "RANKS", "STEP",
                "STEPS/S", "STEP_MS", "ASSEMBLY", "COPY_IN", "NS", "WRITEBACK", "RETURN", "FENCED");
    std::map<std::string, TopSample> current;
    for (const v1::JobStatus& j : jobs) {
      const std::string& id = j.spec().job_id();
      TopSample s;
      s.steps = j.steps_completed();
      const std::map<std::string, std::string> job_label{{"muond_job", id}};
      if (scrape.samples) {
        s.step_sum = FindSample(*scrape.samples, "muond_step_duration_seconds_sum", job_label, 0);
        s.step_count =
            FindSample(*scrape.samples, "muond_step_duration_seconds_count", job_label, 0);
        for (const char* phase : kPhases) {
          std::map<std::string, std::string> labels{{"muond_job", id}, {"phase", phase}};
          s.phases[phase] = {
              FindSample(*scrape.samples, "muond_step_phase_duration_seconds_sum", labels, 0),
              FindSample(*scrape.samples, "muond_step_phase_duration_seconds_count", labels, 0)};
        }
      }
      const auto p = prev.find(id);
      const bool has_prev = p != prev.end();
      const TopSample before = has_prev ? p->second : TopSample{};
      std::string rate = "-";
      if (has_prev && now > prev_time) {
        rate = absl::StrFormat("%.2f", static_cast<double>(s.steps - before.steps) /
                                           absl::ToDoubleSeconds(now - prev_time));
      }
      std::string cols;
      for (const char* phase : kPhases) {
        const auto& [sum, count] = s.phases[phase];
        auto bp = before.phases.find(phase);
        const double psum = bp == before.phases.end() ? 0 : bp->second.first;
        const double pcount = bp == before.phases.end() ? 0 : bp->second.second;
        absl::StrAppend(&cols, absl::StrFormat(" %9s", MeanMs(sum, count, psum, pcount)));
      }
      std::printf("%-24s %2d/%-2d %9lld %8s %9s%s %6s\n", id.c_str(), RanksAttached(j),
                  std::max(1, j.spec().world_size()), static_cast<long long>(j.next_step()),
                  rate.c_str(),
                  MeanMs(s.step_sum, s.step_count, before.step_sum, before.step_count).c_str(),
                  cols.c_str(), j.fenced() ? "yes" : "no");
      current[id] = std::move(s);
    }
    if (jobs.empty()) std::printf("(no jobs)\n");
    if (!tty) std::printf("\n");
    std::fflush(stdout);
    prev = std::move(current);
    prev_time = now;
  }
  return absl::OkStatus();
}

}  // namespace muond::client
