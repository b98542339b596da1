// Where should an owner's GPU fold streamed chunks (docs/runtime.md, streamed scheme; issue #27
// item 1)? Two candidates, measured here on one GPU without any communication:
//   - a persistent folder: one small CTA on a side stream for the whole minibatch, polling the
//     arrival words of every sender; it holds an SM slot and issues loads while training computes;
//   - fold on entry: a short kernel at every odc call of the owner (each gather and push) that
//     looks at the arrival words and returns when nothing arrived.
// The table: a compute-bound and a memory-bound kernel alone and beside a persistent poller
// (several poll back-offs), and the cost of one empty fold-on-entry launch. Medians of 10 runs.
// Build: nvcc -O3 -arch=sm_90 -o build-lab/fold_cost dev/cuda_lab/fold_cost.cu
// Run:   build-lab/fold_cost [senders=256]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                     \
  do {                                                                  \
    cudaError_t error_ = (call);                                        \
    if (error_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(error_));                         \
      std::exit(1);                                                     \
    }                                                                   \
  } while (0)

namespace {

// FMA-bound: every thread runs a long dependent chain.
__global__ void compute_kernel(float* out, int iterations) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f, c = 0.9999f;
  for (int i = 0; i < iterations; ++i) {
    a = fmaf(a, b, c);
    b = fmaf(b, c, a * 1e-9f);
  }
  if (a == 12345.0f) out[0] = b;  // keep the chain
}

