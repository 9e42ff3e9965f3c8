// muonctl for apply-mode jobs (DESIGN.md 4b): `params init` from a file laid out as the rank's
// `step --grads` file, `step --lr GROUP=VALUE [--wd GROUP=VALUE] [--grad-divisor X]` writing the
// rank's new parameters, `export` of the masters as a safetensors model file, and every refusal
// (one line on stderr, the gRPC code as the exit code, nothing changed). The expected parameters
// come from the float64 AdamW reference of apply_test_model.h.
// (The flags without a daemon: muonctl_apply_flags_test.cc.)
#include <algorithm>
#include <cstdlib>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/integration/apply_test_model.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/reference_data.h"

namespace muond::integration {
namespace {

namespace am = apply_model;
using common::DType;

class MuonctlApplyTest : public DaemonSuite {
 protected:
  void SetUp() override {
    DaemonSuite::SetUp();
    files_ = std::make_unique<TempDir>();
  }
  std::string File(const std::string& name) const { return files_->File(name); }

  // Creates the model's job through muonctl (spec_ and token_file_ set).
  void CreateJob(const std::string& prefix, int world, int stage, DType param_w, DType param_b) {
    const std::string id = NewJobId(prefix);
    const std::string json = am::JobJson(id, world, stage, param_w, param_b);
    auto spec = common::ParseJobSpecJson(json);
    ASSERT_TRUE(spec.ok()) << spec.status();
    spec_ = *spec;
    WriteWholeFile(File(id + ".json"), json);
    token_file_ = File(id + ".token");
    const ProcessResult r = RunMuonctl(
        address(), {"job", "create", "--spec", File(id + ".json"), "--token-file", token_file_});
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }

  // Rank r's tensors in the normative file form of the layout (as for `step --grads`), from
  // whole-tensor values, tensor m in dtypes[m] (a partition in dtypes[0]); padding zero.
  std::vector<client::NamedTensor> RankFile(int r, const std::vector<std::vector<float>>& whole,
                                            const std::vector<DType>& dtypes) const {
    const std::vector<common::ShardSpan> spans = common::RankSpans(spec_, r);
    std::vector<client::NamedTensor> out;
    if (spec_.zero_stage == 0) {
      for (int m = 0; m < am::kTensors; ++m) {
        out.push_back(MakeTensor(am::kNames[m], am::kShapes[m], whole[m], dtypes[m]));
      }
      return out;
    }
    if (spec_.zero_stage == 3) {
      std::vector<std::vector<float>> chunks(am::kTensors);
      for (int m = 0; m < am::kTensors; ++m) chunks[m].assign(Chunk(m), 0.0f);
      for (const common::ShardSpan& s : spans) {  // a rank's span starts its chunk
        for (uint64_t k = 0; k < s.length; ++k) chunks[s.matrix][k] = whole[s.matrix][s.offset + k];
      }
      for (int m = 0; m < am::kTensors; ++m) {
        out.push_back(MakeTensor(am::kNames[m], {Chunk(m)}, chunks[m], dtypes[m]));
      }
      return out;
    }
    const int64_t n = common::RankBufferElements(spec_, r);
    std::vector<float> flat(n, 0.0f);
    for (const common::ShardSpan& s : spans) {
      for (uint64_t k = 0; k < s.length; ++k) {
        flat[s.rank_offset + k] = whole[s.matrix][s.offset + k];
      }
    }
    out.push_back(MakeTensor("partition", {n}, flat, dtypes[0]));
    return out;
  }

  // Elements of a stage 3 chunk of tensor m.
  int64_t Chunk(int m) const { return (am::Numel(m) + spec_.world_size - 1) / spec_.world_size; }

  std::string Write(const std::string& name, const std::vector<client::NamedTensor>& tensors) {
    std::vector<common::TensorRef> refs;
    for (const client::NamedTensor& t : tensors) refs.push_back({t.name, t.dtype, t.shape, t.data});
    const std::string path = File(name);
    const absl::Status s = common::WriteSafetensorsFile(path, refs);
    EXPECT_TRUE(s.ok()) << s;
    return path;
  }

