#include "tests/gpu/direct_copy_daemon.h"

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/shm_channel.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/metrics.h"
#include "server/storage/durable_file.h"

namespace muond::server::testing_direct {

absl::StatusOr<std::unique_ptr<InProcessDaemon>> InProcessDaemon::Start(
    std::unique_ptr<device::Device> device, bool register_with_device,
    uint64_t gather_budget_bytes) {
  std::unique_ptr<InProcessDaemon> d(new InProcessDaemon());
  char tmpl[] = "/tmp/muond-direct-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  d->dir_ = tmpl;
  d->shm_path_ = d->dir_ + "/shm.sock";
  const std::string why = device->name();
  auto streams = DeviceStreams::Create(std::move(device), why, /*serial=*/false);
  if (!streams.ok()) return streams.status();
  d->devices_ = *std::move(streams);
  d->executor_ = std::make_unique<ComputeExecutor>(2);
  d->registry_ = std::make_unique<JobRegistry>(why, DaemonLimits{}, gather_budget_bytes,
                                               d->executor_.get(), d->devices_.get(), d->dir_);
  ShmLimits limits;
  limits.register_with_device = register_with_device;
  auto shm = ShmServer::Start(d->shm_path_, d->registry_.get(), limits);
  if (!shm.ok()) return shm.status();
  d->shm_ = *std::move(shm);
  return d;
}

InProcessDaemon::~InProcessDaemon() {
  shm_.reset();
  registry_.reset();
  executor_.reset();
  devices_.reset();
  if (!dir_.empty()) (void)durable::RemoveTree(dir_);
}

absl::StatusOr<std::string> InProcessDaemon::CreateJob(const std::string& json) {
  auto spec = common::ParseJobSpecJson(json);
  if (!spec.ok()) return spec.status();
  auto created = registry_->Create(*std::move(spec));
  if (!created.ok()) return created.status();
  return created->token;
}

std::vector<float> Gradient(uint32_t matrix, int64_t numel, int64_t step, uint32_t seed) {
  std::vector<float> g(static_cast<size_t>(numel));
  uint64_t x = (uint64_t{seed} << 40) ^ (uint64_t{matrix} << 20) ^ static_cast<uint64_t>(step);
  for (float& v : g) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<float>(static_cast<double>(x >> 40) / double{1 << 23} - 1.0);
  }
  return g;
}

