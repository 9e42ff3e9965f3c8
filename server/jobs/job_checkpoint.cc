// The checkpoint side of a Job (DESIGN.md 7): saves of a consistent snapshot of its
// MomentumStore through its CheckpointWriter, background saves, loads of a verified generation
// back into the store, and the durable reset. Format and durability: server/storage/checkpoint.cc.
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "server/jobs/job_impl.h"
#include "server/record/status_progress.h"

namespace muond::server {

absl::Status JobImpl::CheckSavable() const {
  if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
  if (spec_.transport_probe) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' is a transport probe: it has no momentum to save"));
  }
  if (fenced_) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' is fenced (", fence_reason_,
                     "): its momentum may not be consistent; load a checkpoint or reset it first"));
  }
  return absl::OkStatus();
}

absl::StatusOr<checkpoint::GenerationInfo> JobImpl::SaveCheckpoint() {
  CheckpointWriter::Exclusive exclusive(writer_);
  if (apply()) return SaveApplyCheckpoint(exclusive);
  int64_t step = 0;
  {
    // At a step boundary: a sealed step writing in place has committed (or failed) first.
    MomentumStore::Lock store(momentum_, StateBuffers::Lock::AtStepBoundary{});
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckSavable());
    // The store between two commits is the momentum at the boundary of next_step_.
    step = next_step_;
    rollback_step_.store(-1);  // a generation of the step now exists
    store.BeginSnapshot();
  }
  auto source = [this](size_t m, std::vector<float>* out) -> absl::Status {
    momentum_.CopyForSnapshot(static_cast<uint32_t>(m), out, /*held=*/true);
    return absl::OkStatus();
  };
  auto info = writer_.Write(exclusive, id(), spec_, step, source);
  momentum_.EndSnapshot();
  return info;
}

absl::StatusOr<checkpoint::GenerationInfo> JobImpl::SaveApplyCheckpoint(
    const CheckpointWriter::Exclusive& exclusive) {
  int64_t step = 0;
  {
    ParamStore::Lock store(*params_, StateBuffers::Lock::AtStepBoundary{});
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckSavable());
    if (const std::vector<int> missing = RanksMissingWeights(); !missing.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", id(), "': the initial weights of rank ", missing[0],
                       " are not in; there is no model to save yet"));
    }
    step = next_step_;
    rollback_step_.store(-1);  // a generation of the step now exists
    store.BeginSnapshot();
  }
  // Array a of the payload is (tensor, slot) in StateTensors order.
  std::vector<std::pair<uint32_t, int>> arrays;
  for (uint32_t t = 0; t < spec_.matrices.size(); ++t) {
    for (int s = 0; s < params_->slots(t); ++s) arrays.emplace_back(t, s);
  }
  auto source = [this, &arrays](size_t a, std::vector<float>* out) -> absl::Status {
    params_->CopyForSnapshot(arrays[a].first, arrays[a].second, out, /*held=*/true);
    return absl::OkStatus();
  };
  auto info = writer_.Write(exclusive, id(), spec_, step, source, params_->SnapshotSteps());
  params_->EndSnapshot();
  return info;
}

void JobImpl::SaveCheckpointInBackground() {
  writer_.SaveInBackground(id(), [self = shared_from_this()] {
    (void)self->SaveCheckpoint();  // logged and counted there
  });
}

void JobImpl::WaitForSaves() { writer_.WaitForSaves(); }

absl::StatusOr<std::vector<checkpoint::GenerationInfo>> JobImpl::ListCheckpoints() const {
  return writer_.List();
}

int64_t JobImpl::NewestGeneration() const { return writer_.NewestGeneration(); }