  ProcessResult Ctl(std::vector<std::string> args) {
    args.push_back("--token-file");
    args.push_back(token_file_);
    return RunMuonctl(address(), args);
  }

  ProcessResult ParamsInit(int rank, const std::string& file, const std::string& transport) {
    return Ctl({"params", "init", "--job", spec_.job_id, "--rank", std::to_string(rank), "--params",
                file, "--transport", transport});
  }

  ProcessResult CtlStep(int rank, int step, const std::string& grads, const std::string& out,
                        const std::string& transport, const std::vector<std::string>& hyper) {
    std::vector<std::string> args = {"step",
                                     "--job",
                                     spec_.job_id,
                                     "--rank",
                                     std::to_string(rank),
                                     "--step",
                                     std::to_string(step),
                                     "--grads",
                                     grads,
                                     "--out",
                                     out,
                                     "--transport",
                                     transport};
    args.insert(args.end(), hyper.begin(), hyper.end());
    return Ctl(args);
  }

  // Steps every rank at once (one muonctl per rank, rank r over transports[r]) with the model's
  // gradients and hyperparameters of step t, and checks each OUT against the reference.
  void StepAllRanks(int t, const std::vector<std::string>& transports) {
    SCOPED_TRACE(absl::StrCat("step ", t));
    ref_.Step(t);
    const int world = spec_.world_size;
    std::vector<std::vector<float>> grads;
    for (int m = 0; m < am::kTensors; ++m) grads.push_back(am::Gradient(m, t));
    std::vector<std::string> in(world), out(world);
    std::vector<ProcessResult> results(world);
    for (int r = 0; r < world; ++r) {
      in[r] = Write(absl::StrCat("grads-", r, "-", t, ".safetensors"),
                    RankFile(r, grads, {DType::kFloat32, DType::kFloat32}));
      out[r] = File(absl::StrCat("out-", r, "-", t, ".safetensors"));
    }
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        results[r] = CtlStep(r, t, in[r], out[r], transports[r], am::CtlHyperArgs(t));
      });
    }
    for (std::thread& th : threads) th.join();
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE(absl::StrCat("rank ", r, " over ", transports[r]));
      ASSERT_EQ(results[r].exit_code, 0) << results[r].out << results[r].err;
      EXPECT_NE(results[r].out.find(absl::StrCat("step ", t, ": job ", spec_.job_id)),
                std::string::npos)
          << results[r].out;
      ExpectRankParams(r, out[r]);
    }
  }

  // OUT of rank r: the layout of its --grads file in the param dtypes, holding the reference's
  // masters at the rank's elements, zero elsewhere.
  void ExpectRankParams(int r, const std::string& path) {
    auto file = common::SafetensorsFile::ReadFile(path);
    ASSERT_TRUE(file.ok()) << file.status();
    if (spec_.zero_stage == 0) {
      ASSERT_EQ(file->tensors().size(), static_cast<size_t>(am::kTensors));
      for (int m = 0; m < am::kTensors; ++m) {
        const common::TensorInfo* t = file->Find(am::kNames[m]);
        ASSERT_NE(t, nullptr) << am::kNames[m];
        EXPECT_EQ(t->dtype, spec_.matrices[m].param_dtype) << am::kNames[m];
        EXPECT_EQ(t->shape, am::kShapes[m]) << am::kNames[m];
        EXPECT_TRUE(am::ParamsNear(ToFloats(t->dtype, std::string(file->Data(*t))), ref_.master(m),
                                   t->dtype))
            << am::kNames[m];
      }
      return;
    }
    // Stage 1/2: one flat `partition`; stage 3: one chunk per tensor. Either way each file tensor
    // holds the rank's spans from `first` on and zeros after them.
    std::vector<std::string> names;
    if (spec_.zero_stage == 3) {
      names.assign(am::kNames, am::kNames + am::kTensors);
    } else {
      names = {"partition"};
    }
    ASSERT_EQ(file->tensors().size(), names.size());
    std::vector<std::vector<float>> values;
    for (size_t i = 0; i < names.size(); ++i) {
      const common::TensorInfo* t = file->Find(names[i]);
      ASSERT_NE(t, nullptr) << names[i];
      const int64_t n =
          spec_.zero_stage == 3 ? Chunk(static_cast<int>(i)) : common::RankBufferElements(spec_, r);
      EXPECT_EQ(t->shape, (std::vector<int64_t>{n})) << names[i];
      EXPECT_EQ(t->dtype, spec_.matrices[i].param_dtype) << names[i];
      values.push_back(ToFloats(t->dtype, std::string(file->Data(*t))));
      ASSERT_EQ(values.back().size(), static_cast<size_t>(n)) << names[i];
    }
    std::vector<uint64_t> owned(names.size(), 0);
    for (const common::ShardSpan& s : common::RankSpans(spec_, r)) {
      const size_t i = spec_.zero_stage == 3 ? s.matrix : 0;
      const uint64_t first = spec_.zero_stage == 3 ? 0 : s.rank_offset;
      const std::vector<float> part(values[i].begin() + first,
                                    values[i].begin() + first + s.length);
      EXPECT_TRUE(am::ParamsNear(part, ref_.master(s.matrix), spec_.matrices[s.matrix].param_dtype,
                                 s.offset))
          << am::kNames[s.matrix] << " from element " << s.offset;
      owned[i] = std::max(owned[i], first + s.length);
    }
    for (size_t i = 0; i < names.size(); ++i) {
      for (uint64_t k = owned[i]; k < values[i].size(); ++k) {
        EXPECT_EQ(values[i][k], 0.0f) << names[i] << " padding " << k;
      }
    }
  }

  // `muonctl export` in `dtype`: every tensor whole, the reference's masters.
  void ExpectExport(DType dtype, const std::string& dtype_flag) {
    SCOPED_TRACE(dtype_flag);
    const std::string path = File("export-" + dtype_flag + ".safetensors");
    std::vector<std::string> args = {"export", "--job", spec_.job_id, "--out", path};
    if (!dtype_flag.empty()) {
      args.push_back("--dtype");
      args.push_back(dtype_flag);
    }
    const ProcessResult r = Ctl(args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find(absl::StrCat("exported job ", spec_.job_id)), std::string::npos) << r.out;
    auto file = common::SafetensorsFile::ReadFile(path);
    ASSERT_TRUE(file.ok()) << file.status();
    ASSERT_EQ(file->tensors().size(), static_cast<size_t>(am::kTensors));
    for (int m = 0; m < am::kTensors; ++m) {
      const common::TensorInfo* t = file->Find(am::kNames[m]);
      ASSERT_NE(t, nullptr) << am::kNames[m];
      EXPECT_EQ(t->dtype, dtype);
      EXPECT_EQ(t->shape, am::kShapes[m]);
      EXPECT_TRUE(
          am::ParamsNear(ToFloats(t->dtype, std::string(file->Data(*t))), ref_.master(m), dtype))
          << am::kNames[m];
    }
    EXPECT_EQ(file->metadata().count("format"), 1u);
    if (dtype == DType::kBFloat16) ExpectPythonReadsBack(path, dtype);  // (python starts slowly)
  }

  // Where Debian's python3 with torch is installed, it reads the file back by the safetensors
  // format alone (8-byte header length, JSON header, raw little-endian data) and prints every
  // tensor's name, shape and float64 sum.
  void ExpectPythonReadsBack(const std::string& path, DType dtype) {
    if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) return;
    const char* script = R"(
