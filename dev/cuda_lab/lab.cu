// Kernel lab: one process drives every visible GPU (peer access between all pairs, one stream per
// GPU) and times the gather and scatter-accumulate variants of src/kernels against NCCL in the
// same run, checking every result against NCCL's output and a closed-form reference.
// Inputs are random multiples of 1/256 in [-1, 1], exact in bf16, so sums of up to 2^15 terms are
// exact in fp32 in any order: every check must show an error of exactly 0 (one extra check with
// full-precision random floats shows the reordering error against NCCL).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "bulk_kernels.h"
#include "kernels/kernels.h"
#include "lab_kernels.h"

using namespace odc::kernels;

#define CK(expr)                                                                                  \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)
#define NK(expr)                                                                                  \
  do {                                                                                            \
    const ncclResult_t r_ = (expr);                                                               \
    if (r_ != ncclSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, ncclGetErrorString(r_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace {

constexpr double kNvlinkGBs = 478.0;           // per direction per GPU, measured (docs/design.md)
constexpr int64_t kTimeoutNs = 5'000'000'000;  // 5 s: generous, a hang shows as an error record
constexpr size_t kMiB = 1 << 20;

// ---- inputs and references (same formulas on host and device) --------------------------------
__host__ __device__ inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}
__host__ __device__ inline uint32_t hash3(int rank, size_t i, uint32_t salt) {
  return mix32(mix32(static_cast<uint32_t>(i) ^ salt) ^
               mix32(static_cast<uint32_t>(i >> 32) + 0x9e3779b9U * (rank + 1)));
}
// mode 0: multiples of 1/256 in [-1, 1] (exact in bf16); mode 1: full-precision fp32 in [-1, 1).
__host__ __device__ inline float src_value(int rank, size_t i, int mode, uint32_t salt) {
  const uint32_t h = hash3(rank, i, salt);
  if (mode == 0) return static_cast<float>(static_cast<int>(h % 513) - 256) / 256.0f;
  return static_cast<float>(h) * (2.0f / 4294967296.0f) - 1.0f;
}
__host__ __device__ inline unsigned char shard_byte(int rank, size_t i) {
  return static_cast<unsigned char>(hash3(rank, i, 0xabcdU) >> 24);
}

__global__ void fill_shard(unsigned char* p, size_t n, int rank) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = shard_byte(rank, i);
}
__global__ void fill_src32(float* p, size_t n, int rank, int mode, uint32_t salt) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = src_value(rank, i, mode, salt);
}
__global__ void fill_src16(__nv_bfloat16* p, size_t n, int rank, uint32_t salt) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16_rn(src_value(rank, i, 0, salt));  // exact: mode 0 values fit bf16
}
// out[r*S + j] must equal byte (offset + j) of rank r's shard.
__global__ void check_gather(const unsigned char* out, size_t shard_bytes, int num_ranks,
                             size_t offset, unsigned long long* mismatches) {
  unsigned long long bad = 0;
  const size_t n = shard_bytes * num_ranks;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const int r = static_cast<int>(i / shard_bytes);
    bad += out[i] != shard_byte(r, offset + i % shard_bytes);
  }
  if (bad) atomicAdd(mismatches, bad);
}
__global__ void count_diff(const unsigned char* a, const unsigned char* b, size_t n,
                           unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    bad += a[i] != b[i];
  if (bad) atomicAdd(mismatches, bad);
}
// max |acc[j] - mult * sum_g src_value(g, offset + owner*S + j)| (reference summed in double).
__global__ void check_acc(const float* acc, size_t shard_elems, int owner, int num_ranks,
                          size_t offset, float mult, int mode, uint32_t salt,
                          unsigned* max_err_bits) {
  float worst = 0.0f;
  for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < shard_elems;
       j += (size_t)gridDim.x * blockDim.x) {
    double ref = 0.0;
    for (int g = 0; g < num_ranks; ++g)
      ref += src_value(g, offset + owner * shard_elems + j, mode, salt);
    const float err = fabsf(acc[j] - static_cast<float>(mult * ref));
    worst = (err > worst || err != err) ? err : worst;  // NaN propagates as the worst
  }
  if (worst != 0.0f) atomicMax(max_err_bits, __float_as_uint(worst));
}
__global__ void max_abs_diff(const float* a, const float* b, size_t n, unsigned* max_err_bits) {
  float worst = 0.0f;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float err = fabsf(a[i] - b[i]);
    worst = (err > worst || err != err) ? err : worst;
  }
  if (worst != 0.0f) atomicMax(max_err_bits, __float_as_uint(worst));
}

