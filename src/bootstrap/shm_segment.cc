// POSIX shm_open / mmap wrappers. Every failure names the segment and the call.
#include "bootstrap/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/check.h"

namespace odc::shm {
namespace {

// Closes a descriptor on scope exit; the mapping outlives it.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

Status segment_error(const char* call, const std::string& name, int error) {
  return Status::SystemError(std::string(call) + "(" + name + ") failed: " + std::strerror(error));
}

}  // namespace

Result<std::unique_ptr<Segment>> Segment::create(const std::string& name, size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    if (errno == EEXIST) {
      return Status::InvalidArgument("shared memory segment " + name + " already exists");
    }
    return segment_error("shm_open", name, errno);
  }
  FdCloser closer{fd};
  // The umask can only remove bits; force exactly owner read/write.
  if (::fchmod(fd, 0600) != 0) {
    const int error = errno;
    ::shm_unlink(name.c_str());
    return segment_error("fchmod", name, error);
  }
  if (const int error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0) {
    ::shm_unlink(name.c_str());
    return segment_error("posix_fallocate", name, error);
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::shm_unlink(name.c_str());
    return segment_error("fstat", name, error);
  }
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int error = errno;
    ::shm_unlink(name.c_str());
    return segment_error("mmap", name, error);
  }
  return std::unique_ptr<Segment>(
      new Segment(name, data, bytes, /*owns_name=*/true, static_cast<uint64_t>(info.st_ino)));
}

Result<std::unique_ptr<Segment>> Segment::open(const std::string& name, size_t min_bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0);
  if (fd < 0) {
    if (errno == ENOENT) return Status::InvalidUsage("shared memory segment " + name + " missing");
    return segment_error("shm_open", name, errno);
  }
  FdCloser closer{fd};
  struct stat info {};
  if (::fstat(fd, &info) != 0) return segment_error("fstat", name, errno);
  // Only this user's own private segments are peers: anything another user made, or could read
  // or write, may be a forged rank (planted parameters, stolen gradients).
  if (info.st_uid != ::geteuid() || (info.st_mode & 077) != 0 || !S_ISREG(info.st_mode)) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(info.st_mode & 07777));
    return Status::SystemError(
        "refusing shared memory segment /dev/shm" + name + ": owner uid " +
        std::to_string(info.st_uid) + ", mode " + mode + "; odc maps only segments owned by " +
        "its own uid (" + std::to_string(::geteuid()) + ") with mode 0600 (another user made " +
        "it or can read or write it; remove it if it is not yours)");
  }
  const auto bytes = static_cast<size_t>(info.st_size);
  if (bytes < min_bytes || bytes == 0) {
    return Status::InvalidUsage("shared memory segment " + name + " is not sized yet");
  }
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) return segment_error("mmap", name, errno);
  return std::unique_ptr<Segment>(
      new Segment(name, data, bytes, /*owns_name=*/false, static_cast<uint64_t>(info.st_ino)));
}

Status Segment::unlink_name(const std::string& name) {
  if (::shm_unlink(name.c_str()) != 0 && errno != ENOENT) {
    return segment_error("shm_unlink", name, errno);
  }
  return Status::Ok();
}

Status Segment::unlink() {
  if (!owns_name_) return Status::Ok();
  return remove_name();
}

Status Segment::remove_name() {
  owns_name_ = false;
  // Only while the name is still ours: a peer that took us for dead may have removed it and a
  // restarted rank made a new segment under it.
  const int fd = ::shm_open(name_.c_str(), O_RDONLY | O_NOFOLLOW, 0);
  if (fd < 0) return Status::Ok();  // already gone
  FdCloser closer{fd};
  struct stat info {};
  if (::fstat(fd, &info) != 0 || static_cast<uint64_t>(info.st_ino) != inode_) return Status::Ok();
  return unlink_name(name_);
}

Segment::~Segment() {
  ::munmap(data_, bytes_);
  (void)unlink();
}

}  // namespace odc::shm