// Memory-bound: a grid-stride copy.
__global__ void copy_kernel(const float4* src, float4* dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

__device__ unsigned long long load_acquire(const unsigned long long* word) {
  unsigned long long value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
  return value;
}

// The persistent folder's loop without arrivals: poll every sender's word until told to stop.
__global__ void poller_kernel(const unsigned long long* arrivals, int senders,
                              const volatile int* stop, unsigned sleep_ns,
                              unsigned long long* polls) {
  unsigned long long seen = 0, count = 0;
  while (*stop == 0) {
    for (int s = threadIdx.x; s < senders; s += blockDim.x) seen += load_acquire(&arrivals[s]);
    __syncthreads();
    if (sleep_ns > 0) __nanosleep(sleep_ns);
    ++count;
  }
  if (threadIdx.x == 0) polls[0] = count + (seen == 42 ? 1 : 0);
}

// Fold on entry with nothing arrived: one look at every sender's word.
__global__ void look_kernel(const unsigned long long* arrivals, int senders,
                            unsigned long long* out) {
  unsigned long long seen = 0;
  for (int s = threadIdx.x; s < senders; s += blockDim.x) seen += load_acquire(&arrivals[s]);
  if (seen == 42) out[0] = seen;
}

float median(std::vector<float> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int senders = argc > 1 ? std::atoi(argv[1]) : 256;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t work, side;
  CHECK(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  unsigned long long *arrivals, *scratch;
  CHECK(cudaMalloc(&arrivals, sizeof(unsigned long long) * senders));
  CHECK(cudaMemset(arrivals, 0, sizeof(unsigned long long) * senders));
  CHECK(cudaMalloc(&scratch, 64));
  int* stop_host;
  CHECK(cudaHostAlloc(&stop_host, sizeof(int), cudaHostAllocMapped));
  int* stop_device;
  CHECK(cudaHostGetDevicePointer(&stop_device, stop_host, 0));
  const size_t copy_bytes = size_t{1} << 30;
  float4 *src, *dst;
  CHECK(cudaMalloc(&src, copy_bytes));
  CHECK(cudaMalloc(&dst, copy_bytes));
  CHECK(cudaMemset(src, 0, copy_bytes));
  float* out;
  CHECK(cudaMalloc(&out, 64));
  cudaEvent_t begin, end;
  CHECK(cudaEventCreate(&begin));
  CHECK(cudaEventCreate(&end));

  auto time_workload = [&](bool compute) {
    std::vector<float> times;
    for (int run = 0; run < 11; ++run) {
      CHECK(cudaEventRecord(begin, work));
      if (compute) {
        compute_kernel<<<sms * 8, 256, 0, work>>>(out, 200000);
      } else {
        copy_kernel<<<sms * 4, 512, 0, work>>>(src, dst, copy_bytes / sizeof(float4));
      }
      CHECK(cudaEventRecord(end, work));
      CHECK(cudaEventSynchronize(end));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, begin, end));
      if (run > 0) times.push_back(ms);  // the first warms up
    }
    return median(times);
  };

  std::printf("device: %s, %d SMs; %d senders' arrival words polled\n\n", prop.name, sms, senders);
  const float compute_alone = time_workload(true);
  const float copy_alone = time_workload(false);
  std::printf("| folder | compute kernel ms | slowdown | 1 GiB copy ms | slowdown | polls/ms |\n");
  std::printf("|---|---|---|---|---|---|\n");
  std::printf("| none | %.3f | | %.3f | | |\n", compute_alone, copy_alone);
  for (unsigned sleep_ns : {0u, 200u, 2000u}) {
    *stop_host = 0;
    poller_kernel<<<1, 128, 0, side>>>(arrivals, senders, stop_device, sleep_ns, scratch);
    CHECK(cudaGetLastError());
    const float compute = time_workload(true);
    const float copy = time_workload(false);
    *stop_host = 1;
    CHECK(cudaStreamSynchronize(side));
    unsigned long long polls = 0;
    CHECK(cudaMemcpy(&polls, scratch, sizeof(polls), cudaMemcpyDeviceToHost));
    const float span_ms = 11 * (compute + copy);
    std::printf(
        "| persistent, 1 CTA x 128, nanosleep %u ns | %.3f | %+.2f%% | %.3f | %+.2f%% | %.0f |\n",
        sleep_ns, compute, 100.0 * (compute / compute_alone - 1), copy,
        100.0 * (copy / copy_alone - 1), polls / span_ms);
  }
  // Fold on entry: back-to-back empty looks, and one look between two compute kernels.
  std::vector<float> per_look;
  for (int run = 0; run < 11; ++run) {
    CHECK(cudaEventRecord(begin, work));
    for (int i = 0; i < 1000; ++i) look_kernel<<<1, 128, 0, work>>>(arrivals, senders, scratch);
    CHECK(cudaEventRecord(end, work));
    CHECK(cudaEventSynchronize(end));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, begin, end));
    if (run > 0) per_look.push_back(ms / 1000 * 1000);  // microseconds per look
  }
  std::vector<float> between;
  for (int run = 0; run < 11; ++run) {
    CHECK(cudaEventRecord(begin, work));
    for (int i = 0; i < 20; ++i) {
      compute_kernel<<<sms * 8, 256, 0, work>>>(out, 20000);
      look_kernel<<<1, 128, 0, work>>>(arrivals, senders, scratch);
    }
    CHECK(cudaEventRecord(end, work));
    CHECK(cudaEventSynchronize(end));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, begin, end));
    if (run > 0) between.push_back(ms);
  }
  std::vector<float> without;
  for (int run = 0; run < 11; ++run) {
    CHECK(cudaEventRecord(begin, work));
    for (int i = 0; i < 20; ++i) compute_kernel<<<sms * 8, 256, 0, work>>>(out, 20000);
    CHECK(cudaEventRecord(end, work));
    CHECK(cudaEventSynchronize(end));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, begin, end));
    if (run > 0) without.push_back(ms);
  }
  std::printf(
      "\nfold on entry, nothing arrived: %.2f us per look back to back; "
      "20 compute kernels %.3f ms alone, %.3f ms with a look after each (+%.2f us per "
      "look)\n",
      median(per_look), median(without), median(between),
      (median(between) - median(without)) / 20 * 1000);
  return 0;
}