// ---- per-GPU state ---------------------------------------------------------------------------
struct Gpu {
  int dev = 0;
  int num_sms = 0;
  cudaStream_t stream = nullptr;
  CopyEngineSet engines;
  cudaEvent_t start = nullptr, stop = nullptr;
  unsigned char* shard = nullptr;
  unsigned char* gather_out = nullptr;
  unsigned char* nccl_gather_out = nullptr;
  float* src32 = nullptr;
  __nv_bfloat16* src16 = nullptr;
  float* acc = nullptr;
  float* nccl_out32 = nullptr;
  __nv_bfloat16* nccl_out16 = nullptr;
  char* staging = nullptr;
  SignalBlock* signals = nullptr;
  WaitError* error = nullptr;             // device memory: the kernels check it on every wait
  unsigned long long* scratch = nullptr;  // device: check results
};

struct Lab {
  int n = 0;
  std::vector<Gpu> gpus;
  std::vector<ncclComm_t> comms;
  uint64_t barrier_epoch = 0;
  uint64_t stage_seq = 0;
  int warmup = 3, iters = 10;
  int blocks = 0;  // 0: automatic
  size_t max_bytes = 1024 * kMiB;
  FILE* md = nullptr;

  RankInfo info(int g) const { return RankInfo{g, n, gpus[g].num_sms}; }
  PeerPointers peers(std::function<void*(const Gpu&)> f) const {
    PeerPointers p;
    for (int g = 0; g < n; ++g) p.ptr[g] = f(gpus[g]);
    return p;
  }
  void sync_all() {
    for (auto& gp : gpus) {
      CK(cudaSetDevice(gp.dev));
      CK(cudaStreamSynchronize(gp.stream));
    }
  }
  void check_errors(const char* what) {
    sync_all();
    for (int g = 0; g < n; ++g) {
      const WaitError e = read_error(g);
      if (e.site != kWaitNone) {
        std::printf("WAIT ERROR in %s: site %d rank %d peer %d expected %llu seen %llu\n", what,
                    e.site, e.rank, e.peer, (unsigned long long)e.expected,
                    (unsigned long long)e.seen);
        std::exit(2);
      }
    }
  }
  WaitError read_error(int g) {
    WaitError e{};
    CK(cudaSetDevice(gpus[g].dev));
    CK(cudaMemcpy(&e, gpus[g].error, sizeof(e), cudaMemcpyDeviceToHost));
    return e;
  }
  void barrier_all() {
    ++barrier_epoch;
    for (int g = 0; g < n; ++g) {
      CK(cudaSetDevice(gpus[g].dev));
      CK(device_barrier(peers([](const Gpu& x) { return (void*)x.signals; }), info(g),
                        barrier_epoch, /*op=*/0, kTimeoutNs, gpus[g].error, gpus[g].stream));
    }
  }
  // Median over iterations of the slowest GPU's time (us); GPUs are aligned by a device barrier
  // before the start events, so launch skew on the host does not count.
  double time_op(const std::function<void()>& enqueue_all) {
    std::vector<double> times;
    for (int it = 0; it < warmup + iters; ++it) {
      barrier_all();
      for (auto& gp : gpus) {
        CK(cudaSetDevice(gp.dev));
        CK(cudaEventRecord(gp.start, gp.stream));
      }
      enqueue_all();
      for (auto& gp : gpus) {
        CK(cudaSetDevice(gp.dev));
        CK(cudaEventRecord(gp.stop, gp.stream));
      }
      sync_all();
      float worst = 0.0f;
      for (auto& gp : gpus) {
        float ms = 0.0f;
        CK(cudaEventElapsedTime(&ms, gp.start, gp.stop));
        worst = std::max(worst, ms);
      }
      if (it >= warmup) times.push_back(worst * 1000.0);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }

  // ---- operations on all GPUs ----
  void gather_all(const std::string& v, size_t shard_bytes, size_t offset = 0,
                  size_t dst_offset = 0) {
    if (v == "nccl") {
      NK(ncclGroupStart());
      for (int g = 0; g < n; ++g)
        NK(ncclAllGather(gpus[g].shard, gpus[g].nccl_gather_out, shard_bytes / 2, ncclBfloat16,
                         comms[g], gpus[g].stream));
      NK(ncclGroupEnd());
      return;
    }
    const PeerPointers shards = peers([offset](const Gpu& x) { return (void*)(x.shard + offset); });
    for (int g = 0; g < n; ++g) {
      CK(cudaSetDevice(gpus[g].dev));
      if (v == "ce")
        CK(gather_copy_engine(gpus[g].gather_out + dst_offset, shards, shard_bytes, info(g),
                              gpus[g].engines, gpus[g].stream));
      else if (v == "hint" || v == "bulk" || v == "write")
        CK(lab::gather_variant(v == "hint"   ? lab::GatherVariant::kLoadHint
                               : v == "bulk" ? lab::GatherVariant::kBulk
                                             : lab::GatherVariant::kWrite,
                               gpus[g].gather_out + dst_offset,
                               peers([](const Gpu& x) { return (void*)x.gather_out; }), shards,
                               shard_bytes, info(g), blocks, gpus[g].stream));
      else
        CK(gather_sm(gpus[g].gather_out + dst_offset, shards, shard_bytes, info(g), blocks,
                     gpus[g].stream));
    }
  }
  // src_off / acc_off in elements (misalignment tests)
  void scatter_all(const std::string& v, ElemType t, size_t shard_elems, size_t src_off = 0,
                   size_t acc_off = 0) {
    if (v == "nccl") {
      NK(ncclGroupStart());
      for (int g = 0; g < n; ++g) {
        if (t == ElemType::kFloat32)
          NK(ncclReduceScatter(gpus[g].src32, gpus[g].nccl_out32, shard_elems, ncclFloat32, ncclSum,
                               comms[g], gpus[g].stream));
        else
          NK(ncclReduceScatter(gpus[g].src16, gpus[g].nccl_out16, shard_elems, ncclBfloat16,
                               ncclSum, comms[g], gpus[g].stream));
      }
      NK(ncclGroupEnd());
      return;
    }
    const PeerPointers accs = peers([acc_off](const Gpu& x) { return (void*)(x.acc + acc_off); });
    if (v == "staged-ce" || v == "staged-sm") ++stage_seq;
    for (int g = 0; g < n; ++g) {
      CK(cudaSetDevice(gpus[g].dev));
      const void* src = t == ElemType::kFloat32 ? (const void*)(gpus[g].src32 + src_off)
                                                : (const void*)(gpus[g].src16 + src_off);
      if (v == "bulk-red") {
        CK(lab::scatter_accumulate_bulk(src, t, accs, shard_elems, info(g), blocks,
                                        gpus[g].stream));
      } else if (v == "red" || v == "red-gpu") {
        CK(scatter_accumulate_reduce(src, t, accs, shard_elems, info(g), blocks, gpus[g].stream,
                                     v == "red"));
      } else {
        StagedBuffers b;
        b.staging = peers([](const Gpu& x) { return (void*)x.staging; });
        b.signals = peers([](const Gpu& x) { return (void*)x.signals; });
        b.accs = accs;
        CK(scatter_accumulate_staged(src, t, b, shard_elems, info(g), stage_seq,
                                     v == "staged-ce" ? PushEngine::kCopyEngine : PushEngine::kSm,
                                     &gpus[g].engines, blocks, kTimeoutNs, gpus[g].error,
                                     gpus[g].stream));
      }
    }
  }
  void zero_acc(size_t elems) {
    for (auto& gp : gpus) {
      CK(cudaSetDevice(gp.dev));
      CK(cudaMemsetAsync(gp.acc, 0, (elems + 8) * sizeof(float), gp.stream));
    }
  }
  // ---- checks (return the worst over GPUs) ----
  unsigned long long gather_mismatches(size_t shard_bytes, size_t offset = 0, size_t dst_offset = 0,
                                       bool vs_nccl = false) {
    sync_all();
    unsigned long long total = 0;
    for (auto& gp : gpus) {
      CK(cudaSetDevice(gp.dev));
      CK(cudaMemset(gp.scratch, 0, 16));
      if (vs_nccl)
        count_diff<<<1024, 256>>>(gp.gather_out + dst_offset, gp.nccl_gather_out, shard_bytes * n,
                                  gp.scratch);
      else
        check_gather<<<1024, 256>>>(gp.gather_out + dst_offset, shard_bytes, n, offset, gp.scratch);
      CK(cudaGetLastError());
      unsigned long long h = 0;
      CK(cudaMemcpy(&h, gp.scratch, 8, cudaMemcpyDeviceToHost));
      total += h;
    }
    return total;
  }
  float acc_error(const float* const* outs, size_t shard_elems, size_t offset, float mult, int mode,
                  uint32_t salt) {
    sync_all();
    float worst = 0.0f;
    for (int g = 0; g < n; ++g) {
      CK(cudaSetDevice(gpus[g].dev));
      CK(cudaMemset(gpus[g].scratch, 0, 16));
      check_acc<<<1024, 256>>>(outs[g], shard_elems, g, n, offset, mult, mode, salt,
                               (unsigned*)gpus[g].scratch);
      CK(cudaGetLastError());
      unsigned h = 0;
      CK(cudaMemcpy(&h, gpus[g].scratch, 4, cudaMemcpyDeviceToHost));
      float f;
      std::memcpy(&f, &h, 4);
      worst = std::max(worst, f);
    }
    return worst;
  }
  float odc_error(size_t shard_elems, size_t offset, size_t acc_off, float mult, int mode,
                  uint32_t salt) {
    std::vector<const float*> outs;
    for (auto& gp : gpus) outs.push_back(gp.acc + acc_off);
    return acc_error(outs.data(), shard_elems, offset, mult, mode, salt);
  }
  float odc_vs_nccl(size_t shard_elems) {
    sync_all();
    float worst = 0.0f;
    for (auto& gp : gpus) {
      CK(cudaSetDevice(gp.dev));
      CK(cudaMemset(gp.scratch, 0, 16));
      max_abs_diff<<<1024, 256>>>(gp.acc, gp.nccl_out32, shard_elems, (unsigned*)gp.scratch);
      unsigned h = 0;
      CK(cudaMemcpy(&h, gp.scratch, 4, cudaMemcpyDeviceToHost));
      float f;
      std::memcpy(&f, &h, 4);
      worst = std::max(worst, f);
    }
    return worst;
  }
  void fill_inputs(int mode, uint32_t salt) {
    for (int g = 0; g < n; ++g) {
      Gpu& gp = gpus[g];
      CK(cudaSetDevice(gp.dev));
      fill_src32<<<4096, 256, 0, gp.stream>>>(gp.src32, max_bytes / 4, g, mode, salt);
      fill_src16<<<4096, 256, 0, gp.stream>>>(gp.src16, max_bytes / 2, g, salt);
      CK(cudaGetLastError());
    }
    sync_all();
  }
};

struct Row {
  std::string variant;
  double us;
  std::string check;
};

void print_rows(Lab& lab, const char* title, size_t size_bytes, double nccl_us,
                const std::vector<Row>& rows) {
  for (const Row& r : rows) {
    const double algbw = size_bytes / (r.us * 1e3);  // GB/s
    const double busbw = algbw * (lab.n - 1) / lab.n;
    char line[256];
    std::snprintf(line, sizeof(line),
                  "| %-9s | %-10s | %10.0f | %9.1f | %8.1f | %8.1f | %5.2fx | %5.1f%% | %s |",
                  title, r.variant.c_str(), (double)size_bytes, r.us, algbw, busbw, nccl_us / r.us,
                  100.0 * busbw / kNvlinkGBs, r.check.c_str());
    std::printf("%s\n", line);
    if (lab.md) std::fprintf(lab.md, "%s\n", line);
  }
  std::fflush(stdout);
}

void header(Lab& lab, const char* what) {
  const char* h =
      "| table     | variant    |   size (B) | time (us) | algbw GB/s | busbw GB/s | vs NCCL | of "
      "NVLink | check |\n"
      "|---|---|---:|---:|---:|---:|---:|---:|---|";
  std::printf("\n## %s\n%s\n", what, h);
  if (lab.md) std::fprintf(lab.md, "\n### %s\n\n%s\n", what, h);
}

std::string fmt_err(float e) {
  char b[64];
  std::snprintf(b, sizeof(b), "%.3g", e);
  return b;
}

// The table sizes (nccl-tests' per-rank full buffer) within [min_mib, max_mib].
std::vector<size_t> table_sizes(size_t min_mib, size_t max_mib) {
  std::vector<size_t> sizes;
  for (size_t m : {1, 4, 16, 64, 256, 512, 1024})
    if (m >= min_mib && m <= max_mib) sizes.push_back(m * kMiB);
  return sizes;
}

// One gather table: NCCL's all-gather, then each variant timed and checked against the reference
// and NCCL's output.
void gather_table(Lab& lab, const char* title, const std::vector<size_t>& sizes,
                  std::initializer_list<const char*> variants) {
  header(lab, title);
  for (size_t size : sizes) {
    const size_t sb = size / lab.n;
    std::vector<Row> rows;
    const double nccl = lab.time_op([&] { lab.gather_all("nccl", sb); });
    rows.push_back({"nccl", nccl, "ref"});
    for (const char* v : variants) {
      const double t = lab.time_op([&] { lab.gather_all(v, sb); });
      const auto bad_ref = lab.gather_mismatches(sb);
      const auto bad_nccl = lab.gather_mismatches(sb, 0, 0, true);
      rows.push_back(
          {v, t,
           "mismatch ref " + std::to_string(bad_ref) + ", vs nccl " + std::to_string(bad_nccl)});
    }
    print_rows(lab, "gather", size, nccl, rows);
  }
}

// The scatter-accumulate tables, fp32 and bf16 sources: NCCL's reduce-scatter, then each variant
// checked after one call (against the reference, and for fp32 against NCCL) and after three,
// then timed. `prefix` starts each table's title.
void scatter_tables(Lab& lab, const std::string& prefix, const std::vector<size_t>& sizes,
                    std::initializer_list<const char*> variants) {
  for (ElemType t : {ElemType::kFloat32, ElemType::kBfloat16}) {
    const bool f32 = t == ElemType::kFloat32;
    header(lab, (prefix + (f32 ? "scatter-accumulate fp32 source vs ncclReduceScatter fp32"
                               : "scatter-accumulate bf16 source (fp32 acc) vs ncclReduceScatter "
                                 "bf16 (bf16 out)"))
                    .c_str());
    for (size_t size : sizes) {
      const size_t se = size / elem_bytes(t) / lab.n;
      std::vector<Row> rows;
      const double nccl = lab.time_op([&] { lab.scatter_all("nccl", t, se); });
      std::string nccl_check = "ref";
      if (f32) {
        std::vector<const float*> outs;
        for (auto& gp : lab.gpus) outs.push_back(gp.nccl_out32);
        nccl_check = "err " + fmt_err(lab.acc_error(outs.data(), se, 0, 1.0f, 0, 1));
      }
      rows.push_back({"nccl", nccl, nccl_check});
      for (const char* v : variants) {
        lab.zero_acc(se);
        lab.scatter_all(v, t, se);
        lab.check_errors(v);
        std::string check = "err " + fmt_err(lab.odc_error(se, 0, 0, 1.0f, 0, 1));
        if (f32) check += ", vs nccl " + fmt_err(lab.odc_vs_nccl(se));
        lab.scatter_all(v, t, se);
        lab.scatter_all(v, t, se);
        lab.check_errors(v);
        check += ", x3 err " + fmt_err(lab.odc_error(se, 0, 0, 3.0f, 0, 1));
        const double us = lab.time_op([&] { lab.scatter_all(v, t, se); });
        lab.check_errors(v);
        rows.push_back({v, us, check});
      }
      print_rows(lab, f32 ? "rs-fp32" : "rs-bf16", size, nccl, rows);
    }
  }
}

// Issue #47: every GPU gathers (pushes) at once. Variants of the read path (load hint, bulk
// copies through the TMA, the write path as reference) and bulk reductions for pushes, beside
// the product's kernels and NCCL in the same run; then a block-count sweep at 256 MiB.
int run_bulk_section(Lab& lab, size_t min_mib, size_t max_mib) {
  const int n = lab.n;
  const std::vector<size_t> sizes = table_sizes(min_mib, max_mib);
  gather_table(lab, "bulk section: gather (bf16 payload), all GPUs at once, vs ncclAllGather",
               sizes, {"sm", "hint", "bulk", "write", "sm"});
  scatter_tables(lab, "bulk section: ", sizes, {"red", "bulk-red", "red"});
  const size_t size = std::min<size_t>(256 * kMiB, lab.max_bytes);
  std::printf(
      "\n## bulk section: block-count sweep at %zu MiB (time us; bulk: blocks of one warp)\n",
      size / kMiB);
  const int saved = lab.blocks;
  const double nccl_gather = lab.time_op([&] { lab.gather_all("nccl", size / n); });
  const double nccl_rs =
      lab.time_op([&] { lab.scatter_all("nccl", ElemType::kFloat32, size / 4 / n); });
  std::printf("nccl: all-gather %8.1f  reduce-scatter fp32 %8.1f\n", nccl_gather, nccl_rs);
  for (int b : {n * 8, n * 16, 66, 132, 264, 396, 528}) {
    lab.blocks = b;
    const double g = lab.time_op([&] { lab.gather_all("sm", size / n); });
    const double h = lab.time_op([&] { lab.gather_all("hint", size / n); });
    const double k = lab.time_op([&] { lab.gather_all("bulk", size / n); });
    const double r = lab.time_op([&] { lab.scatter_all("red", ElemType::kFloat32, size / 4 / n); });
    const double br =
        lab.time_op([&] { lab.scatter_all("bulk-red", ElemType::kFloat32, size / 4 / n); });
    lab.check_errors("bulk sweep");
    std::printf(
        "blocks %5d: gather sm %8.1f  hint %8.1f  bulk %8.1f   push red %8.1f  bulk-red %8.1f\n", b,
        g, h, k, r, br);
  }
  lab.blocks = saved;
  std::fflush(stdout);
  for (int g = 0; g < n; ++g) NK(ncclCommDestroy(lab.comms[g]));
  if (lab.md) std::fclose(lab.md);
  std::printf("\ndone\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Lab lab;
  size_t min_mib = 1, max_mib = 1024;
  bool sweep = false;
  bool bulk = false;  // only the #47 section: bulk-copy and load-hint variants, then exit
  std::string md_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() { return std::string(i + 1 < argc ? argv[++i] : "0"); };
    if (a == "--min-mib")
      min_mib = std::stoul(next());
    else if (a == "--max-mib")
      max_mib = std::stoul(next());
    else if (a == "--iters")
      lab.iters = std::stoi(next());
    else if (a == "--warmup")
      lab.warmup = std::stoi(next());
    else if (a == "--blocks")
      lab.blocks = std::stoi(next());
    else if (a == "--sweep")
      sweep = true;
    else if (a == "--bulk")
      bulk = true;
    else if (a == "--md")
      md_path = next();
    else {
      std::fprintf(stderr,
                   "usage: %s [--min-mib N] [--max-mib N] [--iters N] [--warmup N] [--blocks N] "
                   "[--sweep] [--bulk] [--md FILE]\n",
                   argv[0]);
      return 1;
    }
  }
  lab.max_bytes = max_mib * kMiB;
  if (!md_path.empty()) lab.md = std::fopen(md_path.c_str(), "w");

  int count = 0;
  CK(cudaGetDeviceCount(&count));
  lab.n = std::min(count, kMaxRanks);
  if (lab.n < 2) {
    std::fprintf(stderr, "need at least 2 GPUs, found %d\n", count);
    return 1;
  }
  int nccl_version = 0;
  NK(ncclGetVersion(&nccl_version));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# odc cuda_lab: %d x %s (%d SMs), NCCL %d, CUDA runtime built %d\n", lab.n,
              prop.name, prop.multiProcessorCount, nccl_version, CUDART_VERSION);
  std::printf("# NCCL_NVLS_ENABLE=%s\n",
              std::getenv("NCCL_NVLS_ENABLE") ? std::getenv("NCCL_NVLS_ENABLE") : "(unset)");

