// checkpoint::Store (server/storage/checkpoint.h): round trips, verification (bit flips, truncation),
// fault injection at every write / fsync / rename point, ENOSPC, a process killed in the middle of
// a save. After every failure the previous generation loads bit for bit.
#include "server/storage/checkpoint.h"
#include "server/storage/durable_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"

namespace muond::server::checkpoint {
namespace {

using durable::Fault;
using durable::IoPoint;
using durable::IoPointName;
using durable::RemoveTree;
using durable::SetFaultForTesting;

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/muond-ckpt-XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() { (void)RemoveTree(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

common::JobSpec Spec() {
  common::JobSpec spec;
  spec.job_id = "ckpt";
  spec.matrices.push_back({"layers.0.attn.q", {16, 24}, 1, common::DType::kFloat32});
  spec.matrices.push_back({"layers.0.mlp.up", {40, 12}, 1, common::DType::kBFloat16});
  spec.matrices.push_back({"experts", {3, 8, 8}, 1, common::DType::kFloat32});
  return spec;
}

using Momentum = std::vector<std::vector<float>>;

Momentum MakeMomentum(const common::JobSpec& spec, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  Momentum m;
  for (const auto& ms : spec.matrices) {
    std::vector<float> v(static_cast<size_t>(ms.numel()));
    for (float& x : v) x = d(rng);
    m.push_back(std::move(v));
  }
  return m;
}

MatrixSource From(const Momentum& m) {
  return [&m](size_t i, std::vector<float>* out) {
    *out = m[i];
    return absl::OkStatus();
  };
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void ExpectLoads(Store& store, const Selector& sel, const Momentum& want, int64_t step) {
  auto loaded = store.Load(sel);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, step);
  ASSERT_EQ(loaded->data.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(SameBits(loaded->data[i], want[i])) << i;
}

std::string GenDir(const Store& store, int64_t g) {
  char name[32];
  std::snprintf(name, sizeof name, "/gen-%012lld", static_cast<long long>(g));
  return store.dir() + name;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// Flips one bit of the file at `offset` (from the end when negative).
void FlipBit(const std::string& path, long offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.good()) << path;
  f.seekg(0, std::ios::end);
  const long size = static_cast<long>(f.tellg());
  const long at = offset < 0 ? size + offset : offset;
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c ^= 0x10;
  f.seekp(at);
  f.write(&c, 1);
}

std::vector<std::string> DirNames(const std::string& dir) {
  std::vector<std::string> out;
  if (auto* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(CheckpointStoreTest, RoundTripByNewestGenerationAndStep) {
  TempDir tmp;
  Store store(tmp.path() + "/job/checkpoints", 3);
  const common::JobSpec spec = Spec();
  const Momentum a = MakeMomentum(spec, 1), b = MakeMomentum(spec, 2);
  auto g1 = store.Write(spec, 10, From(a));
  ASSERT_TRUE(g1.ok()) << g1.status();
  auto g2 = store.Write(spec, 20, From(b));
  ASSERT_TRUE(g2.ok()) << g2.status();
  EXPECT_EQ(g1->generation, 1);
  EXPECT_EQ(g2->generation, 2);
  ExpectLoads(store, {}, b, 20);
  ExpectLoads(store, {1, -1}, a, 10);
  ExpectLoads(store, {-1, 10}, a, 10);
  auto loaded = store.Load({});
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->spec.job_id, "ckpt");
  EXPECT_EQ(loaded->names[1], "layers.0.mlp.up");
  auto list = store.List();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].generation, 2);
  EXPECT_EQ((*list)[0].step, 20);
  EXPECT_EQ((*list)[1].step, 10);
  EXPECT_TRUE((*list)[0].problem.empty());
  EXPECT_EQ(store.Load({7, -1}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Load({-1, 15}).status().code(), absl::StatusCode::kNotFound);
}

TEST(CheckpointStoreTest, KeepsTheNewestN) {
  TempDir tmp;
  Store store(tmp.path() + "/c", 2);
  const common::JobSpec spec = Spec();
  const Momentum m = MakeMomentum(spec, 3);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(store.Write(spec, i, From(m)).ok());
  EXPECT_EQ(DirNames(store.dir()),
            (std::vector<std::string>{"gen-000000000004", "gen-000000000005"}));
}

// Every corruption of the newest generation is detected: it is set aside (.broken) and the
// previous one loads; asked for by number, the corrupt one is DATA_LOSS.
TEST(CheckpointStoreTest, CorruptionIsDetectedAndSetAside) {
  struct Corruption {
    const char* what;
    std::function<void(const std::string& gen)> apply;
  };
  const std::vector<Corruption> corruptions = {
      {"payload last byte", [](const std::string& g) { FlipBit(g + "/momentum.safetensors", -1); }},
      {"payload first tensor",
       [](const std::string& g) {
         // 8 length bytes + the header, then data: flip inside the first tensor.
         std::ifstream f(g + "/momentum.safetensors", std::ios::binary);
         uint64_t n = 0;
         f.read(reinterpret_cast<char*>(&n), 8);
         FlipBit(g + "/momentum.safetensors", static_cast<long>(8 + n + 5));
       }},
      {"payload header", [](const std::string& g) { FlipBit(g + "/momentum.safetensors", 20); }},
      {"payload truncated",
       [](const std::string& g) {
         const std::string p = g + "/momentum.safetensors";
         struct stat st;
         ::stat(p.c_str(), &st);
         ASSERT_EQ(::truncate(p.c_str(), st.st_size - 100), 0);
       }},
      {"payload missing", [](const std::string& g) { ::unlink((g + "/momentum.safetensors").c_str()); }},
      {"manifest step digit",
       [](const std::string& g) {
         // A changed number that stays valid JSON: only the manifest checksum can tell.
         std::ifstream in(g + "/manifest.json");
         std::stringstream s;
         s << in.rdbuf();
         std::string text = s.str();
         const size_t at = text.find("\"step\": 20");
         ASSERT_NE(at, std::string::npos) << text;
         text.replace(at, 10, "\"step\": 21");
         std::ofstream(g + "/manifest.json", std::ios::trunc) << text;
       }},
      {"manifest truncated",
       [](const std::string& g) { ASSERT_EQ(::truncate((g + "/manifest.json").c_str(), 30), 0); }},
  };
  for (const Corruption& c : corruptions) {
    SCOPED_TRACE(c.what);
    TempDir tmp;
    Store store(tmp.path() + "/c", 5);
    const common::JobSpec spec = Spec();
    const Momentum a = MakeMomentum(spec, 4), b = MakeMomentum(spec, 5);
    ASSERT_TRUE(store.Write(spec, 10, From(a)).ok());
    ASSERT_TRUE(store.Write(spec, 20, From(b)).ok());
    c.apply(GenDir(store, 2));
    auto loaded = store.Load({});
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->info.generation, 1);
    ASSERT_EQ(loaded->set_aside.size(), 1u);
    EXPECT_EQ(loaded->set_aside[0], GenDir(store, 2) + ".broken");
    EXPECT_TRUE(Exists(GenDir(store, 2) + ".broken"));
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(SameBits(loaded->data[i], a[i]));
    // A new write does not reuse the broken generation's number.
    auto g3 = store.Write(spec, 30, From(b));
    ASSERT_TRUE(g3.ok());
    EXPECT_EQ(g3->generation, 3);
  }
  // Explicitly asked for: DATA_LOSS naming the path, no fallback.
  TempDir tmp;
  Store store(tmp.path() + "/c", 5);
  const common::JobSpec spec = Spec();
  ASSERT_TRUE(store.Write(spec, 10, From(MakeMomentum(spec, 6))).ok());
  ASSERT_TRUE(store.Write(spec, 20, From(MakeMomentum(spec, 7))).ok());
  FlipBit(GenDir(store, 2) + "/momentum.safetensors", -3);
  auto s = store.Load({2, -1});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(std::string(s.status().message()).find("gen-000000000002"), std::string::npos)
      << s.status();
  EXPECT_NE(std::string(s.status().message()).find("checksum mismatch"), std::string::npos)
      << s.status();
}

TEST(CheckpointStoreTest, NoGoodGenerationIsDataLossNamingThePaths) {
  TempDir tmp;
  Store store(tmp.path() + "/c", 5);
  const common::JobSpec spec = Spec();
  ASSERT_TRUE(store.Write(spec, 1, From(MakeMomentum(spec, 8))).ok());
  ASSERT_TRUE(store.Write(spec, 2, From(MakeMomentum(spec, 9))).ok());
  FlipBit(GenDir(store, 1) + "/momentum.safetensors", -1);
  FlipBit(GenDir(store, 2) + "/momentum.safetensors", -1);
  auto s = store.Load({});
  ASSERT_EQ(s.status().code(), absl::StatusCode::kDataLoss);
  const std::string msg(s.status().message());
  EXPECT_NE(msg.find("gen-000000000001.broken"), std::string::npos) << msg;
  EXPECT_NE(msg.find("gen-000000000002.broken"), std::string::npos) << msg;
  // Nothing there at all: NOT_FOUND.
  Store empty(tmp.path() + "/none", 1);
  EXPECT_EQ(empty.Load({}).status().code(), absl::StatusCode::kNotFound);
}

// A failure at each I/O point of a save (first and later calls): the save reports the error with
// the call and path, leaves no generation or temporary directory behind, and the previous
// generation still loads bit for bit.
TEST(CheckpointStoreTest, FaultAtEveryPointKeepsThePreviousGeneration) {
  const common::JobSpec spec = Spec();
  const Momentum old_m = MakeMomentum(spec, 10), new_m = MakeMomentum(spec, 11);
  struct Point {
    IoPoint point;
    int calls;  // calls of this point in one save
    const char* call;
  };
  // One save: mkdir (tmp dir), open x2, write: 2 + 3 tensors (payload) + 1 (manifest), fsync
  // file x2, fsync dir x2 (tmp dir, job dir), rename x1.
  const Point points[] = {{IoPoint::kMkdir, 1, "mkdir"},      {IoPoint::kOpen, 2, "open"},
                          {IoPoint::kWrite, 6, "write"},      {IoPoint::kFsyncFile, 2, "fsync"},
                          {IoPoint::kFsyncDir, 2, "fsync"},   {IoPoint::kRename, 1, "rename"}};
  int injected = 0;
  for (const Point& p : points) {
    for (int nth = 1; nth <= p.calls; ++nth) {
      SCOPED_TRACE(absl::StrCat(IoPointName(p.point), " #", nth));
      TempDir tmp;
      Store store(tmp.path() + "/c", 3);
      ASSERT_TRUE(store.Write(spec, 5, From(old_m)).ok());
      SetFaultForTesting(Fault{p.point, nth, EIO, false, 0});
      auto s = store.Write(spec, 6, From(new_m));
      SetFaultForTesting(std::nullopt);
      ASSERT_FALSE(s.ok()) << "a failed save was reported as success";
      ++injected;
      EXPECT_NE(std::string(s.status().message()).find(p.call), std::string::npos) << s.status();
      EXPECT_NE(std::string(s.status().message()).find("Input/output error"), std::string::npos)
          << s.status();
      EXPECT_EQ(DirNames(store.dir()), std::vector<std::string>{"gen-000000000001"});
      ExpectLoads(store, {}, old_m, 5);
      // The next save works.
      auto again = store.Write(spec, 6, From(new_m));
      ASSERT_TRUE(again.ok()) << again.status();
      ExpectLoads(store, {}, new_m, 6);
    }
  }
  EXPECT_EQ(injected, 14);
}

TEST(CheckpointStoreTest, DiskFullIsResourceExhaustedAndOlderGenerationsSurvive) {
  TempDir tmp;
  Store store(tmp.path() + "/c", 3);
  const common::JobSpec spec = Spec();
  const Momentum a = MakeMomentum(spec, 12);
  ASSERT_TRUE(store.Write(spec, 1, From(a)).ok());
  ASSERT_TRUE(store.Write(spec, 2, From(a)).ok());
  SetFaultForTesting(Fault{IoPoint::kWrite, 4, ENOSPC, false, 0});
  auto s = store.Write(spec, 3, From(MakeMomentum(spec, 13)));
  SetFaultForTesting(std::nullopt);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(std::string(s.status().message()).find("No space left"), std::string::npos);
  EXPECT_EQ(DirNames(store.dir()),
            (std::vector<std::string>{"gen-000000000001", "gen-000000000002"}));
  ExpectLoads(store, {}, a, 2);
  ExpectLoads(store, {1, -1}, a, 1);
}

// A source that fails (e.g. the job was deleted): the save fails, nothing is left behind.
TEST(CheckpointStoreTest, FailingSourceLeavesNothing) {
  TempDir tmp;
  Store store(tmp.path() + "/c", 3);
  const common::JobSpec spec = Spec();
  auto s = store.Write(spec, 1, [](size_t i, std::vector<float>*) {
    return absl::CancelledError(absl::StrCat("matrix ", i, " gone"));
  });
  EXPECT_EQ(s.status().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(DirNames(store.dir()).empty());
}

// kill -9 at each point of a save (in a child process): the previous generation loads, the
// leftover temporary directory is not a generation and the next save removes it.
TEST(CheckpointStoreTest, KilledMidSaveKeepsThePreviousGeneration) {
  const common::JobSpec spec = Spec();
  const Momentum old_m = MakeMomentum(spec, 14);
  for (IoPoint point : {IoPoint::kWrite, IoPoint::kFsyncFile, IoPoint::kFsyncDir,
                        IoPoint::kRename}) {
    SCOPED_TRACE(IoPointName(point));
    TempDir tmp;
    Store store(tmp.path() + "/c", 3);
    ASSERT_TRUE(store.Write(spec, 5, From(old_m)).ok());
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      SetFaultForTesting(Fault{point, point == IoPoint::kWrite ? 3 : 1, 0, true, 0});
      const Momentum m = MakeMomentum(spec, 15);
      (void)store.Write(spec, 6, From(m));
      ::_exit(0);  // not reached: the fault kills the process
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
    EXPECT_TRUE(Exists(GenDir(store, 2) + ".tmp"));
    ExpectLoads(store, {}, old_m, 5);
    auto list = store.List();
    ASSERT_TRUE(list.ok());
    EXPECT_EQ(list->size(), 1u);
    ASSERT_TRUE(store.Write(spec, 7, From(old_m)).ok());
    EXPECT_FALSE(Exists(GenDir(store, 2) + ".tmp"));
  }
}

// The checkpoint directory cannot be created (a file is in the way): a clear error naming it.
TEST(CheckpointStoreTest, UncreatableDirectoryIsAClearError) {
  TempDir tmp;
  std::ofstream(tmp.path() + "/c") << "not a directory";
  Store store(tmp.path() + "/c/checkpoints", 3);
  auto s = store.Write(Spec(), 1, From(MakeMomentum(Spec(), 1)));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string(s.status().message()).find(tmp.path() + "/c"), std::string::npos)
      << s.status();
  EXPECT_EQ(store.Load({}).status().code(), absl::StatusCode::kInternal) << store.Load({}).status();
}

}  // namespace
}  // namespace muond::server::checkpoint