import json, struct, sys, torch
raw = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
header = json.loads(raw[8:8 + n])
kinds = {'F32': torch.float32, 'BF16': torch.bfloat16, 'F16': torch.float16}
for name, info in header.items():
    if name == '__metadata__':
        continue
    b, e = info['data_offsets']
    t = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=kinds[info['dtype']])
    t = t.reshape(info['shape'])
    print(name, list(t.shape), '%.9e' % t.double().sum().item())
)";
    const ProcessResult r = RunProcess({"/usr/bin/python3", "-c", script, path});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    for (int m = 0; m < am::kTensors; ++m) {
      double want = 0;
      for (double w : ref_.master(m)) {
        const float f = static_cast<float>(w);
        char as_dtype[4];
        common::FromFloat32(&f, 1, dtype, as_dtype);  // the export rounds the fp32 masters
        float widened = 0;
        common::ToFloat32(dtype, as_dtype, 1, &widened);
        want += widened;
      }
      const std::string prefix = absl::StrCat(am::kNames[m], " ", m == 0 ? "[4, 8]" : "[6]", " ");
      const size_t at = r.out.find(prefix);
      ASSERT_NE(at, std::string::npos) << prefix << " in " << r.out;
      const double got = std::strtod(r.out.c_str() + at + prefix.size(), nullptr);
      EXPECT_NEAR(got, want, 1e-4 + 1e-2 * std::fabs(want)) << am::kNames[m] << ": " << r.out;
    }
  }

  // muonctl failed with `code`, one line on stderr containing each of `substrings`.
  static void ExpectFailure(const ProcessResult& r, int code,
                            const std::vector<std::string>& substrings) {
    EXPECT_TRUE(r.exited) << "signal " << r.signal;
    EXPECT_EQ(r.exit_code, code) << r.out << r.err;
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    for (const std::string& s : substrings) {
      EXPECT_NE(r.err.find(s), std::string::npos) << "wanted '" << s << "' in: " << r.err;
    }
  }

  // `job show` holds each of `lines`.
  void ExpectShow(const std::vector<std::string>& lines) {
    const ProcessResult r = Ctl({"job", "show", "--job", spec_.job_id});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    for (const std::string& l : lines) EXPECT_NE(r.out.find(l), std::string::npos) << l << r.out;
  }

  std::unique_ptr<TempDir> files_;
  common::JobSpec spec_;
  std::string token_file_;
  am::Reference ref_;
};

