// A short multi-process run of the CUDA transport for compute-sanitizer (memcheck, racecheck):
// 2 ranks (forked, one per GPU), a few minibatches of gather and scatter-accumulate, checked.
// Exit status 0 when every rank's sums are right.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/fork_ranks.h"
#include "odc/odc.h"

namespace {

int run_rank(int rank, int world, const std::string& key) {
#define SMOKE_CHECK(call)                                                      \
  if ((call) != odcSuccess) {                                                  \
    std::fprintf(stderr, "rank %d: %s: %s\n", rank, #call, odcGetLastError()); \
    return 1;                                                                  \
  }
  if (cudaSetDevice(rank) != cudaSuccess) return 1;
  odcComm_t comm;
  SMOKE_CHECK(odcCommInitCuda(&comm, rank, world, key.c_str(), 30.0, rank));
  const size_t count = 4099;
  odcBuffer_t params, accumulator;
  void *params_local, *accumulator_local;
  SMOKE_CHECK(odcBufferAlloc(comm, count, odcBfloat16, 0, &params, &params_local));
  SMOKE_CHECK(odcBufferAlloc(comm, count, odcFloat32, 1, &accumulator, &accumulator_local));
  std::vector<float> host_src(world * count);
  for (size_t i = 0; i < host_src.size(); ++i) host_src[i] = static_cast<float>(i % 5 + rank);
  void *src, *gathered;
  cudaMalloc(&src, host_src.size() * sizeof(float));
  cudaMalloc(&gathered, world * count * 2);
  cudaMemcpy(src, host_src.data(), host_src.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  for (int minibatch = 0; minibatch < 3; ++minibatch) {
    SMOKE_CHECK(odcMinibatchBegin(comm, stream));
    SMOKE_CHECK(odcGather(comm, gathered, world * count, params, stream));
    for (int push = 0; push < 2; ++push) {
      SMOKE_CHECK(odcScatterAccumulate(comm, src, world * count, odcFloat32, accumulator, stream));
    }
    SMOKE_CHECK(odcMinibatchEnd(comm, stream));
    std::vector<float> sums(count);
    cudaMemcpyAsync(sums.data(), accumulator_local, count * sizeof(float), cudaMemcpyDeviceToHost,
                    stream);
    cudaStreamSynchronize(stream);
    for (size_t i = 0; i < count; ++i) {
      float expected = 0;
      for (int sender = 0; sender < world; ++sender) {
        expected += 2.0f * static_cast<float>((rank * count + i) % 5 + sender);
      }
      if (sums[i] != expected) {
        std::fprintf(stderr, "rank %d minibatch %d element %zu: %f != %f\n", rank, minibatch, i,
                     sums[i], expected);
        return 1;
      }
    }
    SMOKE_CHECK(odcBarrier(comm, stream));
  }
  cudaStreamSynchronize(stream);
  SMOKE_CHECK(odcCommDestroy(comm));
  cudaFree(src);
  cudaFree(gathered);
  cudaStreamDestroy(stream);
  return 0;
#undef SMOKE_CHECK
}

}  // namespace

int main() {
  const int world = 2;
  const std::string key = "smoke-" + std::to_string(getpid());
  const int failures = odc::fork_ranks(world, [&](int rank) { return run_rank(rank, world, key); });
  std::printf("cuda smoke: %s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
