// The external bootstrap (callbacks supplied by the caller) and the key agreement built on any
// bootstrap. See bootstrap.h.
#include "bootstrap/bootstrap.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/interrupt.h"

namespace odc {
namespace {

class ExternalBootstrap final : public Bootstrap {
 public:
  ExternalBootstrap(int rank, int world_size, const ExternalBootstrapCallbacks& calls)
      : rank_(rank), world_size_(world_size), calls_(calls) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  Status allgather(const void* mine, void* all, size_t bytes, const char* operation) override {
    const int code = calls_.allgather(calls_.ctx, mine, all, bytes);
    // A callback interrupted (Ctrl-C) as it started may have returned 0 without doing anything
    // (ctypes does that): the interrupt check says so, and `all` is not trusted.
    ODC_RETURN_IF_ERROR(
        check_interrupt_now(std::string("in the bootstrap's allgather (") + operation + ")"));
    if (code == 0) return Status::Ok();
    return Status::RemoteError(std::string("bootstrap allgather (") + operation +
                               ") failed: the caller's callback returned " + std::to_string(code));
  }

  Status barrier(const char* operation) override {
    const int code = calls_.barrier(calls_.ctx);
    ODC_RETURN_IF_ERROR(
        check_interrupt_now(std::string("in the bootstrap's barrier (") + operation + ")"));
    if (code == 0) return Status::Ok();
    return Status::RemoteError(std::string("bootstrap barrier (") + operation +
                               ") failed: the caller's callback returned " + std::to_string(code));
  }

  void mark_failed(const std::string& reason) override {
    if (failed_ || calls_.mark_failed == nullptr) return;
    failed_ = true;
    calls_.mark_failed(calls_.ctx, reason.c_str());
  }

 private:
  int rank_;
  int world_size_;
  ExternalBootstrapCallbacks calls_;
  bool failed_ = false;
};

// What every rank contributes to agree_on_key.
struct KeyRecord {
  uint64_t magic;
  int32_t rank;
  int32_t world_size;
  char key[48];
};
constexpr uint64_t kKeyMagic = 0x3179656b2d63646fULL;  // "odc-key1"

}  // namespace

Result<std::unique_ptr<Bootstrap>> make_external_bootstrap(
    int rank, int world_size, const ExternalBootstrapCallbacks& calls) {
  if (calls.allgather == nullptr || calls.barrier == nullptr) {
    return Status::InvalidArgument(std::string("bootstrap: the ") +
                                   (calls.allgather == nullptr ? "allgather" : "barrier") +
                                   " callback is NULL");
  }
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return Status::InvalidArgument("bootstrap: rank " + std::to_string(rank) +
                                   " is outside world size " + std::to_string(world_size));
  }
  return std::unique_ptr<Bootstrap>(new ExternalBootstrap(rank, world_size, calls));
}

Result<std::string> agree_on_key(Bootstrap& bootstrap) {
  KeyRecord mine{};
  mine.magic = kKeyMagic;
  mine.rank = bootstrap.rank();
  mine.world_size = bootstrap.world_size();
  if (bootstrap.rank() == 0) {
    std::random_device entropy;  // /dev/urandom on Linux
    std::snprintf(mine.key, sizeof(mine.key), "b%08x%08x%08x%08x", entropy(), entropy(), entropy(),
                  entropy());
  }
  std::vector<KeyRecord> all(static_cast<size_t>(bootstrap.world_size()));
  ODC_RETURN_IF_ERROR(bootstrap.allgather(&mine, all.data(), sizeof(KeyRecord), "agree on key"));
  for (int r = 0; r < bootstrap.world_size(); ++r) {
    const KeyRecord& record = all[static_cast<size_t>(r)];
    if (record.magic != kKeyMagic || record.rank != r) {
      return Status::InvalidUsage("bootstrap allgather returned garbage in rank " +
                                  std::to_string(r) +
                                  "'s slot (recv must hold every rank's record in rank order)");
    }
    if (record.world_size != bootstrap.world_size()) {
      return Status::InvalidArgument("rank " + std::to_string(r) + " joined with world size " +
                                     std::to_string(record.world_size) + ", this rank with " +
                                     std::to_string(bootstrap.world_size()));
    }
  }
  const KeyRecord& root = all[0];
  return std::string(root.key, strnlen(root.key, sizeof(root.key)));
}

}  // namespace odc
