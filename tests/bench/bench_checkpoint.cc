// `muond-bench checkpoint`: checkpoint save and load throughput of a real muond against a plain
// sequential write (+ fsync) and read of the same number of bytes in the same directory, measured
// in the same run; and the step time of the job alone and with a save started at the same moment.
//
// The job: --mib of fp32 momentum in matrices of 32 x 131072 (16 MiB each: many bytes, little
// Newton-Schulz work, so that a save and steps are of similar length on a small machine).
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "tests/bench/bench.h"

namespace muond::bench {
namespace {

// Sequential write + fsync of `bytes` to `path` (the baseline of a save); seconds.
double PlainWrite(const std::string& path, const std::vector<char>& data) {
  const auto t0 = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return -1;
  size_t at = 0;
  while (at < data.size()) {
    const ssize_t w = ::write(fd, data.data() + at, std::min<size_t>(data.size() - at, 64 << 20));
    if (w <= 0) break;
    at += static_cast<size_t>(w);
  }
  ::fsync(fd);
  ::close(fd);
  return Since(t0);
}

// Sequential read of the whole file (the baseline of a load); seconds.
double PlainRead(const std::string& path, std::vector<char>* buf) {
  const auto t0 = Clock::now();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  size_t at = 0;
  while (at < buf->size()) {
    const ssize_t r = ::read(fd, buf->data() + at, std::min<size_t>(buf->size() - at, 64 << 20));
    if (r <= 0) break;
    at += static_cast<size_t>(r);
  }
  ::close(fd);
  return Since(t0);
}

constexpr int64_t kRows = 32, kCols = 131072;

// The benchmark's job, attached as rank 0, with its gradients: steps are numbered from 0.
struct BenchJob {
  common::JobSpec spec;
  std::string token;
  std::unique_ptr<client::RankSession> session;
  std::vector<float> grads, updates;
  int64_t step = 0;

  // The next step; its seconds, or -1 (the error printed).
  double Step() {
    const auto t0 = Clock::now();
    auto r = session->StepBuffer(step++, grads.data(), updates.data());
    if (!r.ok()) {
      std::fprintf(stderr, "muond-bench checkpoint: step: %s\n", r.status().ToString().c_str());
      return -1;
    }
    return Since(t0);
  }
};

// Creates and attaches "ckpt-bench", `matrices` fp32 matrices of kRows x kCols, with random
// gradients; prints the error and returns nullptr on failure.
std::unique_ptr<BenchJob> StartJob(client::Client& client, int matrices) {
  auto job = std::make_unique<BenchJob>();
  job->spec.job_id = "ckpt-bench";
  for (int i = 0; i < matrices; ++i) {
    job->spec.matrices.push_back(
        {absl::StrCat("layers.", i, ".w"), {kRows, kCols}, 1, common::DType::kFloat32});
  }
  auto token = client.CreateJob(job->spec);
  auto session = token.ok() ? client.Attach(job->spec.job_id, 0, *token) : token.status();
  if (!session.ok()) {
    std::fprintf(stderr, "muond-bench checkpoint: %s\n", session.status().ToString().c_str());
    return nullptr;
  }
  job->token = *token;
  job->session = *std::move(session);
  const size_t elements = static_cast<size_t>(matrices) * kRows * kCols;
  job->grads.resize(elements);
  job->updates.resize(elements);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& g : job->grads) g = nd(rng);
  return job;
}

// Best-of-reps seconds of a save and a load of the job, and of plain I/O of as many bytes in the
// same directory.
struct IoTimes {
  double save_s = 1e30, load_s = 1e30, write_s = 1e30, read_s = 1e30;
  uint64_t bytes = 0;
};

// Saves and loads the job `reps` times, each followed by a plain write + fsync and read of the
// checkpoint's size under `dir`/state. False (the error printed) on failure.
bool MeasureSaveAndLoad(client::Client& client, const BenchJob& job, const std::string& dir,
                        int reps, IoTimes* times) {
  IoTimes& t = *times;
  std::string path;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    auto saved = client.SaveCheckpoint(job.spec.job_id, job.token);
    if (!saved.ok()) {
      std::fprintf(stderr, "muond-bench checkpoint: save: %s\n", saved.status().ToString().c_str());
      return false;
    }
    t.save_s = std::min(t.save_s, Since(t0));
    t.bytes = saved->bytes();
    path = saved->path() + "/momentum.safetensors";
    t0 = Clock::now();
    auto loaded = client.LoadCheckpoint(job.spec.job_id, job.token, saved->generation(), -1);
    if (!loaded.ok()) {
      std::fprintf(stderr, "muond-bench checkpoint: load: %s\n",
                   loaded.status().ToString().c_str());
      return false;
    }
    t.load_s = std::min(t.load_s, Since(t0));
    std::vector<char> data(t.bytes, 1);
    const std::string plain = dir + "/state/plain.bin";
    t.write_s = std::min(t.write_s, PlainWrite(plain, data));
    t.read_s = std::min(t.read_s, PlainRead(plain, &data));
    ::unlink(plain.c_str());
  }
  return true;
}

