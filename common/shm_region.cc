#include "common/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace muond::common {
namespace {

absl::Status Errno(const std::string& what) {
  const int err = errno;
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOMEM || err == EMFILE || err == ENFILE) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

size_t PageRound(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (std::max<size_t>(bytes, 1) + page - 1) / page * page;
}

}  // namespace

absl::StatusOr<SharedRegion> SharedRegion::Create(const char* name, size_t bytes,
                                                  bool peer_read_only, bool lock) {
  SharedRegion r;
  r.size_ = PageRound(bytes);
  r.fd_ = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (r.fd_ < 0) return Errno(absl::StrCat("memfd_create(", name, ")"));
  if (ftruncate(r.fd_, static_cast<off_t>(r.size_)) != 0) {
    return Errno(absl::StrCat("ftruncate(", name, ", ", r.size_, ")"));
  }
  void* p = mmap(nullptr, r.size_, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd_, 0);
  if (p == MAP_FAILED) return Errno(absl::StrCat("mmap(", name, ", ", r.size_, ")"));
  r.data_ = static_cast<char*>(p);
  // Our own writable mapping exists before the seal, so the daemon keeps writing; a peer cannot
  // create a new writable one.
  int seals = F_SEAL_SHRINK | F_SEAL_GROW;
  if (peer_read_only) seals |= F_SEAL_FUTURE_WRITE;
  if (fcntl(r.fd_, F_ADD_SEALS, seals | F_SEAL_SEAL) != 0) {
    return Errno(absl::StrCat("fcntl(", name, ", F_ADD_SEALS)"));
  }
  if (lock) r.locked_ = mlock(r.data_, r.size_) == 0;
  return r;
}

absl::StatusOr<SharedRegion> SharedRegion::Map(int fd, size_t bytes, bool writable) {
  SharedRegion r;
  r.fd_ = fd;
  struct stat st;
  if (fstat(fd, &st) != 0) return Errno("fstat(shared region)");
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    return absl::FailedPreconditionError(absl::StrCat("shared region holds ", st.st_size,
                                                      " bytes; expected at least ", bytes));
  }
  r.size_ = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, r.size_, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Errno("mmap(shared region)");
  r.data_ = static_cast<char*>(p);
  return r;
}

SharedRegion::SharedRegion(SharedRegion&& other) noexcept { *this = std::move(other); }

SharedRegion& SharedRegion::operator=(SharedRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    std::swap(fd_, other.fd_);
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(locked_, other.locked_);
  }
  return *this;
}

SharedRegion::~SharedRegion() { Reset(); }

void SharedRegion::Reset() {
  if (data_ != nullptr) {
    if (locked_) munlock(data_, size_);
    munmap(data_, size_);
  }
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  data_ = nullptr;
  size_ = 0;
  locked_ = false;
}

}  // namespace muond::common
