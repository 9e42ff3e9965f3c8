#include "server/api/job_status_proto.h"

#include "common/job_spec_proto.h"
#include "server/optim/cpu_isa.h"

namespace muond::server {

namespace {

// What anyone may see of a job (WithheldJobStatus): ids, sizes and state. An allow-list: a field
// added to JobStatus stays out of it until it is added here on purpose.
void SetPublicFields(const JobReport& r, v1::JobStatus* st) {
  v1::JobSpec* spec = st->mutable_spec();
  const v1::JobSpec full = common::JobSpecToProto(r.spec);
  spec->set_job_id(full.job_id());
  spec->set_mode(full.mode());
  spec->set_world_size(full.world_size());
  spec->set_zero_stage(full.zero_stage());
  st->set_backend(r.backend);
  st->set_created_unix_ms(r.created_unix_ms);
  st->set_momentum_bytes(r.momentum_bytes);
  st->set_next_step(r.next_step);
  st->set_steps_completed(r.steps_completed);
  st->set_steps_refused(r.steps_refused);
  st->set_steps_skipped(r.steps_skipped);
  st->set_steps_aborted(r.steps_aborted);
  st->set_fenced(r.fenced);
  if (r.step_in_flight) st->set_step_in_flight(*r.step_in_flight);
  if (r.step_prepared) st->set_step_prepared(*r.step_prepared);
  st->set_weights_complete(r.weights_complete);
  for (const RankReport& rank : r.ranks) {
    v1::RankStatus* rs = st->add_ranks();
    rs->set_rank(rank.rank);
    rs->set_attached(rank.attached);
    rs->set_elements(rank.elements);
  }
}

}  // namespace

v1::JobStatus JobStatusToProto(const JobReport& r) {
  v1::JobStatus st;
  SetPublicFields(r, &st);
  *st.mutable_spec() = common::JobSpecToProto(r.spec);
  st.set_cpu_math(DescribeCpuMathPath(CurrentCpuMathPath()));
  st.set_gather_budget_bytes(r.gather_budget_bytes);
  st.set_gather_peak_bytes(r.gather_peak_bytes);
  st.set_fence_reason(r.fence_reason);
  st.set_last_step_device_seconds(r.last_step_device_seconds);
  st.set_transport_copy_bytes(r.transport_copy_bytes);
  if (r.last_checkpoint_step) {
    st.set_last_checkpoint_step(*r.last_checkpoint_step);
    st.set_last_checkpoint_unix_ms(r.last_checkpoint_unix_ms);
  }
  st.set_checkpoint_dir(r.checkpoint_dir);
  if (r.owner_uid) st.set_owner_uid(*r.owner_uid);
  st.set_owner(r.owner);
  st.set_step_timeout_seconds(r.step_timeout_seconds);
  for (int rank : r.ranks_missing_weights) st.add_ranks_missing_weights(rank);
  st.set_clip_redo_steps(static_cast<uint64_t>(r.clip_redo_steps));
  st.set_last_grad_norm(r.last_grad_norm);
  const auto held = MemoryKinds(r.memory);
  const auto footprint = MemoryKinds(r.footprint);
  for (size_t k = 0; k < held.size(); ++k) {
    v1::MemoryUse* use = st.add_memory();
    use->set_kind(held[k].first);
    use->set_bytes(held[k].second);
    use->set_footprint_bytes(footprint[k].second);
  }
  for (int i = 0; i < st.ranks_size(); ++i) {
    const RankReport& rank = r.ranks[static_cast<size_t>(i)];
    v1::RankStatus* rs = st.mutable_ranks(i);
    rs->set_session_id(rank.session_id);
    if (r.step_in_flight) {
      rs->set_in_step(rank.in_step);
      rs->set_finished_pushing(rank.finished_pushing);
    }
  }
  return st;
}

v1::JobStatus WithheldJobStatus(const JobReport& r) {
  v1::JobStatus st;
  st.set_details_withheld(true);
  SetPublicFields(r, &st);
  return st;
}

}  // namespace muond::server
