// `muond-bench transport`: bytes per second of moving one step's gradient in and update out,
// per rank, over shared memory and over gRPC, against a plain memcpy of the same bytes measured in
// the same run. The daemon runs a transport-probe job (updates echo the gradients, no Muon math),
// so the numbers are the data path alone. For shared memory the timed part is the step itself
// (doorbell, the daemon reading the gradient from the region and writing the update into the out
// region, completion): the trainer's device-to-host copy lands in the region and its
// host-to-device copy reads from it, which it does with any transport. gRPC is timed from the
// trainer's buffer to the trainer's buffer. The results are checked byte for byte.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "tests/bench/bench.h"

namespace muond::bench {
namespace {

// Shared memory should move a step's data at a large fraction of memcpy speed: its only costs
// over memcpy are the doorbell round trip and the daemon's one copy from region to region.
constexpr double kTarget = 0.7;

// Runs fn(rank) on `ranks` threads started together; returns the wall time.
template <typename Fn>
double Parallel(int ranks, Fn fn) {
  absl::Notification go;
  std::vector<std::thread> ts;
  for (int r = 0; r < ranks; ++r) {
    ts.emplace_back([&, r] {
      go.WaitForNotification();
      fn(r);
    });
  }
  const auto t0 = Clock::now();
  go.Notify();
  for (auto& t : ts) t.join();
  return Since(t0);
}

// A transport-probe job (updates echo the gradients, no Muon math) of one flat float32 matrix of
// `elems` elements over `world` ranks.
common::JobSpec ProbeSpec(const std::string& job_id, int world, uint64_t elems) {
  common::JobSpec spec;
  spec.job_id = job_id;
  spec.world_size = world;
  spec.zero_stage = world == 1 ? 0 : 2;
  spec.transport_probe = true;
  common::MatrixSpec m;
  m.name = "flat";
  m.shape = {static_cast<int64_t>(elems / 1024), 1024};
  spec.matrices.push_back(m);
  return spec;
}

// One step's data moved by memcpy on every rank (in, then out): the best of `reps`, in seconds.
double BestMemcpySeconds(int world, int reps, uint64_t per_rank, std::vector<std::string>& src,
                         std::vector<std::string>& dst) {
  double best_memcpy = 1e30;
  for (int k = 0; k < reps; ++k) {
    best_memcpy = std::min(best_memcpy, Parallel(world, [&](int r) {
                             std::memcpy(dst[r].data(), src[r].data(), per_rank);  // in
                             std::memcpy(src[r].data(), dst[r].data(), per_rank);  // out
                           }));
  }
  return best_memcpy;
}

// One step of every rank over `kind` (gradient src[r] in, the update into dst[r]), checked byte for
// byte against the gradient: the best of `reps`, in seconds. The job `spec` is created, attached by
// every rank and deleted. Prints the errors and returns nullopt on failure.
std::optional<double> BestStepSeconds(client::Client& client, const std::string& address,
                                      const common::JobSpec& spec, client::Transport kind, int reps,
                                      uint64_t per_rank, std::vector<std::string>& src,
                                      std::vector<std::string>& dst) {
  const int world = spec.world_size;
  auto token = client.CreateJob(spec);
  if (!token.ok()) {
    std::fprintf(stderr, "muond-bench transport: %s\n",
                 std::string(token.status().message()).c_str());
    return std::nullopt;
  }
  bool failed = false;
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::unique_ptr<client::RankSession>> sessions;
  for (int r = 0; r < world && !failed; ++r) {
    clients.push_back(*client::Client::Connect(address));
    auto s = clients.back()->Attach(spec.job_id, r, *token, false, kind);
    if (!s.ok()) {
      std::fprintf(stderr, "muond-bench transport: %s\n",
                   std::string(s.status().message()).c_str());
      failed = true;
    } else {
      sessions.push_back(*std::move(s));
    }
  }
  double best = 1e30;
  std::vector<absl::Status> status(world);
  for (int k = 0; k < reps && !failed; ++k) {
    if (kind == client::Transport::kShm) {
      for (int r = 0; r < world; ++r) {
        std::memcpy(sessions[r]->GradientView(k)->data, src[r].data(), per_rank);
      }
    }
    const double secs = Parallel(world, [&](int r) {
      if (kind == client::Transport::kShm) {
        status[r] = sessions[r]->StepInPlace(k).status();
      } else {
        status[r] = sessions[r]->StepBuffer(k, src[r].data(), dst[r].data()).status();
      }
    });
    if (kind == client::Transport::kShm) {
      for (int r = 0; r < world; ++r) {
        if (status[r].ok()) std::memcpy(dst[r].data(), sessions[r]->UpdateView(k)->data, per_rank);
      }
    }
    for (int r = 0; r < world; ++r) {
      if (!status[r].ok() || dst[r] != src[r]) {
        std::fprintf(stderr, "muond-bench transport: rank %d: %s\n", r,
                     status[r].ok() ? "update differs from the gradient"
                                    : std::string(status[r].message()).c_str());
        failed = true;
      }
    }
    best = std::min(best, secs);
  }
  sessions.clear();
  (void)client.DeleteJob(spec.job_id, *token);
  if (failed) return std::nullopt;
  return best;
}

// One row of the table: `mib` MiB per rank over `world` ranks, memcpy against shared memory and
// gRPC (jobs "transport-<*job_no>", counting up). *shm_ratio: shared memory's GB/s over memcpy's.
// False (the error printed) on failure.
bool MeasureRow(client::Client& client, const std::string& address, int64_t mib, int world,
                int reps, int* job_no, double* shm_ratio) {
  const uint64_t per_rank = static_cast<uint64_t>(mib) << 20;
  const uint64_t elems = per_rank / 4 * world;
  const double bytes_moved = 2.0 * per_rank * world;  // in and out
  std::vector<std::string> src(world, std::string(per_rank, '\0')), dst = src;
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < per_rank; i += 4096) src[r][i] = static_cast<char>(i / 4096 + r);
  }
  const double best_memcpy = BestMemcpySeconds(world, reps, per_rank, src, dst);
  double best[2] = {1e30, 1e30};
  const client::Transport kinds[2] = {client::Transport::kShm, client::Transport::kGrpc};
  for (int t = 0; t < 2; ++t) {
    const common::JobSpec spec = ProbeSpec(absl::StrCat("transport-", (*job_no)++), world, elems);
    const std::optional<double> secs =
        BestStepSeconds(client, address, spec, kinds[t], reps, per_rank, src, dst);
    if (!secs) return false;
    best[t] = *secs;
  }
  const double gbs_memcpy = bytes_moved / best_memcpy / 1e9;
  const double gbs_shm = bytes_moved / best[0] / 1e9;
  const double gbs_grpc = bytes_moved / best[1] / 1e9;
  std::printf("%9lld %6d %12.2f %12.2f %12.2f %10.3f\n", static_cast<long long>(mib), world,
              gbs_memcpy, gbs_shm, gbs_grpc, gbs_shm / gbs_memcpy);
  *shm_ratio = gbs_shm / gbs_memcpy;
  return true;
}

}  // namespace

