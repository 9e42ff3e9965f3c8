#include "server/jobs/checkpoint_writer.h"

#include <algorithm>
#include <memory>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "common/logging.h"
#include "server/record/daemon_metrics.h"
#include "server/record/status_progress.h"

namespace muond::server {

absl::StatusOr<checkpoint::GenerationInfo> CheckpointWriter::Write(
    const Exclusive&, const std::string& job_id, const common::JobSpec& spec, int64_t step,
    const checkpoint::MatrixSource& source, const std::vector<int64_t>& tensor_steps) {
  const absl::Time start = absl::Now();
  // Progress counts a tensor once it was written: when the next one is asked for, and the last
  // when the generation is durable.
  const std::unique_ptr<OperationProgress::Handle> progress =
      OperationProgress::Default().Begin(job_id, "save", job_id, StateBytes(spec));
  uint64_t pending = 0;
  auto counted = [&](size_t i, std::vector<float>* out) {
    progress->Advance(std::exchange(pending, 0));
    absl::Status s = source(i, out);
    if (s.ok()) pending = out->size() * sizeof(float);
    return s;
  };
  absl::StatusOr<checkpoint::GenerationInfo> info = store_.Write(spec, step, counted, tensor_steps);
  if (info.ok()) progress->Advance(pending);
  progress->End(info.status());
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  RecordCheckpointSave(job_id, info.ok(), seconds, info.ok() ? info->bytes : 0);
  if (!info.ok()) {
    MUOND_LOG(ERROR) << info.status().message();
    return info.status();
  }
  Remember(step, info->created_unix_ms);
  MUOND_LOG(INFO) << "job '" << job_id << "': checkpoint generation " << info->generation
                  << " at step " << step << " (" << info->bytes << " bytes, " << seconds
                  << " s) in " << info->path;
  return info;
}

uint64_t CheckpointWriter::StateBytes(const common::JobSpec& spec) {
  uint64_t bytes = 0;
  for (const checkpoint::StateTensor& t : checkpoint::StateTensors(spec)) bytes += t.stored_bytes();
  return bytes;
}

absl::StatusOr<checkpoint::Loaded> CheckpointWriter::Read(const Exclusive&,
                                                          const checkpoint::Selector& selector) {
  return store_.Load(selector);
}

int64_t CheckpointWriter::NewestGeneration() const {
  int64_t newest = 0;
  if (auto list = store_.List(); list.ok()) {
    for (const auto& info : *list) newest = std::max(newest, info.generation);
  }
  return newest;
}

void CheckpointWriter::SaveInBackground(const std::string& job_id, std::function<void()> save) {
  if (background_.exchange(true)) {
    MUOND_LOG(WARNING) << "job '" << job_id
                       << "': the previous checkpoint is still being written; skipping this one";
    return;
  }
  std::thread([this, save = std::move(save)] {
    save();
    background_ = false;
  }).detach();
}

void CheckpointWriter::WaitForSaves() {
  while (background_.load()) absl::SleepFor(absl::Milliseconds(5));
  absl::MutexLock lock(&mu_);
}

void CheckpointWriter::Remember(int64_t step, int64_t unix_ms) {
  last_step_ = step;
  last_unix_ms_ = unix_ms;
}

}  // namespace muond::server
