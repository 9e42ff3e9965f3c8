// fuzz_replay TARGET INPUTS...: replays inputs through one fuzz target's entry point without
// libFuzzer: every file of the directories (or files) named, in name order. A crash, a sanitizer
// report or a failed harness check ends the process, and the ctest entry fails naming the input
// (printed before it runs). Missing directories count as empty (a target with no regressions yet).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#define MUOND_FUZZ_TARGET(t) extern "C" int MuondFuzz_##t(const uint8_t* data, size_t size);
#include "fuzz_targets.inc"
#undef MUOND_FUZZ_TARGET

namespace {

using Entry = int (*)(const uint8_t*, size_t);

struct Target {
  const char* name;
  Entry entry;
};

#define MUOND_FUZZ_TARGET(t) {#t, MuondFuzz_##t},
constexpr Target kTargets[] = {
#include "fuzz_targets.inc"
};
#undef MUOND_FUZZ_TARGET

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  Entry entry = nullptr;
  for (const Target& t : kTargets) {
    if (argc > 1 && std::strcmp(argv[1], t.name) == 0) entry = t.entry;
  }
  if (entry == nullptr) {
    std::fprintf(stderr, "usage: fuzz_replay TARGET INPUTS... (TARGET one of:");
    for (const Target& t : kTargets) std::fprintf(stderr, " %s", t.name);
    std::fprintf(stderr, ")\n");
    return 2;
  }
  std::vector<fs::path> inputs;
  for (int i = 2; i < argc; ++i) {
    const fs::path p = argv[i];
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      for (const auto& e : fs::directory_iterator(p)) {
        if (e.is_regular_file()) inputs.push_back(e.path());
      }
    } else if (fs::is_regular_file(p, ec)) {
      inputs.push_back(p);
    }
  }
  std::sort(inputs.begin(), inputs.end());
  for (const fs::path& p : inputs) {
    std::ifstream in(p, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) {
      std::fprintf(stderr, "replay: cannot read %s\n", p.c_str());
      return 1;
    }
    std::fprintf(stderr, "replay: %s %s (%zu bytes)\n", argv[1], p.c_str(), bytes.size());
    entry(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::printf("replay: %s: %zu inputs, all passed\n", argv[1], inputs.size());
  return 0;
}