  const size_t max_bytes = lab.max_bytes;
  lab.gpus.resize(lab.n);
  for (int g = 0; g < lab.n; ++g) {
    Gpu& gp = lab.gpus[g];
    gp.dev = g;
    CK(cudaSetDevice(g));
    for (int p = 0; p < lab.n; ++p) {
      if (p == g) continue;
      int can = 0;
      CK(cudaDeviceCanAccessPeer(&can, g, p));
      if (!can) {
        std::fprintf(stderr, "GPU %d cannot access GPU %d\n", g, p);
        return 1;
      }
      CK(cudaDeviceEnablePeerAccess(p, 0));
    }
    CK(cudaDeviceGetAttribute(&gp.num_sms, cudaDevAttrMultiProcessorCount, g));
    CK(cudaStreamCreateWithFlags(&gp.stream, cudaStreamNonBlocking));
    CK(copy_engine_set_create(&gp.engines, lab.n));
    CK(cudaEventCreate(&gp.start));
    CK(cudaEventCreate(&gp.stop));
    const size_t shard_max = max_bytes / lab.n + 64;
    CK(cudaMalloc(&gp.shard, shard_max));
    CK(cudaMalloc(&gp.gather_out, max_bytes + 64));
    CK(cudaMalloc(&gp.nccl_gather_out, max_bytes));
    CK(cudaMalloc(&gp.src32, max_bytes + 64));
    CK(cudaMalloc(&gp.src16, max_bytes + 64));
    const size_t acc_elems_max = max_bytes / 2 / lab.n + 64;  // bf16 table: E = bytes / 2
    CK(cudaMalloc(&gp.acc, acc_elems_max * 4));
    CK(cudaMalloc(&gp.nccl_out32, acc_elems_max * 4));
    CK(cudaMalloc(&gp.nccl_out16, acc_elems_max * 2));
    const size_t staging =
        std::max(staging_bytes(acc_elems_max, ElemType::kBfloat16, lab.n),
                 staging_bytes(max_bytes / 4 / lab.n + 64, ElemType::kFloat32, lab.n));
    CK(cudaMalloc(&gp.staging, staging));
    CK(cudaMalloc(&gp.signals, sizeof(SignalBlock)));
    CK(cudaMemset(gp.signals, 0, sizeof(SignalBlock)));
    CK(cudaMalloc(&gp.error, sizeof(WaitError)));
    CK(cudaMemset(gp.error, 0, sizeof(WaitError)));
    CK(cudaMalloc(&gp.scratch, 64));
    fill_shard<<<4096, 256, 0, gp.stream>>>(gp.shard, shard_max, g);
    CK(cudaGetLastError());
  }
  lab.fill_inputs(0, 1);
  lab.comms.resize(lab.n);
  std::vector<int> devs(lab.n);
  for (int g = 0; g < lab.n; ++g) devs[g] = g;
  NK(ncclCommInitAll(lab.comms.data(), lab.n, devs.data()));
  lab.sync_all();
  const int n = lab.n;
  if (lab.md)
    std::fprintf(
        lab.md,
        "Device: %d x %s (%d SMs), NCCL %d. size = per-rank full buffer (nccl-tests' size), "
        "busbw = algbw * (N-1)/N, vs NCCL = NCCL time / ODC time, of NVLink = busbw / %.0f GB/s.\n",
        n, prop.name, prop.multiProcessorCount, nccl_version, kNvlinkGBs);

