#include "tests/integration/multirank_util.h"

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "common/dtype.h"

namespace muond::integration {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

common::MatrixSpec Matrix(const std::string& name, std::vector<int64_t> shape, int64_t num_heads,
                          common::DType dtype) {
  common::MatrixSpec m;
  m.name = name;
  m.shape = std::move(shape);
  m.num_heads = num_heads;
  m.dtype = dtype;
  return m;
}

std::vector<common::MatrixSpec> MixedMatrices(common::DType dtype, common::DType tall_dtype) {
  return {Matrix("big", {64, 96}, 1, dtype), Matrix("tiny", {2, 3}, 1, dtype),
          Matrix("experts", {3, 16, 24}, 1, dtype), Matrix("heads", {32, 40}, 4, dtype),
          Matrix("tall", {80, 20}, 1, tall_dtype)};
}

MatrixBytes MakeGradients(const std::vector<common::MatrixSpec>& matrices, int steps,
                          uint64_t seed) {
  MatrixBytes out(steps);
  for (int t = 0; t < steps; ++t) {
    for (size_t m = 0; m < matrices.size(); ++m) {
      uint64_t state = seed * 1000003u + static_cast<uint64_t>(t) * 7919u + m * 104729u;
      const size_t n = static_cast<size_t>(matrices[m].numel());
      std::vector<float> values(n);
      for (float& v : values) {
        v = static_cast<float>(static_cast<double>(SplitMix64(state) >> 11) * 0x1.0p-52 - 1.0);
      }
      std::string bytes(n * common::DTypeSize(matrices[m].dtype), '\0');
      common::FromFloat32(values.data(), n, matrices[m].dtype, bytes.data());
      out[t].push_back(std::move(bytes));
    }
  }
  return out;
}

std::string Slice(const std::string& whole, common::DType dtype, uint64_t offset, uint64_t length) {
  const size_t esize = common::DTypeSize(dtype);
  if ((offset + length) * esize > whole.size()) return std::string();
  return whole.substr(offset * esize, length * esize);
}

absl::StatusOr<MatrixBytes> ReferenceTrajectory(client::Client& client, const std::string& job_id,
                                                const common::JobSpec& like,
                                                const MatrixBytes& grads) {
  common::JobSpec spec;
  spec.job_id = job_id;
  spec.muon = like.muon;
  spec.state = like.state;
  spec.matrices = like.matrices;
  absl::StatusOr<std::string> token = client.CreateJob(spec);
  if (!token.ok()) return token.status();
  absl::StatusOr<std::unique_ptr<client::RankSession>> session = client.Attach(job_id, 0, *token);
  if (!session.ok()) return session.status();
  MatrixBytes updates;
  for (size_t t = 0; t < grads.size(); ++t) {
    absl::StatusOr<std::vector<std::string>> u = StepSpans(**session, t, grads[t]);
    if (!u.ok()) return u.status();
    updates.push_back(*std::move(u));  // zero_stage 0: one span per matrix, in matrix order
  }
  return updates;
}

absl::StatusOr<std::vector<std::string>> StepSpans(client::RankSession& session, int64_t step,
                                                   const std::vector<std::string>& grads,
                                                   client::StepResult* result) {
  const common::JobSpec& spec = session.spec();
  std::vector<std::string> in, out;
  for (const common::ShardSpan& s : session.spans()) {
    in.push_back(Slice(grads.at(s.matrix), spec.matrices[s.matrix].dtype, s.offset, s.length));
    out.emplace_back(in.back().size(), '\xAB');
  }
  std::vector<client::GradientSpan> g;
  std::vector<client::UpdateSpan> u;
  for (size_t i = 0; i < session.spans().size(); ++i) {
    const common::ShardSpan& s = session.spans()[i];
    g.push_back({s.matrix, s.offset, in[i].data(), s.length});
    u.push_back({s.matrix, s.offset, out[i].data(), s.length});
  }
  absl::StatusOr<client::StepResult> r = session.Step(step, g, u);
  if (!r.ok()) return r.status();
  if (result != nullptr) *result = *r;
  return out;
}

absl::StatusOr<std::vector<std::string>> StepFlatBuffer(client::RankSession& session, int64_t step,
                                                        const std::vector<std::string>& grads,
                                                        float padding_value,
                                                        client::StepResult* result) {
  const common::JobSpec& spec = session.spec();
  const common::DType dtype = spec.matrices[0].dtype;
  const size_t esize = common::DTypeSize(dtype);
  const uint64_t n = session.buffer_elements();
  std::vector<float> pad(n, padding_value);
  std::string in(n * esize, '\0');
  common::FromFloat32(pad.data(), n, dtype, in.data());
  uint64_t covered = 0;
  for (const common::ShardSpan& s : session.spans()) {
    const std::string bytes = Slice(grads.at(s.matrix), dtype, s.offset, s.length);
    std::memcpy(in.data() + s.rank_offset * esize, bytes.data(), bytes.size());
    covered += s.length;
  }
  std::string out(n * esize, '\xAB');
  absl::StatusOr<client::StepResult> r = session.StepBuffer(step, in.data(), out.data());
  if (!r.ok()) return r.status();
  if (result != nullptr) *result = *r;
  std::vector<std::string> spans;
  std::string rest = out;  // the padding: what no span covers
  for (const common::ShardSpan& s : session.spans()) {
    spans.push_back(out.substr(s.rank_offset * esize, s.length * esize));
    std::memset(rest.data() + s.rank_offset * esize, 0, s.length * esize);
  }
  if (rest != std::string(rest.size(), '\0')) {
    return absl::InternalError(absl::StrCat("rank ", session.rank(), " step ", step, ": ",
                                            n - covered,
                                            " padding elements of the update "
                                            "buffer are not zero"));
  }
  return spans;
}

std::vector<RankRun> RunRanks(const std::string& address, const std::string& job_id,
                              const std::string& token, int world, const MatrixBytes& grads,
                              bool use_buffer, int64_t first_step, bool takeover) {
  std::vector<RankRun> runs(world);
  std::vector<std::thread> threads;
  // Every rank attaches before any steps, as trainers do (a barrier after attach): a rank that
  // steps first would find a peer of a restarted job not attached yet, and the daemon refuses a
  // step while a rank whose session was lost has not attached again.
  absl::Barrier* attached = new absl::Barrier(world);  // deletes itself after the last Block
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r, attached] {
      RankRun& run = runs[r];
      absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(address);
      absl::StatusOr<std::unique_ptr<client::RankSession>> session =
          c.ok() ? (*c)->Attach(job_id, r, token, takeover) : c.status();
      if (attached->Block()) delete attached;
      if (!session.ok()) {
        run.status.push_back(session.status());
        return;
      }
      run.layout = (*session)->spans();
      for (size_t i = 0; i < grads.size(); ++i) {
        const int64_t step = first_step + static_cast<int64_t>(i);
        absl::StatusOr<std::vector<std::string>> u =
            use_buffer ? StepFlatBuffer(**session, step, grads[i], 0.5f)
                       : StepSpans(**session, step, grads[i]);
        run.status.push_back(u.status());
        if (!u.ok()) return;
        run.spans.push_back(*std::move(u));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return runs;
}

::testing::AssertionResult SpansEqual(const common::JobSpec& spec,
                                      const std::vector<common::ShardSpan>& layout,
                                      const std::vector<std::string>& got,
                                      const std::vector<std::string>& want) {
  if (got.size() != layout.size()) {
    return ::testing::AssertionFailure()
           << got.size() << " update spans for " << layout.size() << " layout spans";
  }
  for (size_t i = 0; i < layout.size(); ++i) {
    const common::ShardSpan& s = layout[i];
    const common::MatrixSpec& ms = spec.matrices[s.matrix];
    const std::string expected = Slice(want.at(s.matrix), ms.dtype, s.offset, s.length);
    if (got[i] == expected) continue;
    const size_t esize = common::DTypeSize(ms.dtype);
    size_t first = 0;
    while (first < got[i].size() && first < expected.size() && got[i][first] == expected[first]) {
      ++first;
    }
    return ::testing::AssertionFailure()
           << "matrix '" << ms.name << "' elements [" << s.offset << ", " << s.offset + s.length
           << "): first differing element " << s.offset + first / esize << " (" << got[i].size()
           << " bytes got, " << expected.size() << " expected)";
  }
  return ::testing::AssertionSuccess();
}

bool WaitForJob(client::Client& client, const std::string& job_id, const std::string& token,
                const std::function<bool(const v1::JobStatus&)>& pred, double timeout_seconds) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (true) {
    absl::StatusOr<v1::JobStatus> st = client.GetJob(job_id, token);
    if (st.ok() && pred(*st)) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace muond::integration
