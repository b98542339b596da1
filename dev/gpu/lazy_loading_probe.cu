// Does a kernel launched on a non-blocking stream run beside a long kernel on another stream
// the first time it is launched? (Issue #41, the progress rule on the device: the progress
// thread's first fold pass never ran while the owner's stream slept.) Prints, per case, how long
// after the long kernel started the probe kernel finished; "beside" when it finished before the
// long kernel did.
//
//   nvcc -arch=sm_90 -O2 -o lazy_loading_probe dev/gpu/lazy_loading_probe.cu
//   CUDA_MODULE_LOADING=LAZY  ./lazy_loading_probe            # first launch, nothing loaded
//   CUDA_MODULE_LOADING=LAZY  ./lazy_loading_probe preload    # cudaFuncGetAttributes first
//   CUDA_MODULE_LOADING=EAGER ./lazy_loading_probe
//   ... big_local / small_local: the probe needs 16 KiB / 192 bytes of local memory per thread,
//   the first kernel of the process that needs any (the driver reserves local memory then)
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK(call)                                                                     \
  do {                                                                                  \
    cudaError_t e = (call);                                                             \
    if (e != cudaSuccess) {                                                             \
      std::printf("%s failed: %s (line %d)\n", #call, cudaGetErrorString(e), __LINE__); \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void probe_kernel(int* out) {
  out[threadIdx.x] += 1;
}

__global__ void probe_small_local_kernel(int* out, int index) {
  volatile int scratch[48];  // 192 bytes of local memory per thread (the fold kernel's stack: 216)
  scratch[index % 48] = threadIdx.x;
  out[threadIdx.x] += scratch[(index * 7) % 48];
}

__global__ void probe_big_local_kernel(int* out, int index) {
  volatile int scratch[4096];  // 16 KiB of local memory per thread
  scratch[index & 4095] = threadIdx.x;
  out[threadIdx.x] += scratch[(index * 7) & 4095];
}

int main(int argc, char** argv) {
  bool preload = false, big_local = false, small_local = false;
  for (int i = 1; i < argc; ++i) {
    preload |= std::strcmp(argv[i], "preload") == 0;
    big_local |= std::strcmp(argv[i], "big_local") == 0;
    small_local |= std::strcmp(argv[i], "small_local") == 0;
  }
  const void* probe = big_local     ? (const void*)probe_big_local_kernel
                      : small_local ? (const void*)probe_small_local_kernel
                                    : (const void*)probe_kernel;
  int* out = nullptr;
  CHECK(cudaMalloc(&out, 1024 * sizeof(int)));
  CHECK(cudaMemset(out, 0, 1024 * sizeof(int)));
  spin_kernel<<<1, 1>>>(1000);  // load the spin kernel and calibrate the clock
  CHECK(cudaDeviceSynchronize());
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  size_t local_bytes = 0;
  if (preload) {
    cudaFuncAttributes attributes{};
    CHECK(cudaFuncGetAttributes(&attributes, probe));
    local_bytes = attributes.localSizeBytes;
  }
  cudaStream_t side = nullptr;
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t done = nullptr, spun = nullptr;
  CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&spun, cudaEventDisableTiming));
  const double spin_seconds = 3.0;
  const auto started = std::chrono::steady_clock::now();
  spin_kernel<<<1, 1, 0, 0>>>(static_cast<long long>(spin_seconds * clock_khz * 1e3));  // legacy
  CHECK(cudaEventRecord(spun, 0));
  const auto launch_begin = std::chrono::steady_clock::now();
  if (big_local) {
    probe_big_local_kernel<<<1, 32, 0, side>>>(out, 3);
  } else if (small_local) {
    probe_small_local_kernel<<<1, 32, 0, side>>>(out, 3);
  } else {
    probe_kernel<<<1, 32, 0, side>>>(out);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(done, side));
  const double launch_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - launch_begin).count();
  double probe_s = -1, spin_s = -1;
  for (;;) {
    const double now =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (probe_s < 0 && cudaEventQuery(done) == cudaSuccess) probe_s = now;
    if (spin_s < 0 && cudaEventQuery(spun) == cudaSuccess) spin_s = now;
    if (probe_s >= 0 && spin_s >= 0) break;
  }
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  std::printf(
      "loading=%-5s preload=%d local=%-5s local_bytes=%zu | launch %.3f s, probe done "
      "%.3f s, spin done %.3f s -> %s\n",
      loading ? loading : "(unset)", preload,
      big_local     ? "16K"
      : small_local ? "192"
                    : "0",
      local_bytes, launch_s, probe_s, spin_s,
      probe_s < spin_s ? "beside" : "AFTER the long kernel");
  return 0;
}