  if (bulk) return run_bulk_section(lab, min_mib, max_mib);

  // ---- 1. edge cases: odd sizes and misaligned pointers (checked against the formula) ----
  std::printf("\n## edge cases (odd sizes, misaligned pointers)\n");
  {
    const size_t sb = 100003;  // odd shard bytes
    for (const char* v : {"ce", "sm"}) {
      for (size_t dst_off : {size_t(3), size_t(8)}) {  // co-aligned mod 16 with src+3, and not
        lab.gather_all(v, sb, 3, dst_off);
        const auto bad = lab.gather_mismatches(sb, 3, dst_off);
        std::printf("gather %-3s shard_bytes=%zu src+3 dst+%zu: mismatches %llu\n", v, sb, dst_off,
                    bad);
      }
    }
    const size_t se = 100003;  // odd shard elements
    for (ElemType t : {ElemType::kFloat32, ElemType::kBfloat16}) {
      for (const char* v : {"red", "staged-ce", "staged-sm"}) {
        for (size_t off : {size_t(0), size_t(1)}) {
          lab.zero_acc(se + 2);
          lab.scatter_all(v, t, se, off, off);
          lab.check_errors(v);
          const float e1 = lab.odc_error(se, off, off, 1.0f, 0, 1);
          lab.scatter_all(v, t, se, off, off);
          lab.scatter_all(v, t, se, off, off);
          lab.check_errors(v);
          const float e3 = lab.odc_error(se, off, off, 3.0f, 0, 1);
          std::printf(
              "scatter %-9s %s shard_elems=%zu src+%zu acc+%zu: max err after 1 call %g, after 3 "
              "calls %g\n",
              v, t == ElemType::kFloat32 ? "fp32" : "bf16", se, off, off, e1, e3);
        }
      }
    }
  }

