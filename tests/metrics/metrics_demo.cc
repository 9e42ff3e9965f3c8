// metrics_demo: registers a representative set of muond_* families, fills them as a daemon that has
// run a few steps would, and serves them with MetricsServer until SIGTERM/SIGINT.
//
//   metrics_demo [ADDRESS]     (default 127.0.0.1:0)
//
// Prints "port=<N>" on stdout once serving. The values are fixed (nothing changes between scrapes
// except the gauges set by collect callbacks, which are constant too), so a test can assert them:
// muond_steps_completed_total{job="demo"} is 42.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/metrics.h"
#include "server/ops/metrics_http.h"

namespace {

using muond::common::Counter;
using muond::common::ExponentialBuckets;
using muond::common::Family;
using muond::common::Gauge;
using muond::common::Histogram;
using muond::common::MetricsRegistry;

template <typename T>
T* Must(absl::StatusOr<T*> family) {
  if (!family.ok()) {
    std::fprintf(stderr, "metrics_demo: %s\n", family.status().ToString().c_str());
    std::exit(1);
  }
  return *family;
}

void Populate(MetricsRegistry& r) {
  Must(r.AddGauge("muond_build_info", "Build of the running muond; the value is always 1."))
      ->Add({{"version", "0.1.0"}, {"compiler", "gcc"}})
      .Set(1);
  Must(r.AddGauge("muond_device_info", "Backend and device in use; the value is always 1."))
      ->Add({{"backend", "cpu"}, {"device", "Intel \"Xeon\" \\ 2 vCPU"}})
      .Set(1);

  Must(r.AddGauge("muond_jobs", "Jobs that exist."))->Add({}).Set(2);
  Family<Gauge>* ranks = Must(r.AddGauge("muond_ranks_attached", "Ranks attached, per job."));
  ranks->Add({{"job", "demo"}}).Set(4);
  ranks->Add({{"job", "other"}}).Set(1);

  Family<Counter>* completed =
      Must(r.AddCounter("muond_steps_completed_total", "Optimizer steps completed."));
  completed->Add({{"job", "demo"}}).Increment(42);
  completed->Add({{"job", "other"}}).Increment(7);
  Must(r.AddCounter("muond_steps_refused_total", "Steps refused before starting."))
      ->Add({{"job", "demo"}, {"code", "FAILED_PRECONDITION"}})
      .Increment(3);
  Must(r.AddCounter("muond_steps_aborted_total", "Steps aborted after starting."))
      ->Add({{"job", "demo"}})
      .Increment(1);

  Family<Histogram>* step =
      Must(r.AddHistogram("muond_step_duration_seconds", "Wall time of a step."));
  Family<Histogram>* phase =
      Must(r.AddHistogram("muond_step_phase_duration_seconds", "Wall time of each step phase."));
  const char* phases[] = {"assembly", "copy_in", "newton_schulz", "writeback", "return"};
  for (int s = 0; s < 42; ++s) {
    step->Add({{"job", "demo"}}, ExponentialBuckets(0.001, 2, 14)).Observe(0.02 + 0.001 * s);
    for (int p = 0; p < 5; ++p) {
      phase->Add({{"job", "demo"}, {"phase", phases[p]}}, ExponentialBuckets(0.0001, 4, 10))
          .Observe(0.0002 * (p + 1) * (1 + s % 5));
    }
  }

  Family<Counter>* bytes =
      Must(r.AddCounter("muond_transfer_bytes_total", "Bytes moved between ranks and the daemon."));
  bytes->Add({{"direction", "in"}, {"transport", "shm"}}).Increment(1.5e9);
  bytes->Add({{"direction", "out"}, {"transport", "shm"}}).Increment(1.5e9);
  bytes->Add({{"direction", "in"}, {"transport", "grpc"}}).Increment(4096);

  Must(r.AddGauge("muond_pinned_bytes", "Host memory pinned for transfers."))->Add({}).Set(1 << 30);
  Must(r.AddGauge("muond_momentum_bytes", "Momentum state held, per job."))
      ->Add({{"job", "demo"}})
      .Set(268435456);
  Must(r.AddGauge("muond_gather_budget_bytes", "Gather buffer budget."))->Add({}).Set(2147483648.0);
  Must(r.AddGauge("muond_gather_used_bytes", "Gather buffer in use."))->Add({}).Set(0);

  Must(r.AddHistogram("muond_checkpoint_save_duration_seconds", "Wall time of checkpoint saves."))
      ->Add({}, ExponentialBuckets(0.01, 2, 12))
      .Observe(0.8);
  Must(r.AddCounter("muond_checkpoint_bytes_total", "Checkpoint bytes written and read."))
      ->Add({{"direction", "out"}})
      .Increment(268435456);
  Must(r.AddCounter("muond_checkpoint_failures_total", "Checkpoint saves and loads that failed."))
      ->Add({{"operation", "save"}});
  Must(r.AddCounter("muond_rpc_errors_total", "RPCs that returned an error, by gRPC code."))
      ->Add({{"code", "INVALID_ARGUMENT"}})
      .Increment(2);

  // Computed at scrape time.
  Gauge& depth = Must(r.AddGauge("muond_queue_depth", "Steps waiting to run."))->Add({});
  Gauge& age = Must(r.AddGauge("muond_checkpoint_newest_age_seconds",
                               "Age of the newest good checkpoint generation."))
                   ->Add({});
  r.AddCollectCallback([&depth, &age] {
    depth.Set(0);
    age.Set(12.5);
  });
}

}  // namespace

int main(int argc, char** argv) {
  const std::string address = argc > 1 ? argv[1] : "127.0.0.1:0";
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  // Blocked before any thread starts, so only sigwait below sees them.
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  MetricsRegistry registry;
  Populate(registry);
  auto server = muond::server::MetricsServer::Start(address, &registry);
  if (!server.ok()) {
    std::fprintf(stderr, "metrics_demo: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("port=%d\n", (*server)->port());
  std::fflush(stdout);
  int signal = 0;
  sigwait(&signals, &signal);
  return 0;
}