std::vector<std::vector<float>> InitialWeights() { return {am::Initial(0), am::Initial(1)}; }

TEST_F(MuonctlApplyTest, World1Stage0InitStepsAndExportOverGrpcAndShm) {
  for (const std::string transport : {"grpc", "shm"}) {
    SCOPED_TRACE(transport);
    ref_ = am::Reference();
    // "w" keeps float32 parameters, "b" bfloat16; the file holds each in its param dtype.
    ASSERT_NO_FATAL_FAILURE(
        CreateJob("ctl-apply-w1-" + transport, 1, 0, DType::kFloat32, DType::kBFloat16));
    const std::string params =
        Write("params-" + transport + ".safetensors",
              RankFile(0, InitialWeights(), {DType::kFloat32, DType::kBFloat16}));
    ProcessResult r = ParamsInit(0, params, transport);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("weights complete"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("(" + transport + ")"), std::string::npos) << r.out;
    for (int t = 0; t < 3; ++t) ASSERT_NO_FATAL_FAILURE(StepAllRanks(t, {transport}));
    ExpectShow({"next_step: 3", "steps_completed: 3", "fenced: no", "weights_complete: yes"});
    ExpectExport(DType::kFloat32, "");
    ExpectExport(DType::kBFloat16, "bfloat16");
  }
}

TEST_F(MuonctlApplyTest, World2Stage1PartitionsOverGrpcAndShm) {
  for (const std::string transport : {"grpc", "shm"}) {
    SCOPED_TRACE(transport);
    ref_ = am::Reference();
    ASSERT_NO_FATAL_FAILURE(
        CreateJob("ctl-apply-w2-" + transport, 2, 1, DType::kBFloat16, DType::kBFloat16));
    // Rank 0 uploads float32, rank 1 its param dtype (bfloat16).
    const std::vector<DType> file_dtype = {DType::kFloat32, DType::kBFloat16};
    for (int r = 0; r < 2; ++r) {
      const std::string params =
          Write(absl::StrCat("params-", transport, "-", r, ".safetensors"),
                RankFile(r, InitialWeights(), {file_dtype[r], file_dtype[r]}));
      const ProcessResult p = ParamsInit(r, params, transport);
      ASSERT_EQ(p.exit_code, 0) << p.err;
      EXPECT_NE(p.out.find(r == 0 ? "waiting for the weights of rank 1" : "weights complete"),
                std::string::npos)
          << p.out;
    }
    for (int t = 0; t < 2; ++t) ASSERT_NO_FATAL_FAILURE(StepAllRanks(t, {transport, transport}));
    ExpectExport(DType::kFloat32, "float32");
  }
}

