// The progress rule (design.md): a push never waits on an owner that is blocked elsewhere. A
// streamed sender whose ring at an owner is full waits for that owner's folds, and an owner folds
// only inside its own calls of that communicator (host transports) or in the fold kernels those
// calls enqueue on its stream (device transports). An owner blocked in a sub-communicator's
// barrier, a second communicator, a torch collective or its own computation (or whose stream is
// blocked in a collective or a long kernel) would hold the sender hostage, whatever the budget.
// HostProgress is one helper thread per process that serves every live streamed communicator:
// StreamedStaging::progress(). Host staging: only while no call of the communicator runs (it
// takes the call lock without waiting), a fold for the senders that raised their hunger there.
// Device staging: under the staging's own lock (the host may sit in a push call as long as its
// stream is blocked), one pass of the fold kernel enqueued on the transport's background stream
// (never two at once), which runs beside whatever the caller's stream waits in. Invariants:
//   - the thread never blocks on a client (try-locks, short critical sections);
//   - it looks at the clients every kTick while one of them has a minibatch open, and sleeps
//     otherwise;
//   - remove() returns only once the thread no longer touches the client.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace odc {

// What the progress thread serves (a Communicator with streamed staging).
class ProgressClient {
 public:
  // Never blocks: lets the senders waiting on this client progress. False when no minibatch is
  // open for it (nothing can wait on it until one opens).
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