  // ---- 2. reordering error with full-precision random fp32 inputs (16 MiB) ----
  {
    lab.fill_inputs(1, 7);
    const size_t se = 16 * kMiB / 4 / n;
    lab.scatter_all("nccl", ElemType::kFloat32, se);
    std::vector<const float*> outs;
    for (auto& gp : lab.gpus) outs.push_back(gp.nccl_out32);
    const float nccl_err = lab.acc_error(outs.data(), se, 0, 1.0f, 1, 7);
    std::printf("\n## random fp32 inputs, 16 MiB: NCCL vs fp64 reference max abs err %g\n",
                nccl_err);
    for (const char* v : {"red", "staged-ce", "staged-sm"}) {
      lab.zero_acc(se);
      lab.scatter_all(v, ElemType::kFloat32, se);
      lab.check_errors(v);
      std::printf("%-9s: vs fp64 reference %g, vs NCCL %g (tolerance 1e-5: 4 terms in [-1,1))\n", v,
                  lab.odc_error(se, 0, 0, 1.0f, 1, 7), lab.odc_vs_nccl(se));
    }
    lab.fill_inputs(0, 1);
  }

  // ---- 3. block-count sweep at 64 MiB ----
  if (sweep) {
    std::printf("\n## block-count sweep at 64 MiB (time us)\n");
    const int saved = lab.blocks;
    const size_t size = std::min<size_t>(64 * kMiB, max_bytes);
    for (int b : {n * 8, n * 33, 132, 264, 528, 1056}) {
      lab.blocks = b;
      const double g = lab.time_op([&] { lab.gather_all("sm", size / n); });
      const double r =
          lab.time_op([&] { lab.scatter_all("red", ElemType::kFloat32, size / 4 / n); });
      const double rg =
          lab.time_op([&] { lab.scatter_all("red-gpu", ElemType::kFloat32, size / 4 / n); });
      const double s =
          lab.time_op([&] { lab.scatter_all("staged-sm", ElemType::kFloat32, size / 4 / n); });
      lab.check_errors("sweep");
      std::printf("blocks %5d: gather-sm %8.1f  red(sys) %8.1f  red(gpu) %8.1f  staged-sm %8.1f\n",
                  b, g, r, rg, s);
    }
    lab.blocks = saved;
    // One GPU pulling alone (the others idle) vs all pulling at once, at 256 MiB.
    const size_t sb = std::min<size_t>(256 * kMiB, max_bytes) / n;
    const PeerPointers shards = lab.peers([](const Gpu& x) { return (void*)x.shard; });
    for (const char* v : {"ce", "sm"}) {
      const double t = lab.time_op([&] {
        CK(cudaSetDevice(0));
        if (std::string(v) == "ce")
          CK(gather_copy_engine(lab.gpus[0].gather_out, shards, sb, lab.info(0),
                                lab.gpus[0].engines, lab.gpus[0].stream));
        else
          CK(gather_sm(lab.gpus[0].gather_out, shards, sb, lab.info(0), 0, lab.gpus[0].stream));
      });
      std::printf("gather %s, GPU 0 alone, 256 MiB: %.1f us, %.1f GB/s in from peers\n", v, t,
                  sb * (n - 1) / (t * 1e3));
    }
  }

