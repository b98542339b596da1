// One forked process per rank, for the benchmark and smoke programs that play a whole local job
// (the way torchrun starts one process per GPU). No CUDA context may exist in the caller before
// it forks.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <vector>

namespace odc {

// Runs `body(rank)` in `world_size` child processes; a child's exit status is body's return value.
// Returns how many ranks failed (non-zero status or killed).
inline int fork_ranks(int world_size, const std::function<int(int rank)>& body) {
  std::fflush(nullptr);  // children must not inherit (and re-print) buffered output
  std::vector<pid_t> children;
  for (int rank = 0; rank < world_size; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) _exit(body(rank));
    if (pid < 0) {
      std::perror("fork");
      return world_size - rank;
    }
    children.push_back(pid);
  }
  int failures = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    failures += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  return failures;
}

}  // namespace odc
