// The streamed staging's layout and the owner's device loop as plain data (no CUDA types): what
// core/streamed_staging.h shares with the kernel that folds chunks on the device
// (kernels/streamed_fold.cuh) and with the host fold. A slot of a sender's ring at an owner is a
// ChunkHeader followed by up to a slot's payload of pushed elements.
#pragma once

#include <cstddef>
#include <cstdint>

namespace odc::kernels {

// The first 64 bytes of every slot. Written by the sender before the arrival signal that covers
// it, read by the owner only after that signal (or the end that covers it).
struct ChunkHeader {
  uint64_t sequence;   // this sender's chunk number to this owner, from 1 (the arrival signal)
  uint64_t minibatch;  // the minibatch it belongs to
  uint64_t buffer_id;  // the accumulator it adds to
  uint64_t first;      // first element of the owner's shard it adds to
  uint64_t count;      // payload elements
  uint32_t dtype;      // odc::DataType of the payload (float32 or bfloat16)
  uint32_t reserved32;
  uint64_t reserved[2];
};
static_assert(sizeof(ChunkHeader) == 64, "a chunk header fills its 64 bytes");

// An accumulator a device fold may add into: this owner's fp32 sums of buffer `buffer_id`.
struct FoldTarget {
  uint64_t buffer_id;
  float* sums;
  uint64_t count;
};

// The most accumulators one communicator folds into on the device: the table travels in the
// kernel's parameters (under the classic 4 KiB limit, so every launch stays cheap).
inline constexpr int kMaxFoldTargets = 160;

// What ends a device fold.
enum class FoldUntil : int32_t {
  kOnce = 0,      // one pass over what has arrived (an entry into odc)
  kCredit = 1,    // credits[peer] >= value: this rank may put its next chunk to `peer`
  kEnds = 2,      // the ends of minibatch `minibatch` of senders [ends_from, ends_to) consumed
  kMeetings = 3,  // meetings[s] >= value for every s, then everything arrived is folded
};

// One launch of the owner's fold. Pointers are this rank's local addresses of its symmetric
// regions (the credit slots too: the transport turns them into the sender's copy).
struct StreamedFold {
  const char* rings;              // sender s's ring at s * depth * slot_bytes
  uint64_t slot_bytes;            // header + payload
  uint64_t depth;                 // slots per sender
  const uint64_t* arrivals;       // slot s: the last chunk sender s put here
  const uint64_t* end_marks;      // slot s: the last minibatch sender s ended here
  const uint64_t* end_sequences;  // slot s: that end's sequence (raised before its mark)
  const uint64_t* meetings;       // slot s: meetings sender s entered
  const uint64_t* credits;        // slot p: the last sequence of ours owner p consumed
  uint64_t* folded;        // slot s: the last sequence of sender s consumed here (device only)
  uint64_t* locks;         // slot s: nonzero while a fold holds sender s (device only)
  uint64_t* credit_slots;  // the credits region: slot `rank` at sender s receives folded[s]
  uint64_t* credit_waits;  // one counter: kCredit launches that found no credit at first look
  uint64_t* ended;         // slot s: the last minibatch whose end of sender s was consumed here
  int rank = 0;
  int world_size = 0;
  uint64_t minibatch = 0;  // the open minibatch: every chunk folded must belong to it
  FoldUntil until = FoldUntil::kOnce;
  int peer = 0;        // kCredit: the owner whose credit is awaited
  uint64_t value = 0;  // kCredit: the credit needed; kMeetings: the meeting
  // kEnds: the senders whose ends it waits for (ends consumed earlier count as there): all of
  // them, or a node's first (node-aggregated pushes end on their node before they forward).
  int ends_from = 0;
  int ends_to = 0;
  int64_t timeout_ns = 0;
  // A pass of the progress thread (core/host_progress.h): its table of targets and its minibatch
  // were copied when it was enqueued, and an accumulator allocated since may already get chunks
  // (peers push into it once their allocation returned, before this rank set its table). Such a
  // pass leaves a chunk that is in order but not for its table or minibatch to the caller's
  // folds, which know the current ones, instead of refusing it; it folds and credits what came
  // before it. Every other fold refuses it (a chunk for no live accumulator).
  bool leave_unknown = false;
  int num_targets = 0;
  FoldTarget targets[kMaxFoldTargets];
};
static_assert(sizeof(StreamedFold) <= 4096, "a fold's parameters stay under 4 KiB");

}  // namespace odc::kernels
