// The checkpoint half of Job (DESIGN.md 7): consistent snapshots with per-matrix copy-on-write,
// background saves, loads into the pinned momentum store. Format and durability: checkpoint.cc.
#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/daemon_metrics.h"
#include "server/job.h"
#include "server/job_internal.h"
#include "server/parallel_bytes.h"

namespace muond::server {

void Job::PreserveForSnapshot() {
  if (snapshot_ == nullptr) return;
  for (size_t m = 0; m < momentum_.size(); ++m) {
    if (!snapshot_->copied[m] && snapshot_->saved[m].empty()) snapshot_->saved[m] = momentum_[m];
  }
}

absl::StatusOr<checkpoint::GenerationInfo> Job::SaveCheckpoint() {
  absl::MutexLock save_lock(&save_mu_);
  const absl::Time start = absl::Now();
  int64_t step = 0;
  {
    absl::MutexLock snap_lock(&snap_mu_);
    absl::MutexLock lock(&mu_);
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
    // The store between two commits is the momentum at the boundary of next_step_.
    step = next_step_;
    snapshot_ = std::make_unique<Snapshot>();
    snapshot_->step = step;
    snapshot_->copied.assign(momentum_.size(), false);
    snapshot_->saved.resize(momentum_.size());
  }
  auto source = [this](size_t m, std::vector<float>* out) -> absl::Status {
    absl::MutexLock snap_lock(&snap_mu_);
    if (!snapshot_->saved[m].empty()) {
      *out = std::move(snapshot_->saved[m]);
      snapshot_->saved[m] = std::vector<float>();
    } else {
      out->assign(momentum_[m].begin(), momentum_[m].end());
    }
    snapshot_->copied[m] = true;
    return absl::OkStatus();
  };
  absl::StatusOr<checkpoint::GenerationInfo> info = store_.Write(spec_, step, source);
  {
    absl::MutexLock snap_lock(&snap_mu_);
    snapshot_.reset();
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  RecordCheckpointSave(id(), info.ok(), seconds, info.ok() ? info->bytes : 0);
  if (!info.ok()) {
    MUOND_LOG(ERROR) << info.status().message();
    return info.status();
  }
  last_checkpoint_step_ = step;
  last_checkpoint_unix_ms_ = info->created_unix_ms;
  MUOND_LOG(INFO) << "job '" << id() << "': checkpoint generation " << info->generation
                  << " at step " << step << " (" << info->bytes << " bytes, " << seconds
                  << " s) in " << info->path;
  return info;
}

void Job::SaveCheckpointInBackground() {
  if (background_save_.exchange(true)) {
    MUOND_LOG(WARNING) << "job '" << id()
                       << "': the previous checkpoint is still being written; skipping this one";
    return;
  }
  std::thread([self = shared_from_this()] {
    (void)self->SaveCheckpoint();  // logged and counted there
    self->background_save_ = false;
  }).detach();
}

void Job::WaitForSaves() {
  while (background_save_.load()) absl::SleepFor(absl::Milliseconds(5));
  absl::MutexLock save_lock(&save_mu_);
}

int64_t Job::last_checkpoint_step() const { return last_checkpoint_step_.load(); }

absl::StatusOr<std::vector<checkpoint::GenerationInfo>> Job::ListCheckpoints() const {
  return store_.List();
}

int64_t Job::NewestGeneration() const {
  int64_t newest = 0;
  if (auto list = store_.List(); list.ok()) {
    for (const auto& info : *list) newest = std::max(newest, info.generation);
  }
  return newest;
}

absl::Status Job::ResetDurably(int64_t next_step,
                               const std::function<absl::Status(int64_t)>& persist) {
  // Held across the reset, the listing and the record: a save that began earlier finishes
  // first, and one that begins later writes the reset momentum under a newer number.
  absl::MutexLock save_lock(&save_mu_);
  RETURN_IF_ERROR(Reset(next_step));
  absl::Status s = persist(NewestGeneration());
  if (s.ok()) return s;
  Fence(absl::StrCat("reset to step ", next_step, " could not be made durable: ", s.message()));
  return absl::Status(s.code(), absl::StrCat("job '", id(), "' was reset in memory but the reset "
                                             "could not be recorded (", s.message(),
                                             "); the job is fenced"));
}

uint64_t Job::MomentumBytes() const {
  uint64_t bytes = 0;
  for (const auto& m : momentum_) bytes += m.size() * sizeof(float);
  return bytes;
}

absl::Status Job::InstallMomentum(const checkpoint::Loaded& loaded, const std::string& source) {
  if (spec_.transport_probe) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' is a transport probe: it has no momentum to load"));
  }
  // Everything is checked before the store changes.
  std::vector<int> index(spec_.matrices.size(), -1);
  std::vector<bool> used(loaded.names.size(), false);
  for (size_t m = 0; m < spec_.matrices.size(); ++m) {
    const common::MatrixSpec& ms = spec_.matrices[m];
    for (size_t i = 0; i < loaded.names.size(); ++i) {
      if (loaded.names[i] == ms.name) index[m] = static_cast<int>(i);
    }
    if (index[m] < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", source, " has no matrix '", ms.name, "' of job '", id(), "'"));
    }
    used[index[m]] = true;
    const std::vector<float>& data = loaded.data[index[m]];
    const common::MatrixSpec* saved = nullptr;
    for (const common::MatrixSpec& s : loaded.spec.matrices) {
      if (s.name == ms.name) saved = &s;
    }
    if (saved == nullptr || saved->shape != ms.shape || data.size() != momentum_[m].size()) {
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
  PreserveForSnapshot();
  // Back into the registered (pinned) store, in place.
  ParallelFor(spec_.matrices.size(), MomentumBytes(), [&](size_t m) {
    const std::vector<float>& data = loaded.data[index[m]];
    std::memcpy(momentum_[m].data(), data.data(), data.size() * sizeof(float));
  });
  for (auto& u : last_updates_) u = nullptr;
  refusal_ = Refusal();
  next_step_ = loaded.info.step;
  fenced_ = false;
  fence_reason_.clear();
  return absl::OkStatus();
}

absl::StatusOr<Job::LoadResult> Job::InstallLoaded(const checkpoint::Loaded& loaded,
                                                   const Job& from) {
  absl::MutexLock snap_lock(&snap_mu_);
  absl::MutexLock lock(&mu_);
  if (in_flight_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", id(), "': step ", in_flight_->step, " is in flight; load after it ends"));
  }
  RETURN_IF_ERROR(InstallMomentum(loaded, loaded.info.path));
  if (&from == this) {  // one of this job's own generations
    last_checkpoint_step_ = loaded.info.step;
    last_checkpoint_unix_ms_ = loaded.info.created_unix_ms;
  }
  MUOND_LOG(INFO) << "job '" << id() << "': momentum from checkpoint generation "
                  << loaded.info.generation << " of job '" << from.id() << "' ("
                  << loaded.info.path << "); next step " << next_step_;
  return LoadResult{loaded.info, next_step_, loaded.set_aside};
}

absl::StatusOr<Job::LoadResult> Job::LoadCheckpoint(const checkpoint::Selector& selector) {
  // Held across the load and the install: no save of this job interleaves.
  absl::MutexLock save_lock(&save_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (in_flight_ != nullptr) {  // checked before reading the generation as well
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", id(), "': step ", in_flight_->step, " is in flight; load after it ends"));
    }
  }
  auto loaded = store_.Load(selector);
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
    // Serialized with the source job's own saves and loads (its store is thread-compatible).
    absl::MutexLock source_lock(&source->save_mu_);
    loaded = source->store_.Load(selector);
  }
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(),
                        absl::StrCat("job '", source->id(), "': ", loaded.status().message()));
  }
  absl::MutexLock save_lock(&save_mu_);
  return InstallLoaded(*loaded, *source);
}

void Job::Fence(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  fenced_ = true;
  fence_reason_ = reason;
}

}  // namespace muond::server
