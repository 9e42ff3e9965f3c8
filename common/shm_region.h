// A shared-memory region backed by a memfd: anonymous (nothing under a guessable name in /dev/shm),
// freed when the last descriptor and mapping are gone. Move-only; not thread-safe to move while in
// use, the mapped bytes themselves are shared by design.
#ifndef MUOND_COMMON_SHM_REGION_H_
#define MUOND_COMMON_SHM_REGION_H_

#include <cstddef>

#include "absl/status/statusor.h"

namespace muond::common {

class SharedRegion {
 public:
  // Daemon side: a new memfd of `bytes` (rounded up to a page), mapped read-write, sealed against
  // resizing; with `peer_read_only` also sealed F_SEAL_FUTURE_WRITE, so a peer given the descriptor
  // can map it only read-only. With `lock`, mlock()ed: failure to lock is not an error (the region
  // works unpinned; locked() tells). Errors name the call.
  static absl::StatusOr<SharedRegion> Create(const char* name, size_t bytes, bool peer_read_only,
                                             bool lock);
  // Peer side: maps a received descriptor (taking ownership of `fd`), after checking with fstat
  // that it holds at least `bytes`. FAILED_PRECONDITION for a short region.
  static absl::StatusOr<SharedRegion> Map(int fd, size_t bytes, bool writable);

  SharedRegion() = default;
  SharedRegion(SharedRegion&& other) noexcept;
  SharedRegion& operator=(SharedRegion&& other) noexcept;
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;
  ~SharedRegion();

  char* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  bool locked() const { return locked_; }

 private:
  void Reset();
  int fd_ = -1;
  char* data_ = nullptr;
  size_t size_ = 0;
  bool locked_ = false;
};

}  // namespace muond::common

#endif  // MUOND_COMMON_SHM_REGION_H_
