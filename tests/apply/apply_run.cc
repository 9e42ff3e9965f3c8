// The helpers of apply mode's end-to-end suites (apply_run.h).
#include "tests/apply/apply_run.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "common/layout.h"
#include "gtest/gtest.h"

namespace muond::integration::apply_test {

using common::DType;

common::JobSpec ApplySpec(const std::string& id, int world, int stage, DType param) {
  common::JobSpec spec;
  spec.job_id = id;
  spec.world_size = world;
  spec.zero_stage = stage;
  spec.mode = common::JobMode::kApply;
  spec.groups = {{"muon", 0.02, 0.01}, {"adamw", 0.003, 0.1}};
  spec.adamw = {0.9, 0.95, 1e-8};
  auto add = [&](std::string name, std::vector<int64_t> shape, common::Optimizer opt,
                 int64_t heads = 1) {
    common::MatrixSpec m;
    m.name = std::move(name);
    m.shape = std::move(shape);
    m.optimizer = opt;
    m.group = opt == common::Optimizer::kMuon ? "muon" : "adamw";
    m.num_heads = heads;
    m.dtype = DType::kFloat32;
    m.param_dtype = param;
    spec.matrices.push_back(m);
  };
  add("embed", {97, 24}, common::Optimizer::kAdamW);
  add("attn.w", {48, 24}, common::Optimizer::kMuon, 2);
  add("mlp.w", {24, 64}, common::Optimizer::kMuon);
  add("norm", {24}, common::Optimizer::kAdamW);
  add("head", {97, 24}, common::Optimizer::kAdamW);
  return spec;
}

Floats Random(size_t n, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  Floats v(n);
  for (float& x : v) x = d(gen);
  return v;
}

Model RandomModel(const common::JobSpec& spec, uint32_t seed, float scale) {
  Model m;
  for (size_t t = 0; t < spec.matrices.size(); ++t) {
    m.push_back(Random(static_cast<size_t>(spec.matrices[t].numel()), seed * 131 + t, scale));
  }
  return m;
}

client::StepHyper Hyper(double muon_lr, double adamw_lr, double divisor) {
  client::StepHyper h;
  h.lr = {{"muon", muon_lr}, {"adamw", adamw_lr}};
  h.grad_divisor = divisor;
  return h;
}

Floats Flatten(const common::JobSpec& spec, int rank, const Model& m) {
  Floats flat(common::RankBufferElements(spec, rank), 0.0f);
  for (const common::ShardSpan& s : common::RankSpans(spec, rank)) {
    std::memcpy(flat.data() + s.rank_offset, m[s.matrix].data() + s.offset,
                s.length * sizeof(float));
  }
  return flat;
}

void Unflatten(const common::JobSpec& spec, int rank, const std::string& flat, DType dtype,
               Model* m) {
  const size_t esize = common::DTypeSize(dtype);
  for (const common::ShardSpan& s : common::RankSpans(spec, rank)) {
    common::ToFloat32(dtype, flat.data() + s.rank_offset * esize, s.length,
                      (*m)[s.matrix].data() + s.offset);
  }
}

JobRun RunJob(const std::string& address, const common::JobSpec& spec, const std::string& token,
              const Model* init, const std::vector<Model>& grads,
              const std::vector<client::StepHyper>& hyper, int64_t first_step,
              client::Transport transport) {
  JobRun run;
  run.params.assign(grads.size(), Model());
  run.status.assign(grads.size(), absl::OkStatus());
  for (Model& m : run.params) {
    for (const auto& t : spec.matrices) m.emplace_back(static_cast<size_t>(t.numel()), 0.0f);
  }
  const DType pdtype = spec.matrices[0].param_dtype;
  std::vector<std::vector<absl::Status>> per_rank(spec.world_size,
                                                  std::vector<absl::Status>(grads.size()));
  std::vector<std::vector<std::string>> outs(spec.world_size,
                                             std::vector<std::string>(grads.size()));
  // Every rank's weights are in before any rank steps (a step before would be refused).
  std::atomic<int> ready{0};
  auto barrier = [&] {
    ++ready;
    while (ready.load() < spec.world_size)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < spec.world_size; ++r) {
    threads.emplace_back([&, r] {
      auto c = client::Client::Connect(address);
      auto session = c.ok() ? (*c)->Attach(spec.job_id, r, token, false, transport)
                            : absl::StatusOr<std::unique_ptr<client::RankSession>>(c.status());
      absl::Status s = session.status();
      if (s.ok() && init != nullptr) {
        const Floats flat = Flatten(spec, r, *init);
        s = (*session)->InitParamsBuffer(flat.data(), /*float32=*/true);
      }
      barrier();
      if (!s.ok()) {
        for (auto& st : per_rank[r]) st = s;
        return;
      }
      for (size_t i = 0; i < grads.size(); ++i) {
        absl::Status s = (*session)->SetHyper(hyper[i]);
        const Floats flat = Flatten(spec, r, grads[i]);
        outs[r][i].assign((*session)->buffer_elements() * common::DTypeSize(pdtype), '\0');
        if (s.ok()) {
          s = (*session)
                  ->StepBuffer(first_step + static_cast<int64_t>(i), flat.data(), outs[r][i].data())
                  .status();
        }
        per_rank[r][i] = s;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < grads.size(); ++i) {
    for (int r = 0; r < spec.world_size; ++r) {
      if (!per_rank[r][i].ok() && run.status[i].ok()) run.status[i] = per_rank[r][i];
      if (per_rank[r][i].ok()) Unflatten(spec, r, outs[r][i], pdtype, &run.params[i]);
    }
  }
  return run;
}

void ExpectBitEqual(const Model& a, const Model& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t t = 0; t < a.size(); ++t) {
    ASSERT_EQ(a[t].size(), b[t].size()) << what << " tensor " << t;
    EXPECT_EQ(std::memcmp(a[t].data(), b[t].data(), a[t].size() * sizeof(float)), 0)
        << what << ": tensor " << t << " differs";
  }
}

Model Export(client::Client& c, const common::JobSpec& spec, const std::string& token,
             DType dtype) {
  auto tensors = c.ExportParams(spec.job_id, token, dtype);
  EXPECT_TRUE(tensors.ok()) << tensors.status();
  Model m;
  if (!tensors.ok()) return m;
  for (const client::NamedTensor& t : *tensors) {
    Floats v(t.data.size() / common::DTypeSize(t.dtype));
    common::ToFloat32(t.dtype, t.data.data(), v.size(), v.data());
    m.push_back(std::move(v));
  }
  return m;
}

}  // namespace muond::integration::apply_test
