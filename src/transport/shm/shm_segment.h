// RAII POSIX shared-memory segments: created with mode 0600 (owner only), mapped read-write,
// unmapped on destruction; the name is unlinked on destruction unless it was unlinked earlier.
#pragma once

#include <cstddef>
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
  // ENOENT -> kInvalidUsage so callers can tell "not there yet" from real failures.
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

 private:
  Segment(std::string name, void* data, size_t bytes, bool owns_name)
      : name_(std::move(name)), data_(data), bytes_(bytes), owns_name_(owns_name) {}
  std::string name_;
  void* data_;
  size_t bytes_;
  bool owns_name_;  // created here and not yet unlinked
};

}  // namespace odc::shm
