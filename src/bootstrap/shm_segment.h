// RAII POSIX shared-memory segments: created with mode 0600 (owner only), mapped read-write,
// unmapped on destruction; the name is unlinked on destruction unless it was unlinked earlier (or
// now names another segment: someone removed ours and made a new one). Only segments of this uid
// with mode 0600 are opened.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace odc::shm {

class Segment {
 public:
  // Creates `name` exclusively (EEXIST -> kInvalidArgument naming it) with `bytes` of zeroed,
  // reserved memory (posix_fallocate: a full /dev/shm fails here, not later with SIGBUS).
  static Result<std::unique_ptr<Segment>> create(const std::string& name, size_t bytes);
  // Opens and maps an existing segment; `min_bytes` guards against a segment still being sized.
  // ENOENT -> kInvalidUsage so callers can tell "not there yet" from real failures; a segment of
  // another uid, or one that group or others may access, is refused (kSystemError naming it).
  static Result<std::unique_ptr<Segment>> open(const std::string& name, size_t min_bytes);
  // Removes a name if present (stale segments); missing names are fine.
  static Status unlink_name(const std::string& name);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }
  // Removes the name now; the mapping stays valid for everyone who has it.
  Status unlink();
  // Removes the name if it still names this mapping, whoever made it (a peer's control block,
  // once every rank has mapped it): no-op when it is gone or names a later segment.
  Status remove_name();
  // Leaves the name in place when this segment goes (for a peer to read and remove).
  void keep_name() { owns_name_ = false; }

 private:
  Segment(std::string name, void* data, size_t bytes, bool owns_name, uint64_t inode)
      : name_(std::move(name)), data_(data), bytes_(bytes), owns_name_(owns_name), inode_(inode) {}
  std::string name_;
  void* data_;
  size_t bytes_;
  bool owns_name_;  // created here and not yet unlinked
  uint64_t inode_;  // tells our segment from a later one under the same name
};

}  // namespace odc::shm
