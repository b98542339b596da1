// In-memory transport: the ranks are threads of one process sharing a MemWorld. Gets and puts are
// memcpy; signals are slots written under the owner's mutex, so waits sleep on condition
// variables instead of spinning (256 ranks run on 2 cores). Collectives meet in one central
// barrier. Used to test the protocol at scale and under injected faults (fault_transport.h).
// Invariant: memory of every region lives as long as the world, so a rank that "dies" leaves
// memory its peers may still write, as a dead process's mapped memory would be.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/transport.h"

namespace odc::mem {

struct MemOptions {
  // Offer an atomic remote fp32 add (emulated under the owner's lock), so that the core's
  // remote-add scheme runs too.
  bool remote_fp32_add = false;
  // Report caps().stream_ordered (calls still complete on return), so that the core takes the
  // paths of device transports (the streamed scheme's device steps, whose fold this transport
  // emulates on the host; the destroy barrier) and tests run them.
  bool stream_ordered = false;
  // Pretend nodes of this many consecutive ranks (the transport's topology report); 0: one node.
  int ranks_per_node = 0;
  std::chrono::duration<double> timeout{30.0};
};

class MemWorld : public std::enable_shared_from_this<MemWorld> {
 public:
  static std::shared_ptr<MemWorld> create(int world_size, MemOptions options);
  int world_size() const { return world_size_; }
  const MemOptions& options() const { return options_; }
  // The transport of `rank`; each rank joins once.
  std::unique_ptr<Transport> join(int rank);
  // Simulates the death of `rank`: its peers' waits end with "rank R died", in this world and in
  // every split world it is a member of (as a dead process is dead in every group).
  void kill(int rank);
  // The world of a split group (Transport::split): made by the first member to ask, found by the
  // others under the group's name; its own memory, collectives and mailboxes, this world's
  // options and node keys. Members already dead here are dead there.
  std::shared_ptr<MemWorld> split_world(const SplitGroup& group);
  // The node key the transport reports for `rank`.
  uint64_t node_key(int rank) const;

 private:
  friend class MemTransport;
  enum class RankStatus { kAlive, kFailed, kDead, kClosed };
  struct Mailbox {  // signal slots of one rank are written under its mutex
    std::mutex mutex;
    std::condition_variable wake;
    // poll_signals() sleeping on `wake`: per watched region (its slots here), the value each
    // writer's slot must reach to wake it on its own, or to count towards the all-condition
    // (UINT64_MAX: not watched); and how many of the all-condition's slots are still short.
    struct Polled {
      const uint64_t* slots;
      std::vector<uint64_t> any_at;
      std::vector<uint64_t> all_at;
    };
    // The first num_polled entries are live; the rest keep their vectors for the next wait (a wait
    // of a large world would otherwise allocate two world-sized vectors per watched region).
    std::vector<Polled> polled;
    size_t num_polled = 0;
    size_t all_missing = 0;
  };

  MemWorld(int world_size, MemOptions options);
  // The central barrier: every rank calls it with the same op; `mine`/`all` exchange records.
  Status collective(int rank, CollectiveOp op, const ExchangeRecord* mine,
                    std::vector<ExchangeRecord>* all);
  void set_status(int rank, RankStatus status, const std::string& reason);
  // The failure of `peer` as seen by a waiter, or Ok while it is alive. Requires mutex_.
  Status peer_failure_locked(int peer) const;
  Status peer_failure(int peer);
  void* allocate_bytes(size_t bytes);
  // Split worlds: every rank's node key (its node key in the world it was split from).
  std::vector<uint64_t> node_keys_;
  // Split worlds by group name: held until every member has joined (a member that is quick to
  // destroy its transport must not end the world before a slow one finds it), then followed
  // only to pass deaths on.
  struct SplitWorld {
    std::shared_ptr<MemWorld> joining;
    std::weak_ptr<MemWorld> world;
    std::vector<int> members;
    size_t num_joined = 0;
  };
  std::map<std::string, SplitWorld> split_worlds_;  // under mutex_

  const int world_size_;
  const MemOptions options_;
  std::atomic<int> num_not_alive_{0};  // ranks failed, dead or closed: waiters look only then
  std::mutex mutex_;                   // collective state, statuses, allocations
  std::condition_variable collective_done_;
  uint64_t generation_ = 0;  // collectives completed
  int num_arrived_ = 0;
  CollectiveOp op_ = CollectiveOp::kInit;
  int op_rank_ = -1;                  // the first rank to arrive at the current collective
  std::vector<uint64_t> arrived_at_;  // per rank: generation + 1 of its last arrival
  std::vector<CollectiveOp> last_op_;
  std::vector<ExchangeRecord> arriving_, completed_;
  std::vector<RankStatus> status_;
  std::vector<std::string> reason_;
  std::vector<std::unique_ptr<Mailbox>> mailboxes_;
  struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
  };
  std::vector<std::unique_ptr<void, FreeDeleter>> memory_;
};

}  // namespace odc::mem
