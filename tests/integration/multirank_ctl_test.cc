// `muonctl step` for sharded jobs, one process per rank running concurrently, with the normative
// file formats: stage 1/2 one 1-D tensor `partition` of P = ceil(total / world) elements (tail
// padded); stage 3 one 1-D tensor per matrix, named by it, of ceil(numel / world) elements
// (padded). OUT in the same form with zero padding. Also `job show` and `job reset --step`.
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"

namespace muond::integration {
namespace {

class MultiRankCtlTest : public DaemonSuite {
 protected:
  void SetUp() override {
    DaemonSuite::SetUp();
    files_ = std::make_unique<TempDir>();
  }

  void CreateJob(const std::string& prefix, int world, int stage,
                 std::vector<common::MatrixSpec> matrices, uint64_t budget, int steps) {
    spec_.job_id = NewJobId(prefix);
    spec_.world_size = world;
    spec_.zero_stage = stage;
    spec_.matrices = std::move(matrices);
    spec_.gather_budget_bytes = budget;
    auto token = client().CreateJob(spec_);
    ASSERT_TRUE(token.ok()) << token.status();
    token_ = *token;
    grads_ = MakeGradients(spec_.matrices, steps, /*seed=*/51);
    auto want = ReferenceTrajectory(client(), spec_.job_id + "-ref", spec_, grads_);
    ASSERT_TRUE(want.ok()) << want.status();
    want_ = *want;
  }

  // The normative tensors of rank r for whole-matrix values `grads` (IN; or OUT for updates).
  std::vector<client::NamedTensor> RankTensors(int r, const std::vector<std::string>& grads) {
    std::vector<client::NamedTensor> out;
    if (spec_.zero_stage == 3) {
      const uint64_t world = spec_.world_size;
      for (const common::MatrixSpec& ms : spec_.matrices) {
        const int64_t chunk = (ms.numel() + world - 1) / world;
        out.push_back({ms.name, ms.dtype, {chunk},
                       std::string(chunk * common::DTypeSize(ms.dtype), '\0')});
      }
      for (const common::ShardSpan& s : common::RankSpans(spec_, r)) {
        const common::DType dtype = spec_.matrices[s.matrix].dtype;
        const std::string bytes = Slice(grads[s.matrix], dtype, s.offset, s.length);
        out[s.matrix].data.replace(0, bytes.size(), bytes);  // a rank's span starts its chunk
      }
      return out;
    }
    const common::DType dtype = spec_.matrices[0].dtype;
    const size_t esize = common::DTypeSize(dtype);
    const int64_t n = common::RankBufferElements(spec_, r);
    client::NamedTensor t{"partition", dtype, {n}, std::string(n * esize, '\0')};
    for (const common::ShardSpan& s : common::RankSpans(spec_, r)) {
      t.data.replace(s.rank_offset * esize, s.length * esize,
                     Slice(grads[s.matrix], dtype, s.offset, s.length));
    }
    out.push_back(std::move(t));
    return out;
  }

  std::string Write(const std::string& name, const std::vector<client::NamedTensor>& tensors) {
    std::vector<common::TensorRef> refs;
    for (const client::NamedTensor& t : tensors) refs.push_back({t.name, t.dtype, t.shape, t.data});
    const std::string path = files_->File(name);
    const absl::Status s = common::WriteSafetensorsFile(path, refs);
    EXPECT_TRUE(s.ok()) << s;
    return path;
  }

  ProcessResult Ctl(const std::vector<std::string>& args) {
    return RunMuonctl(address(), args, {{"MUOND_JOB_TOKEN", token_}});
  }

  ProcessResult CtlStep(int rank, int64_t step, const std::string& in, const std::string& out) {
    return Ctl({"step", "--job", spec_.job_id, "--rank", std::to_string(rank), "--step",
                std::to_string(step), "--grads", in, "--out", out});
  }

  // One `muonctl step` process per rank, concurrently; then checks every OUT file against the
  // world-size-1 update of trajectory step `traj` (bit for bit) and its padding (zero).
  void StepAllRanks(int64_t step, int traj) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const int world = spec_.world_size;
    std::vector<std::string> in(world), out(world);
    std::vector<ProcessResult> results(world);
    for (int r = 0; r < world; ++r) {
      in[r] = Write(absl::StrCat("in-", r, "-", step, ".safetensors"), RankTensors(r, grads_[traj]));
      out[r] = files_->File(absl::StrCat("out-", r, "-", step, ".safetensors"));
    }
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] { results[r] = CtlStep(r, step, in[r], out[r]); });
    }
    for (std::thread& t : threads) t.join();
    // The expected OUT: the update's slices in the IN form, padding zero.
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE(absl::StrCat("rank ", r));
      ASSERT_EQ(results[r].exit_code, 0) << results[r].out << results[r].err;
      EXPECT_NE(results[r].out.find(absl::StrCat("step ", step, ": job ", spec_.job_id, " rank ", r)),
                std::string::npos)
          << results[r].out;
      auto file = common::SafetensorsFile::ReadFile(out[r]);
      ASSERT_TRUE(file.ok()) << file.status();
      const std::vector<client::NamedTensor> want = RankTensors(r, want_[traj]);
      ASSERT_EQ(file->tensors().size(), want.size());
      for (const client::NamedTensor& w : want) {
        const common::TensorInfo* t = file->Find(w.name);
        ASSERT_NE(t, nullptr) << "OUT lacks '" << w.name << "'";
        EXPECT_EQ(t->dtype, w.dtype) << w.name;
        EXPECT_EQ(t->shape, w.shape) << w.name;
        EXPECT_TRUE(file->Data(*t) == w.data)
            << "'" << w.name << "' differs from the world-size-1 update (or padding not zero)";
      }
    }
  }

  // A muonctl step that fails locally with INVALID_ARGUMENT (exit 3) and one line naming `what`.
  void ExpectBadFile(int rank, const std::vector<client::NamedTensor>& tensors,
                     const std::string& what) {
    const std::string in = Write("bad.safetensors", tensors);
    const ProcessResult r = CtlStep(rank, 2, in, files_->File("bad-out.safetensors"));
    EXPECT_TRUE(r.exited);
    EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(what), std::string::npos) << "wanted '" << what << "' in: " << r.err;
    EXPECT_NE(r.err.find("INVALID_ARGUMENT"), std::string::npos) << r.err;
  }

  void ExpectUnharmed(int64_t next_step) {
    auto st = client().GetJob(spec_.job_id, token_);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->next_step(), next_step);
    EXPECT_FALSE(st->fenced()) << st->fence_reason();
    EXPECT_EQ(st->steps_refused(), 0);
    EXPECT_FALSE(st->has_step_in_flight());
  }

  std::unique_ptr<TempDir> files_;
  common::JobSpec spec_;
  std::string token_;
  MatrixBytes grads_, want_;
};