TEST_F(MuonctlApplyTest, World4Stage3ChunksWithMixedParamDtypes) {
  // "b" has 6 elements in chunks of 2: rank 3 owns none of it (its chunk is all padding).
  ASSERT_NO_FATAL_FAILURE(CreateJob("ctl-apply-s3", 4, 3, DType::kFloat32, DType::kFloat16));
  for (int r = 0; r < 4; ++r) {
    // Ranks 0 and 1 upload each chunk in its param dtype, ranks 2 and 3 all in float32.
    const std::vector<DType> dtypes = r < 2 ? std::vector<DType>{DType::kFloat32, DType::kFloat16}
                                            : std::vector<DType>{DType::kFloat32, DType::kFloat32};
    const std::string params =
        Write(absl::StrCat("params-s3-", r, ".safetensors"), RankFile(r, InitialWeights(), dtypes));
    const ProcessResult p = ParamsInit(r, params, r % 2 == 0 ? "grpc" : "shm");
    ASSERT_EQ(p.exit_code, 0) << p.err;
  }
  for (int t = 0; t < 2; ++t) {
    ASSERT_NO_FATAL_FAILURE(StepAllRanks(t, {"grpc", "shm", "shm", "grpc"}));
  }
  ExpectShow({"mode: apply", "weights_complete: yes", "group: decay lr=0.01 weight_decay=0.05",
              "matrix: b shape=[6] num_heads=1 dtype=float32 param_dtype=float16 "
              "optimizer=adamw group=no_decay"});
  ExpectExport(DType::kFloat32, "float32");
}

TEST_F(MuonctlApplyTest, RefusalsNameWhatIsWrongAndChangeNothing) {
  ASSERT_NO_FATAL_FAILURE(CreateJob("ctl-apply-bad", 1, 0, DType::kFloat32, DType::kBFloat16));
  std::vector<std::vector<float>> grads = {am::Gradient(0, 0), am::Gradient(1, 0)};
  const std::string in =
      Write("grads.safetensors", RankFile(0, grads, {DType::kFloat32, DType::kFloat32}));
  const std::string out = File("out.safetensors");
  auto step = [&](const std::vector<std::string>& hyper) {
    return CtlStep(0, 0, in, out, "auto", hyper);
  };
  // A step before the initial weights: the daemon refuses it, naming the rank.
  ExpectFailure(step(am::CtlHyperArgs(0)), 9, {"FAILED_PRECONDITION", "rank 0"});
  // Initial parameters of the wrong dtype, shape or name.
  const std::vector<std::pair<std::vector<client::NamedTensor>, std::vector<std::string>>> bad = {
      {RankFile(0, InitialWeights(), {DType::kFloat16, DType::kBFloat16}), {"'w'", "float16"}},
      {RankFile(0, InitialWeights(), {DType::kFloat32, DType::kFloat16}), {"'b'", "float16"}},
      {{MakeTensor("w", {8, 4}, am::Initial(0)), MakeTensor("b", {6}, am::Initial(1))},
       {"'w'", "[8, 4]", "[4, 8]"}},
      {{MakeTensor("w", {4, 8}, am::Initial(0))}, {"'b'", "missing"}},
      {{MakeTensor("w", {4, 8}, am::Initial(0)), MakeTensor("b", {6}, am::Initial(1)),
        MakeTensor("c", {6}, am::Initial(1))},
       {"'c'", spec_.job_id}},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(i);
    const std::string path = Write(absl::StrCat("bad-params", i, ".safetensors"), bad[i].first);
    std::vector<std::string> want = bad[i].second;
    want.push_back("INVALID_ARGUMENT");
    want.push_back(path);
    ExpectFailure(ParamsInit(0, path, "auto"), 3, want);
  }
  ExpectShow({"next_step: 0", "fenced: no", "weights_complete: no - missing ranks 0"});
  const std::string good = Write("params.safetensors",
                                 RankFile(0, InitialWeights(), {DType::kFloat32, DType::kFloat32}));
  ProcessResult r = ParamsInit(0, good, "auto");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Hyperparameters: every group needs an lr, groups must exist, values finite and >= 0.
  ExpectFailure(step({}), 3, {"INVALID_ARGUMENT", "'decay'", "lr"});
  ExpectFailure(step({"--lr", "decay=0.01"}), 3, {"INVALID_ARGUMENT", "'no_decay'"});
  ExpectFailure(step({"--lr", "decay=0.01", "--lr", "no_decay=0.01", "--lr", "bogus=0.1"}), 3,
                {"INVALID_ARGUMENT", "'bogus'"});
  ExpectFailure(step({"--lr", "decay=0.01", "--lr", "no_decay=0.01", "--wd", "nope=0.1"}), 3,
                {"INVALID_ARGUMENT", "'nope'"});
  ExpectFailure(step({"--lr", "decay=0.01", "--lr", "decay=0.02", "--lr", "no_decay=0.01"}), 3,
                {"INVALID_ARGUMENT", "'decay'", "twice"});
  ExpectFailure(step({"--lr", "decay=-0.01", "--lr", "no_decay=0.01"}), 3,
                {"INVALID_ARGUMENT", "'decay'"});
  ExpectFailure(step({"--lr", "decay=0.01", "--lr", "no_decay=nan"}), 3,
                {"INVALID_ARGUMENT", "'no_decay'"});
  ExpectFailure(step({"--lr", "decay=0.01", "--lr", "no_decay=0.01", "--grad-divisor", "0"}), 3,
                {"INVALID_ARGUMENT", "divisor"});
  ExpectShow({"next_step: 0", "steps_completed: 0", "fenced: no"});
  // The job still works with good flags.
  r = step(am::CtlHyperArgs(0));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ref_.Step(0);
  ExpectRankParams(0, out);
  ExpectShow({"next_step: 1", "steps_completed: 1", "fenced: no"});
}

