// What the protocol suites (protocol_test.cc, split_comm_test.cc) share: the accumulation
// schemes, the in-memory world and communicator options that make the core pick each, and threads
// as ranks, each returning its verdict ("" = ok) so a failing rank is named, never a hang.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/communicator.h"
#include "transport/mem/mem_transport.h"

// How much slower the sanitizer builds (scripts/sanitize.sh) run the threads-as-ranks tests, so
// that a suite scales its largest runs down by it: ThreadSanitizer ~10x (and it tracks at most a
// few thousand threads' histories), AddressSanitizer ~3x; 1 in the Release build.
#if defined(__SANITIZE_THREAD__)
#define ODC_HARNESS_SANITIZER_DIVISOR 10
#elif defined(__SANITIZE_ADDRESS__)
#define ODC_HARNESS_SANITIZER_DIVISOR 4
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ODC_HARNESS_SANITIZER_DIVISOR 10
#elif __has_feature(address_sanitizer)
#define ODC_HARNESS_SANITIZER_DIVISOR 4
#endif
#endif
#ifndef ODC_HARNESS_SANITIZER_DIVISOR
#define ODC_HARNESS_SANITIZER_DIVISOR 1
#endif

namespace odc::testing {

inline constexpr int kSanitizerDivisor = ODC_HARNESS_SANITIZER_DIVISOR;

// The accumulation schemes: streamed (no remote add) with the host's steps, streamed with the
// device's steps (reported stream-ordered as device transports are:
// core/device_streamed_staging.h, its fold emulated by the in-memory transport), remote add,
// pulled (deterministic).
enum class Scheme { kStreamed, kStreamedDevice, kRemoteAdd, kPulled };

inline constexpr Scheme kAllSchemes[] = {Scheme::kStreamed, Scheme::kStreamedDevice,
                                         Scheme::kRemoteAdd, Scheme::kPulled};

inline const char* scheme_label(Scheme scheme) {
  switch (scheme) {
    case Scheme::kStreamed:
      return "streamed";
    case Scheme::kStreamedDevice:
      return "streamed-device";
    case Scheme::kRemoteAdd:
      return "remote-add";
    case Scheme::kPulled:
      return "pulled";
  }
  return "?";
}

// The name scheme_name() gives it, where it differs from its label.
inline const char* scheme_name_of(Scheme scheme) {
  return scheme == Scheme::kStreamedDevice ? "streamed" : nullptr;
}

// Whether the core picked `scheme` for `comm`.
inline bool is_scheme(const Communicator& comm, Scheme scheme) {
  const char* want =
      scheme_name_of(scheme) != nullptr ? scheme_name_of(scheme) : scheme_label(scheme);
  return std::string(scheme_name(comm.scheme())) == want;
}

// A small staging budget: rings of six 320-byte slots (and five signal words per peer), so that
// the rings wrap many times and senders wait for credit, and 256 ranks' rings fit in memory.
inline size_t test_staging_bytes(int world) {
  return static_cast<size_t>(world) * (6 * 320 + 40);
}

inline mem::MemOptions mem_options_for(Scheme scheme, double timeout_s, int ranks_per_node = 0) {
  mem::MemOptions options;
  options.remote_fp32_add = scheme == Scheme::kRemoteAdd;
  options.stream_ordered = scheme == Scheme::kStreamedDevice;
  options.ranks_per_node = ranks_per_node;
  options.timeout = std::chrono::duration<double>(timeout_s);
  return options;
}

// With pretend nodes: node-aggregated pushes (streamed schemes) with room for every accumulator.
inline CommOptions comm_options_for(Scheme scheme, int world, size_t staging_bytes = 0,
                                    bool aggregate = false) {
  CommOptions options;
  options.deterministic = scheme == Scheme::kPulled;
  options.staging_bytes = staging_bytes != 0 ? staging_bytes : test_staging_bytes(world);
  options.node_aggregation_bytes = aggregate ? size_t{16} << 20 : 0;
  return options;
}

// Runs `body(rank)` on one thread per rank; returns each rank's verdict ("" = ok).
inline std::vector<std::string> run_threads(int world,
                                            const std::function<std::string(int)>& body) {
  std::vector<std::string> outcome(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] { outcome[static_cast<size_t>(rank)] = body(rank); });
  }
  for (auto& thread : threads) thread.join();
  return outcome;
}

// The ranks that failed, one line each ("rank R: verdict"); "" when every rank passed.
inline std::string describe(const std::vector<std::string>& outcome) {
  std::string text;
  for (size_t r = 0; r < outcome.size(); ++r) {
    if (!outcome[r].empty()) text += "rank " + std::to_string(r) + ": " + outcome[r] + "\n";
  }
  return text;
}

}  // namespace odc::testing