TEST_F(MultiRankCtlTest, Stage2PartitionsWithOneProcessPerRank) {
  CreateJob("ctl-s2", 2, 2, MixedMatrices(), /*budget=*/65536, 2);
  StepAllRanks(0, 0);
  StepAllRanks(1, 1);
  // Wrong name, wrong length, a second tensor: refused before the step begins.
  std::vector<client::NamedTensor> good = RankTensors(0, grads_[0]);
  std::vector<client::NamedTensor> bad = good;
  bad[0].name = "partitions";
  ExpectBadFile(0, bad, "'partition'");
  bad = good;
  bad[0].shape[0] += 1;
  bad[0].data += std::string(4, '\0');
  ExpectBadFile(0, bad, absl::StrCat("expected [", good[0].shape[0], "]"));
  bad = good;
  bad.push_back({"extra", common::DType::kFloat32, {1}, std::string(4, '\0')});
  ExpectBadFile(1, bad, "'extra'");
  ExpectUnharmed(2);

  // job show: the layout, the budget and one line per rank.
  const ProcessResult show = Ctl({"job", "show", "--job", spec_.job_id});
  ASSERT_EQ(show.exit_code, 0) << show.err;
  const int64_t p = common::RankBufferElements(spec_, 0);
  for (const std::string& want :
       {absl::StrCat("layout: zero_stage 2, partition of ", p, " elements per rank"),
        std::string("world_size: 2"), std::string("gather_budget_bytes: 65536"),
        std::string("next_step: 2"), std::string("fenced: no"),
        std::string("step_in_flight: none")}) {
    EXPECT_NE(show.out.find(want + "\n"), std::string::npos) << "wanted '" << want << "' in:\n"
                                                             << show.out;
  }
  for (int r = 0; r < 2; ++r) {
    uint64_t elements = 0;
    for (const common::ShardSpan& s : common::RankSpans(spec_, r)) elements += s.length;
    const std::string line = absl::StrCat("rank: ", r, " attached=no elements=", elements, "\n");
    EXPECT_NE(show.out.find(line), std::string::npos) << "wanted '" << line << "' in:\n" << show.out;
  }

  // job reset --step 5: momentum zero, next step 5; steps 5, 6 replay the trajectory from 0.
  const ProcessResult reset = Ctl({"job", "reset", "--job", spec_.job_id, "--step", "5"});
  ASSERT_EQ(reset.exit_code, 0) << reset.err;
  ExpectUnharmed(5);
  StepAllRanks(5, 0);
  StepAllRanks(6, 1);
}

TEST_F(MultiRankCtlTest, Stage3ChunksWithOneProcessPerRank) {
  // bfloat16 matrices and one float32 ("tall"); "tiny" (6 elements) in chunks of 2.
  CreateJob("ctl-s3", 3, 3, MixedMatrices(common::DType::kBFloat16, common::DType::kFloat32),
            /*budget=*/0, 2);
  StepAllRanks(0, 0);
  StepAllRanks(1, 1);
  std::vector<client::NamedTensor> good = RankTensors(2, grads_[0]);
  std::vector<client::NamedTensor> bad = good;
  bad[3].name = "head";  // "heads" is missing
  ExpectBadFile(2, bad, "'heads'");
  bad = good;
  bad[1].shape = {1, 2};  // "tiny": 2-D instead of its 1-D chunk
  ExpectBadFile(2, bad, "'tiny'");
  bad = good;
  bad[4].dtype = common::DType::kBFloat16;  // "tall" is float32
  bad[4].data.resize(bad[4].data.size() / 2);
  ExpectBadFile(2, bad, "'tall'");
  ExpectUnharmed(2);
  const ProcessResult show = Ctl({"job", "show", "--job", spec_.job_id});
  ASSERT_EQ(show.exit_code, 0) << show.err;
  EXPECT_NE(show.out.find("layout: zero_stage 3, chunks per matrix\n"), std::string::npos)
      << show.out;
  EXPECT_NE(show.out.find("gather_budget_bytes: 1073741824\n"), std::string::npos) << show.out;
  EXPECT_NE(show.out.find("rank: 2 attached=no"), std::string::npos) << show.out;
}

}  // namespace
}  // namespace muond::integration
