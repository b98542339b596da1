// The process's progress thread for host-streamed communicators (see host_progress.h).
#include "core/host_progress.h"

#include <pthread.h>

#include <algorithm>

namespace odc {
namespace {

HostProgress* current = nullptr;
std::once_flag registered_fork_handler;

}  // namespace

HostProgress& HostProgress::instance() {
  std::call_once(registered_fork_handler, [] {
    current = new HostProgress();  // never destroyed: a process may exit with clients alive
    // A forked child has no progress thread and must not touch its parent's clients (the C API
    // refuses a forked child's use of them): it starts from a fresh, empty instance; the parent's
    // copy (whose mutex another thread may have held at the fork) is left untouched.
    ::pthread_atfork(nullptr, nullptr, [] { current = new HostProgress(); });
  });
  return *current;
}

void HostProgress::add(ProgressClient* client) {
  std::lock_guard<std::mutex> lock(mutex_);
  clients_.push_back(client);
  if (!thread_.joinable()) thread_ = std::thread([this, round = round_] { run(round); });
}

void HostProgress::remove(ProgressClient* client) {
  std::thread stopping;
  {
    // Taken only between two passes of the thread over the clients: past it, none touches this.
    std::lock_guard<std::mutex> lock(mutex_);
    clients_.erase(std::remove(clients_.begin(), clients_.end(), client), clients_.end());
    if (!clients_.empty() || !thread_.joinable()) return;
    // The last client left: this round's thread ends (a client added meanwhile starts the next).
    ++round_;
    stopping = std::move(thread_);
  }
  changed_.notify_all();
  stopping.join();
}

void HostProgress::wake() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    woken_ = true;
  }
  changed_.notify_all();
}

void HostProgress::run(uint64_t round) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto ended = [&] { return round_ != round; };
  while (!ended()) {
    bool open = false;
    for (ProgressClient* client : clients_) {
      open = client->serve_waiting_senders() || open;
    }
    if (open) {
      changed_.wait_for(lock, kTick, ended);
    } else {
      // No minibatch open anywhere: nothing can wait on this process until one opens.
      changed_.wait(lock, [&] { return ended() || woken_; });
    }
    woken_ = false;
  }
}

}  // namespace odc
