// muond-bench: dispatches `muond-bench <subcommand> [flags]` to the benchmark of that name.
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/bench/bench.h"

namespace muond::bench {

// `muond-bench capacity` (bench_capacity.cc): muond's host bytes per parameter (VmHWM slopes).
int RunCapacityBench(int argc, char** argv);

namespace {

struct Subcommand {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);
};

// Add new benchmarks here (see bench.h).
constexpr Subcommand kSubcommands[] = {
    {"ns", "CPU Newton-Schulz (standard-equivalent GFLOP/s) vs the best LibTorch GEMM rate",
     RunNsBench},
    {"step", "a ZeRO-2 step of a Qwen3-0.6B-like layer set through muond vs in-process Muon",
     RunStepBench},
    {"transport", "shared memory and gRPC data paths (GB/s) vs memcpy of the same bytes",
     RunTransportBench},
    {"overlap", "simulated device: pipelined step time vs the serial sum of its stages",
     RunOverlapBench},
    {"checkpoint", "checkpoint save/load GB/s vs plain write/read; step time during saves",
     RunCheckpointBench},
    {"adamw", "fused AdamW vs torch::optim::AdamW on the same tensors; GB/s vs memcpy",
     RunAdamWBench},
    {"apply", "an apply-mode step (bf16, Qwen3-0.6B-like) through muond vs in-process Muon+AdamW",
     RunApplyBench},
    {"peer", "muond vs the usual in-process LibTorch Muon (DeepSpeed's NS): s/step, float64 error",
     RunPeerBench},
    {"orthogonality", "--orthogonality-every: the measurement's cost vs the step time",
     RunOrthogonalityBench},
    {"multinode", "emulated nodes (netns, tbf links): step time at 1/2/4 nodes vs the model",
     RunMultinodeBench},
    {"capacity", "host bytes per parameter (VmHWM of muond + rank, slope over 2 job sizes)",
     RunCapacityBench},
#ifdef MUOND_HAVE_CUDA
    {"gpu", "CUDA: Newton-Schulz vs cuBLAS GEMM peak, pinned vs pageable copies, Muon apply",
     RunGpuBench},
#endif
};

void PrintUsage(std::FILE* out) {
  std::fprintf(out,
               "usage: muond-bench <subcommand> [flags]\n"
               "       muond-bench <subcommand> --help\n\nsubcommands:\n");
  for (const Subcommand& s : kSubcommands) std::fprintf(out, "  %-13s %s\n", s.name, s.summary);
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> ParseFlags(int argc, char** argv,
                                                              const std::set<std::string>& known) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      flags["help"] = "";
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    std::string name = arg.substr(2);
    std::string value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
    }
    if (known.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    flags[name] = value;
  }
  return flags;
}

absl::StatusOr<std::vector<int64_t>> ParsePositiveList(const std::string& flag,
                                                       const std::string& value) {
  std::vector<int64_t> out;
  for (const std::string& item : SplitList(value)) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(item, &v) || v < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", item, "' is not a positive integer"));
    }
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " is empty"));
  return out;
}

std::vector<std::string> SplitList(const std::string& value) {
  return absl::StrSplit(value, ',', absl::SkipEmpty());
}

}  // namespace muond::bench

int main(int argc, char** argv) {
  using muond::bench::kSubcommands;
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    muond::bench::PrintUsage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& s : kSubcommands) {
    if (std::strcmp(argv[1], s.name) == 0) return s.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "muond-bench: unknown subcommand '%s'\n\n", argv[1]);
  muond::bench::PrintUsage(stderr);
  return 2;
}
