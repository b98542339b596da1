// Grid sizes of the data kernels (blocks per job, one job per peer), CPU-only so that the rules
// are tested without a GPU (tests/cpp/grid_size_test.cc). The kernels take `num_blocks` from the
// caller when it is positive (the lab's sweeps); 0 asks for these rules.
#pragma once

#include <algorithm>
#include <cstddef>

namespace odc::kernels {

// Writes and reductions into peers and local copies: two blocks per SM shared by the jobs, but
// no more than one block per 16 KiB of a job (small transfers: fewer blocks to launch, fence and
// count; measured in dev/cuda_lab). `num_sms` is the SM budget (ODC_CUDA_SMS, else the device's).
inline int write_blocks_per_job(int num_sms, int num_blocks, int num_jobs, size_t bytes_per_job) {
  if (num_jobs < 1) num_jobs = 1;
  if (num_blocks > 0) return std::max(num_blocks / num_jobs, 1);
  const int sms = num_sms > 0 ? num_sms : 132;
  const size_t per_job =
      std::min(static_cast<size_t>(2 * sms / num_jobs), bytes_per_job / (16 << 10));
  return std::max(static_cast<int>(per_job), 1);
}

// Reads of peer memory by the CUDA transport's gathers (gather_sm, gather_sm_narrow: every rank
// pulls every owner at once): about kRemoteReadBlocks blocks reading remote owners per GPU
// (24 x 512 threads x 64 bytes: ~0.8 MiB of 16-byte loads in flight), shared by the N-1 remote
// owners (at least one each, so above 25 ranks N-1 blocks), within the write rule's budget. Why:
// when every GPU gathers at once, each GPU also serves N-1 readers, and more reads in flight only
// queue on the links. Measured with odc_bench, 4 x H200 (NVLink, 18 links per GPU), 2026-11-29:
// lockstep gathers with 66 blocks per owner (the write rule) 0.91-0.97x NCCL's all-gather from
// 128 MiB to 1 GiB, with 8 per owner (24 remote) 0.99-1.10x, with 12 per owner 0.99-1.06x, 6 per
// owner 0.98-1.09x; one rank gathering alone 1-3% slower with 8 per owner from 256 MiB (1.19 /
// 1.16 / 1.13x NCCL against 1.22 / 1.19 / 1.15x), the same below. On 2 ranks 32 per owner
// (1 remote owner) is as fast as 132, 16 per owner 3-5% slower from 256 MiB, 8 per owner 22-41%
// slower from 16 MiB (docs/benchmarks.md, "Gathers: reads in flight"). Not measured: 3+ remote
// owners beyond 4 ranks (8 ranks get 3 per owner), and the other peer reads, which keep the write
// rule: the NVSHMEM transport's direct pulls and the node cache's fetches (copy_narrow, put_signal)
// and the pulled scheme's reads of one sender. One rank (no remote owner): a local copy, the write
// rule.
inline constexpr int kRemoteReadBlocks = 24;
inline int read_blocks_per_job(int num_sms, int num_blocks, int num_jobs, size_t bytes_per_job) {
  const int by_budget = write_blocks_per_job(num_sms, num_blocks, num_jobs, bytes_per_job);
  if (num_blocks > 0 || num_jobs <= 1) return by_budget;
  return std::min(by_budget, std::max(kRemoteReadBlocks / (num_jobs - 1), 1));
}

}  // namespace odc::kernels
