// StepPipeline's buffers (step_pipeline.h): what a matrix's assembly costs of the gather budget,
// the pools of host staging and device buffers kept between steps (at most the gather peak's
// bytes), the state store's mode, and where it reads the committed momentum and writes the new
// one.
#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "server/engine/step_pipeline.h"

namespace muond::server {

uint64_t StepPipeline::AssembledBytesOf(const common::JobSpec& spec, const common::MatrixSpec& m,
                                        bool in_host_memory) {
  if (spec.transport_probe) return 0;
  const bool adamw =
      spec.mode == common::JobMode::kApply && m.optimizer == common::Optimizer::kAdamW;
  // A device that computes in place reads the momentum where it is stored (and decodes a
  // compressed one block by block in its kernel); the others stage an fp32 copy of it.
  const bool momentum = !adamw && !in_host_memory;
  const bool decoded = momentum && spec.state.momentum != common::StateDType::kFloat32;
  return (1 + (momentum ? 1 : 0) + (decoded ? 1 : 0)) * sizeof(float) *
         static_cast<uint64_t>(m.numel());
}

uint64_t StepPipeline::AssembledBytes(uint32_t m) const {
  return AssembledBytesOf(spec_, spec_.matrices[m], devices_->device->ComputesInHostMemory());
}

std::vector<float> StepPipeline::TakeStaging(size_t n) {
  {
    absl::MutexLock lock(&pool_mu_);
    if (auto it = staging_pool_.find(n); it != staging_pool_.end()) {
      std::vector<float> v = std::move(it->second);
      staging_pool_.erase(it);
      pool_bytes_ -= n * sizeof(float);
      return v;
    }
  }
  return std::vector<float>(n);
}

absl::StatusOr<device::DeviceBuffer> StepPipeline::TakeDeviceBuffer(size_t bytes) {
  {
    absl::MutexLock lock(&pool_mu_);
    if (auto it = device_pool_.find(bytes); it != device_pool_.end()) {
      device::DeviceBuffer b = std::move(it->second);
      device_pool_.erase(it);
      pool_bytes_ -= bytes;
      return b;
    }
  }
  return devices_->device->Allocate(bytes);
}

uint64_t StepPipeline::PoolLimit() const {
  return std::min(gather_budget_bytes_, gather_peak_bytes_.load());
}

void StepPipeline::GiveBack(std::vector<float> staging) {
  const size_t bytes = staging.size() * sizeof(float);
  if (bytes == 0) return;
  device::Device& dev = *devices_->device;
  bool keep = false, pinned = false;
  {
    absl::MutexLock lock(&pool_mu_);
    pinned = pinned_staging_.count(staging.data()) > 0;
    keep = pool_bytes_ + bytes <= PoolLimit();
    if (keep) {
      pool_bytes_ += bytes;
    } else if (pinned) {
      pinned_staging_.erase(staging.data());
    }
  }
  if (!keep) {
    if (pinned) dev.UnregisterHost(staging.data(), bytes);
    return;  // freed here
  }
  // Registered once, outside the lock (it blocks); a device that refuses leaves it pageable.
  if (!pinned && dev.DirectHostCopies()) pinned = dev.RegisterHost(staging.data(), bytes);
  absl::MutexLock lock(&pool_mu_);
  if (pinned) pinned_staging_[staging.data()] = bytes;
  staging_pool_.emplace(staging.size(), std::move(staging));
}

uint64_t StepPipeline::pinned_staging_bytes() const {
  absl::MutexLock lock(&pool_mu_);
  uint64_t bytes = 0;
  for (const auto& [data, n] : pinned_staging_) bytes += n;
  return bytes;
}

uint64_t StepPipeline::pooled_host_bytes() const {
  const bool device_is_host = !devices_->device->DirectHostCopies();
  absl::MutexLock lock(&pool_mu_);
  uint64_t bytes = 0;
  for (const auto& [n, v] : staging_pool_) bytes += n * sizeof(float);
  if (device_is_host) {
    for (const auto& [n, b] : device_pool_) bytes += n;
  }
  return bytes;
}

bool StepPipeline::StagingPinned(const float* data) {
  absl::MutexLock lock(&pool_mu_);
  return pinned_staging_.count(data) > 0;
}

void StepPipeline::GiveBack(device::DeviceBuffer buffer) {
  if (!buffer.owned()) return;  // a view of host memory (in place): nothing to keep
  const size_t bytes = buffer.size();
  absl::MutexLock lock(&pool_mu_);
  if (bytes == 0 || pool_bytes_ + bytes > PoolLimit()) return;  // freed here
  pool_bytes_ += bytes;
  device_pool_.emplace(bytes, std::move(buffer));
}

bool StepPipeline::StateTwoCopies() const {
  return params_ != nullptr ? params_->two_copies() : momentum_.two_copies();
}

uint64_t StepPipeline::StateWindowBytes() const {
  return params_ != nullptr ? params_->window_bytes() : momentum_.window_bytes();
}

const float* StepPipeline::CommittedMomentum(uint32_t m) const {
  return params_ != nullptr ? params_->front(m, ParamStore::kMomentum) : momentum_.data(m);
}

float* StepPipeline::NextMomentum(uint32_t m) const {
  return params_ != nullptr ? params_->back(m, ParamStore::kMomentum) : momentum_.next(m);
}

}  // namespace muond::server