// Mean seconds per step over `steps` steps alone (*quiet), and with a save (on its own connection
// to `address`) started at the same moment as each step (*busy; the saves' mean: *save_during),
// as with checkpoint_every_steps = 1.
void MeasureStepsDuringSaves(BenchJob& job, const std::string& address, int steps, double* quiet,
                             double* busy, double* save_during) {
  *quiet = 0;
  for (int i = 0; i < steps; ++i) *quiet += job.Step();
  *quiet /= steps;
  auto saver_client = client::Client::Connect(address);
  *busy = 0;
  *save_during = 0;
  for (int i = 0; i < steps; ++i) {
    double save_seconds = 0;
    std::thread saver([&] {
      const auto t0 = Clock::now();
      if ((*saver_client)->SaveCheckpoint(job.spec.job_id, job.token).ok()) {
        save_seconds = Since(t0);
      }
    });
    *busy += job.Step();
    saver.join();
    *save_during += save_seconds;
  }
  *busy /= steps;
  *save_during /= steps;
}

}  // namespace

int RunCheckpointBench(int argc, char** argv) {
  auto flags = ParseFlags(argc, argv, {"mib", "steps", "reps"});
  if (!flags.ok() || flags->count("help")) {
    std::fprintf(flags.ok() ? stdout : stderr,
                 "usage: muond-bench checkpoint [--mib 128] [--steps 4] [--reps 5]\n");
    return flags.ok() ? 0 : 2;
  }
  auto get = [&](const char* k, const char* d) {
    return flags->count(k) ? flags->at(k) : std::string(d);
  };
  auto mib = ParsePositiveList("mib", get("mib", "128"));
  auto steps_l = ParsePositiveList("steps", get("steps", "4"));
  auto reps_l = ParsePositiveList("reps", get("reps", "5"));
  if (!mib.ok() || !steps_l.ok() || !reps_l.ok()) {
    std::fprintf(stderr, "muond-bench checkpoint: bad flags (see --help)\n");
    return 2;
  }
  const int steps = static_cast<int>((*steps_l)[0]);
  const int reps = static_cast<int>((*reps_l)[0]);
  const int matrices = std::max<int64_t>(1, (*mib)[0] / 16);

  std::string address;
  const std::string dir = MakeTempDir("muond-bench-checkpoint");
  const pid_t daemon = StartDaemon(dir, 2, &address);
  auto client = client::Client::Connect(address);
  if (!client.ok() || !WaitHealthy(**client)) {
    std::fprintf(stderr, "muond-bench checkpoint: muond did not start\n");
    StopDaemon(daemon, dir);
    return 1;
  }
  const std::unique_ptr<BenchJob> job = StartJob(**client, matrices);
  if (job == nullptr) {
    StopDaemon(daemon, dir);
    return 1;
  }
  (void)job->Step();  // warm-up; the momentum is now non-zero

  // Save and load against plain I/O of the same bytes in the same directory.
  IoTimes t;
  if (!MeasureSaveAndLoad(**client, *job, dir, reps, &t)) {
    StopDaemon(daemon, dir);
    return 1;
  }
  const double gb = static_cast<double>(t.bytes) / 1e9;
  std::printf("checkpoint of %.1f MiB (%d matrices), best of %d:\n",
              static_cast<double>(t.bytes) / (1 << 20), matrices, reps);
  std::printf("  save  %7.3f s  %6.2f GB/s   plain write+fsync %7.3f s  %6.2f GB/s\n", t.save_s,
              gb / t.save_s, t.write_s, gb / t.write_s);
  std::printf("  load  %7.3f s  %6.2f GB/s   plain read        %7.3f s  %6.2f GB/s\n", t.load_s,
              gb / t.load_s, t.read_s, gb / t.read_s);

  double quiet = 0, busy = 0, save_during = 0;
  MeasureStepsDuringSaves(*job, address, steps, &quiet, &busy, &save_during);
  std::printf("  step  %7.3f s alone, %7.3f s with a save started with it (the save: %.3f s)\n",
              quiet, busy, save_during);
  std::printf("result: checkpoint save_ratio=%.3f load_ratio=%.3f step_ratio=%.3f\n",
              (gb / t.save_s) / (gb / t.write_s), (gb / t.load_s) / (gb / t.read_s), busy / quiet);
  StopDaemon(daemon, dir);
  return 0;
}

}  // namespace muond::bench
