// Apply mode's end-to-end suites (apply_engine_test.cc, apply_checkpoint_test.cc): a small model
// of Muon and AdamW tensors, its ranks run through a real muond over the client library, and the
// comparisons between runs that must agree bit for bit.
#ifndef MUOND_TESTS_APPLY_APPLY_RUN_H_
#define MUOND_TESTS_APPLY_APPLY_RUN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/client.h"
#include "common/dtype.h"
#include "common/job_spec.h"

namespace muond::integration::apply_test {

using Floats = std::vector<float>;
// Per tensor, whole.
using Model = std::vector<Floats>;

// An apply-mode job of `world` ranks at ZeRO `stage`: embed, attn.w (Muon, 2 heads), mlp.w
// (Muon), norm, head; fp32 gradients, `param` parameters.
common::JobSpec ApplySpec(const std::string& id, int world, int stage, common::DType param);

// `n` normal values of standard deviation `scale` (seeded).
Floats Random(size_t n, uint32_t seed, float scale);
// Every tensor of `spec`, normal values (seeded per tensor).
Model RandomModel(const common::JobSpec& spec, uint32_t seed, float scale);
client::StepHyper Hyper(double muon_lr, double adamw_lr, double divisor = 1);

// Rank r's flat fp32 buffer of a whole model (padding zero).
Floats Flatten(const common::JobSpec& spec, int rank, const Model& m);
// The rank's new parameters (param dtype, flat) written back into a whole fp32 model.
void Unflatten(const common::JobSpec& spec, int rank, const std::string& flat, common::DType dtype,
               Model* m);

struct JobRun {
  std::vector<Model> params;  // per step: the new parameters, assembled from every rank
  std::vector<absl::Status> status;
};

// Every rank of `spec` (threads) uploads `init` and runs the steps; all ranks must agree.
JobRun RunJob(const std::string& address, const common::JobSpec& spec, const std::string& token,
              const Model* init, const std::vector<Model>& grads,
              const std::vector<client::StepHyper>& hyper, int64_t first_step,
              client::Transport transport);

// Fails the test unless `a` and `b` hold the same bits.
void ExpectBitEqual(const Model& a, const Model& b, const std::string& what);

// The job's parameters exported in `dtype`, as fp32.
Model Export(client::Client& c, const common::JobSpec& spec, const std::string& token,
             common::DType dtype = common::DType::kFloat32);

}  // namespace muond::integration::apply_test

#endif  // MUOND_TESTS_APPLY_APPLY_RUN_H_
