// muond-bench: one binary, many benchmarks ("subcommands"). Each subcommand lives in its own
// bench_<name>.cc, exposes `int Run<Name>Bench(int argc, char** argv)` here and is listed in
// main.cc's kSubcommands. argv[0] is the subcommand name; the return value is the exit code.
//
// Convention (DESIGN/STYLE): a benchmark measures a baseline in the same run and prints, as its
// last line, `result: <name> ratio=<x> target=<y>`.
#ifndef MUOND_TESTS_BENCH_BENCH_H_
#define MUOND_TESTS_BENCH_BENCH_H_

#include <sys/types.h>

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/job_spec.h"

namespace muond::bench {

// `muond-bench ns`: CPU Newton-Schulz throughput against a plain LibTorch matmul.
int RunNsBench(int argc, char** argv);
// `muond-bench step`: a multi-rank step through a real muond against in-process Muon.
int RunStepBench(int argc, char** argv);
// `muond-bench transport`: shared memory and gRPC data paths against memcpy.
int RunTransportBench(int argc, char** argv);
// `muond-bench overlap`: the simulated device's step time, pipelined against a serial schedule.
int RunOverlapBench(int argc, char** argv);
// `muond-bench checkpoint`: save/load throughput vs plain sequential I/O; step time during saves.
int RunCheckpointBench(int argc, char** argv);
// `muond-bench adamw`: the fused AdamW against torch::optim::AdamW and memcpy.
int RunAdamWBench(int argc, char** argv);
// `muond-bench apply`: an apply-mode step through a real muond against in-process Muon + AdamW.
int RunApplyBench(int argc, char** argv);
// `muond-bench peer`: muond's Muon step against the usual in-process LibTorch Muon (speed, error).
int RunPeerBench(int argc, char** argv);
// bench_multinode.cc: emulated nodes in network namespaces (runs multinode_netns_bench.py).
int RunMultinodeBench(int argc, char** argv);
// `muond-bench orthogonality`: what --orthogonality-every costs against the step time.
int RunOrthogonalityBench(int argc, char** argv);
// `muond-bench gpu` (built with the CUDA backend): the CUDA device against cuBLAS and copy peaks.
int RunGpuBench(int argc, char** argv);

// `layers` Qwen3-0.6B-like layers of Muon matrices (hidden 1024, intermediate 3072, 16 q heads and
// 8 kv heads of head_dim 128; 7 matrices a layer), gradients and compute in `dtype`
// (bench_step.cc).
common::JobSpec Qwen3LikeLayers(int layers, common::DType dtype);

// The clock every benchmark times with, the seconds since `t0` on it, and the median of `v` (the
// mean of the middle two when even; `v` must not be empty).
using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0);
double Median(std::vector<double> v);

// A real muond for the daemon benchmarks (bench_daemon.cc): started from the binary next to
// muond-bench on a socket in `dir`, with `threads` compute threads (and `extra` flags).
std::string MakeTempDir(const std::string& prefix);
pid_t StartDaemon(const std::string& dir, int threads, std::string* address,
                  const std::vector<std::string>& extra = {});
bool WaitHealthy(client::Client& client);
// SIGTERM, wait, and remove `dir`.
void StopDaemon(pid_t pid, const std::string& dir);
// A loopback port that was free a moment ago, for a daemon's metrics endpoint.
int FreePort();
// The step phases of muond_step_phase_duration_seconds, in pipeline order.
inline constexpr const char* kPhases[] = {"assembly", "copy_in", "newton_schulz", "writeback",
                                          "return"};
// The sums of muond_step_duration_seconds ("step") and muond_step_phase_duration_seconds (per
// phase) of `job` at the endpoint `metrics`; empty when it cannot be scraped.
std::map<std::string, double> PhaseSums(const std::string& metrics, const std::string& job);
// User + system CPU seconds used so far by process `pid` (0: this process), from /proc.
double CpuSeconds(pid_t pid);

// --cpu-isa of `ns` and `peer` (server/optim/cpu_isa.h): sets this process's CPU path before any
// LibTorch or oneDNN work. A forced path narrower than AVX-512 also has the system BLAS (OpenBLAS:
// LibTorch's fp32 GEMMs, muond's SYRK/SYMM) run its AVX2 kernels, as on an AVX2 machine: the
// benchmark re-executes itself once with OPENBLAS_CORETYPE=Haswell (read when OpenBLAS loads)
// unless that variable is set. Returns -1 to go on, or the exit code (2: refused, the error
// printed). `argv` is the subcommand's (argv[0] the subcommand's name).
int SetBenchCpuIsa(const char* bench, const std::string& isa, int argc, char** argv);
// One line on the CPU path in use, and the system BLAS's kernel set ("unknown" if not OpenBLAS).
std::string CpuPathLine();
std::string BlasCoreName();

// Flags of a subcommand: `--name value` or `--name=value`; `--help`/`-h` is returned as "help".
// INVALID_ARGUMENT for a flag not in `known`, a missing value or a positional argument.
absl::StatusOr<std::map<std::string, std::string>> ParseFlags(int argc, char** argv,
                                                              const std::set<std::string>& known);
// "1024,2048" -> {1024, 2048}; INVALID_ARGUMENT naming the flag for anything but positive ints.
absl::StatusOr<std::vector<int64_t>> ParsePositiveList(const std::string& flag,
                                                       const std::string& value);
// "a,b" -> {"a", "b"} (empty items dropped).
std::vector<std::string> SplitList(const std::string& value);

}  // namespace muond::bench

#endif  // MUOND_TESTS_BENCH_BENCH_H_