namespace {

bool Apply(const common::JobSpec& spec) { return spec.mode == common::JobMode::kApply; }

// Apply mode: the rank's initial parameters (a tenth of Gradient(.., step -1, ..)), in each
// tensor's param dtype at its param offset of gradient buffer 0, then installed.
absl::Status RankInit(client::ShmChannel& ch, uint32_t seed) {
  const common::JobSpec& spec = ch.spec();
  char* init = ch.GradientBuffer(0);
  for (const client::ShmSpan& span : ch.spans()) {
    const common::MatrixSpec& ms = spec.matrices[span.matrix];
    std::vector<float> w = Gradient(span.matrix, ms.numel(), -1, seed);
    for (float& v : w) v *= 0.1f;
    common::FromFloat32(w.data() + span.offset, span.length, ms.param_dtype,
                        init + span.param_byte_offset);
  }
  return ch.RingInitParams();
}

// One rank's step: its spans' gradients into the step's buffer (apply mode: and the step's
// hyperparameters, every group's job lr and weight decay), the doorbell, its update spans (apply
// mode: its new parameters).
absl::Status RankStep(client::ShmChannel& ch, int64_t step, uint32_t seed, double grad_divisor,
                      std::string* update) {
  const common::JobSpec& spec = ch.spec();
  char* grad = ch.GradientBuffer(step);
  for (const client::ShmSpan& span : ch.spans()) {
    const common::MatrixSpec& ms = spec.matrices[span.matrix];
    const std::vector<float> g = Gradient(span.matrix, ms.numel(), step, seed);
    common::FromFloat32(g.data() + span.offset, span.length, ms.dtype, grad + span.byte_offset);
  }
  if (Apply(spec)) {
    std::vector<double> hyper;
    for (const common::ParamGroup& g : spec.groups) hyper.push_back(g.lr);
    for (const common::ParamGroup& g : spec.groups) hyper.push_back(g.weight_decay);
    // Step t divides by grad_divisor * (t + 1) when grad_divisor is not 1: a divisor that changes
    // from step to step weighs the momentum's terms differently (a constant one would cancel in
    // Muon's orthogonalization).
    hyper.push_back(grad_divisor == 1.0 ? 1.0 : grad_divisor * static_cast<double>(step + 1));
    hyper.push_back(0.0);  // the global clip: mode 0 (none), sum 0
    hyper.push_back(0.0);
    std::memcpy(grad + ch.hyper_byte_offset(), hyper.data(), hyper.size() * sizeof(double));
    std::memset(grad + ch.hyper_byte_offset() + hyper.size() * sizeof(double), 0,
                spec.matrices.size());  // the presence mask: every tensor has a gradient
  }
  auto rung = ch.Ring(step);
  if (!rung.ok()) return rung.status();
  update->clear();
  const char* out = ch.UpdateBuffer(step);
  for (const client::ShmSpan& span : ch.spans()) {
    const common::MatrixSpec& ms = spec.matrices[span.matrix];
    const size_t esize = common::DTypeSize(Apply(spec) ? ms.param_dtype : ms.dtype);
    update->append(out + (Apply(spec) ? span.param_byte_offset : span.byte_offset),
                   span.length * esize);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StepResults> RunSteps(const std::string& socket, const std::string& job_id,
                                     const std::string& token, int steps, uint32_t seed,
                                     double grad_divisor) {
  std::vector<std::unique_ptr<client::ShmChannel>> ranks;
  for (int r = 0;; ++r) {
    auto ch = client::ShmChannel::Attach(socket, job_id, r, token, /*takeover=*/false);
    if (!ch.ok())
      return absl::Status(ch.status().code(),
                          absl::StrCat("attach rank ", r, ": ", ch.status().message()));
    const int world = (*ch)->spec().world_size;
    ranks.push_back(*std::move(ch));
    if (r + 1 == world) break;
  }
  StepResults results;
  for (size_t r = 0; r < ranks.size() && Apply(ranks[r]->spec()); ++r) {
    if (absl::Status s = RankInit(*ranks[r], seed); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("rank ", r, " initial parameters: ", s.message()));
    }
  }
  for (int64_t t = 0; t < steps; ++t) {
    std::vector<std::string> updates(ranks.size());
    std::vector<absl::Status> status(ranks.size());
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (size_t r = 0; r < ranks.size(); ++r) {
      threads.emplace_back(
          [&, r] { status[r] = RankStep(*ranks[r], t, seed, grad_divisor, &updates[r]); });
    }
    for (std::thread& th : threads) th.join();
    results.seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (!status[r].ok()) {
        return absl::Status(status[r].code(),
                            absl::StrCat("rank ", r, " step ", t, ": ", status[r].message()));
      }
    }
    results.updates.push_back(std::move(updates));
  }
  return results;
}

double MetricValue(const std::string& name, const std::map<std::string, std::string>& labels) {
  std::string want = name;
  if (!labels.empty()) {
    want += "{";
    bool first = true;
    for (const auto& [k, v] : labels) {
      absl::StrAppend(&want, first ? "" : ",", k, "=\"", v, "\"");
      first = false;
    }
    want += "}";
  }
  std::istringstream text(common::DefaultRegistry().Serialize());
  for (std::string line; std::getline(text, line);) {
    if (line.size() > want.size() && line.compare(0, want.size(), want) == 0 &&
        line[want.size()] == ' ') {
      return std::stod(line.substr(want.size() + 1));
    }
  }
  return 0;
}

}  // namespace muond::server::testing_direct
