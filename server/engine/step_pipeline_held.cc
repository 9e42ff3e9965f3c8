// Compressed momentum in the step pipeline (step_pipeline_run.h; README "Memory"), for a job whose
// Muon momentum is held as bf16 or int8 (JobSpec::state):
//  - on a device that computes in host memory (cpu: kInPlace) the kernel itself reads the store
//    as held and, block by block, decodes, applies the EMA and encodes where the store planned
//    (MuonKernelItem::held_in/held_out): no fp32 copy of the momentum at all;
//  - the staged and direct paths (GPUs, the simulated device) give each device matrix of a batch
//    an fp32 decoding of its committed momentum, in a pooled host buffer the gather budget counts
//    (StepPipeline::AssembledBytes); the device copies it in and writes the new momentum back
//    into it, with the EMA rounded as ApplyMomentum rounds it, and the retirement encodes it
//    where the store planned (the step window or, once sealed, in place).
// Either way the committed momentum is read once and written once per step, both as held.
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
