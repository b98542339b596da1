// NVSHMEM transport (see nvshmem_transport.h), built into the plugin libodc_nvshmem.so: how bytes
// move between ranks. Process-wide setup lives in nvshmem_process.cc, the symmetric heap's
// collective malloc and free in nvshmem_heap.cc, what every device transport shares in
// device/device_transport.cc. Invariant: nothing is read from a peer before the barrier or signal
// that orders it, and every device-side wait is bounded.
#include "transport/nvshmem/nvshmem_transport.h"

#include <cuda_runtime.h>
#include <nvshmem_host.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "transport/device/cuda_check.h"
#include "transport/nvshmem/nvshmem_heap.h"
#include "transport/nvshmem/nvshmem_kernels.h"
#include "transport/nvshmem/nvshmem_plugin.h"
#include "transport/nvshmem/nvshmem_process.h"

namespace odc::nvshmem {

using cuda::as_stream;
using cuda::check_device_pointer;
using cuda::DeviceGuard;

NvshmemTransport::NvshmemTransport(const TransportSpec& spec)
    : DeviceTransport(spec.bootstrap, spec.device, spec.timeout,
                      TransportCaps{/*remote_fp32_add=*/false, /*stream_ordered=*/true}),
      settings_(spec.nvshmem),
      configured_ranks_per_node_(spec.ranks_per_node),
      heap_(std::make_shared<SymmetricHeap>()) {
  heap_->bootstrap = spec.bootstrap;
  heap_->device = spec.device;
}

Result<std::unique_ptr<NvshmemTransport>> NvshmemTransport::create(const TransportSpec& spec) {
  if (!spec.bootstrap) {
    return Status::InvalidUsage("the NVSHMEM transport needs a bootstrap (none was given)");
  }
  if (spec.bootstrap->rank() != spec.rank || spec.bootstrap->world_size() != spec.world_size) {
    return Status::InvalidArgument("bootstrap is rank " + std::to_string(spec.bootstrap->rank()) +
                                   " of " + std::to_string(spec.bootstrap->world_size()) +
                                   ", the communicator rank " + std::to_string(spec.rank) + " of " +
                                   std::to_string(spec.world_size));
  }
  ODC_RETURN_IF_ERROR(check_device_exists(spec.device));
  std::unique_ptr<NvshmemTransport> transport(new NvshmemTransport(spec));
  if (Status status = transport->init(); !status.ok()) {
    transport->mark_failed("init: " + status.message());
    return status;
  }
  return transport;
}

Status NvshmemTransport::init() {
  ODC_RETURN_IF_ERROR(join_process_nvshmem(bootstrap(), device(), settings_.heap_size));
  ODC_RETURN_IF_ERROR(init_device_state(/*max_sms=*/0));  // all SMs (ODC_CUDA_SMS is CUDA's)
  {
    // The progress thread's fold passes must never wait for the caller's kernels (the fold's
    // first launch would: it loads the kernel and reserves its local memory).
    DeviceGuard guard(device());
    ODC_CUDA_CHECK(warm_up_fold_streamed(device_error()));
  }
  ODC_RETURN_IF_ERROR(allocate_control_words());
  auto ranks_per_node = agree_ranks_per_node(bootstrap(), configured_ranks_per_node_);
  if (!ranks_per_node.ok()) return ranks_per_node.status();
  local_size_ = ranks_per_node.value();
  map_direct_peers();
  return warm_up_stream_operations();
}

// A process's first launch of a kernel (loaded then, under lazy loading, torch's default) may
// wait for every kernel running on the device, and hold the driver's launches from other threads
// meanwhile. An owner whose stream runs a long kernel (a collective waiting for a peer) then sat
// in its first push until that kernel ended, and so did its progress thread's fold passes, which
// its senders needed: their credit waits expired. Measured on 2 x H200 (2026-11-28,
// dev/gpu/progress_first_minibatch.py): warming up only the fold kernel left the first
// minibatch failing; these kernels as well fixed it; NVSHMEM's calls alone did not. So every
// kernel a push, a fold or a gather launches runs once here, before any of the caller's kernels
// (the barrier's wait runs first in minibatch_begin, before any push), with NVSHMEM's stream calls
// (cheap; to this rank itself they take NVSHMEM's local path only, not the proxy's to other
// nodes), on a stream of its own, over two scratch regions (about 1 KiB) freed afterwards.
Status NvshmemTransport::warm_up_stream_operations() {
  constexpr size_t kCount = 64;  // fp32 elements per part
  constexpr size_t kBytes = kCount * sizeof(float);
  auto data_made = allocate(4 * kBytes);  // zeroed: src, dst, sums, bf16 part
  if (!data_made.ok()) return data_made.status();
  auto signals_made = allocate(static_cast<size_t>(world_size()) * sizeof(uint64_t));
  if (!signals_made.ok()) return signals_made.status();
  const std::unique_ptr<SymmetricRegion> data = std::move(data_made).value();
  const std::unique_ptr<SymmetricRegion> signals = std::move(signals_made).value();
  DeviceGuard guard(device());
  cudaStream_t stream = nullptr;
  ODC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto run = [&]() -> Status {
    char* base = static_cast<char*>(data->local());
    char* src = base;
    char* dst = base + kBytes;
    auto* sums = reinterpret_cast<float*>(base + 2 * kBytes);
    char* narrow = base + 3 * kBytes;
    auto* words = static_cast<uint64_t*>(signals->local());
    const int me = rank();
    // odc's kernels, as a push, a fold's neighbours, a gather and a barrier launch them.
    ODC_RETURN_IF_ERROR(local().zero(dst, kBytes, stream));
    for (DataType type : {DataType::kFloat32, DataType::kBfloat16}) {
      ODC_RETURN_IF_ERROR(local().accumulate_reducing(sums, src, type, kCount, stream));
      ODC_RETURN_IF_ERROR(local().accumulate(sums, src, type, kCount, stream));
    }
    const kernels::ChunkHeader header{};
    ODC_RETURN_IF_ERROR(local().pack_chunk(dst, header, src, kBytes - sizeof(header), stream));
    ODC_RETURN_IF_ERROR(local().copy_many({dst}, {src}, kBytes, push_done_.get(), stream));
    ODC_RETURN_IF_ERROR(local().narrow_many({narrow}, {src}, kCount / 2, stream));
    ODC_RETURN_IF_ERROR(local().wait_slots(words, {me}, 0, timeout_ns(), nullptr, stream));
    ODC_CUDA_CHECK(store_u64(words + me, 0, stream));
    ODC_CUDA_CHECK(publish_u64(words + me, 0, device_error(), stream));
    // NVSHMEM's stream calls, every one the transport makes.
    nvshmemx_putmem_signal_on_stream(dst, src, kBytes, words + me, 0, NVSHMEM_SIGNAL_SET, me,
                                     stream);
    nvshmemx_signal_op_on_stream(words + me, 0, NVSHMEM_SIGNAL_SET, me, stream);
    nvshmemx_putmem_on_stream(dst, src, kBytes, me, stream);
    nvshmemx_getmem_on_stream(dst, src, kBytes, me, stream);
    nvshmemx_getmem_nbi_on_stream(dst, src, kBytes, me, stream);
    nvshmemx_quiet_on_stream(stream);
    void* temporary = nullptr;  // the narrowed gather's stream-ordered temporary
    ODC_CUDA_CHECK(cudaMallocAsync(&temporary, kBytes, stream));
    ODC_CUDA_CHECK(cudaFreeAsync(temporary, stream));
    ODC_CUDA_CHECK(cudaGetLastError());
    ODC_CUDA_CHECK(cudaStreamSynchronize(stream));
    return poll_error();
  };
  const Status ran = run();
  cudaStreamDestroy(stream);
  if (!ran.ok()) return ran.with_context("while warming up the NVSHMEM transport's operations");
  return Status::Ok();
}

// The transport's own words: barrier words and their outbox, signal outboxes, copy counters.
Status NvshmemTransport::allocate_control_words() {
  DeviceGuard guard(device());
  const size_t slots_bytes = static_cast<size_t>(world_size()) * sizeof(uint64_t);
  uint32_t* push_done = nullptr;
  ODC_CUDA_CHECK(cudaMalloc(&push_done, sizeof(uint32_t) * kernels::kMaxRanks));
  push_done_.reset(push_done);
  ODC_CUDA_CHECK(cudaMemset(push_done, 0, sizeof(uint32_t) * kernels::kMaxRanks));
  auto words = allocate(slots_bytes);
  if (!words.ok()) return words.status();
  barrier_words_ = std::move(words).value();
  // Three parts: the caller's streams' signals, the background stream's (the node cache's ready
  // words) and the send lane's (the streamed staging's arrivals), so that a value stored for one
  // is never put by another.
  auto outbox = allocate(kSignalOutboxParts * slots_bytes);
  if (!outbox.ok()) return outbox.status();
  outbox_ = std::move(outbox).value();
  auto barrier_outbox = allocate(slots_bytes);
  if (!barrier_outbox.ok()) return barrier_outbox.status();
  barrier_outbox_ = std::move(barrier_outbox).value();
  signal_by_put_ = settings_.signal_put;
  return Status::Ok();
}

// Same-node peers whose heap NVSHMEM mapped into this GPU (NVLink) get odc's kernels.
void NvshmemTransport::map_direct_peers() {
  mapped_.assign(static_cast<size_t>(world_size()), 0);
  for (int r = 0; r < world_size(); ++r) {
    mapped_[static_cast<size_t>(r)] =
        settings_.direct && node_of(r) == node_of(rank()) && barrier_words_->peer(r) != nullptr;
  }
}

int NvshmemTransport::num_direct_peers() const {
  return static_cast<int>(std::count(mapped_.begin(), mapped_.end(), 1));
}

void NvshmemTransport::count_remote(int peer, size_t bytes, uint64_t* total) const {
  if (node_of(peer) != node_of(rank())) *total += bytes;
}

void NvshmemTransport::print_stats() const {
  char line[256];
  const int length = std::snprintf(
      line, sizeof(line),
      "odc nvshmem rank %d: to/from other nodes: %llu bytes put, %llu bytes fetched "
      "(%d ranks per node, %d direct peers)\n",
      rank(), static_cast<unsigned long long>(remote_put_bytes_),
      static_cast<unsigned long long>(remote_get_bytes_), local_size_, num_direct_peers());
  // One write, so that the lines of ranks sharing a terminal or file do not interleave.
  if (length > 0) {
    const ssize_t written =
        ::write(STDERR_FILENO, line, std::min(static_cast<size_t>(length), sizeof(line) - 1));
    (void)written;
  }
}

NvshmemTransport::~NvshmemTransport() {
  if (settings_.stats) print_stats();
  DeviceGuard guard(device());
  cudaDeviceSynchronize();
  outbox_.reset();
  barrier_outbox_.reset();
  barrier_words_.reset();
  push_done_.reset();
}

void NvshmemTransport::mark_failed(const std::string& reason) {
  heap_->failed.store(true);
  bootstrap().mark_failed(reason);
}

Result<std::unique_ptr<SymmetricRegion>> NvshmemTransport::allocate(size_t bytes) {
  return allocate_symmetric(heap_, bytes);
}

Status NvshmemTransport::barrier(CollectiveOp op, StreamHandle stream) {
  DeviceGuard guard(device());
  cudaStream_t cuda_stream = as_stream(stream);
  // Epoch and collective in one word (kernels/wait_record.h), so a peer in another collective is
  // a mismatch naming both. Words stay below 2^32 for 2^24 barriers, so a put torn into 4-byte
  // halves over a network cannot show a later epoch than was sent.
  const uint64_t word = next_barrier_word(op);
  // Our earlier NVSHMEM puts are complete at their targets before anyone sees our arrival (direct
  // puts fenced at system scope in their kernel; gets completed in stream order).
  nvshmemx_quiet_on_stream(cuda_stream);
  // Announced by a put of the word from this rank's barrier outbox, written by a kernel that
  // writes nothing once a device wait of this rank failed: a failed rank stays silent (its peers
  // time out naming it), as on the CUDA transport, instead of letting them pass the barrier.
  auto* words = static_cast<uint64_t*>(barrier_words_->local());
  auto* announced = static_cast<uint64_t*>(barrier_outbox_->local());
  for (int i = 0; i < world_size(); ++i) {
    const int peer = (rank() + 1 + i) % world_size();
    ODC_CUDA_CHECK(publish_u64(announced + peer, word, device_error(), cuda_stream));
    nvshmemx_putmem_on_stream(words + rank(), announced + peer, sizeof(uint64_t), peer,
                              cuda_stream);
  }
  ODC_CUDA_CHECK(cudaGetLastError());
  ODC_CUDA_CHECK(wait_barrier_words(words, world_size(), word, rank(), timeout_ns(), device_error(),
                                    cuda_stream));
  return Status::Ok();
}

Status NvshmemTransport::pull_parts(void* dst, const std::vector<PulledPart>& parts, size_t count,
                                    size_t element_bytes, bool narrowed, StreamHandle stream) {
  DeviceGuard guard(device());
  ODC_RETURN_IF_ERROR(check_device_pointer(device(), dst, "destination"));
  cudaStream_t cuda_stream = as_stream(stream);
  const size_t src_bytes = count * element_bytes;
  const size_t part_bytes = narrowed ? count * sizeof(uint16_t) : src_bytes;
  auto part_at = [&](const PulledPart& part) {
    return static_cast<char*>(dst) + part.index * part_bytes;
  };
  std::vector<void*> to;  // through odc's copy kernels (this GPU's or NVLink-mapped memory)
  std::vector<const void*> from;
  std::vector<const PulledPart*> fetched;  // through NVSHMEM's gets
  for (const PulledPart& part : parts) {
    if (part.peer == rank() || mapped_[static_cast<size_t>(part.peer)]) {
      to.push_back(part_at(part));
      from.push_back(static_cast<const char*>(part.region->peer(part.peer)) + part.offset);
    } else {
      fetched.push_back(&part);
    }
  }
  // Fetched parts land in place, or (narrowed) in a stream-ordered fp32 temporary of their size
  // only, freed in stream order once the narrowing copy has read it.
  void* temporary = nullptr;
  if (!fetched.empty()) {
    if (narrowed) {
      ODC_CUDA_CHECK(cudaMallocAsync(&temporary, fetched.size() * src_bytes, cuda_stream));
    }
    for (size_t k = 0; k < fetched.size(); ++k) {
      const PulledPart& part = *fetched[k];
      char* landing = narrowed ? static_cast<char*>(temporary) + k * src_bytes : part_at(part);
      // Non-blocking, so the gets from different owners overlap; the quiet below completes them
      // all before anything later on the stream.
      nvshmemx_getmem_nbi_on_stream(landing,
                                    static_cast<const char*>(part.region->local()) + part.offset,
                                    src_bytes, part.peer, cuda_stream);
      count_remote(part.peer, src_bytes, &remote_get_bytes_);
      if (narrowed) {
        to.push_back(part_at(part));
        from.push_back(landing);
      }
    }
    nvshmemx_quiet_on_stream(cuda_stream);
    ODC_CUDA_CHECK(cudaGetLastError());
  }
  const Status copied = narrowed ? local().narrow_many(to, from, count, stream)
                                 : local().copy_many(to, from, src_bytes, push_done_.get(), stream);
  // Freed in stream order even when a launch failed (nothing may still read it then).
  if (temporary != nullptr) ODC_CUDA_CHECK(cudaFreeAsync(temporary, cuda_stream));
  return copied;
}

std::vector<NvshmemTransport::PulledPart> NvshmemTransport::every_owner(
    const SymmetricRegion& region) const {
  std::vector<PulledPart> parts;
  for (int i = 0; i < world_size(); ++i) {
    const int owner = (rank() + 1 + i) % world_size();  // ranks start at different owners
    parts.push_back({static_cast<size_t>(owner), &region, owner, 0});
  }
  return parts;
}

Status NvshmemTransport::get_all(void* dst, const SymmetricRegion& region, size_t count,
                                 DataType src_dtype, DataType dst_dtype, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(check_gather_dtypes(src_dtype, dst_dtype));
  return pull_parts(dst, every_owner(region), count, element_bytes(src_dtype),
                    dst_dtype != src_dtype, stream);
}

Status NvshmemTransport::get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                                  DataType src_dtype, DataType dst_dtype, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(check_gather_dtypes(src_dtype, dst_dtype));
  std::vector<PulledPart> parts;
  for (size_t j = 0; j < sources.size(); ++j) {
    parts.push_back({j, sources[j].region, sources[j].peer, sources[j].offset});
  }
  return pull_parts(dst, parts, count, element_bytes(src_dtype), dst_dtype != src_dtype, stream);
}