  // ---- 4. tables ----
  const std::vector<size_t> sizes = table_sizes(min_mib, max_mib);
  gather_table(lab, "gather (bf16 payload) vs ncclAllGather", sizes, {"ce", "sm"});
  scatter_tables(lab, "", sizes, {"red", "staged-ce", "staged-sm"});

  // ---- 5. barrier: latency, and a timeout that must name the missing rank ----
  {
    const int reps = 1000;
    for (auto& gp : lab.gpus) {
      CK(cudaSetDevice(gp.dev));
      CK(cudaEventRecord(gp.start, gp.stream));
    }
    for (int i = 0; i < reps; ++i) lab.barrier_all();
    for (auto& gp : lab.gpus) {
      CK(cudaSetDevice(gp.dev));
      CK(cudaEventRecord(gp.stop, gp.stream));
    }
    lab.check_errors("barrier");
    float worst = 0.0f;
    for (auto& gp : lab.gpus) {
      float ms = 0.0f;
      CK(cudaEventElapsedTime(&ms, gp.start, gp.stop));
      worst = std::max(worst, ms);
    }
    std::printf("\n## device barrier: %.2f us per barrier (%d back to back, %d GPUs)\n",
                worst * 1000.0 / reps, reps, n);
    if (lab.md)
      std::fprintf(lab.md, "\nDevice barrier: %.2f us per barrier (%d back to back).\n",
                   worst * 1000.0 / reps, reps);

    // GPU n-1 never arrives: every other GPU must report (itself, peer n-1, epoch, epoch - 1), as
    // barrier words (kernels.h).
    const uint64_t epoch = ++lab.barrier_epoch;
    for (int g = 0; g < n - 1; ++g) {
      CK(cudaSetDevice(lab.gpus[g].dev));
      CK(device_barrier(lab.peers([](const Gpu& x) { return (void*)x.signals; }), lab.info(g),
                        epoch, /*op=*/0, 2'000'000, lab.gpus[g].error, lab.gpus[g].stream));
    }
    lab.sync_all();
    for (int g = 0; g < n - 1; ++g) {
      const WaitError e = lab.read_error(g);
      std::printf("timeout test GPU %d: site %d rank %d peer %d expected %llu seen %llu -> %s\n", g,
                  e.site, e.rank, e.peer, (unsigned long long)e.expected,
                  (unsigned long long)e.seen,
                  (e.site == kWaitBarrier && e.rank == g && e.peer == n - 1 &&
                   e.expected == barrier_word(epoch, 0) && e.seen == barrier_word(epoch - 1, 0))
                      ? "OK"
                      : "UNEXPECTED");
    }
  }

  for (int g = 0; g < n; ++g) NK(ncclCommDestroy(lab.comms[g]));
  for (auto& gp : lab.gpus) {
    CK(cudaSetDevice(gp.dev));
    CK(copy_engine_set_destroy(&gp.engines));
  }
  if (lab.md) std::fclose(lab.md);
  std::printf("\ndone\n");
  return 0;
}
