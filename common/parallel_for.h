// Splits large byte-wise work (copies, scans) over the CPUs. Small work runs inline: a thread
// costs tens of microseconds, worth it only for megabytes.
#ifndef MUOND_COMMON_PARALLEL_FOR_H_
#define MUOND_COMMON_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

namespace muond::common {

// Runs fn(i) for i in [0, n), on up to hardware_concurrency threads when `total_bytes` is large.
// fn must be safe to run concurrently for different i.
inline void ParallelFor(size_t n, size_t total_bytes, const std::function<void(size_t)>& fn) {
  constexpr size_t kWorthIt = size_t{8} << 20;
  const size_t threads =
      std::min<size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1 || total_bytes < kWorthIt) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < n; i = next++) fn(i);
  };
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < threads; ++t) helpers.emplace_back(worker);
  worker();
  for (auto& t : helpers) t.join();
}

}  // namespace muond::common

#endif  // MUOND_COMMON_PARALLEL_FOR_H_