TEST_F(MuonctlApplyTest, UpdateJobRefusesApplyFlagsParamsAndExport) {
  const std::string id = NewJobId("ctl-upd");
  WriteWholeFile(File(id + ".json"),
                 absl::StrCat(R"({"job_id": ")", id,
                              R"(", "matrices": [{"name": "w", "shape": [64, 256]}]})"));
  token_file_ = File(id + ".token");
  ProcessResult r = RunMuonctl(
      address(), {"job", "create", "--spec", File(id + ".json"), "--token-file", token_file_});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  spec_.job_id = id;
  const std::string in = Write("g.safetensors", {RefGrad("wide_std", 0, "w")});
  for (const std::vector<std::string>& flags : {std::vector<std::string>{"--lr", "muon=0.02"},
                                                {"--wd", "muon=0.1"},
                                                {"--grad-divisor", "2"}}) {
    SCOPED_TRACE(flags[0]);
    ExpectFailure(CtlStep(0, 0, in, File("o.safetensors"), "auto", flags), 3,
                  {"INVALID_ARGUMENT", "--lr", "mode 'update'", id});
  }
  const std::string params = Write("p.safetensors", {RefGrad("wide_std", 0, "w")});
  ExpectFailure(ParamsInit(0, params, "auto"), 9, {"FAILED_PRECONDITION", "mode 'update'", id});
  ExpectFailure(Ctl({"export", "--job", id, "--out", File("x.safetensors")}), 9,
                {"FAILED_PRECONDITION", "mode 'update'", id});
  EXPECT_EQ(ReadWholeFile(File("x.safetensors")), "");
  ExpectShow({"next_step: 0", "steps_completed: 0", "fenced: no"});
  // The update job steps as before without the flags.
  r = CtlStep(0, 0, in, File("o.safetensors"), "auto", {});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto file = common::SafetensorsFile::ReadFile(File("o.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(MatchesReferenceUpdate(
      ToFloats(DType::kFloat32, std::string(file->Data(file->tensors()[0]))), "wide_std", 0, 1e-4));
}

}  // namespace
}  // namespace muond::integration
