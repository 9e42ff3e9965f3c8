// The host ranges a device has registered for direct copies (Device::IsHostRegistered), for the
// backends that keep their own list (the host devices' test mode, Level Zero's imported
// pointers). Header-only: the GPU backends are libraries of their own that must not depend on
// muond_server. Thread-compatible: the owning device guards it with its lock.
#ifndef MUOND_SERVER_DEVICE_HOST_RANGES_H_
#define MUOND_SERVER_DEVICE_HOST_RANGES_H_

#include <cstddef>
#include <iterator>
#include <map>
#include <vector>

namespace muond::server::device {

class HostRanges {
 public:
  // Records [data, data + bytes). REQUIRES: it overlaps no recorded range.
  void Add(const void* data, size_t bytes) { ranges_[static_cast<const char*>(data)] = bytes; }
  // Forgets the range that starts at `data`; false when there is none.
  bool Remove(const void* data) { return ranges_.erase(static_cast<const char*>(data)) != 0; }
  // True when [data, data + bytes) lies in recorded ranges, adjacent ones counting as one.
  bool Covers(const void* data, size_t bytes) const {
    const char* at = static_cast<const char*>(data);
    const char* const end = at + bytes;
    while (true) {
      auto next = ranges_.upper_bound(at);  // the first range starting after `at`
      if (next == ranges_.begin()) return false;
      const auto& [start, size] = *std::prev(next);
      if (at >= start + size) return false;
      if (end <= start + size) return true;
      at = start + size;  // continues in an adjacent range, or not at all
    }
  }
  bool empty() const { return ranges_.empty(); }
  // The recorded ranges' starts, in address order.
  std::vector<const void*> Starts() const {
    std::vector<const void*> starts;
    for (const auto& [start, size] : ranges_) starts.push_back(start);
    return starts;
  }

 private:
  std::map<const char*, size_t> ranges_;  // start -> bytes
};

}  // namespace muond::server::device

#endif  // MUOND_SERVER_DEVICE_HOST_RANGES_H_
