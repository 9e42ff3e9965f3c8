// Apply mode's part of the step pipeline (step_pipeline_run.h, DESIGN.md 4b): the tensors no rank
// has a gradient of are carried, the AdamW tensors step on the host threads (kHost) while the
// device runs the batch's Newton-Schulz, and each retired batch's Muon updates are applied to the
// masters (server/engine/apply_step.h does the arithmetic).
#include <utility>
#include <vector>

#include "server/engine/step_pipeline_run.h"

namespace muond::server {

// The presence mask: the batch's tensors that no rank has a gradient of this step leave it,
// their state carried unchanged and their parameters returned as they are.
void StepPipeline::Run::CarryAbsent(Batch& batch) {
  if (!apply_mode() || state_.hyper.absent.empty()) return;
  std::vector<uint32_t> absent, rest;
  for (uint32_t m : batch.matrices) (state_.hyper.absent_at(m) ? absent : rest).push_back(m);
  if (absent.empty()) return;
  for (uint32_t m : absent) p_.apply_->Carry(state_, m);
  batch.matrices = std::move(rest);
  MarkDone(absent);
}

void StepPipeline::Run::HostWork(Batch& batch) {
  if (!apply_mode()) return;
  for (size_t i = 0; i < batch.matrices.size(); ++i) {
    if (batch.path[i] != MatrixPath::kHost) continue;
    p_.apply_->ApplyAdamW(state_, batch.matrices[i], batch.staging[i].data());
    p_.GiveBack(std::move(batch.staging[i]));  // done with it: leave the budget
    batch.staging[i] = std::vector<float>();
  }
}

// W <- W*(1 - lr*wd) - lr*U into the store's back, new parameters to the owners.
void StepPipeline::Run::ApplyToMasters(Batch& b) {
  for (size_t i = 0; i < b.matrices.size(); ++i) {
    const uint32_t m = b.matrices[i];
    if (p_.spec_.matrices[m].optimizer == common::Optimizer::kMuon) {
      p_.apply_->ApplyMuon(state_, m, b.staging[i].data());
    }
  }
}

}  // namespace muond::server
