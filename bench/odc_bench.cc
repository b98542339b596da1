// odc-bench: ODC's one-sided gather and scatter-accumulate against NCCL's all-gather and
// reduce-scatter, one process per GPU (forked here), nccl-tests style. Every ODC result is
// checked against NCCL's output. Gather is also timed one rank at a time (the others wait), the
// out-of-step pattern of ODC training that a collective cannot follow, and inside minibatches
// (kGathersPerMinibatch gathers between begin and end, as a layer is gathered in forward and
// backward: where the core's node cache fetches other nodes' shards once per node).
// Usage: odc_bench [--transport cuda|nvshmem] [--deterministic] [min_mib=1] [max_mib=1024]
//                  [ranks=all GPUs]
// Sizes are per-rank bytes: the gathered output (bf16) and the pushed source (fp32).
// --transport nvshmem: ODC over NVSHMEM (streamed pushes: chunks through bounded rings, folded
// by the owner's device).
// --deterministic: the pulled scheme on any transport (the CUDA transport's atomics off), so
// transports compare on the same protocol.
// ODC_BENCH_STATS=1: each rank also prints, per size, the streamed chunks it sent during the
// back-to-back pushes and how often they waited for their owner's credit (flow control engaged:
// the owner's folds did not keep up), read outside the timed loop.
// ODC_BENCH_LINK_GBS=G: the links' GB/s per direction per GPU that the odc/link and nccl/link
// columns divide by (default: nominal NVLink 4, kNominalLinkGBs).
#include <cuda_runtime.h>
#include <nccl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/fork_ranks.h"
#include "odc/odc.h"

namespace {

// The links' nominal bandwidth per direction per GPU: NVLink 4 (H100 / H200 SXM), 18 links of
// 25 GB/s. ODC_BENCH_LINK_GBS overrides it for other machines. A column can pass 100%: such a
// machine's links carried about 478 GB/s per direction per GPU (docs/design.md, "Measuring").
constexpr double kNominalLinkGBs = 450.0;

#define BENCH_CUDA(call)                                                         \
  do {                                                                           \
    const cudaError_t bench_error_ = (call);                                     \
    if (bench_error_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(bench_error_)); \
      _exit(1);                                                                  \
    }                                                                            \
  } while (0)
#define BENCH_NCCL(call)                                                         \
  do {                                                                           \
    const ncclResult_t bench_error_ = (call);                                    \
    if (bench_error_ != ncclSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, ncclGetErrorString(bench_error_)); \
      _exit(1);                                                                  \
    }                                                                            \
  } while (0)
