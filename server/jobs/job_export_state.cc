// The full-state export of a Job (re-sharding across nodes, DESIGN.md 4c): its whole state by
// tensor name, live or from a checkpoint generation, each array as the job holds it (compressed
// momentum and moments stay compressed) or decoded to float32 on request. The files are written by
// the client (common/state_export.h); the import side is job_import_state.cc.
//
// The live export takes the same snapshot a checkpoint save takes (copy-on-write per array under
// the CheckpointWriter's exclusivity, steps keep running), so what it hands out is the state at
// one step boundary: update mode the momentum, apply mode the masters, momenta, AdamW moments and
// step counts, and the next step. The snapshot is copied whole before anything is handed out and
// the exclusivity released: `header` and `sink` write to the network, and a reader that stops
// reading must not hold up the job's saves, loads, reset or delete (issue 32, item 9). The copy
// costs the state's held size (float32: its decoded size) in memory for the export's duration. A
// generation is read (and verified) decoded, as a load reads it, and encoded again for a held
// export: the codec gives back the generation's bits (server/optim/state_codec.h). Everything a
// continuation needs to be bit-identical is there: the state of a step is a function of these
// arrays, the step's gradients and its hyperparameters.
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/jobs/job_impl.h"
#include "server/optim/state_codec.h"

namespace muond::server {
namespace {

// The arrays of `spec` (StateTensors order; `float32`: all of them float32) and, per array, its
// job tensor.
Job::ExportedState LayOut(const common::JobSpec& spec, int64_t step, int64_t generation,
                          bool float32) {
  Job::ExportedState out;
  out.step = step;
  out.generation = generation;
  out.arrays = checkpoint::StateTensors(spec);
  if (float32) {
    for (checkpoint::StateTensor& a : out.arrays) {
      a.dtype = common::StateDType::kFloat32;
      a.non_negative = false;
    }
  }
  for (uint32_t t = 0; t < spec.matrices.size(); ++t) {
    const int slots = spec.mode != common::JobMode::kApply                      ? 1
                      : spec.matrices[t].optimizer == common::Optimizer::kAdamW ? 3
                                                                                : 2;
    for (int s = 0; s < slots; ++s) out.tensor_of.push_back(t);
  }
  return out;
}

// A generation's decoded arrays held as `arrays` say (each encoded again where not float32).
void EncodeAsHeld(const std::vector<checkpoint::StateTensor>& arrays,
                  std::vector<std::vector<float>>* data) {
  for (size_t a = 0; a < arrays.size(); ++a) {
    const checkpoint::StateTensor& t = arrays[a];
    if (t.dtype == common::StateDType::kFloat32) continue;
    std::vector<float> held(StoredWords(t.dtype, t.numel()));
    EncodeStoredAll(t.dtype, t.non_negative ? StateRole::kNonNegative : StateRole::kSigned,
                    (*data)[a].data(), t.numel(), held.data());
    (*data)[a] = std::move(held);
  }
}

}  // namespace

absl::Status JobImpl::ExportState(
    const std::optional<checkpoint::Selector>& generation, bool float32,
    const std::function<absl::Status(const ExportedState&)>& header,
    const std::function<absl::Status(size_t array, const std::vector<float>& data)>& sink) {
  ExportedState state;
  std::vector<std::vector<float>> arrays;
  {
    CheckpointWriter::Exclusive exclusive(writer_);
    if (generation) {
      {
        absl::MutexLock lock(&mu_);
        if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
      }
      auto loaded = writer_.Read(exclusive, *generation);
      if (!loaded.ok()) {
        return absl::Status(loaded.status().code(),
                            absl::StrCat("job '", id(), "': export: ", loaded.status().message()));
      }
      // Written by this job: its spec, names in StateTensors order.
      state = LayOut(loaded->spec, loaded->info.step, loaded->info.generation, float32);
      if (state.arrays.size() != loaded->data.size()) {
        return absl::InternalError(
            absl::StrCat("job '", id(), "': generation ", loaded->info.generation, " holds ",
                         loaded->data.size(), " arrays, its spec ", state.arrays.size()));
      }
      state.tensor_steps = loaded->tensor_steps;
      arrays = std::move(loaded->data);
      EncodeAsHeld(state.arrays, &arrays);
    } else {
      RETURN_IF_ERROR(CopyLiveState(exclusive, float32, &state, &arrays));
    }
  }
  // Nothing of the job is held from here on.
  RETURN_IF_ERROR(header(state));
  for (size_t a = 0; a < arrays.size(); ++a) {
    RETURN_IF_ERROR(sink(a, arrays[a]));
    std::vector<float>().swap(arrays[a]);  // handed out: give the memory back early
  }
  return absl::OkStatus();
}

absl::Status JobImpl::CopyLiveState(const CheckpointWriter::Exclusive&, bool float32,
                                    ExportedState* state, std::vector<std::vector<float>>* arrays) {
  {
    // At a step boundary: a sealed step writing in place has committed (or failed) first.
    MomentumStore::Lock momentum(momentum_, StateBuffers::Lock::AtStepBoundary{});
    std::optional<ParamStore::Lock> params;
    if (apply()) params.emplace(*params_, StateBuffers::Lock::AtStepBoundary{});
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckSavable());
    if (const std::vector<int> missing = apply() ? RanksMissingWeights() : std::vector<int>();
        !missing.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", id(), "': the initial weights of rank ", missing[0],
                       " are not in; there is no state to export yet"));
    }
    *state = LayOut(spec_, next_step_, 0, float32);
    if (params) {
      params->BeginSnapshot();
    } else {
      momentum.BeginSnapshot();
    }
  }
  if (apply()) state->tensor_steps = params_->SnapshotSteps();
  arrays->resize(state->arrays.size());
  int slot = 0;  // the slots of a tensor are consecutive arrays
  for (size_t a = 0; a < state->arrays.size(); ++a) {
    const uint32_t t = state->tensor_of[a];
    slot = a > 0 && state->tensor_of[a - 1] == t ? slot + 1 : 0;
    if (apply()) {
      params_->CopyForSnapshot(t, slot, &(*arrays)[a], /*held=*/!float32);
    } else {
      momentum_.CopyForSnapshot(t, &(*arrays)[a], /*held=*/!float32);
    }
  }
  if (apply()) {
    params_->EndSnapshot();
  } else {
    momentum_.EndSnapshot();
  }
  return absl::OkStatus();
}

}  // namespace muond::server
