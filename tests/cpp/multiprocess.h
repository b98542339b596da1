// Runs one function per rank in forked processes (one process per rank, as launchers do) and
// collects each rank's verdict. A child reports failure by returning a non-empty message; the
// parent kills every child still running at the deadline, so a test can never hang.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "odc/odc.h"

namespace odc::testing {

using RankBody = std::function<std::string(int rank, int world_size, const std::string& key)>;

inline std::string unique_key(const std::string& label) {
  static std::atomic<int> counter{0};
  return "t-" + label + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

// Per-rank outcome: "" on success, otherwise what went wrong.
inline std::vector<std::string> run_ranks(int world_size, const RankBody& body,
                                          std::chrono::seconds deadline = std::chrono::seconds(60),
                                          const std::string& key_label = "mp") {
  constexpr size_t kMessageBytes = 1024;
  const size_t bytes = kMessageBytes * static_cast<size_t>(world_size);
  auto* messages = static_cast<char*>(
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  std::memset(messages, 0, bytes);
  const std::string key = unique_key(key_label);
  std::vector<pid_t> pids;
  std::fflush(nullptr);  // children must not inherit (and re-print) buffered output
  for (int rank = 0; rank < world_size; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      std::string verdict = body(rank, world_size, key);
      if (verdict.empty()) verdict = "ok";
      std::strncpy(messages + rank * kMessageBytes, verdict.c_str(), kMessageBytes - 1);
      _exit(0);
    }
    pids.push_back(pid);
  }
  std::vector<std::string> outcome(static_cast<size_t>(world_size));
  std::vector<bool> done(static_cast<size_t>(world_size), false);
  const auto stop_at = std::chrono::steady_clock::now() + deadline;
  int remaining = world_size;
  while (remaining > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);  // reap whoever exits, so none lingers
    if (pid > 0) {
      for (int rank = 0; rank < world_size; ++rank) {
        if (pids[rank] != pid) continue;
        done[rank] = true;
        --remaining;
        const std::string message(messages + rank * kMessageBytes);
        if (message == "ok") {
          outcome[rank] = "";
        } else if (!message.empty()) {
          outcome[rank] = message;
        } else if (WIFSIGNALED(status)) {
          outcome[rank] = "killed by signal " + std::to_string(WTERMSIG(status));
        } else {
          outcome[rank] = "exited without a verdict";
        }
      }
      continue;
    }
    if (std::chrono::steady_clock::now() > stop_at) {
      for (int rank = 0; rank < world_size; ++rank) {
        if (done[rank]) continue;
        kill(pids[rank], SIGKILL);
        waitpid(pids[rank], nullptr, 0);
        outcome[rank] = "did not finish before the test deadline";
        --remaining;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  munmap(messages, bytes);
  return outcome;
}

}  // namespace odc::testing

// Inside a rank body: return a message when a C API call fails.
#define RANK_CHECK(call)                                                                 \
  do {                                                                                   \
    const odcResult_t rank_check_result = (call);                                        \
    if (rank_check_result != odcSuccess) {                                               \
      return std::string(#call) + " -> " + odcGetErrorString(rank_check_result) + ": " + \
             odcGetLastError();                                                          \
    }                                                                                    \
  } while (0)

// Inside a rank body: return a message when a condition does not hold.
#define RANK_EXPECT(condition, message)                                                \
  do {                                                                                 \
    if (!(condition)) return std::string("expected ") + #condition + ": " + (message); \
  } while (0)