absl::Status JobImpl::ResetDurably(int64_t next_step,
                               const std::function<absl::Status(int64_t)>& persist) {
  // Held across the reset, the listing and the record: a save that began earlier finishes
  // first, and one that begins later writes the reset momentum under a newer number.
  CheckpointWriter::Exclusive exclusive(writer_);
  RETURN_IF_ERROR(Reset(next_step));
  absl::Status s = persist(NewestGeneration());
  if (s.ok()) return s;
  Fence(absl::StrCat("reset to step ", next_step, " could not be made durable: ", s.message()));
  return absl::Status(s.code(), absl::StrCat("job '", id(),
                                             "' was reset in memory but the reset "
                                             "could not be recorded (",
                                             s.message(), "); the job is fenced"));
}

absl::Status JobImpl::MatchLoaded(const checkpoint::Loaded& loaded, const std::string& source,
                              std::vector<int>* index) const {
  if (spec_.transport_probe) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' is a transport probe: it has no momentum to load"));
  }
  if (loaded.spec.mode != spec_.mode) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", source, " was written by a job in mode '",
                     std::string(common::JobModeName(loaded.spec.mode)), "'; job '", id(),
                     "' is in mode '", std::string(common::JobModeName(spec_.mode)), "'"));
  }
  // By state tensor name (a matrix's own name in update mode; "master/<name>", ... in apply
  // mode) and shape.
  const std::vector<checkpoint::StateTensor> want = checkpoint::StateTensors(spec_);
  const std::vector<checkpoint::StateTensor> have = checkpoint::StateTensors(loaded.spec);
  index->assign(want.size(), -1);
  std::vector<bool> used(loaded.names.size(), false);
  for (size_t a = 0; a < want.size(); ++a) {
    for (size_t i = 0; i < loaded.names.size(); ++i) {
      if (loaded.names[i] == want[a].name) (*index)[a] = static_cast<int>(i);
    }
    if ((*index)[a] < 0) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", source, " has no tensor '",
                                                        want[a].name, "' of job '", id(), "'"));
    }
    used[(*index)[a]] = true;
    const checkpoint::StateTensor* saved = nullptr;
    for (const checkpoint::StateTensor& t : have) {
      if (t.name == want[a].name) saved = &t;
    }
    uint64_t numel = 1;
    for (int64_t d : want[a].shape) numel *= static_cast<uint64_t>(d);
    if (saved == nullptr || saved->shape != want[a].shape ||
        loaded.data[(*index)[a]].size() != numel) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint ", source, ": tensor '", want[a].name, "' has shape [",
                       saved == nullptr ? std::string("?") : absl::StrJoin(saved->shape, ", "),
                       "], job '", id(), "' has [", absl::StrJoin(want[a].shape, ", "), "]"));
    }
  }
  for (size_t i = 0; i < loaded.names.size(); ++i) {
    if (!used[i]) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", source, " has tensor '",
                                                        loaded.names[i], "' that job '", id(),
                                                        "' does not have"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Job::LoadResult> JobImpl::InstallLoaded(const checkpoint::Loaded& loaded,
                                                   const JobImpl& from) {
  MomentumStore::Lock store(momentum_);
  std::optional<ParamStore::Lock> params;
  if (apply()) params.emplace(*params_);
  absl::MutexLock lock(&mu_);
  DropPrepared("checkpoint load");
  RETURN_IF_ERROR(CheckNoStepInFlight("load"));
  rollback_step_.store(-1);
  // Everything is checked before the store changes.
  std::vector<int> index;
  RETURN_IF_ERROR(MatchLoaded(loaded, loaded.info.path, &index));
  // Back into the registered (pinned) store, in place, encoded as this job holds its state (a
  // generation holds fp32 values: of a job that held them compressed, its decoding, which
  // encodes back to the same bits, server/optim/state_codec.h).
  struct Destination {
    float* held;
    StateBuffers::Form form;
  };
  std::vector<Destination> dst;
  if (params) {
    for (uint32_t t = 0; t < spec_.matrices.size(); ++t) {
      for (int s = 0; s < params_->slots(t); ++s) {
        dst.push_back({params->mutable_front(t, s), params_->form(t, s)});
      }
      // The step count of the tensor of the same name in the generation's spec.
      for (size_t i = 0; i < loaded.spec.matrices.size(); ++i) {
        if (loaded.spec.matrices[i].name == spec_.matrices[t].name) {
          params->set_steps(t, loaded.tensor_steps[i]);
        }
      }
    }
    weights_in_.assign(spec_.world_size, true);
  } else {
    for (uint32_t m = 0; m < spec_.matrices.size(); ++m) {
      dst.push_back({store.mutable_data(m), momentum_.form(m)});
    }
  }
  common::ParallelFor(dst.size(), MomentumBytes(), [&](size_t a) {
    const StateBuffers::Form& f = dst[a].form;
    EncodeStoredAll(f.dtype, f.role, loaded.data[index[a]].data(), f.numel, dst[a].held);
  });
  for (auto& u : last_updates_) u = nullptr;
  refusal_.Clear();
  next_step_ = loaded.info.step;
  fenced_ = false;
  fence_reason_.clear();
  if (&from == this) writer_.Remember(loaded.info.step, loaded.info.created_unix_ms);
  MUOND_LOG(INFO) << "job '" << id() << "': state from checkpoint generation "
                  << loaded.info.generation << " of job '" << from.id() << "' (" << loaded.info.path
                  << "); next step " << next_step_;
  return LoadResult{loaded.info, next_step_, loaded.set_aside};
}

absl::StatusOr<Job::LoadResult> JobImpl::LoadCheckpoint(const checkpoint::Selector& selector) {
  // Held across the load and the install: no save of this job interleaves.
  CheckpointWriter::Exclusive exclusive(writer_);
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckNoStepInFlight("load"));  // checked before reading the generation too
  }
  const auto progress =
      OperationProgress::Default().Begin(id(), "load", id(), CheckpointWriter::StateBytes(spec_));
  checkpoint::Selector counted = selector;
  counted.on_bytes_read = [p = progress.get()](uint64_t bytes) { p->Advance(bytes); };
  auto loaded = writer_.Read(exclusive, counted);
  if (!loaded.ok()) {
    const absl::Status s(loaded.status().code(),
                         absl::StrCat("job '", id(), "': ", loaded.status().message()));
    progress->End(s);
    return s;
  }
  auto installed = InstallLoaded(*loaded, *this);
  progress->End(installed.status());
  return installed;
}