int RunTransportBench(int argc, char** argv) {
  auto flags = ParseFlags(argc, argv, {"sizes-mib", "ranks", "reps"});
  if (!flags.ok() || flags->count("help")) {
    std::fprintf(flags.ok() ? stdout : stderr,
                 "usage: muond-bench transport [--sizes-mib 8,64,512] [--ranks 1,4] [--reps 3]\n");
    return flags.ok() ? 0 : 2;
  }
  auto get = [&](const char* k, const char* d) {
    return flags->count(k) ? flags->at(k) : std::string(d);
  };
  auto sizes = ParsePositiveList("sizes-mib", get("sizes-mib", "8,64,512"));
  auto ranks_list = ParsePositiveList("ranks", get("ranks", "1,4"));
  auto reps_list = ParsePositiveList("reps", get("reps", "3"));
  if (!sizes.ok() || !ranks_list.ok() || !reps_list.ok()) {
    std::fprintf(stderr, "muond-bench transport: bad flags (see --help)\n");
    return 2;
  }
  const int reps = static_cast<int>((*reps_list)[0]);
  std::string address;
  const std::string dir = MakeTempDir("muond-bench-transport");
  const pid_t daemon = StartDaemon(dir, 1, &address);
  auto client = client::Client::Connect(address);
  if (!WaitHealthy(**client)) {
    std::fprintf(stderr, "muond-bench transport: muond did not start\n");
    StopDaemon(daemon, dir);
    return 1;
  }
  std::printf("muond-bench transport: GB/s of gradient in + update out, best of %d steps\n", reps);
  std::printf("%9s %6s %12s %12s %12s %10s\n", "MiB/rank", "ranks", "memcpy", "shm", "grpc",
              "shm/memcpy");
  double result = -1;
  int code = 0;
  int job_no = 0;
  for (int64_t mib : *sizes) {
    for (int64_t nranks : *ranks_list) {
      const int world = static_cast<int>(nranks);
      double shm_ratio = 0;
      if (!MeasureRow(**client, address, mib, world, reps, &job_no, &shm_ratio)) {
        code = 1;
        break;
      }
      if (mib == 64 && world == 4) result = shm_ratio;
    }
    if (code != 0) break;
  }
  StopDaemon(daemon, dir);
  if (code != 0) return code;
  if (result < 0) {
    std::printf("(the result line needs --sizes-mib with 64 and --ranks with 4)\n");
    return 0;
  }
  std::printf("result: transport ratio=%.3f target=%.3f\n", result, kTarget);
  return 0;
}

}  // namespace muond::bench
