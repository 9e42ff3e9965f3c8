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
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "tests/bench/bench.h"

namespace muond::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

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
  constexpr int64_t kRows = 32, kCols = 131072;
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
  common::JobSpec spec;
  spec.job_id = "ckpt-bench";
  for (int i = 0; i < matrices; ++i) {
    spec.matrices.push_back({absl::StrCat("layers.", i, ".w"), {kRows, kCols}, 1,
                             common::DType::kFloat32});
  }
  auto token = (*client)->CreateJob(spec);
  auto session = token.ok() ? (*client)->Attach(spec.job_id, 0, *token) : token.status();
  if (!session.ok()) {
    std::fprintf(stderr, "muond-bench checkpoint: %s\n", session.status().ToString().c_str());
    StopDaemon(daemon, dir);
    return 1;
  }
  const size_t elements = static_cast<size_t>(matrices) * kRows * kCols;
  std::vector<float> grads(elements), updates(elements);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& g : grads) g = nd(rng);
  int64_t step = 0;
  auto run_step = [&]() -> double {
    const auto t0 = Clock::now();
    auto r = (*session)->StepBuffer(step++, grads.data(), updates.data());
    if (!r.ok()) {
      std::fprintf(stderr, "muond-bench checkpoint: step: %s\n", r.status().ToString().c_str());
      return -1;
    }
    return Since(t0);
  };
  (void)run_step();  // warm-up; the momentum is now non-zero

  // Save and load against plain I/O of the same bytes in the same directory.
  double save_s = 1e30, load_s = 1e30, write_s = 1e30, read_s = 1e30;
  uint64_t bytes = 0;
  std::string path;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    auto saved = (*client)->SaveCheckpoint(spec.job_id, *token);
    if (!saved.ok()) {
      std::fprintf(stderr, "muond-bench checkpoint: save: %s\n",
                   saved.status().ToString().c_str());
      StopDaemon(daemon, dir);
      return 1;
    }
    save_s = std::min(save_s, Since(t0));
    bytes = saved->bytes();
    path = saved->path() + "/momentum.safetensors";
    t0 = Clock::now();
    auto loaded = (*client)->LoadCheckpoint(spec.job_id, *token, saved->generation(), -1);
    if (!loaded.ok()) {
      std::fprintf(stderr, "muond-bench checkpoint: load: %s\n",
                   loaded.status().ToString().c_str());
      StopDaemon(daemon, dir);
      return 1;
    }
    load_s = std::min(load_s, Since(t0));
    std::vector<char> data(bytes, 1);
    const std::string plain = dir + "/state/plain.bin";
    write_s = std::min(write_s, PlainWrite(plain, data));
    read_s = std::min(read_s, PlainRead(plain, &data));
    ::unlink(plain.c_str());
  }
  const double gb = static_cast<double>(bytes) / 1e9;
  std::printf("checkpoint of %.1f MiB (%d matrices), best of %d:\n",
              static_cast<double>(bytes) / (1 << 20), matrices, reps);
  std::printf("  save  %7.3f s  %6.2f GB/s   plain write+fsync %7.3f s  %6.2f GB/s\n", save_s,
              gb / save_s, write_s, gb / write_s);
  std::printf("  load  %7.3f s  %6.2f GB/s   plain read        %7.3f s  %6.2f GB/s\n", load_s,
              gb / load_s, read_s, gb / read_s);

  // Step time without and with a save started at the same moment (one save per step, as with
  // checkpoint_every_steps = 1).
  double quiet = 0;
  for (int i = 0; i < steps; ++i) quiet += run_step();
  quiet /= steps;
  auto saver_client = client::Client::Connect(address);
  double busy = 0, save_during = 0;
  for (int i = 0; i < steps; ++i) {
    double save_seconds = 0;
    std::thread saver([&] {
      const auto t0 = Clock::now();
      if ((*saver_client)->SaveCheckpoint(spec.job_id, *token).ok()) save_seconds = Since(t0);
    });
    busy += run_step();
    saver.join();
    save_during += save_seconds;
  }
  busy /= steps;
  save_during /= steps;
  std::printf("  step  %7.3f s alone, %7.3f s with a save started with it (the save: %.3f s)\n",
              quiet, busy, save_during);
  std::printf("result: checkpoint save_ratio=%.3f load_ratio=%.3f step_ratio=%.3f\n",
              (gb / save_s) / (gb / write_s), (gb / load_s) / (gb / read_s), busy / quiet);
  StopDaemon(daemon, dir);
  return 0;
}

}  // namespace muond::bench
