// The progress rule on host transports (design.md): a push never waits on an owner that is
// blocked elsewhere. A streamed sender whose ring at an owner is full waits for that owner's
// folds, and an owner folds only inside its own calls of that communicator; an owner blocked in a
// sub-communicator's barrier, a second communicator, a torch collective or its own computation
// would hold the sender hostage, whatever the staging budget. HostProgress is one helper thread
// per process that serves every live host-streamed communicator whose caller is not inside it:
// it takes the communicator's lock without waiting (never while a call of it runs), folds for the
// senders that raised their hunger there, and returns their credit. Invariants:
//   - a client is served only under its own lock, so the thread and the client's calls never run
//     its protocol at the same time; the thread never blocks on a client (try-lock);
//   - it looks at clients only while one of them has a minibatch open (every kTick), and sleeps
//     otherwise; it serves only hungry senders, so a rank inside odc folds as before;
//   - remove() returns only once the thread no longer touches the client.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace odc {

// What the progress thread serves (a Communicator with host-streamed staging).
class ProgressClient {
 public:
  // Never blocks: unless a call of this client runs, folds for the senders hungry here and returns
  // their credit. False when no minibatch is open (nothing can wait on it until one opens).
  virtual bool serve_waiting_senders() = 0;

 protected:
  ~ProgressClient() = default;
};

class HostProgress {
 public:
  // Between two looks at the clients while a minibatch is open: how long a sender whose owner is
  // outside odc waits for the owner's fold at most (plus the fold).
  static constexpr std::chrono::milliseconds kTick{1};

  // The process's progress thread (started with the first client, stopped with the last).
  static HostProgress& instance();

  void add(ProgressClient* client);
  // Returns once the thread no longer touches `client`.
  void remove(ProgressClient* client);
  // A client opened a minibatch: look at the clients from now on.
  void wake();

 private:
  HostProgress() = default;
  // The thread of round `round`: serves until the round ends (its last client left).
  void run(uint64_t round);

  std::mutex mutex_;  // guards everything below
  std::condition_variable changed_;
  std::vector<ProgressClient*> clients_;
  bool woken_ = false;
  uint64_t round_ = 0;  // a thread serves while its round is the current one
  std::thread thread_;  // this round's (none before the first client)
};

}  // namespace odc
