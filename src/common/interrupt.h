// Ending host waits on other ranks from outside: every loop that waits for a peer calls
// poll_interrupt() between its sleeps (which last at most kInterruptPollInterval). It ends the wait
// when the call's communicator is being destroyed by another thread (the call scope's flag), or
// when the caller's interrupt check (odcSetInterruptCheck; Python wires it to its signal handlers,
// so Ctrl-C reaches a rank waiting with an infinite timeout) says so. Invariant: a wait that polls
// ends within about kInterruptPollInterval of either event, with a Status the communicator treats
// as a fault (it is failed, so peers name this rank).
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>

#include "common/status.h"

namespace odc {

// Longest sleep of a wait loop between two polls, and least time between two calls of the check.
inline constexpr auto kInterruptPollInterval = std::chrono::milliseconds(20);

using InterruptCheck = int (*)(void* ctx);

struct InterruptHook {
  std::mutex mutex;
  InterruptCheck check = nullptr;
  void* ctx = nullptr;
};

inline InterruptHook& interrupt_hook() {
  static InterruptHook hook;
  return hook;
}

inline void set_interrupt_check(InterruptCheck check, void* ctx) {
  InterruptHook& hook = interrupt_hook();
  std::lock_guard<std::mutex> lock(hook.mutex);
  hook.check = check;
  hook.ctx = ctx;
}

// The flag of the communicator the calling thread is inside a call of (set by the C API for the
// call's duration): true once another thread destroys that communicator.
inline thread_local const std::atomic<bool>* current_call_closing = nullptr;

class CallScope {
 public:
  explicit CallScope(const std::atomic<bool>* closing) : saved_(current_call_closing) {
    current_call_closing = closing;
  }
  ~CallScope() { current_call_closing = saved_; }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

 private:
  const std::atomic<bool>* saved_;
};

// The caller's check, now (not rate-limited): Ok, or Interrupted naming `what`.
inline Status check_interrupt_now(const std::string& what) {
  InterruptCheck check;
  void* ctx;
  {
    InterruptHook& hook = interrupt_hook();
    std::lock_guard<std::mutex> lock(hook.mutex);
    check = hook.check;
    ctx = hook.ctx;
  }
  if (check != nullptr && check(ctx) != 0) {
    return Status::Interrupted("interrupted (the caller's interrupt check, e.g. Ctrl-C) while " +
                               what);
  }
  return Status::Ok();
}

// Ok, or an Interrupted status saying why the wait (`what`, e.g. "waiting for rank 1") ends. Cheap:
// the caller's check runs at most every kInterruptPollInterval per thread.
inline Status poll_interrupt(const std::string& what) {
  if (current_call_closing != nullptr && current_call_closing->load(std::memory_order_acquire)) {
    return Status::Interrupted(
        "the communicator was destroyed (odcCommDestroy; Python: close()) by another thread "
        "while this call was " +
        what);
  }
  thread_local auto next_check = std::chrono::steady_clock::time_point{};
  const auto now = std::chrono::steady_clock::now();
  if (now < next_check) return Status::Ok();
  next_check = now + kInterruptPollInterval;
  return check_interrupt_now(what);
}

}  // namespace odc
