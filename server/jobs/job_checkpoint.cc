// The checkpoint side of a Job (DESIGN.md 7): saves of a consistent snapshot of its
// MomentumStore through its CheckpointWriter, background saves, loads of a verified generation
// back into the store, and the durable reset. Format and durability: server/storage/checkpoint.cc.
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/jobs/job.h"
#include "common/parallel_for.h"

namespace muond::server {

absl::Status Job::CheckSavable() const {
  if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
  if (spec_.transport_probe) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' is a transport probe: it has no momentum to save"));
  }
  if (fenced_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", id(), "' is fenced (", fence_reason_,
        "): its momentum may not be consistent; load a checkpoint or reset it first"));
  }
  return absl::OkStatus();
}

absl::StatusOr<checkpoint::GenerationInfo> Job::SaveCheckpoint() {
  CheckpointWriter::Exclusive exclusive(writer_);
  int64_t step = 0;
  {
    MomentumStore::Lock store(momentum_);
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckSavable());
    // The store between two commits is the momentum at the boundary of next_step_.
    step = next_step_;
    store.BeginSnapshot();
  }
  return writer_.Write(exclusive, id(), spec_, step, momentum_);
}

void Job::SaveCheckpointInBackground() {
  writer_.SaveInBackground(id(), [self = shared_from_this()] {
    (void)self->SaveCheckpoint();  // logged and counted there
  });
}

void Job::WaitForSaves() { writer_.WaitForSaves(); }

absl::StatusOr<std::vector<checkpoint::GenerationInfo>> Job::ListCheckpoints() const {
  return writer_.List();
}

int64_t Job::NewestGeneration() const { return writer_.NewestGeneration(); }

absl::Status Job::ResetDurably(int64_t next_step,
                               const std::function<absl::Status(int64_t)>& persist) {
  // Held across the reset, the listing and the record: a save that began earlier finishes
  // first, and one that begins later writes the reset momentum under a newer number.
  CheckpointWriter::Exclusive exclusive(writer_);
  RETURN_IF_ERROR(Reset(next_step));
  absl::Status s = persist(NewestGeneration());
  if (s.ok()) return s;
  Fence(absl::StrCat("reset to step ", next_step, " could not be made durable: ", s.message()));
  return absl::Status(s.code(), absl::StrCat("job '", id(), "' was reset in memory but the reset "
                                             "could not be recorded (", s.message(),
                                             "); the job is fenced"));
}

absl::Status Job::MatchLoaded(const checkpoint::Loaded& loaded, const std::string& source,
                              std::vector<int>* index) const {
  if (spec_.transport_probe) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' is a transport probe: it has no momentum to load"));
  }
  index->assign(spec_.matrices.size(), -1);
  std::vector<bool> used(loaded.names.size(), false);
  for (size_t m = 0; m < spec_.matrices.size(); ++m) {
    const common::MatrixSpec& ms = spec_.matrices[m];
    for (size_t i = 0; i < loaded.names.size(); ++i) {
      if (loaded.names[i] == ms.name) (*index)[m] = static_cast<int>(i);
    }
    if ((*index)[m] < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", source, " has no matrix '", ms.name, "' of job '", id(), "'"));
    }
    used[(*index)[m]] = true;
    const common::MatrixSpec* saved = nullptr;
    for (const common::MatrixSpec& s : loaded.spec.matrices) {
      if (s.name == ms.name) saved = &s;
    }
    if (saved == nullptr || saved->shape != ms.shape ||
        loaded.data[(*index)[m]].size() != momentum_.numel(m)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", source, ": matrix '", ms.name, "' has shape [",
          saved == nullptr ? std::string("?") : absl::StrJoin(saved->shape, ", "),
          "], job '", id(), "' has [", absl::StrJoin(ms.shape, ", "), "]"));
    }
  }
  for (size_t i = 0; i < loaded.names.size(); ++i) {
    if (!used[i]) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", source, " has matrix '",
                                                        loaded.names[i], "' that job '", id(),
                                                        "' does not have"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Job::LoadResult> Job::InstallLoaded(const checkpoint::Loaded& loaded,
                                                   const Job& from) {
  MomentumStore::Lock store(momentum_);
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckNoStepInFlight("load"));
  // Everything is checked before the store changes.
  std::vector<int> index;
  RETURN_IF_ERROR(MatchLoaded(loaded, loaded.info.path, &index));
  // Back into the registered (pinned) store, in place.
  std::vector<float*> dst(spec_.matrices.size());
  for (uint32_t m = 0; m < dst.size(); ++m) dst[m] = store.mutable_data(m);
  common::ParallelFor(spec_.matrices.size(), MomentumBytes(), [&](size_t m) {
    const std::vector<float>& data = loaded.data[index[m]];
    std::memcpy(dst[m], data.data(), data.size() * sizeof(float));
  });
  for (auto& u : last_updates_) u = nullptr;
  refusal_.Clear();
  next_step_ = loaded.info.step;
  fenced_ = false;
  fence_reason_.clear();
  if (&from == this) writer_.Remember(loaded.info.step, loaded.info.created_unix_ms);
  MUOND_LOG(INFO) << "job '" << id() << "': momentum from checkpoint generation "
                  << loaded.info.generation << " of job '" << from.id() << "' ("
                  << loaded.info.path << "); next step " << next_step_;
  return LoadResult{loaded.info, next_step_, loaded.set_aside};
}

absl::StatusOr<Job::LoadResult> Job::LoadCheckpoint(const checkpoint::Selector& selector) {
  // Held across the load and the install: no save of this job interleaves.
  CheckpointWriter::Exclusive exclusive(writer_);
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckNoStepInFlight("load"));  // checked before reading the generation too
  }
  auto loaded = writer_.Read(exclusive, selector);
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(),
                        absl::StrCat("job '", id(), "': ", loaded.status().message()));
  }
  return InstallLoaded(*loaded, *this);
}

absl::StatusOr<Job::LoadResult> Job::LoadCheckpointFrom(const std::shared_ptr<Job>& source,
                                                        const checkpoint::Selector& selector) {
  absl::StatusOr<checkpoint::Loaded> loaded;
  {
    // Serialized with the source job's own saves and loads.
    CheckpointWriter::Exclusive source_exclusive(source->writer_);
    loaded = source->writer_.Read(source_exclusive, selector);
  }
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(),
                        absl::StrCat("job '", source->id(), "': ", loaded.status().message()));
  }
  CheckpointWriter::Exclusive exclusive(writer_);
  return InstallLoaded(*loaded, *source);
}

void Job::Fence(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  fenced_ = true;
  fence_reason_ = reason;
}

}  // namespace muond::server
