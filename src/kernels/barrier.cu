// Stream-ordered device barrier across the ranks of a node: each rank announces (epoch, collective)
// in every peer's SignalBlock (system-scope release) and waits for every peer's announcement in its
// own (system-scope acquire), with a bounded spin. Epochs are monotonic, so flags are never reset;
// ranks that meet at one epoch in different collectives (barrier() on one, minibatch_begin() on
// another) record a mismatch naming both instead of pairing up, as the host transport does.
#include "kernels/device_sync.cuh"
#include "kernels/kernels.h"

namespace odc::kernels {
namespace {

constexpr int kThreads = 32;
static_assert(kMaxRanks <= kThreads, "one thread per rank");

struct BarrierArgs {
  uint64_t* announce[kMaxRanks];       // &signals[p]->barrier[rank]
  const uint64_t* arrived[kMaxRanks];  // &signals[rank]->barrier[p]
  uint64_t word;                       // barrier_word(epoch, op)
  int64_t timeout_ns;
  WaitError* error;
  int rank;
  int num_ranks;
};

__global__ void barrier_kernel(BarrierArgs a) {
  const int peer = threadIdx.x;
  // Work earlier in this stream (remote reductions and copies included) is complete when this
  // kernel starts; the fence makes it visible system-wide before the announcement.
  __threadfence_system();
  __syncthreads();
  const bool active = peer < a.num_ranks && peer != a.rank;
  // A rank that has recorded an error stays silent, so that its peers time out and name it
  // rather than proceed with what may be a wrong sum.
  const bool healthy = *reinterpret_cast<volatile int32_t*>(&a.error->site) == kWaitNone;
  if (active && healthy) detail::st_release_sys(a.announce[peer], a.word);
  if (active)
    detail::wait_barrier_word(a.arrived[peer], a.word, a.timeout_ns, a.error, a.rank, peer);
  __syncthreads();
}

}  // namespace

cudaError_t device_barrier(const PeerPointers& signals, const RankInfo& info, uint64_t epoch,
                           uint32_t op, int64_t timeout_ns, WaitError* error, cudaStream_t stream) {
  if (info.num_ranks < 1 || info.num_ranks > kMaxRanks || epoch == 0 ||
      barrier_epoch(barrier_word(epoch, op)) != epoch || op >= (1u << kBarrierOpBits) ||
      error == nullptr)
    return cudaErrorInvalidValue;
  BarrierArgs a{};
  auto* local = static_cast<SignalBlock*>(signals.ptr[info.rank]);
  for (int p = 0; p < info.num_ranks; ++p) {
    a.announce[p] = &static_cast<SignalBlock*>(signals.ptr[p])->barrier[info.rank];
    a.arrived[p] = &local->barrier[p];
  }
  a.word = barrier_word(epoch, op);
  a.timeout_ns = timeout_ns;
  a.error = error;
  a.rank = info.rank;
  a.num_ranks = info.num_ranks;
  barrier_kernel<<<1, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace odc::kernels