#define BENCH_ODC(call)                                           \
  do {                                                            \
    if ((call) != odcSuccess) {                                   \
      std::fprintf(stderr, "%s: %s\n", #call, odcGetLastError()); \
      _exit(1);                                                   \
    }                                                             \
  } while (0)

// Per size and rank, written by the children into shared memory; rank 0 prints the slowest rank.
struct Measurement {
  double odc_us;
  double nccl_us;
  int mismatches;
};

// Gathers of one buffer per minibatch in the minibatch table (a layer gathered in forward and
// again in backward, for two microbatches).
constexpr int kGathersPerMinibatch = 4;

int iterations_for(size_t bytes) {
  return bytes <= (64u << 20) ? 20 : (bytes <= (256u << 20) ? 10 : 5);
}

// Times `iterations` calls of `op` on `stream`, after `warmup` untimed ones; microseconds per call.
template <typename Op>
double time_on_stream(cudaStream_t stream, int iterations, Op&& op) {
  for (int i = 0; i < 3; ++i) op();
  BENCH_CUDA(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  BENCH_CUDA(cudaEventRecord(start, stream));
  for (int i = 0; i < iterations; ++i) op();
  BENCH_CUDA(cudaEventRecord(stop, stream));
  BENCH_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 1000.0 * ms / iterations;
}

void run_rank(int rank, int world, const std::string& key, odcTransport_t transport,
              bool deterministic, const ncclUniqueId& id, const std::vector<size_t>& sizes,
              Measurement* gather_table, Measurement* solo_table, Measurement* window_table,
              Measurement* scatter_table, Measurement* push_table) {
  BENCH_CUDA(cudaSetDevice(rank));
  odcComm_t comm;
  odcCommConfig_t config = ODC_COMM_CONFIG_INIT;
  BENCH_ODC(odcCommConfigInit(&config));
  config.transport = transport;
  config.key = key.c_str();
  config.timeout_seconds = 120.0;
  config.device = rank;
  config.deterministic = deterministic ? 1 : 0;
  BENCH_ODC(odcCommInitConfig(&comm, rank, world, &config));
  ncclComm_t nccl;
  BENCH_NCCL(ncclCommInitRank(&nccl, world, id, rank));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const char* stats_env = std::getenv("ODC_BENCH_STATS");
  const bool stats = stats_env != nullptr && std::strcmp(stats_env, "1") == 0;

  for (size_t s = 0; s < sizes.size(); ++s) {
    const size_t bytes = sizes[s];
    const int iterations = iterations_for(bytes);
    const auto sync_all = [&] {
      BENCH_CUDA(cudaStreamSynchronize(stream));
      BENCH_ODC(odcBarrier(comm, stream));
      BENCH_CUDA(cudaStreamSynchronize(stream));
    };

    // gather (bf16) vs ncclAllGather
    {
      const size_t shard = bytes / 2 / world;
      odcBuffer_t params;
      void* local;
      // Published (rewritten only between minibatches), as odc.torch's parameters: gathers
      // inside a minibatch may come from a node's copy (NVSHMEM's hierarchical gathers).
      BENCH_ODC(odcBufferAllocKind(comm, shard, odcBfloat16, odcBufferPublished, "params", &params,
                                   &local));
      std::vector<uint16_t> host(shard);
      for (size_t i = 0; i < shard; ++i) host[i] = static_cast<uint16_t>(rank * 7919 + i);
      BENCH_CUDA(cudaMemcpy(local, host.data(), shard * 2, cudaMemcpyHostToDevice));
      void *out_odc, *out_nccl;
      BENCH_CUDA(cudaMalloc(&out_odc, shard * 2 * world));
      BENCH_CUDA(cudaMalloc(&out_nccl, shard * 2 * world));
      sync_all();
      const double odc_us = time_on_stream(stream, iterations, [&] {
        BENCH_ODC(odcGather(comm, out_odc, shard * world, params, stream));
      });
      sync_all();
      const double nccl_us = time_on_stream(stream, iterations, [&] {
        BENCH_NCCL(ncclAllGather(local, out_nccl, shard, ncclBfloat16, nccl, stream));
      });
      std::vector<uint16_t> a(shard * world), b(shard * world);
      BENCH_CUDA(cudaMemcpy(a.data(), out_odc, a.size() * 2, cudaMemcpyDeviceToHost));
      BENCH_CUDA(cudaMemcpy(b.data(), out_nccl, b.size() * 2, cudaMemcpyDeviceToHost));
      int mismatches = 0;
      for (size_t i = 0; i < a.size(); ++i) mismatches += a[i] != b[i];
      gather_table[s * world + rank] = {odc_us, nccl_us, mismatches};
      // One rank gathers while the others wait in a barrier: how ODC's pulls run when ranks
      // are out of step (training with uneven microbatches), which no collective can do.
      double solo_us = 0;
      for (int turn = 0; turn < world; ++turn) {
        sync_all();
        if (turn == rank) {
          BENCH_CUDA(cudaMemset(out_odc, 0, shard * 2 * world));
          solo_us = time_on_stream(stream, iterations, [&] {
            BENCH_ODC(odcGather(comm, out_odc, shard * world, params, stream));
          });
        }
      }
      sync_all();
      BENCH_CUDA(cudaMemcpy(a.data(), out_odc, a.size() * 2, cudaMemcpyDeviceToHost));
      int solo_mismatches = 0;
      for (size_t i = 0; i < a.size(); ++i) solo_mismatches += a[i] != b[i];
      solo_table[s * world + rank] = {solo_us, nccl_us, solo_mismatches};
      // Inside minibatches: begin, kGathersPerMinibatch gathers, end (no accumulators), per
      // gather; against as many all-gathers.
      sync_all();
      BENCH_CUDA(cudaMemset(out_odc, 0, shard * 2 * world));
      const int minibatches = std::max(2, iterations / kGathersPerMinibatch);
      const double window_us = time_on_stream(stream, minibatches, [&] {
        BENCH_ODC(odcMinibatchBegin(comm, stream));
        for (int g = 0; g < kGathersPerMinibatch; ++g) {
          BENCH_ODC(odcGather(comm, out_odc, shard * world, params, stream));
        }
        BENCH_ODC(odcMinibatchEnd(comm, stream));
      });
      sync_all();
      const double nccl_window_us = time_on_stream(stream, minibatches, [&] {
        for (int g = 0; g < kGathersPerMinibatch; ++g) {
          BENCH_NCCL(ncclAllGather(local, out_nccl, shard, ncclBfloat16, nccl, stream));
        }
      });
      BENCH_CUDA(cudaMemcpy(a.data(), out_odc, a.size() * 2, cudaMemcpyDeviceToHost));
      int window_mismatches = 0;
      for (size_t i = 0; i < a.size(); ++i) window_mismatches += a[i] != b[i];
      window_table[s * world + rank] = {window_us / kGathersPerMinibatch,
                                        nccl_window_us / kGathersPerMinibatch, window_mismatches};
      sync_all();
      BENCH_ODC(odcBufferFree(comm, params));
      cudaFree(out_odc);
      cudaFree(out_nccl);
    }

    // scatter-accumulate (fp32 source, fp32 accumulator) vs ncclReduceScatter
    {
      const size_t shard = bytes / 4 / world;
      odcBuffer_t accumulator;
      void* local;
      BENCH_ODC(odcBufferAlloc(comm, shard, odcFloat32, 1, &accumulator, &local));
      std::vector<float> host(shard * world);
      for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>((i + rank) % 13);
      void *src, *out_nccl;
      BENCH_CUDA(cudaMalloc(&src, shard * 4 * world));
      BENCH_CUDA(cudaMalloc(&out_nccl, shard * 4));
      BENCH_CUDA(cudaMemcpy(src, host.data(), shard * 4 * world, cudaMemcpyHostToDevice));
      sync_all();
      // One push per minibatch, so the timed op includes the minibatch barriers that make the
      // sums final: the fair counterpart of one synchronizing reduce-scatter.
      const double odc_us = time_on_stream(stream, iterations, [&] {
        BENCH_ODC(odcMinibatchBegin(comm, stream));
        BENCH_ODC(odcScatterAccumulate(comm, src, shard * world, odcFloat32, accumulator, stream));
        BENCH_ODC(odcMinibatchEnd(comm, stream));
      });
      sync_all();
      const double nccl_us = time_on_stream(stream, iterations, [&] {
        BENCH_NCCL(ncclReduceScatter(src, out_nccl, shard, ncclFloat32, ncclSum, nccl, stream));
      });
      sync_all();
      // The pattern of training: many pushes into one open minibatch, one end barrier.
      BENCH_ODC(odcMinibatchBegin(comm, stream));
      uint64_t chunks_before = 0, waits_before = 0;
      if (stats) BENCH_ODC(odcCommGetStreamStats(comm, &chunks_before, &waits_before));
      const double push_us = time_on_stream(stream, iterations, [&] {
        BENCH_ODC(odcScatterAccumulate(comm, src, shard * world, odcFloat32, accumulator, stream));
      });
      BENCH_ODC(odcMinibatchEnd(comm, stream));
      if (stats) {
        BENCH_CUDA(cudaStreamSynchronize(stream));
        uint64_t chunks = 0, waits = 0;
        BENCH_ODC(odcCommGetStreamStats(comm, &chunks, &waits));
        std::fprintf(stderr,
                     "odc_bench stats rank %d %zu MiB: back-to-back pushes (%d + 3 warm-up): "
                     "%llu chunks sent, %llu credit waits\n",
                     rank, bytes >> 20, iterations,
                     static_cast<unsigned long long>(chunks - chunks_before),
                     static_cast<unsigned long long>(waits - waits_before));
      }
      sync_all();
      // Checked minibatch: one push per rank, compared with NCCL's reduce-scatter.
      BENCH_ODC(odcMinibatchBegin(comm, stream));
      BENCH_ODC(odcScatterAccumulate(comm, src, shard * world, odcFloat32, accumulator, stream));
      BENCH_ODC(odcMinibatchEnd(comm, stream));
      BENCH_CUDA(cudaStreamSynchronize(stream));
      std::vector<float> a(shard), b(shard);
      BENCH_CUDA(cudaMemcpy(a.data(), local, shard * 4, cudaMemcpyDeviceToHost));
      BENCH_CUDA(cudaMemcpy(b.data(), out_nccl, shard * 4, cudaMemcpyDeviceToHost));
      int mismatches = 0;
      for (size_t i = 0; i < shard; ++i) mismatches += a[i] != b[i];  // small integers: exact
      scatter_table[s * world + rank] = {odc_us, nccl_us, mismatches};
      push_table[s * world + rank] = {push_us, nccl_us, mismatches};
      sync_all();
      BENCH_ODC(odcBufferFree(comm, accumulator));
      cudaFree(src);
      cudaFree(out_nccl);
    }
  }
  ncclCommDestroy(nccl);
  BENCH_ODC(odcCommDestroy(comm));
}

// odc/link and nccl/link: each one's bus bandwidth as a share of the links' (link_gbs).
void print_table(const char* title, const char* odc_name, const char* nccl_name,
                 const std::vector<size_t>& sizes, const Measurement* table, int world,
                 double link_gbs) {
  std::printf("\n%s (%d ranks; size = per-rank bytes; slowest rank; busbw = size/time*(N-1)/N)\n",
              title, world);
  std::printf("%10s %12s %12s %12s %12s %8s %9s %9s %6s\n", "size",
              (std::string(odc_name) + "_us").c_str(), "odc_busbw",
              (std::string(nccl_name) + "_us").c_str(), "nccl_busbw", "speedup", "odc/link",
              "nccl/link", "check");
  for (size_t s = 0; s < sizes.size(); ++s) {
    Measurement worst{0, 0, 0};
    for (int r = 0; r < world; ++r) {
      const Measurement& m = table[s * world + r];
      worst.odc_us = std::max(worst.odc_us, m.odc_us);
      worst.nccl_us = std::max(worst.nccl_us, m.nccl_us);
      worst.mismatches += m.mismatches;
    }
    const double factor = static_cast<double>(world - 1) / world;
    const double odc_bus = sizes[s] / (worst.odc_us * 1e-6) / 1e9 * factor;
    const double nccl_bus = sizes[s] / (worst.nccl_us * 1e-6) / 1e9 * factor;
    char size_text[32];
    if (sizes[s] >= (1u << 30)) {
      std::snprintf(size_text, sizeof(size_text), "%zuGiB", sizes[s] >> 30);
    } else {
      std::snprintf(size_text, sizeof(size_text), "%zuMiB", sizes[s] >> 20);
    }
    std::printf("%10s %12.1f %12.1f %12.1f %12.1f %7.2fx %8.1f%% %8.1f%% %6s\n", size_text,
                worst.odc_us, odc_bus, worst.nccl_us, nccl_bus, worst.nccl_us / worst.odc_us,
                100.0 * odc_bus / link_gbs, 100.0 * nccl_bus / link_gbs,
                worst.mismatches == 0 ? "ok" : "FAIL");
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args;
  std::string transport_name = "cuda";
  bool deterministic = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--transport" && i + 1 < argc) {
      transport_name = argv[++i];
    } else if (arg == "--deterministic") {
      deterministic = true;
    } else if (arg.rfind("--transport=", 0) == 0) {
      transport_name = arg.substr(12);
    } else {
      args.push_back(arg);
    }
  }
  odcTransport_t transport;
  if (transport_name == "cuda") {
    transport = odcTransportCuda;
  } else if (transport_name == "nvshmem") {
    transport = odcTransportNvshmem;
  } else {
    std::fprintf(stderr, "odc_bench: unknown transport '%s' (cuda, nvshmem)\n",
                 transport_name.c_str());
    return 2;
  }
  const size_t min_mib = args.size() > 0 ? std::strtoull(args[0].c_str(), nullptr, 10) : 1;
  const size_t max_mib = args.size() > 1 ? std::strtoull(args[1].c_str(), nullptr, 10) : 1024;
  double link_gbs = kNominalLinkGBs;
  const char* link_text = std::getenv("ODC_BENCH_LINK_GBS");
  if (link_text != nullptr) {
    char* end = nullptr;
    link_gbs = std::strtod(link_text, &end);
    if (end == link_text || *end != '\0' || !(link_gbs > 0) || !std::isfinite(link_gbs)) {
      std::fprintf(stderr,
                   "odc_bench: ODC_BENCH_LINK_GBS='%s': expected a positive number (GB/s per "
                   "direction per GPU)\n",
                   link_text);
      return 2;
    }
  }
  // Count GPUs and name the first in a child: a CUDA context must not exist in the parent
  // before fork().
  struct DeviceFacts {
    int count;
    char name[256];
  };
  void* shared =
      mmap(nullptr, sizeof(DeviceFacts), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) {
    std::perror("odc_bench: mmap");
    return 1;
  }
  auto* facts = static_cast<DeviceFacts*>(shared);
  const pid_t child = fork();
  if (child < 0) {
    std::perror("odc_bench: fork");
    return 1;
  }
  if (child == 0) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceCount(&facts->count) != cudaSuccess) facts->count = 0;
    if (facts->count > 0 && cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
      std::snprintf(facts->name, sizeof(facts->name), "%s", prop.name);
    }
    _exit(0);
  }
  int child_status = 0;
  if (waitpid(child, &child_status, 0) != child || !WIFEXITED(child_status) ||
      WEXITSTATUS(child_status) != 0) {
    std::fprintf(stderr, "odc_bench: the process counting GPUs failed (status %d)\n", child_status);
    return 1;
  }
  int world = args.size() > 2 ? std::atoi(args[2].c_str()) : 0;
  if (world <= 0) world = facts->count;
  if (world < 2) {
    std::fprintf(stderr,
                 "odc_bench needs at least 2 ranks (one per GPU), got %d (%d GPU(s) visible)\n",
                 world, facts->count);
    return 2;
  }
  if (world > facts->count) {
    std::fprintf(stderr, "odc_bench: %d ranks asked for, but %d GPU(s) visible (one per rank)\n",
                 world, facts->count);
    return 2;
  }
  std::vector<size_t> sizes;
  for (size_t mib = min_mib; mib <= max_mib; mib *= 2) sizes.push_back(mib << 20);
  const size_t table_bytes = sizeof(Measurement) * sizes.size() * world;
  auto* gather_table = static_cast<Measurement*>(
      mmap(nullptr, table_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  auto* solo_table = static_cast<Measurement*>(
      mmap(nullptr, table_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  auto* window_table = static_cast<Measurement*>(
      mmap(nullptr, table_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  auto* scatter_table = static_cast<Measurement*>(
      mmap(nullptr, table_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  auto* push_table = static_cast<Measurement*>(
      mmap(nullptr, table_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ncclUniqueId id;
  BENCH_NCCL(ncclGetUniqueId(&id));
  const std::string key = "odc-bench-" + std::to_string(getpid());
  const int failures = odc::fork_ranks(world, [&](int rank) {
    run_rank(rank, world, key, transport, deterministic, id, sizes, gather_table, solo_table,
             window_table, scatter_table, push_table);
    return 0;
  });
  if (failures) {
    std::fprintf(stderr, "%d rank(s) failed\n", failures);
    return 1;
  }
  int nccl_version = 0;
  ncclGetVersion(&nccl_version);
  std::printf(
      "odc-bench: %d x %s, NCCL %d, odc transport %s%s; links %g GB/s per direction "
      "per GPU%s\n",
      world, facts->name[0] != '\0' ? facts->name : "GPU", nccl_version, transport_name.c_str(),
      deterministic ? " (deterministic: pulled pushes)" : "", link_gbs,
      link_text != nullptr ? " (ODC_BENCH_LINK_GBS)"
                           : " (nominal NVLink 4, 18 x 25 GB/s: H100 / H200 SXM)");
  print_table("gather (bf16) vs ncclAllGather", "odc", "nccl", sizes, gather_table, world,
              link_gbs);
  print_table(
      "gather (bf16), one rank at a time while the others wait (ranks out of step), vs "
      "ncclAllGather",
      "solo", "nccl", sizes, solo_table, world, link_gbs);
  const std::string window_title = "gather (bf16), " + std::to_string(kGathersPerMinibatch) +
                                   " per minibatch incl. its begin/end barriers, per gather, vs "
                                   "ncclAllGather";
  print_table(window_title.c_str(), "odc", "nccl", sizes, window_table, world, link_gbs);
  print_table(
      "scatter-accumulate (fp32 -> fp32), one push per minibatch incl. its begin/end "
      "barriers, vs ncclReduceScatter",
      "odc", "nccl", sizes, scatter_table, world, link_gbs);
  print_table(
      "scatter-accumulate (fp32 -> fp32), back-to-back pushes in one open minibatch, vs "
      "ncclReduceScatter",
      "odc", "nccl", sizes, push_table, world, link_gbs);
  return 0;
}
