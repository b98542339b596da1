// The local shared-memory bootstrap: ranks of one host meet through a key, with no server. Each
// rank claims its slot of the key, then publishes a control block "/odc.<key>.r<rank>" (mode
// 0600, owner checked by every peer) and maps its peers'; collectives are arrivals in those
// blocks, waited on with a futex.
// Invariants:
//   - a rank slot has one live claimant: the claim is an abstract Unix socket bound for the
//     process's life (the kernel frees it when the process ends, however it ends; nothing on
//     disk). A second claimant (another job with the same key) fails, and tells the holder. A
//     holder whose ranks have not all met yet fails too (a set of ranks that paired across two
//     jobs started together cannot be told from one job); a job whose ranks had all met before
//     the claim goes on untouched (its ranks are fixed: the claimant cannot be one of them).
//     Ranks started by different launches (torchrun's MASTER_ADDR/MASTER_PORT/
//     TORCHELASTIC_RUN_ID, Slurm's job and step, ODC_JOB_ID) refuse each other at the join, so
//     two launched jobs never pair, whatever the timing;
//   - nothing stays named in /dev/shm once every rank has mapped it: the control blocks are
//     unlinked at the end of init (and allocation segments once mapped, shm_transport.cc), so a
//     job killed later (torchrun's SIGTERM) leaves no names. What a killed job can leave (names
//     of init, of an allocation or of a split group's init) records the pid that made it, and
//     every job's init on the host removes the names of dead processes (reclaim_debris);
//   - every wait is bounded by the timeout (infinite: forever) and ends early, naming the rank,
//     when a peer failed, closed or died.
// The shared-memory transport builds on the same blocks (its signal waits sleep on their futex
// words and check liveness through peer_status() and check_claim()).
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

  // The communicator a split group is made from (Communicator::split): its bootstrap and the
  // group's members as its ranks, in the group's order.
  struct SplitParent {
    Bootstrap* bootstrap = nullptr;
    std::vector<int> members;
  };

  // Collective: returns once every rank of `world_size` has joined `key` (or fails after
  // `timeout`, naming the missing rank; or at once when the key is held by a live job). `outer`:
  // the bootstrap the ranks agreed on `key` through, if any (an external one): every rank meets
  // there once its control block exists, so a rank that fails before (e.g. EMFILE) and marks
  // itself failed there is seen by its peers at once, not as a block that never appears.
  // `parent`: for a split group, the communicator it is split from: a member that failed, closed
  // or died there (e.g. after its colour record, before its block of the group exists) ends the
  // wait at once, naming it. Without a parent (a job's init), first removes what dead processes
  // left in /dev/shm (reclaim_debris). `launch`: the launch this process belongs to (ODC_JOB_ID
  // and the launcher's job variables, as core/comm_config.cc resolves them; "" for none): ranks
  // of two launches never pair on one key.
  static Result<std::shared_ptr<ShmBootstrap>> create(int rank, int world_size,
                                                      const std::string& key,
                                                      std::chrono::duration<double> timeout,
                                                      Bootstrap* outer = nullptr,
                                                      const SplitParent* parent = nullptr,
                                                      const std::string& launch = "");
  // Removes every odc name of this uid in /dev/shm that a dead process of this PID namespace
  // left (a job killed during init, an allocation or a split): allocation segments whose
  // creator (named in the segment's name) is dead, and dead ranks' control blocks of keys none
  // of whose named blocks has a live owner: a split group's at once, a job's once the dead
  // rank's own timeout has passed (until then a peer starting late learns that it died).
  // Returns how many names it removed.
  static int reclaim_debris();
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
  // The launch identity it was created with (create's `launch`).
  const std::string& launch() const { return launch_; }
  // "/odc.<key>.r<rank><suffix>": every shared-memory name of this job.
  std::string segment_name(int rank, const std::string& suffix) const;
  // The name of `rank`'s allocation segment `index`: "/odc.<key>.r<rank>.a<index>.p<pid>.n<pid
  // namespace>", so whoever finds it after its creator died removes it (reclaim_debris).
  std::string allocation_name(int rank, uint64_t index) const;
  // Records that this rank has named `count` allocation segments (".a0", ".a1", ...), so that
  // whoever finds it dead removes them.
  void note_allocations(uint64_t count);
  // Ok while `peer` lives and is open; otherwise a RemoteError naming it (failed: its reason;
  // closed; died: its pid, and what it left in /dev/shm is removed). Reads /proc: callers on a
  // hot path rate-limit it.
  Status peer_status(int peer) override;
  // Ok unless another process claimed this rank's slot of the key, or a rank of another launch
  // met this one (another job uses the key), before every rank of this job had met: then this
  // rank is marked failed and the error says so. Claims after the ranks met are dropped (the
  // claimant fails alone). One non-blocking syscall: callers on a hot path rate-limit it.
  Status check_claim();
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
  Status join(Bootstrap* outer, const SplitParent* parent);
  // Ok unless a member of the split group (this rank too) failed, closed or died in the
  // communicator the group is split from: then an error naming it.
  Status check_parent(const SplitParent& parent) const;
  // Binds this rank's claim; a live holder is told of this second claimant, and this fails.
  Status claim_rank();
  // Tells the holder of `peer`'s claim that its job collided with another (`reason`).
  void notify_collision(int peer, const std::string& reason) const;
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
  std::string launch_;
  uint64_t epoch_ = 0;                              // collectives entered so far
  std::vector<std::unique_ptr<Segment>> controls_;  // index = rank
  // The join failed because a peer runs in another PID namespace: this rank's (failed) block
  // stays named, so that peer learns why too (it removes the block; so does this rank's restart).
  bool leave_block_ = false;
  int foreign_peer_ = -1;  // that peer
  // After this rank marked itself failed: whether the foreign peer knows why already (its block
  // is failed too, or gone: both ranks saw each other at once). Then both blocks go now, this
  // rank's and the peer's, instead of both staying named for the next use of the key.
  bool foreign_peer_knows() const;
  int claim_fd_ = -1;      // this rank's claim (bound abstract socket), -1 before the claim
  std::string collision_;  // why the job collided with another, once check_claim found out
  // Every rank of the job had joined before this rank last read its claim socket: a later
  // claimant of a slot cannot be one of the job's ranks, so its claim fails alone.
  bool met_ = false;
  bool split_group_ = false;  // joins a split group (made with a SplitParent)
};

}  // namespace odc::shm
