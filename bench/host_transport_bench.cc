// Host transport bandwidth: gather and scatter-accumulate through the C API, one forked process
// per rank, against a single-process memcpy / fp32 add loop over the same bytes; and whole
// minibatches (begin, one push, end), where every scheme has moved and added all its bytes.
// Usage: odc_host_bench [max_mib=256] [ranks=2,4]
// Sizes are per-rank totals: the gathered output (world x shard) and the pushed source. The
// scatter column times pushes inside one open minibatch: the streamed scheme moves the bytes
// there, the deterministic (pulled) one only sums locally and moves them at minibatch_end (its
// end_ms), so only minibatch_us compares the two.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/fork_ranks.h"
#include "odc/odc.h"

namespace {

using Clock = std::chrono::steady_clock;

int iterations_for(size_t bytes) {
  const size_t target = size_t{1} << 30;  // ~1 GiB moved per measurement
  return static_cast<int>(std::max<size_t>(3, std::min<size_t>(200, target / bytes)));
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Single-process reference: memcpy and an fp32 add loop over `bytes`.
void reference(size_t bytes, double& copy_gbps, double& add_gbps) {
  std::vector<float> a(bytes / 4, 1.0f), b(bytes / 4, 0.0f);
  const int iterations = iterations_for(bytes);
  std::memcpy(b.data(), a.data(), bytes);
  auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) std::memcpy(b.data(), a.data(), bytes);
  copy_gbps = bytes * iterations / seconds_since(start) / 1e9;
  start = Clock::now();
  for (int i = 0; i < iterations; ++i) {
    for (size_t j = 0; j < a.size(); ++j) b[j] += a[j];
  }
  add_gbps = bytes * iterations / seconds_since(start) / 1e9;
  if (b[0] < 0) std::printf("impossible\n");  // keep the loop
}

#define BENCH_CHECK(call)                                                \
  do {                                                                   \
    if ((call) != odcSuccess) {                                          \
      std::fprintf(stderr, "%s failed: %s\n", #call, odcGetLastError()); \
      _exit(1);                                                          \
    }                                                                    \
  } while (0)

// One rank: measures gather and scatter-accumulate for every size; rank 0 prints.
void run_rank(int rank, int world, const std::string& key, size_t max_bytes) {
  odcComm_t comm;
  BENCH_CHECK(odcCommInit(&comm, rank, world, key.c_str(), 120.0));
  for (size_t bytes = size_t{1} << 20; bytes <= max_bytes; bytes *= 4) {
    const size_t shard = bytes / 4 / world;  // fp32 elements per rank
    odcBuffer_t params, accumulator;
    void* params_local;
    void* accumulator_local;
    BENCH_CHECK(odcBufferAlloc(comm, shard, odcFloat32, 0, &params, &params_local));
    BENCH_CHECK(odcBufferAlloc(comm, shard, odcFloat32, 1, &accumulator, &accumulator_local));
    std::vector<float> full(world * shard, 1.0f);
    const int iterations = iterations_for(bytes);

    BENCH_CHECK(odcGather(comm, full.data(), full.size(), params, nullptr));  // warm-up
    BENCH_CHECK(odcBarrier(comm, nullptr));
    auto start = Clock::now();
    for (int i = 0; i < iterations; ++i) {
      BENCH_CHECK(odcGather(comm, full.data(), full.size(), params, nullptr));
    }
    BENCH_CHECK(odcBarrier(comm, nullptr));
    const double gather_s = seconds_since(start) / iterations;

    BENCH_CHECK(odcMinibatchBegin(comm, nullptr));
    BENCH_CHECK(
        odcScatterAccumulate(comm, full.data(), full.size(), odcFloat32, accumulator, nullptr));
    BENCH_CHECK(odcBarrier(comm, nullptr));
    start = Clock::now();
    for (int i = 0; i < iterations; ++i) {
      BENCH_CHECK(
          odcScatterAccumulate(comm, full.data(), full.size(), odcFloat32, accumulator, nullptr));
    }
    BENCH_CHECK(odcBarrier(comm, nullptr));
    const double scatter_s = seconds_since(start) / iterations;
    start = Clock::now();
    BENCH_CHECK(odcMinibatchEnd(comm, nullptr));
    const double end_s = seconds_since(start);

    const int minibatches = std::max(3, iterations / 4);
    for (int i = 0; i < 3; ++i) {  // warm-up
      BENCH_CHECK(odcMinibatchBegin(comm, nullptr));
      BENCH_CHECK(
          odcScatterAccumulate(comm, full.data(), full.size(), odcFloat32, accumulator, nullptr));
      BENCH_CHECK(odcMinibatchEnd(comm, nullptr));
    }
    start = Clock::now();
    for (int i = 0; i < minibatches; ++i) {
      BENCH_CHECK(odcMinibatchBegin(comm, nullptr));
      BENCH_CHECK(
          odcScatterAccumulate(comm, full.data(), full.size(), odcFloat32, accumulator, nullptr));
      BENCH_CHECK(odcMinibatchEnd(comm, nullptr));
    }
    const double minibatch_s = seconds_since(start) / minibatches;

    if (rank == 0) {
      double copy_gbps = 0, add_gbps = 0;
      reference(bytes, copy_gbps, add_gbps);
      std::printf("%5d %9zu %12.1f %10.2f %10.2f %14.1f %10.2f %10.2f %10.1f %13.1f\n", world,
                  bytes >> 20, gather_s * 1e6, bytes / gather_s / 1e9, copy_gbps, scatter_s * 1e6,
                  bytes / scatter_s / 1e9, add_gbps, end_s * 1e3, minibatch_s * 1e6);
      std::fflush(stdout);
    }
    BENCH_CHECK(odcBarrier(comm, nullptr));
    BENCH_CHECK(odcBufferFree(comm, params));
    BENCH_CHECK(odcBufferFree(comm, accumulator));
  }
  BENCH_CHECK(odcCommDestroy(comm));
}

}  // namespace

int main(int argc, char** argv) {
  const size_t max_mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256;
  std::vector<int> worlds = {2, 4};
  if (argc > 2) worlds = {std::atoi(argv[2])};
  std::printf("%5s %9s %12s %10s %10s %14s %10s %10s %10s %13s\n", "ranks", "size_MiB", "gather_us",
              "gather_GBs", "memcpy_GBs", "scatter_acc_us", "scatter_GBs", "add_GBs", "end_ms",
              "minibatch_us");
  for (int world : worlds) {
    const std::string key = "bench-" + std::to_string(getpid()) + "-" + std::to_string(world);
    const int failures = odc::fork_ranks(world, [&](int rank) {
      run_rank(rank, world, key, max_mib << 20);
      return 0;
    });
    if (failures) {
      std::fprintf(stderr, "%d rank(s) failed\n", failures);
      return 1;
    }
  }
  return 0;
}