absl::StatusOr<Job::LoadResult> JobImpl::LoadCheckpointFrom(const std::shared_ptr<Job>& from,
                                                            const checkpoint::Selector& selector) {
  // Every Job is a JobImpl (the face has no other implementation).
  JobImpl* const source = static_cast<JobImpl*>(from.get());
  absl::StatusOr<checkpoint::Loaded> loaded;
  // Listed under the source job: the client restoring holds its token, not yet the new job's.
  const auto progress = OperationProgress::Default().Begin(source->id(), "restore", id(),
                                                           CheckpointWriter::StateBytes(spec_));
  {
    // Serialized with the source job's own saves and loads.
    CheckpointWriter::Exclusive source_exclusive(source->writer_);
    checkpoint::Selector counted = selector;
    counted.on_bytes_read = [p = progress.get()](uint64_t bytes) { p->Advance(bytes); };
    loaded = source->writer_.Read(source_exclusive, counted);
  }
  if (!loaded.ok()) {
    const absl::Status s(loaded.status().code(),
                         absl::StrCat("job '", source->id(), "': ", loaded.status().message()));
    progress->End(s);
    return s;
  }
  CheckpointWriter::Exclusive exclusive(writer_);
  auto installed = InstallLoaded(*loaded, *source);
  progress->End(installed.status());
  return installed;
}

void JobImpl::Fence(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  fenced_ = true;
  fence_reason_ = reason;
}

}  // namespace muond::server
