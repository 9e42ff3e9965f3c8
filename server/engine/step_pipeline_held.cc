// Compressed momentum in the step pipeline (step_pipeline_run.h; README "Memory"): a job whose
// Muon momentum is held as bf16 or int8 (JobSpec::state) gives each device matrix of a batch an
// fp32 decoding of its committed momentum, in a pooled host buffer the gather budget counts
// (StepPipeline::AssembledBytes). Every path reads the momentum from there and writes the new one
// back into it (the cpu kernel in place; the GPUs copy it in and write it back), with the EMA
// rounded as ApplyMomentum rounds it; the retirement encodes it, block by block, where the store
// planned (the step window or, once sealed, in place). So the committed momentum is read once and
// written once per step, both as held, and nothing but the matrices in flight is ever fp32.
#include <utility>
#include <vector>

#include "common/parallel_for.h"
#include "server/engine/step_pipeline_run.h"
#include "server/optim/state_codec.h"

namespace muond::server {

void StepPipeline::Run::DecodeMomentum(Batch& batch, size_t i) {
  const uint32_t m = batch.matrices[i];
  const size_t n = static_cast<size_t>(p_.spec_.matrices[m].numel());
  batch.momentum.resize(batch.matrices.size());
  batch.momentum[i] = p_.TakeStaging(n);
  DecodeStoredAll(p_.spec_.state.momentum, StateRole::kSigned, p_.CommittedMomentum(m), n,
                  batch.momentum[i].data());
}

const float* StepPipeline::Run::MomentumIn(Batch& batch, size_t i) {
  if (p_.MomentumHeld()) return batch.momentum[i].data();
  return p_.CommittedMomentum(batch.matrices[i]);
}

float* StepPipeline::Run::MomentumOut(Batch& batch, size_t i) {
  if (p_.MomentumHeld()) return batch.momentum[i].data();
  return p_.NextMomentum(batch.matrices[i]);
}

void StepPipeline::Run::EncodeMomentum(Batch& b) {
  if (!p_.MomentumHeld()) return;
  for (size_t i = 0; i < b.momentum.size(); ++i) {
    if (b.momentum[i].empty()) continue;
    const uint32_t m = b.matrices[i];
    EncodeStoredAll(p_.spec_.state.momentum, StateRole::kSigned, b.momentum[i].data(),
                    b.momentum[i].size(), p_.NextMomentum(m));
  }
}

}  // namespace muond::server