Status NvshmemTransport::get(void* dst, const SymmetricRegion& region, int peer, size_t offset,
                             size_t bytes, StreamHandle stream) {
  DeviceGuard guard(device());
  ODC_RETURN_IF_ERROR(check_device_pointer(device(), dst, "destination"));
  if (peer == rank() || mapped_[static_cast<size_t>(peer)]) {  // this GPU's, or NVLink-mapped
    const void* from = static_cast<const char*>(region.peer(peer)) + offset;
    ODC_CUDA_CHECK(cudaMemcpyAsync(dst, from, bytes, cudaMemcpyDeviceToDevice, as_stream(stream)));
    return Status::Ok();
  }
  nvshmemx_getmem_on_stream(dst, static_cast<const char*>(region.local()) + offset, bytes, peer,
                            as_stream(stream));
  count_remote(peer, bytes, &remote_get_bytes_);
  ODC_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status NvshmemTransport::put(const void* src, const SymmetricRegion& region, int peer,
                             size_t offset, size_t bytes, StreamHandle stream) {
  DeviceGuard guard(device());
  ODC_RETURN_IF_ERROR(check_device_pointer(device(), src, "source"));
  nvshmemx_putmem_on_stream(static_cast<char*>(region.local()) + offset, src, bytes, peer,
                            as_stream(stream));
  count_remote(peer, bytes, &remote_put_bytes_);
  ODC_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status NvshmemTransport::put_signal(const void* src, const SymmetricRegion& region, int peer,
                                    size_t offset, size_t bytes, const SymmetricRegion& signals,
                                    uint64_t value, StreamHandle stream) {
  if (signal_by_put_) {  // no signal atomics on this path: a put, a quiet, a put of the value
    return Transport::put_signal(src, region, peer, offset, bytes, signals, value, stream);
  }
  DeviceGuard guard(device());
  ODC_RETURN_IF_ERROR(check_device_pointer(device(), src, "source"));
  // One operation: NVSHMEM delivers the signal after the data, with no quiet of this rank's
  // other operations in flight (a streamed chunk to one owner does not wait for another's).
  nvshmemx_putmem_signal_on_stream(static_cast<char*>(region.local()) + offset, src, bytes,
                                   static_cast<uint64_t*>(signals.local()) + rank(), value,
                                   NVSHMEM_SIGNAL_SET, peer, as_stream(stream));
  count_remote(peer, bytes, &remote_put_bytes_);
  ODC_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status NvshmemTransport::signal(const SymmetricRegion& signals, int peer, uint64_t value,
                                StreamHandle stream) {
  DeviceGuard guard(device());
  nvshmemx_quiet_on_stream(as_stream(stream));  // earlier puts are visible before the signal
  ODC_RETURN_IF_ERROR(send_signal(static_cast<uint64_t*>(signals.local()) + rank(), value, peer,
                                  as_stream(stream)));
  ODC_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status NvshmemTransport::send_signal(uint64_t* signal, uint64_t value, int peer,
                                     cudaStream_t stream) {
  if (!signal_by_put_) {
    nvshmemx_signal_op_on_stream(signal, value, NVSHMEM_SIGNAL_SET, peer, stream);
    ODC_CUDA_CHECK(cudaGetLastError());
    return Status::Ok();
  }
  // A put of the value, after a quiet: every earlier put of this rank has landed at its target
  // before the signal is sent. The value goes out from this rank's outbox slot for `peer`
  // (symmetric memory, as remote transports need), reusable once the put completes in stream
  // order. Values fit in 32 bits in practice, so a torn 8-byte write cannot fake a larger one.
  // The background stream and the send lane have parts of their own: their puts and the
  // caller's run concurrently.
  nvshmemx_quiet_on_stream(stream);
  size_t part = 0;
  if (background_stream() != nullptr && stream == background_stream()) part = 1;
  if (sends_stream() != nullptr && stream == sends_stream()) part = 2;
  uint64_t* slot = static_cast<uint64_t*>(outbox_->local()) +
                   part * static_cast<size_t>(world_size()) + static_cast<size_t>(peer);
  ODC_CUDA_CHECK(store_u64(slot, value, stream));
  nvshmemx_putmem_on_stream(signal, slot, sizeof(uint64_t), peer, stream);
  ODC_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status NvshmemTransport::wait_signals(const SymmetricRegion& signals, const std::vector<int>& peers,
                                      uint64_t value, const std::string&, StreamHandle stream) {
  // NVSHMEM's peers announce no failure on the device (as for its folds): a dead fetcher is
  // named when the wait expires.
  return local().wait_slots(static_cast<const uint64_t*>(signals.local()), peers, value,
                            timeout_ns(), nullptr, stream);
}

Result<StreamHandle> NvshmemTransport::fork_background(StreamHandle stream) {
  auto background = DeviceTransport::fork_background(stream);
  if (!background.ok()) return background;
  if (const double delay_us = settings_.fetch_delay_us; delay_us > 0) {
    DeviceGuard guard(device());
    ODC_CUDA_CHECK(spin_for(static_cast<int64_t>(delay_us * 1e3), as_stream(background.value())));
  }
  return background;
}

Status NvshmemTransport::accumulate(float* dst, const void* src, DataType src_type, size_t count,
                                    StreamHandle stream) {
  // Reductions, not plain adds: the streamed fold may add into the same sums from another
  // stream at the same time (a gather's fold while a push adds this rank's own slice).
  return local().accumulate_reducing(dst, src, src_type, count, stream);
}

Status NvshmemTransport::fold_streamed(const kernels::StreamedFold& fold, StreamHandle stream) {
  DeviceGuard guard(device());
  ODC_CUDA_CHECK(nvshmem::fold_streamed(fold, device_error(), as_stream(stream)));
  return Status::Ok();
}

uint64_t* NvshmemTransport::claim_word(const CompareSwapOp& op) const {
  return reinterpret_cast<uint64_t*>(static_cast<char*>(op.region->local()) + op.offset);
}

cudaError_t NvshmemTransport::launch_compare_swap(const kernels::CompareSwapJob* jobs, int count,
                                                  uint64_t* old_values, cudaStream_t stream) {
  return ::odc::nvshmem::compare_swap(jobs, count, old_values, stream);
}

}  // namespace odc::nvshmem

extern "C" __attribute__((visibility("default"))) int odc_nvshmem_plugin_abi() {
  return ODC_NVSHMEM_PLUGIN_ABI;
}

extern "C" __attribute__((visibility("default"))) odc::Transport* odc_nvshmem_create(
    const odc::TransportSpec* spec, odc::Status* status) {
  auto made = odc::nvshmem::NvshmemTransport::create(*spec);
  if (!made.ok()) {
    *status = made.status().with_context("NVSHMEM " + odc::nvshmem::nvshmem_version_text());
    return nullptr;
  }
  *status = odc::Status::Ok();
  return std::move(made).value().release();
}
