// The local shared-memory bootstrap: ranks of one host meet through a key, with no server. Each
// rank publishes a control block "/odc.<key>.r<rank>" (mode 0600, owner checked by every peer)
// and maps its peers'; collectives are arrivals in those blocks, waited on with a futex.
// Invariants:
//   - a key is reserved while its job lives: the control names stay until their rank closes, so a
//     second job with a live key fails at init ("key ... is in use"), never joins the first;
//   - nothing of a job stays in /dev/shm once its ranks are gone: a rank removes its names when it
//     closes or exits, and whoever finds a rank dead removes what it left (control block and
//     allocation segments), at init or later;
//   - every wait is bounded by the timeout (infinite: forever) and ends early, naming the rank,
//     when a peer failed, closed or died.
// The shared-memory transport builds on the same blocks (its signal waits sleep on their futex
// words and check liveness through peer_status()).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "bootstrap/shm_segment.h"

namespace odc::shm {

struct ControlBlock;

class ShmBootstrap final : public Bootstrap {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective: returns once every rank of `world_size` has joined `key` (or fails after
  // `timeout`, naming the missing rank; or at once when the key is held by a live job). `outer`:
  // the bootstrap the ranks agreed on `key` through, if any (an external one): every rank meets
  // there once its control block exists, so a rank that fails before (e.g. EMFILE) and marks
  // itself failed there is seen by its peers at once, not as a block that never appears.
  static Result<std::shared_ptr<ShmBootstrap>> create(int rank, int world_size,
                                                      const std::string& key,
                                                      std::chrono::duration<double> timeout,
                                                      Bootstrap* outer = nullptr);
  ~ShmBootstrap() override;
  ShmBootstrap(const ShmBootstrap&) = delete;
  ShmBootstrap& operator=(const ShmBootstrap&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  // Any size: records larger than a control block's slot travel in several rounds.
  Status allgather(const void* mine, void* all, size_t bytes, const char* operation) override;
  // Ranks that meet in differently named collectives fail with "collective mismatch" naming both.
  Status barrier(const char* operation) override;
  void mark_failed(const std::string& reason) override;
  std::string failure_of(int peer) override;

  // ---- for the shared-memory transport -------------------------------------------------------
  const std::string& key() const { return key_; }
  std::chrono::duration<double> timeout() const { return timeout_; }
  // "/odc.<key>.r<rank><suffix>": every shared-memory name of this job.
  std::string segment_name(int rank, const std::string& suffix) const;
  // Records that this rank has named `count` allocation segments (".a0", ".a1", ...), so that
  // whoever finds it dead removes them.
  void note_allocations(uint64_t count);
  // Ok while `peer` lives and is open; otherwise a RemoteError naming it (failed: its reason;
  // closed; died: its pid, and what it left in /dev/shm is removed). Reads /proc: callers on a
  // hot path rate-limit it.
  Status peer_status(int peer);
  // Sleeps until `peer` bumps its wake word past `seen` (it arrived, signaled or failed), at most
  // `limit`. Read the word (wake_count) before checking the condition, then sleep.
  uint32_t wake_count(int peer) const;
  void sleep_on(int peer, uint32_t seen, Clock::duration limit) const;
  // Wakes every rank sleeping on this rank's word (after a signal).
  void wake_peers();
  // This rank's inbox word, bumped by every peer that signals it (wake_inbox): a rank waiting for
  // a signal from any of several peers reads it, checks, then sleeps on it.
  uint32_t inbox_count() const;
  void sleep_on_inbox(uint32_t seen, Clock::duration limit) const;
  void wake_inbox(int peer);

 private:
  ShmBootstrap(int rank, int world_size, std::string key, std::chrono::duration<double> timeout);
  Status join(Bootstrap* outer);
  Status create_control_segment();
  // One look at a peer's control block: true once mapped, false while it is missing (or dead
  // for less than the grace period, measured from `dead_since`), an error once it is dead.
  Result<bool> try_map_peer(int peer, Clock::time_point& dead_since);
  Status arrive_and_wait(const char* operation);
  Status wait_for_peer(int peer, uint64_t epoch, const char* operation, Clock::time_point deadline);
  // Removes a dead rank's names (its control block, if still the dead one's, and its allocation
  // segments). Idempotent; errors are ignored (another survivor may be removing them too).
  void remove_remains(int peer, int32_t dead_pid, uint64_t num_allocations) const;
  ControlBlock& block(int rank) const;

  int rank_;
  int world_size_;
  std::string key_;
  std::chrono::duration<double> timeout_;
  uint64_t epoch_ = 0;                              // collectives entered so far
  std::vector<std::unique_ptr<Segment>> controls_;  // index = rank
  // The join failed because a peer runs in another PID namespace: this rank's (failed) block
  // stays named, so that peer learns why too (it removes the block; so does this rank's restart).
  bool leave_block_ = false;
};

}  // namespace odc::shm
