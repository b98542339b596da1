// The ODC protocol (core/communicator) at scale on the in-memory transport, threads as ranks:
// 2 to 256 ranks, 1,000 minibatches of random uneven pushes (some ranks push nothing), exact
// integer sums read by every rank from every owner right after minibatch_end with no extra
// barrier; every accumulation scheme (streamed with the host's and with the device's steps,
// remote add, pulled); deterministic mode
// bit for bit under random delays; and every injected fault (death, dropped and duplicated
// signals and credits, reordering, a slow owner, collective mismatch) detected and named, with no
// hang and no partial sum reported as success.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/env.h"
#include "core/communicator.h"
#include "core/device_staging_ops.h"
#include "core/device_streamed_staging.h"
#include "protocol_harness.h"
#include "transport/fault/fault_transport.h"
#include "transport/mem/mem_transport.h"
#include "transport/transport_wrapper.h"

namespace odc {
namespace {

using testing::comm_options_for;
using testing::describe;
using testing::is_scheme;
using testing::kAllSchemes;
using testing::mem_options_for;
using testing::run_threads;
using testing::Scheme;
using testing::scheme_label;

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ODC_UNDER_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define ODC_UNDER_TSAN 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ODC_UNDER_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define ODC_UNDER_ASAN 1
#endif
#ifdef ODC_UNDER_TSAN
// ThreadSanitizer runs these ~10x slower and tracks at most a few thousand threads' histories:
// the same tests, scaled down (scripts/sanitize.sh).
constexpr int kScaleDivisor = 10;
// Signals that run ahead of their data are races by construction (the protocol names them; the
// sanitizer would stop at the racy read first): those faults run in the other builds only.
constexpr bool kInjectRacyFaults = false;
#elif defined(ODC_UNDER_ASAN)
// AddressSanitizer runs them ~3x slower: at most 64 ranks and 250 minibatches there (the
// Release build runs them whole).
constexpr int kScaleDivisor = 4;
constexpr bool kInjectRacyFaults = true;
#else
constexpr int kScaleDivisor = 1;
constexpr bool kInjectRacyFaults = true;
#endif

// Pushes of `rank` in minibatch `m`: 0 to 3, a quarter of them zero.
int num_pushes(uint32_t seed, int m, int rank) {
  std::seed_seq seq{seed, static_cast<uint32_t>(m), static_cast<uint32_t>(rank)};
  std::mt19937 rng(seq);
  return static_cast<int>(rng() % 4);
}

// Element j of push `call` of `sender` in minibatch `m`: a small integer, so every partial sum
// is exact in fp32 whatever the order.
float value(int m, int sender, int call, size_t j) {
  return static_cast<float>((m * 7 + sender * 3 + call * 5) % 17) + static_cast<float>(j % 64);
}

struct Expected {  // per minibatch: sum over pushes of the (m, sender, call) term, and #pushes
  std::vector<double> base;
  std::vector<int> pushes;
};

Expected expected_sums(uint32_t seed, int world, int num_minibatches) {
  Expected e;
  for (int m = 0; m < num_minibatches; ++m) {
    double base = 0;
    int pushes = 0;
    for (int s = 0; s < world; ++s) {
      for (int call = 0, calls = num_pushes(seed, m, s); call < calls; ++call) {
        base += value(m, s, call, 0);
        ++pushes;
      }
    }
    e.base.push_back(base);
    e.pushes.push_back(pushes);
  }
  return e;
}

// Streamed makes about ten times the transport calls per minibatch (chunks).
bool is_streamed(Scheme scheme) {
  return scheme == Scheme::kStreamed || scheme == Scheme::kStreamedDevice;
}

struct RunOptions {
  int world = 2;
  int num_minibatches = 10;
  size_t count = 2;  // shard elements per owner
  Scheme scheme = Scheme::kStreamed;
  uint32_t seed = 7;
  double timeout_s = 60;
  // Pretend nodes of this many ranks (the transport's report); 0: one node.
  int ranks_per_node = 0;
  // Also a published buffer, rewritten by its owners between minibatches and gathered inside
  // each (from the node cache where there are several nodes), checked exactly.
  bool published = false;
  // Streamed with several nodes: pushes to other nodes aggregated per node.
  bool aggregate = false;
};

// Element j of owner `owner`'s published shard in minibatch `m`: a small integer, exact in bf16.
float published_value(int m, int owner, size_t j) {
  return static_cast<float>((m * 3 + owner * 5 + static_cast<int>(j)) % 101);
}

// Inside minibatch m: gathers `params` (every other minibatch narrowed to bf16) and compares.
std::string check_published(Communicator& comm, Buffer* params, int m) {
  const int world = comm.world_size();
  const size_t total = static_cast<size_t>(world) * params->count;
  const bool narrowed = m % 2 == 1;
  std::vector<float> wide(total);
  std::vector<uint16_t> halves(total);
  Status s = narrowed ? comm.gather_as(halves.data(), total, DataType::kBfloat16, params, nullptr)
                      : comm.gather(wide.data(), total, params, nullptr);
  if (!s.ok()) return s.message();
  for (size_t j = 0; j < total; ++j) {
    const int owner = static_cast<int>(j / params->count);
    const float want = published_value(m, owner, j % params->count);
    const float got = narrowed ? bf16_to_float(halves[j]) : wide[j];
    if (got != want) {
      return "wrong published shard: minibatch " + std::to_string(m) + " element " +
             std::to_string(j) + " (owner " + std::to_string(owner) + "): got " +
             std::to_string(got) + ", expected " + std::to_string(want);
    }
  }
  return "";
}

// The check every rank runs: minibatches of uneven pushes; after each minibatch_end it gathers
// every owner's sums (no barrier in between) and compares them exactly.
std::string run_rank(Communicator& comm, const RunOptions& o, const Expected& expected,
                     int* completed) {
  const int world = comm.world_size();
  auto acc = comm.allocate(o.count, DataType::kFloat32, /*accumulator=*/true);
  if (!acc.ok()) return acc.status().message();
  Buffer* params = nullptr;
  if (o.published) {
    auto made = comm.allocate(o.count, DataType::kFloat32, false, "params", /*published=*/true);
    if (!made.ok()) return made.status().message();
    params = made.value();
  }
  std::vector<float> src(static_cast<size_t>(world) * o.count);
  std::vector<float> sums(src.size());
  for (int m = 0; m < o.num_minibatches; ++m) {
    if (params != nullptr) {  // the owner's step: only between minibatches
      auto* shard = static_cast<float*>(params->local());
      for (size_t j = 0; j < params->count; ++j) shard[j] = published_value(m, comm.rank(), j);
    }
    if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
    if (params != nullptr) {
      if (std::string wrong = check_published(comm, params, m); !wrong.empty()) return wrong;
    }
    for (int call = 0, calls = num_pushes(o.seed, m, comm.rank()); call < calls; ++call) {
      for (size_t j = 0; j < src.size(); ++j) src[j] = value(m, comm.rank(), call, j);
      if (Status s = comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32,
                                             acc.value(), nullptr);
          !s.ok()) {
        return s.message();
      }
    }
    if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
    if (Status s = comm.gather(sums.data(), sums.size(), acc.value(), nullptr); !s.ok()) {
      return s.message();
    }
    for (size_t j = 0; j < sums.size(); ++j) {
      const double want = expected.base[m] + static_cast<double>(expected.pushes[m]) * (j % 64);
      if (sums[j] != want) {
        return "wrong sum: minibatch " + std::to_string(m) + " element " + std::to_string(j) +
               " (owner " + std::to_string(j / o.count) + "): got " + std::to_string(sums[j]) +
               ", expected " + std::to_string(want);
      }
    }
    if (completed != nullptr) *completed = m + 1;
  }
  return "";
}

void run_clean(const RunOptions& o, size_t staging_bytes = 0) {
  auto world =
      mem::MemWorld::create(o.world, mem_options_for(o.scheme, o.timeout_s, o.ranks_per_node));
  const Expected expected = expected_sums(o.seed, o.world, o.num_minibatches);
  const auto outcome = run_threads(o.world, [&](int rank) {
    Communicator comm(world->join(rank),
                      comm_options_for(o.scheme, o.world, staging_bytes, o.aggregate));
    if (!is_scheme(comm, o.scheme)) {
      return std::string("wrong scheme ") + scheme_name(comm.scheme());
    }
    std::string verdict = run_rank(comm, o, expected, nullptr);
    const bool nodes = o.ranks_per_node > 0 && o.ranks_per_node < o.world;
    if (verdict.empty() && o.published && nodes &&
        (comm.node_cache() == nullptr || comm.node_cache()->num_cached() != 1)) {
      return std::string("the published buffer was not served from the node cache");
    }
    // Aggregation engages with several ranks per node.
    const bool aggregating = o.aggregate && nodes && o.ranks_per_node > 1;
    if (verdict.empty() && aggregating &&
        (comm.staging() == nullptr || comm.staging()->relays().size() != 1)) {
      return std::string("the accumulator's pushes were not aggregated");
    }
    return verdict;
  });
  EXPECT_EQ(describe(outcome), "");
}

class Scale : public ::testing::TestWithParam<std::tuple<Scheme, int>> {};

// Pretend nodes of the scale tests: 2 of 1 rank, 4 of 16, 16 of 16 (the cost per minibatch grows
// with the nodes: a fetch and a forwarded row per other node and rank).
int pretend_ranks_per_node(int world) {
  return world == 2 ? 1 : 16;
}

TEST_P(Scale, ThousandMinibatchesExact) {
  // Pushes (streamed: aggregated per pretend node) and, inside every minibatch, a gather of
  // published shards from the node cache.
  RunOptions o;
  o.scheme = std::get<0>(GetParam());
  o.world = std::get<1>(GetParam());
  o.num_minibatches = 1000 / kScaleDivisor;
  if (o.world > 64 && kScaleDivisor > 1) o.world = 64;
  o.ranks_per_node = pretend_ranks_per_node(o.world);
  // Under the sanitizers (scaled down) the node schemes run in their own tests (NodeCache,
  // NodeAggregation, Faults.NodeSchemes*), which keeps CI's sanitizer runs lean.
  o.published = kScaleDivisor == 1;
  o.aggregate = kScaleDivisor == 1 && is_streamed(o.scheme);
  run_clean(o);
}

INSTANTIATE_TEST_SUITE_P(Schemes, Scale,
                         ::testing::Combine(::testing::Values(Scheme::kStreamed,
                                                              Scheme::kStreamedDevice,
                                                              Scheme::kRemoteAdd, Scheme::kPulled),
                                            ::testing::Values(2, 64, 256)),
                         [](const ::testing::TestParamInfo<std::tuple<Scheme, int>>& info) {
                           std::string name = scheme_label(std::get<0>(info.param));
                           name.erase(std::remove(name.begin(), name.end(), '-'), name.end());
                           return name + "_" + std::to_string(std::get<1>(info.param)) + "ranks";
                         });

// The node cache on 2 pretend nodes of 4: each remote shard of a cached buffer crosses to a node
// once per minibatch (one row per rank), gathers read no other node; a buffer the budget has no
// room for is gathered flat; budget 0 is flat for all; the bytes it holds are what it reports.
TEST(NodeCache, EachRemoteShardCrossesOncePerNodeAndMinibatch) {
  const int world = 8;
  const int per_node = 4;
  const size_t count = 64;  // 256-byte shards: rows need no padding
  const int minibatches = 5;
  const int gathers = 2;  // per buffer and minibatch
  // One row per rank and cached buffer, plus the ready words: room for the first buffer only.
  const size_t fits_one = count * sizeof(float) + world * sizeof(uint64_t);
  for (size_t budget : {fits_one, size_t{0}}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    auto mem_world =
        mem::MemWorld::create(world, mem_options_for(Scheme::kRemoteAdd, 30, per_node));
    std::vector<size_t> across(world), held(world);
    const auto outcome = run_threads(world, [&](int rank) -> std::string {
      auto transport =
          std::make_unique<fault::FaultTransport>(mem_world->join(rank), fault::FaultPlan{});
      fault::FaultTransport* counted = transport.get();
      CommOptions options;
      options.node_cache_bytes = budget;
      Communicator comm(std::move(transport), options);
      Buffer* buffers[2];
      for (Buffer*& buffer : buffers) {
        auto made = comm.allocate(count, DataType::kFloat32, false, "", /*published=*/true);
        if (!made.ok()) return made.status().message();
        buffer = made.value();
      }
      const size_t before = [&] {
        size_t sum = 0;
        for (int p = 0; p < world; ++p) sum += counted->bytes_read_from(p);
        return sum;
      }();
      if (before != 0) return "read before any gather";
      for (int m = 0; m < minibatches; ++m) {
        for (Buffer* buffer : buffers) {
          auto* shard = static_cast<float*>(buffer->local());
          for (size_t j = 0; j < count; ++j) shard[j] = published_value(m, rank, j);
        }
        if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
        for (int g = 0; g < gathers; ++g) {
          for (Buffer* buffer : buffers) {
            std::vector<float> all(world * count);
            if (Status s = comm.gather(all.data(), all.size(), buffer, nullptr); !s.ok()) {
              return s.message();
            }
            for (size_t j = 0; j < all.size(); ++j) {
              if (all[j] != published_value(m, static_cast<int>(j / count), j % count)) {
                return "wrong published shard at element " + std::to_string(j);
              }
            }
          }
        }
        if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
      }
      for (int p = 0; p < world; ++p) {
        if (p / per_node != rank / per_node) across[rank] += counted->bytes_read_from(p);
      }
      held[rank] = comm.memory().node_cache_bytes;
      return "";
    });
    ASSERT_EQ(describe(outcome), "");
    const size_t shard_bytes = count * sizeof(float);
    const size_t remote_owners = world - per_node;
    for (int rank = 0; rank < world; ++rank) {
      size_t want = 0;
      if (budget == 0) {  // both flat: every gather reads every remote owner
        want = minibatches * 2 * gathers * remote_owners * shard_bytes;
        EXPECT_EQ(held[rank], 0u);
      } else {  // the first: one row per minibatch; the second flat
        want = minibatches * (shard_bytes + gathers * remote_owners * shard_bytes);
        EXPECT_EQ(held[rank], fits_one);
      }
      EXPECT_EQ(across[rank], want) << "rank " << rank;
    }
  }
}

// Node-aggregated pushes on 2 pretend nodes of 4 (host and device steps): every rank pushes a
// full gradient each minibatch; the bytes put across the node boundary are one slice per other
// node and accumulator (the rank's relay row: on the host each piece as soon as the node's 4
// slices are in it, on the device at minibatch_end) instead of one per remote owner, so 4x fewer;
// sums exact; the relay rows are the scheme's bytes beyond the rings.
TEST(NodeAggregation, EachRankSendsOneSlicePerOtherNode) {
  const int world = 8;
  const int per_node = 4;
  const size_t count = 1000;
  const int minibatches = 4;
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice}) {
    for (bool aggregate : {false, true}) {
      SCOPED_TRACE(std::string(scheme_label(scheme)) + (aggregate ? " aggregated" : " direct"));
      auto mem_world = mem::MemWorld::create(world, mem_options_for(scheme, 30, per_node));
      std::vector<size_t> across(world), relay_bytes(world), chunk_bytes(world);
      const auto outcome = run_threads(world, [&](int rank) -> std::string {
        auto transport =
            std::make_unique<fault::FaultTransport>(mem_world->join(rank), fault::FaultPlan{});
        fault::FaultTransport* counted = transport.get();
        Communicator comm(std::move(transport), comm_options_for(scheme, world, 0, aggregate));
        auto acc = comm.allocate(count, DataType::kFloat32, /*accumulator=*/true);
        if (!acc.ok()) return acc.status().message();
        std::vector<float> src(world * count), sums(world * count);
        for (int m = 0; m < minibatches; ++m) {
          for (size_t j = 0; j < src.size(); ++j) src[j] = value(m, rank, 0, j);
          if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
          if (Status s = comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32,
                                                 acc.value(), nullptr);
              !s.ok()) {
            return s.message();
          }
          if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
          if (Status s = comm.gather(sums.data(), sums.size(), acc.value(), nullptr); !s.ok()) {
            return s.message();
          }
          for (size_t j = 0; j < sums.size(); ++j) {
            double want = 0;
            for (int r = 0; r < world; ++r) want += value(m, r, 0, j);
            if (sums[j] != want) return "wrong sum at element " + std::to_string(j);
          }
        }
        for (int p = 0; p < world; ++p) {
          if (p / per_node != rank / per_node) across[rank] += counted->bytes_put_to(p);
        }
        relay_bytes[rank] = comm.memory().scheme_bytes - comm.staging()->allocated_bytes();
        const size_t payload = comm.staging()->geometry().payload_bytes();
        const size_t chunks = (count * sizeof(float) + payload - 1) / payload;
        chunk_bytes[rank] = count * sizeof(float) + chunks * kChunkHeaderBytes;
        return "";
      });
      ASSERT_EQ(describe(outcome), "");
      for (int rank = 0; rank < world; ++rank) {
        // Direct: a slice to each of the 4 owners on the other node; aggregated: its one row.
        const size_t slices = aggregate ? 1 : world - per_node;
        EXPECT_EQ(across[rank], minibatches * slices * chunk_bytes[rank]) << "rank " << rank;
        EXPECT_EQ(relay_bytes[rank], aggregate ? count * sizeof(float) : 0u) << "rank " << rank;
      }
    }
  }
}

// Several pushes of the same accumulator per minibatch (microbatches), fp32 and bf16, 0 to 3 per
// rank and minibatch as LB-Mini gives them, under node aggregation on 2 pretend nodes of 4 (host
// and device steps, one relay rule): sums exact. What crosses the node boundary is the relay rows'
// forwards and nothing else, all inside minibatch_end (the core's own count, node_traffic(),
// agrees with the transport's): per node and minibatch, each remote owner receives exactly one
// row, one fp32 slice, from one carrier of that node, whatever the node's c pushes (0 included:
// the device cannot tell which rows took contributions, so neither path asks). Flat pushes would
// put c slices per remote owner: fp32 pushes never cross more than flat's bytes once the node
// pushed at all, and 1/4 of them when it pushed whole rounds; bf16 ones, forwarded in fp32, no
// more than flat's from two pushes on.
TEST(NodeAggregation, SeveralPushesPerMinibatchExactAndOneRowPerOwnerAtMinibatchEnd) {
  const int world = 8;
  const int per_node = 4;
  const size_t count = 1000;
  const int minibatches = 6;
  const int remote_owners = world - per_node;  // a row each, carried by one rank of the node
  std::vector<std::vector<int>> pushes(minibatches, std::vector<int>(world));
  for (int m = 0; m < minibatches; ++m) {
    for (int r = 0; r < world; ++r) pushes[m][r] = num_pushes(11, m, r);
  }
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice}) {
    for (DataType dtype : {DataType::kFloat32, DataType::kBfloat16}) {
      SCOPED_TRACE(std::string(scheme_label(scheme)) + " " + std::string(dtype_name(dtype)));
      auto mem_world = mem::MemWorld::create(world, mem_options_for(scheme, 30, per_node));
      // Per rank and minibatch: bytes put across the node boundary, and the chunk geometry; per
      // rank and owner: bytes put to it over the whole run; per rank: the core's own count.
      std::vector<std::vector<size_t>> across(world, std::vector<size_t>(minibatches));
      std::vector<std::vector<size_t>> to_owner(world, std::vector<size_t>(world));
      std::vector<size_t> payload(world);
      std::vector<NodeTraffic> traffic(world);
      const auto outcome = run_threads(world, [&](int rank) -> std::string {
        auto transport =
            std::make_unique<fault::FaultTransport>(mem_world->join(rank), fault::FaultPlan{});
        fault::FaultTransport* counted = transport.get();
        Communicator comm(std::move(transport), comm_options_for(scheme, world, 0, true));
        auto acc = comm.allocate(count, DataType::kFloat32, /*accumulator=*/true);
        if (!acc.ok()) return acc.status().message();
        if (comm.staging()->relays().size() != 1) return std::string("not aggregated");
        auto put_across = [&] {
          size_t bytes = 0;
          for (int p = 0; p < world; ++p) {
            if (p / per_node != rank / per_node) bytes += counted->bytes_put_to(p);
          }
          return bytes;
        };
        std::vector<float> src(world * count), sums(world * count);
        std::vector<uint16_t> halves(src.size());
        for (int m = 0; m < minibatches; ++m) {
          if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
          const size_t before = put_across();
          for (int call = 0; call < pushes[m][rank]; ++call) {
            for (size_t j = 0; j < src.size(); ++j) src[j] = value(m, rank, call, j);
            const bool narrow = dtype == DataType::kBfloat16;
            if (narrow) {
              for (size_t j = 0; j < src.size(); ++j) halves[j] = float_to_bf16(src[j]);
            }
            Status s = comm.scatter_accumulate(narrow ? static_cast<const void*>(halves.data())
                                                      : static_cast<const void*>(src.data()),
                                               src.size(), dtype, acc.value(), nullptr);
            if (!s.ok()) return s.message();
          }
          if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
          across[rank][m] = put_across() - before;
          if (Status s = comm.gather(sums.data(), sums.size(), acc.value(), nullptr); !s.ok()) {
            return s.message();
          }
          for (size_t j = 0; j < sums.size(); ++j) {
            double want = 0;
            for (int r = 0; r < world; ++r) {
              for (int call = 0; call < pushes[m][r]; ++call) want += value(m, r, call, j);
            }
            if (sums[j] != want) {
              return "wrong sum in minibatch " + std::to_string(m) + " at element " +
                     std::to_string(j) + ": " + std::to_string(sums[j]) + " vs " +
                     std::to_string(want);
            }
          }
        }
        for (int p = 0; p < world; ++p) to_owner[rank][p] = counted->bytes_put_to(p);
        payload[rank] = comm.staging()->geometry().payload_bytes();
        traffic[rank] = comm.staging()->node_traffic();
        return "";
      });
      ASSERT_EQ(describe(outcome), "");
      const size_t piece = payload[0] / sizeof(float);  // fp32 elements per forwarded chunk
      const size_t pieces = (count + piece - 1) / piece;
      const size_t slice = count * sizeof(float) + pieces * kChunkHeaderBytes;
      const size_t push_element = dtype == DataType::kFloat32 ? 4 : 2;
      const size_t push_chunks = (count * push_element + payload[0] - 1) / payload[0];
      const size_t flat_slice = count * push_element + push_chunks * kChunkHeaderBytes;
      int rounds_over_c = 0;  // minibatches where some node pushed more than once per rank
      for (int rank = 0; rank < world; ++rank) {
        size_t total = 0;
        for (int m = 0; m < minibatches; ++m) total += across[rank][m];
        // Every byte across nodes is a relay forward inside minibatch_end.
        EXPECT_EQ(traffic[rank].during_minibatches, 0u) << "rank " << rank;
        EXPECT_EQ(traffic[rank].in_minibatch_end, total) << "rank " << rank;
      }
      for (int owner = 0; owner < world; ++owner) {
        for (int node = 0; node < world / per_node; ++node) {
          if (node == owner / per_node) continue;
          // One carrier of that node sends the owner its row each minibatch, the others nothing.
          int carriers = 0;
          for (int r = node * per_node; r < (node + 1) * per_node; ++r) {
            if (to_owner[r][owner] == 0) continue;
            ++carriers;
            EXPECT_EQ(to_owner[r][owner], minibatches * slice)
                << "rank " << r << " to owner " << owner;
          }
          EXPECT_EQ(carriers, 1) << "node " << node << " to owner " << owner;
        }
      }
      for (int m = 0; m < minibatches; ++m) {
        for (int node = 0; node < world / per_node; ++node) {
          int c = 0;
          size_t bytes = 0;
          for (int r = node * per_node; r < (node + 1) * per_node; ++r) {
            c += pushes[m][r];
            bytes += across[r][m];
          }
          SCOPED_TRACE("minibatch " + std::to_string(m) + " node " + std::to_string(node) + ": " +
                       std::to_string(c) + " pushes");
          EXPECT_EQ(bytes, remote_owners * slice);  // every row, pushed into or not
          const size_t flat = static_cast<size_t>(c) * remote_owners * flat_slice;
          if (dtype == DataType::kFloat32 && c > 0) {
            // One slice against c: never more than flat; 1/4 of it when the node pushed whole
            // rounds.
            EXPECT_LE(bytes, flat);
            if (c % per_node == 0) {
              EXPECT_LE(bytes * per_node, flat);
            }
          } else if (c >= 2) {
            // Forwards are fp32: one fp32 slice is within two bf16 ones (a lone bf16 push crosses
            // in twice its bytes).
            EXPECT_LE(bytes, flat);
          }
          rounds_over_c += c > per_node ? 1 : 0;
        }
      }
      EXPECT_GT(rounds_over_c, 0) << "no node pushed more than one round: the case is not covered";
    }
  }
}

// Some accumulators relayed, some not (the budget has room for one of two): while a rank waits
// for its node's ends, the other node's ranks may still push the direct one to it through full
// rings; every wait folds every sender, so all finish; sums exact (host and device steps).
TEST(NodeAggregation, RelayedAndDirectAccumulatorsTogether) {
  const int world = 4;
  const size_t count = 1000;  // 16 chunks per slice through six-slot rings: credit waits
  // The sums each minibatch must give (seeding a generator per element and push took a minute).
  const Expected expected = expected_sums(3, world, 20);
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice}) {
    SCOPED_TRACE(scheme_label(scheme));
    auto mem_world = mem::MemWorld::create(world, mem_options_for(scheme, 10, 2));
    const auto outcome = run_threads(world, [&](int rank) -> std::string {
      CommOptions options = comm_options_for(scheme, world);
      options.node_aggregation_bytes = count * sizeof(float);  // one relay of one row
      Communicator comm(mem_world->join(rank), options);
      Buffer* accs[2];
      for (Buffer*& acc : accs) {
        auto made = comm.allocate(count, DataType::kFloat32, /*accumulator=*/true);
        if (!made.ok()) return made.status().message();
        acc = made.value();
      }
      if (comm.staging()->relays().size() != 1) return std::string("expected one relay");
      std::vector<float> src(world * count), sums(world * count);
      for (int m = 0; m < 20; ++m) {
        if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
        for (int call = 0, calls = num_pushes(3, m, rank); call < calls; ++call) {
          for (size_t j = 0; j < src.size(); ++j) src[j] = value(m, rank, call, j);
          for (Buffer* acc : accs) {
            Status s =
                comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32, acc, nullptr);
            if (!s.ok()) return s.message();
          }
        }
        if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
        for (Buffer* acc : accs) {
          if (Status s = comm.gather(sums.data(), sums.size(), acc, nullptr); !s.ok()) {
            return s.message();
          }
          for (size_t j = 0; j < sums.size(); ++j) {
            const double want =
                expected.base[m] + static_cast<double>(expected.pushes[m]) * (j % 64);
            if (sums[j] != want) return "wrong sum at element " + std::to_string(j);
          }
        }
      }
      return "";
    });
    EXPECT_EQ(describe(outcome), "");
  }
}

// What each scheme adds per rank, from the bytes the core asks the transport for: the shards
// (count fp32), and per scheme: remote add nothing; streamed the rings and signals cut from the
// staging budget, once per communicator, at most the budget whatever the model and world size;
// streamed with the device's steps the same geometry, shallower where two outbox slots and the
// fold's words must fit too; pulled (deterministic) one pending buffer of world x count fp32 (4
// bytes per full-gradient element) plus one fixed scratch per communicator.
TEST(Memory, EachSchemeAllocatesItsDocumentedBytes) {
  const size_t budget = size_t{1} << 20;
  for (int world : {2, 64, 256}) {
    for (Scheme scheme :
         {Scheme::kRemoteAdd, Scheme::kStreamed, Scheme::kStreamedDevice, Scheme::kPulled}) {
      if (world == 256 && scheme == Scheme::kPulled) continue;
      auto mem_world = mem::MemWorld::create(world, mem_options_for(scheme, 60));
      const size_t count = 1000;  // elements per shard; two accumulators
      std::vector<size_t> allocated(static_cast<size_t>(world));
      std::vector<size_t> staging(static_cast<size_t>(world));
      const auto outcome = run_threads(world, [&](int rank) -> std::string {
        auto transport =
            std::make_unique<fault::FaultTransport>(mem_world->join(rank), fault::FaultPlan{});
        fault::FaultTransport* counted = transport.get();
        Communicator comm(std::move(transport), comm_options_for(scheme, world, budget));
        if (!is_scheme(comm, scheme)) return "wrong scheme";
        for (int i = 0; i < 2; ++i) {
          if (!comm.allocate(count, DataType::kFloat32, true).ok()) return "alloc failed";
        }
        allocated[static_cast<size_t>(rank)] = counted->allocated_bytes();
        // What the communicator reports (odcCommGetMemory) is what it allocated.
        const Communicator::Memory memory = comm.memory();
        if (memory.buffer_bytes != 2 * count * sizeof(float) ||
            memory.buffer_bytes + memory.scheme_bytes != counted->allocated_bytes()) {
          return "memory() reports " + std::to_string(memory.buffer_bytes) + " + " +
                 std::to_string(memory.scheme_bytes) + " bytes, allocated " +
                 std::to_string(counted->allocated_bytes());
        }
        if (comm.staging() != nullptr) {
          staging[static_cast<size_t>(rank)] = comm.staging()->allocated_bytes();
        }
        return "";
      });
      ASSERT_EQ(describe(outcome), "");
      const size_t shards = 2 * count * sizeof(float);
      const size_t full = 2 * static_cast<size_t>(world) * count * sizeof(float);
      size_t want = shards;
      if (scheme == Scheme::kStreamed) {
        // Host rings: payloads no larger than an accumulator's shard (count fp32).
        const auto geometry =
            RingGeometry::for_budget(budget, world, kMaxChunkPayloadBytes, count * sizeof(float));
        ASSERT_TRUE(geometry.ok());
        want += geometry.value().total_bytes(world);
        EXPECT_LE(want - shards, budget) << "at " << world << " ranks";
        EXPECT_GE(geometry.value().depth, 8u) << "at " << world << " ranks";
      }
      if (scheme == Scheme::kStreamedDevice) {
        // The device steps add the fold's words (folded, locks, ended, a counter) and two
        // outbox slots, from the same budget, with the device's larger payloads.
        const auto geometry = RingGeometry::for_budget(budget, world, kMaxDeviceChunkPayloadBytes);
        ASSERT_TRUE(geometry.ok());
        const size_t extra = (3 * static_cast<size_t>(world) + 1) * sizeof(uint64_t) +
                             2 * geometry.value().slot_bytes;
        size_t depth = geometry.value().depth;
        RingGeometry fitted = geometry.value();
        while (fitted.total_bytes(world) + extra > budget && fitted.depth > 1) --fitted.depth;
        depth = fitted.depth;
        want += fitted.total_bytes(world) + extra;
        EXPECT_LE(want - shards, budget) << "at " << world << " ranks";
        EXPECT_GE(depth, 7u) << "at " << world << " ranks";
      }
      if (scheme == Scheme::kPulled) want += full + kPullChunkBytes;
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(allocated[static_cast<size_t>(r)], want)
            << scheme_label(scheme) << " at " << world << " ranks";
        if (scheme == Scheme::kStreamed || scheme == Scheme::kStreamedDevice) {
          EXPECT_EQ(staging[static_cast<size_t>(r)] + shards, want);
        }
      }
    }
  }
}

// The byte knobs (ODC_STAGING_BYTES, ODC_NODE_CACHE_BYTES, ODC_NODE_AGGREGATION_BYTES) and the
// rank counts read numbers through one parser: 0 in any spelling is 0 (a node budget of "00" is
// "off", not "not a number"), and only plain digits with one K/M/G suffix are numbers.
TEST(Memory, ByteKnobsReadZeroInAnySpellingAndOnlyPlainDigits) {
  EXPECT_EQ(parse_count("0", SIZE_MAX, true), std::optional<uint64_t>(0));
  EXPECT_EQ(parse_count("00", SIZE_MAX, true), std::optional<uint64_t>(0));
  EXPECT_EQ(parse_count("0K", SIZE_MAX, true), std::optional<uint64_t>(0));
  EXPECT_EQ(parse_count("007", SIZE_MAX, true), std::optional<uint64_t>(7));
  EXPECT_EQ(parse_count("256m", SIZE_MAX, true), std::optional<uint64_t>(256ull << 20));
  EXPECT_EQ(parse_count("18446744073709551615", SIZE_MAX, true),
            std::optional<uint64_t>(UINT64_MAX));
  for (const char* text : {"", "lots", "-1", "+5", " 5", "5 ", "1_0", "1.5", "5KB", "5T",
                           "18446744073709551616", "17179869184G"}) {
    EXPECT_EQ(parse_count(text, SIZE_MAX, true), std::nullopt) << "'" << text << "'";
  }
  EXPECT_EQ(parse_count("4K", SIZE_MAX, /*size_suffix=*/false), std::nullopt);
  EXPECT_EQ(parse_count("9", 8), std::nullopt);
  // Positive knobs (the staging budget, ranks per node) refuse 0 however it is written.
  EXPECT_EQ(positive_integer("00", SIZE_MAX, true), 0u);
  EXPECT_EQ(positive_integer("2", 8), 2u);
}

// Host rings hold what the model can put in flight, up to the budget. Made with
// the first accumulator (a 400-byte shard: 16 slots of 512 bytes per sender, not the budget's 8
// of 64 KiB), they grow at the minibatch_begin after a larger accumulator came (to the budget's
// cut, no further), never shrink, and keep their counts; every sum stays exact. Device rings are
// the budget's from the start. Before, every communicator held the budget whatever the model (16
// local ranks 3.75 GiB of /dev/shm at the default budget).
TEST(Memory, HostRingsHoldWhatTheAccumulatorsNeedUpToTheBudget) {
  const int world = 2;
  const size_t budget = size_t{1} << 20;
  const size_t small = 100;     // fp32 elements per shard
  const size_t large = 50'000;  // a 200,000-byte slice per owner: more than the budget's payload
  const auto cut = [&](size_t slice_bytes) {
    return RingGeometry::for_budget(budget, world, kMaxChunkPayloadBytes, slice_bytes).value();
  };
  EXPECT_EQ(cut(small * 4).slot_bytes, 512u);
  EXPECT_EQ(cut(small * 4).depth, 16u);
  EXPECT_EQ(cut(large * 4), RingGeometry::for_budget(budget, world).value());
  EXPECT_EQ(cut(large * 4).total_bytes(world), 1'047'632u);  // docs/runtime.md's budget cut
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice}) {
    SCOPED_TRACE(scheme_label(scheme));
    auto mem_world = mem::MemWorld::create(world, mem_options_for(scheme, 20));
    const auto outcome = run_threads(world, [&](int rank) -> std::string {
      Communicator comm(mem_world->join(rank), comm_options_for(scheme, world, budget));
      const bool host = scheme == Scheme::kStreamed;
      auto first = comm.allocate(small, DataType::kFloat32, true);
      if (!first.ok()) return first.status().message();
      const size_t made = comm.staging()->allocated_bytes();
      const size_t want_made =
          host ? cut(small * 4).total_bytes(world)
               : DeviceStreamedStaging::bytes_for(
                     DeviceStreamedStaging::geometry_for(budget, world).value(), world);
      if (made != want_made) return "first rings of " + std::to_string(made) + " bytes";
      // One minibatch through the small rings, so that there are counts to carry.
      std::vector<float> src(world * large, 1.0f), sums(world * large);
      if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
      if (Status s = comm.scatter_accumulate(src.data(), world * small, DataType::kFloat32,
                                             first.value(), nullptr);
          !s.ok()) {
        return s.message();
      }
      if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
      const uint64_t sent_before = comm.staging()->chunks_sent();
      auto second = comm.allocate(large, DataType::kFloat32, true);
      if (!second.ok()) return second.status().message();
      if (comm.staging()->allocated_bytes() != made) return "the rings changed at alloc";
      for (int m = 0; m < 3; ++m) {
        if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
        const size_t grown = comm.staging()->allocated_bytes();
        if (grown != (host ? 1'047'632u : made)) {
          return "rings of " + std::to_string(grown) + " bytes in minibatch " + std::to_string(m);
        }
        for (Buffer* acc : {first.value(), second.value()}) {
          for (int push = 0; push < 3; ++push) {
            if (Status s = comm.scatter_accumulate(src.data(), world * acc->count,
                                                   DataType::kFloat32, acc, nullptr);
                !s.ok()) {
              return s.message();
            }
          }
        }
        if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
        for (Buffer* acc : {first.value(), second.value()}) {
          if (Status s = comm.gather(sums.data(), world * acc->count, acc, nullptr); !s.ok()) {
            return s.message();
          }
          for (size_t j = 0; j < world * acc->count; ++j) {
            if (sums[j] != 3.0f * world) return "wrong sum at element " + std::to_string(j);
          }
        }
      }
      if (comm.staging()->chunks_sent() <= sent_before) return "the chunk count started over";
      // Never shrink: freeing the large accumulator leaves the rings as they are.
      if (Status s = comm.release(second.value()); !s.ok()) return s.message();
      if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
      if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
      if (comm.staging()->allocated_bytes() != (host ? 1'047'632u : made)) return "rings shrank";
      return "";
    });
    EXPECT_EQ(describe(outcome), "");
  }
}

// The budget is cut into at least one slot per sender or refused, naming what it needs.
TEST(Memory, StagingBudgetTooSmallForTheWorldIsNamed) {
  auto geometry = RingGeometry::for_budget(4096, 64);
  ASSERT_FALSE(geometry.ok());
  EXPECT_NE(geometry.status().message().find("too small for 64 ranks"), std::string::npos)
      << geometry.status().message();
  EXPECT_NE(geometry.status().message().find("ODC_STAGING_BYTES"), std::string::npos);
  auto big = RingGeometry::for_budget(kDefaultStagingBytes, 2);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big.value().payload_bytes(), kMaxChunkPayloadBytes);
  EXPECT_LE(big.value().total_bytes(2), kDefaultStagingBytes);
  auto wide = RingGeometry::for_budget(kDefaultStagingBytes, 16384);
  ASSERT_TRUE(wide.ok());
  EXPECT_GE(wide.value().depth, 2u);
  EXPECT_LE(wide.value().total_bytes(16384), kDefaultStagingBytes);
}

// The device transports' rings at the default budget, as docs/runtime.md ("streamed") lists
// them: 7 slots per sender (8 slots of an eighth of a sender's share, less one: the outbox slots
// and the fold's words come out of the same budget), of 16 MiB at 2 ranks (the largest payload,
// less its header), 8 MiB at 4, 4 MiB at 8, and never beyond the budget (what
// DeviceStreamedStaging::create allocates).
TEST(Memory, DeviceRingsAtTheDefaultBudget) {
  const size_t mib = size_t{1} << 20;
  for (int world : {2, 3, 4, 5, 6, 7}) {
    auto g = DeviceStreamedStaging::geometry_for(kDefaultStagingBytes, world);
    ASSERT_TRUE(g.ok()) << g.status().message();
    // The slot is the share's eighth, rounded down to 64 bytes, header included.
    const size_t share = (kDefaultStagingBytes - 5 * world * sizeof(uint64_t)) / world;
    EXPECT_EQ(g.value().slot_bytes, share / 8 / 64 * 64) << world << " ranks";
    EXPECT_EQ(g.value().depth, 7u) << world << " ranks";
    EXPECT_LE(g.value().payload_bytes(), kMaxDeviceChunkPayloadBytes);
    EXPECT_LE(DeviceStreamedStaging::bytes_for(g.value(), world), kDefaultStagingBytes);
  }
  const auto two = DeviceStreamedStaging::geometry_for(kDefaultStagingBytes, 2).value();
  EXPECT_EQ(kMaxDeviceChunkPayloadBytes - two.payload_bytes(), 128u);           // 16 MiB less 128 B
  EXPECT_EQ((DeviceStreamedStaging::bytes_for(two, 2) + mib / 2) / mib, 256u);  // docs/multinode.md
  EXPECT_EQ(DeviceStreamedStaging::geometry_for(kDefaultStagingBytes, 4).value().payload_bytes() /
                (mib / 8),
            63u);  // 8 MiB less 128 B at 4 ranks
  for (int world : {8, 16, 32, 64, 256, 16384}) {
    auto g = DeviceStreamedStaging::geometry_for(kDefaultStagingBytes, world);
    ASSERT_TRUE(g.ok()) << g.status().message();
    EXPECT_GE(g.value().depth, world <= 256 ? 7u : 2u) << world << " ranks";
    EXPECT_LE(g.value().payload_bytes(), kMaxDeviceChunkPayloadBytes);
    EXPECT_GT(g.value().payload_bytes(), (world <= 8 ? 3 : 0) * mib) << world << " ranks";
    EXPECT_LE(DeviceStreamedStaging::bytes_for(g.value(), world), kDefaultStagingBytes);
  }
  // Host transports keep 1 MiB payloads at 2 ranks.
  auto host = RingGeometry::for_budget(kDefaultStagingBytes, 2);
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host.value().payload_bytes(), kMaxChunkPayloadBytes);
  auto tiny = DeviceStreamedStaging::geometry_for(1024, 8);
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.status().message().find("ODC_STAGING_BYTES"), std::string::npos);
}

// Sums kept across minibatches (odc.torch's gradient accumulation until zero_grad): on every
// scheme, a kept accumulator adds the next minibatch's contributions to its sums, once, while
// another accumulator on the same communicator starts from zero; refused inside a minibatch.
TEST(KeepSums, AddsOneMinibatchToTheLastOnEveryScheme) {
  for (Scheme scheme :
       {Scheme::kStreamed, Scheme::kStreamedDevice, Scheme::kRemoteAdd, Scheme::kPulled}) {
    const int world = 3;
    auto mem_world = mem::MemWorld::create(world, mem_options_for(scheme, 30));
    const auto outcome = run_threads(world, [&](int rank) -> std::string {
      Communicator comm(mem_world->join(rank), comm_options_for(scheme, world));
      if (!is_scheme(comm, scheme)) return "wrong scheme";
      auto kept = comm.allocate(2, DataType::kFloat32, true);
      auto fresh = comm.allocate(2, DataType::kFloat32, true);
      if (!kept.ok() || !fresh.ok()) return "allocate failed";
      // Minibatch m: every rank pushes (m + 1) to every element of every owner.
      std::vector<float> src(static_cast<size_t>(world) * 2);
      std::vector<float> seen;
      for (int m = 0; m < 3; ++m) {
        if (m == 1 && !comm.keep_sums(kept.value()).ok()) return "keep_sums refused";
        if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
        if (m == 0 && comm.keep_sums(kept.value()).code() != StatusCode::kInvalidUsage) {
          return "keep_sums inside a minibatch was not refused";
        }
        std::fill(src.begin(), src.end(), static_cast<float>(m + 1));
        for (Buffer* acc : {kept.value(), fresh.value()}) {
          if (Status s =
                  comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32, acc, nullptr);
              !s.ok())
            return s.message();
        }
        if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
        seen.push_back(static_cast<const float*>(kept.value()->local())[1]);
        seen.push_back(static_cast<const float*>(fresh.value()->local())[1]);
      }
      // kept: 3, then 3 + 6 (kept once), then 9 alone; fresh: 3, 6, 9.
      const std::vector<float> want = {3, 3, 9, 6, 9, 9};
      if (seen != want) {
        std::string got;
        for (float x : seen) got += std::to_string(x) + " ";
        return "sums " + got;
      }
      return "";
    });
    EXPECT_EQ(describe(outcome), "") << scheme_label(scheme);
  }
}

TEST(Scheme, DeterministicIsPulledEvenWithRemoteAdd) {
  mem::MemOptions options;
  options.remote_fp32_add = true;
  auto world = mem::MemWorld::create(8, options);
  RunOptions o;
  o.world = 8;
  o.num_minibatches = 50;
  const Expected expected = expected_sums(o.seed, o.world, o.num_minibatches);
  const auto outcome = run_threads(o.world, [&](int rank) {
    Communicator comm(world->join(rank), CommOptions{/*deterministic=*/true, nullptr});
    if (comm.scheme() != AccumulationScheme::kPulled) return std::string("not pulled");
    return run_rank(comm, o, expected, nullptr);
  });
  EXPECT_EQ(describe(outcome), "");
}

// Deterministic mode: non-integer contributions (sums depend on order), random delays and
// reordered arrivals that differ per run: every run yields the same bits.
std::vector<uint32_t> deterministic_run(int world_size, uint32_t delay_seed, bool remote_add) {
  mem::MemOptions mem_options;
  mem_options.remote_fp32_add = remote_add;
  auto world = mem::MemWorld::create(world_size, mem_options);
  const size_t count = 16;
  std::vector<std::vector<uint32_t>> bits(static_cast<size_t>(world_size));
  const auto outcome = run_threads(world_size, [&](int rank) -> std::string {
    fault::FaultPlan plan;
    plan.max_delay_us = 300;
    plan.reorder = true;
    plan.seed = delay_seed * 1000 + static_cast<uint32_t>(rank);
    Communicator comm(std::make_unique<fault::FaultTransport>(world->join(rank), plan),
                      CommOptions{/*deterministic=*/true, nullptr});
    auto acc = comm.allocate(count, DataType::kFloat32, true);
    if (!acc.ok()) return acc.status().message();
    std::mt19937 values(99 + static_cast<uint32_t>(rank));  // the same data in every run
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<float> src(static_cast<size_t>(world_size) * count);
    for (int m = 0; m < 5; ++m) {
      if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
      for (int call = 0; call < 1 + (rank + m) % 3; ++call) {
        for (float& x : src) x = uniform(values) * 1e3f;
        if (Status s = comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32,
                                               acc.value(), nullptr);
            !s.ok())
          return s.message();
      }
      if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
    }
    const float* sums = static_cast<const float*>(acc.value()->local());
    for (size_t i = 0; i < count; ++i) {
      uint32_t word;
      std::memcpy(&word, &sums[i], sizeof(word));
      bits[static_cast<size_t>(rank)].push_back(word);
    }
    return "";
  });
  EXPECT_EQ(describe(outcome), "");
  std::vector<uint32_t> all;
  for (const auto& b : bits) all.insert(all.end(), b.begin(), b.end());
  return all;
}

TEST(Deterministic, BitwiseIdenticalUnderRandomDelays) {
  for (bool remote_add : {false, true}) {
    const auto first = deterministic_run(16, 1, remote_add);
    ASSERT_FALSE(first.empty());
    for (uint32_t seed = 2; seed <= 4; ++seed) {
      EXPECT_EQ(deterministic_run(16, seed, remote_add), first) << "delay seed " << seed;
    }
  }
}

// ---- faults ---------------------------------------------------------------------------------

struct FaultResult {
  std::vector<std::string> outcome;
  std::vector<int> completed;  // minibatches each rank finished and verified
};

// 40 minibatches of pushes of 300 elements per owner (streamed: five chunks each through
// six-slot rings, so senders wait for credit), random delays and reordering on every rank, and
// `plan` on `faulty_rank`; waits time out after 1 s.
FaultResult run_with_fault(int world_size, int faulty_rank, fault::FaultPlan plan, Scheme scheme,
                           bool kill_on_death = true, int ranks_per_node = 0) {
  auto world = mem::MemWorld::create(world_size, mem_options_for(scheme, 1.0, ranks_per_node));
  RunOptions o;
  o.world = world_size;
  o.num_minibatches = 40;
  o.count = 300;
  o.scheme = scheme;
  // With pretend nodes, published shards gathered from the node cache too, and streamed pushes
  // aggregated per node.
  o.ranks_per_node = ranks_per_node;
  o.published = ranks_per_node > 0;
  o.aggregate = ranks_per_node > 0;
  const Expected expected = expected_sums(o.seed, o.world, o.num_minibatches);
  FaultResult result;
  result.completed.assign(static_cast<size_t>(world_size), 0);
  result.outcome = run_threads(world_size, [&](int rank) {
    fault::FaultPlan mine;
    mine.max_delay_us = 200;
    mine.reorder = true;
    mine.seed = 5 + static_cast<uint32_t>(rank);
    if (rank == faulty_rank) {
      plan.seed = mine.seed;
      mine = plan;
    }
    std::function<void()> die;
    if (kill_on_death) die = [&world, rank] { world->kill(rank); };
    Communicator comm(std::make_unique<fault::FaultTransport>(world->join(rank), mine, die),
                      comm_options_for(scheme, world_size, 0, o.aggregate));
    std::string verdict = run_rank(comm, o, expected, &result.completed[static_cast<size_t>(rank)]);
    return verdict;
  });
  return result;
}

// Every rank but the faulty one fails, in the same minibatch, naming the faulty rank, and none
// reports a wrong sum; and every minibatch before it was verified exact.
void expect_named_failure(const FaultResult& r, int faulty, const std::string& what) {
  const std::string faulty_name = "rank " + std::to_string(faulty);
  for (size_t rank = 0; rank < r.outcome.size(); ++rank) {
    const std::string& verdict = r.outcome[rank];
    EXPECT_FALSE(verdict.empty()) << "rank " << rank << " reported success";
    EXPECT_EQ(verdict.find("wrong sum"), std::string::npos)
        << "rank " << rank << " saw a wrong sum: " << verdict;
    if (static_cast<int>(rank) == faulty) continue;
    EXPECT_NE(verdict.find(faulty_name), std::string::npos)
        << "rank " << rank << " does not name " << faulty_name << ": " << verdict;
    EXPECT_NE(verdict.find(what), std::string::npos) << "rank " << rank << ": " << verdict;
    EXPECT_GT(r.completed[rank], 0) << "the fault should land mid-run";
  }
}

TEST(Faults, RankDiesMidMinibatch) {
  for (Scheme scheme : kAllSchemes) {
    SCOPED_TRACE(scheme_label(scheme));
    fault::FaultPlan plan;
    plan.kind = fault::FaultKind::kDieAtCall;
    // Streamed makes ten times the calls per minibatch (chunks): a few minibatches in either way.
    plan.at_call = is_streamed(scheme) ? 570 : 57;
    const FaultResult r = run_with_fault(8, 3, plan, scheme);
    expect_named_failure(r, 3, "died");
  }
}

TEST(Faults, RankThatFailsWithoutDyingIsNamed) {
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice}) {
    SCOPED_TRACE(scheme_label(scheme));
    fault::FaultPlan plan;
    plan.kind = fault::FaultKind::kDieAtCall;
    plan.at_call = is_streamed(scheme) ? 800 : 80;
    const FaultResult r = run_with_fault(6, 2, plan, scheme, /*kill_on_death=*/false);
    expect_named_failure(r, 2, "failed: died");
  }
}

// Streamed (host and device steps): a link that loses every signal from rank 1 to rank 4 (its
// chunks' arrivals, its hunger, its end, the credits it returns): a wait times out (4 never sees
// 1's end, or 1 never gets 4's credit, or a third rank waits for one of them), every rank fails
// naming rank 1 or rank 4, and nobody reports a sum.
TEST(Faults, StreamedLostArrivalsAndCreditsAreNamed) {
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice}) {
    SCOPED_TRACE(scheme_label(scheme));
    fault::FaultPlan plan;
    plan.kind = fault::FaultKind::kDropSignalsFrom;
    // The device's steps make more calls per minibatch (a fold per credit wait, and its rings
    // are shallower: the fold's words come from the same budget).
    plan.at_call = scheme == Scheme::kStreamedDevice ? 400 : 200;
    plan.peer = 4;
    const FaultResult r = run_with_fault(6, 1, plan, scheme);
    bool timed_out = false;
    for (const std::string& verdict : r.outcome) {
      timed_out = timed_out || verdict.find("timed out") != std::string::npos;
    }
    EXPECT_TRUE(timed_out) << describe(r.outcome);
    for (size_t rank = 0; rank < r.outcome.size(); ++rank) {
      const bool names = r.outcome[rank].find("rank 1") != std::string::npos ||
                         r.outcome[rank].find("rank 4") != std::string::npos;
      EXPECT_TRUE(names) << "rank " << rank << ": " << r.outcome[rank];
      EXPECT_FALSE(r.outcome[rank].empty()) << "rank " << rank << " reported success";
      EXPECT_EQ(r.outcome[rank].find("wrong sum"), std::string::npos) << r.outcome[rank];
      EXPECT_GT(r.completed[rank], 0) << "the fault should land mid-run";
    }
  }
}

// Streamed: signals from rank 1 to rank 4 that claim one chunk more than was put (an arrival
// ahead of its data, or a credit for a slot not yet folded): the stale slot is caught by its
// sequence number and named; no rank reports a sum.
TEST(Faults, StreamedSignalAheadOfItsDataIsNamedNeverSummed) {
  if (!kInjectRacyFaults) GTEST_SKIP() << "a signal ahead of its data races by construction";
  fault::FaultPlan plan;
  plan.kind = fault::FaultKind::kInflateSignal;
  plan.at_call = 200;
  plan.peer = 4;
  const FaultResult r = run_with_fault(6, 1, plan, Scheme::kStreamed);
  EXPECT_NE(r.outcome[4].find("chunk from rank 1 at rank 4"), std::string::npos) << r.outcome[4];
  for (size_t rank = 0; rank < r.outcome.size(); ++rank) {
    EXPECT_FALSE(r.outcome[rank].empty()) << "rank " << rank << " reported success";
    EXPECT_EQ(r.outcome[rank].find("wrong sum"), std::string::npos) << r.outcome[rank];
  }
}

TEST(Faults, DuplicatedSignalsAndPutsCountOnce) {
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice}) {
    SCOPED_TRACE(scheme_label(scheme));
    fault::FaultPlan plan;
    plan.kind = fault::FaultKind::kDuplicateSignal;
    plan.at_call = 30;
    plan.peer = 2;
    const FaultResult r = run_with_fault(5, 0, plan, scheme);
    EXPECT_EQ(describe(r.outcome), "");  // exact sums in all 40 minibatches
    for (int done : r.completed) EXPECT_EQ(done, 40);
  }
}

// Streamed: an owner that spends long stretches outside odc (a slow microbatch) folds only when
// it enters odc, so its senders run out of credit and wait (flow control), folding their own
// arrivals meanwhile; every sum stays exact and nothing times out.
TEST(Faults, StreamedSlowOwnerStarvesSendersOfCreditSumsStayExact) {
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice}) {
    SCOPED_TRACE(scheme_label(scheme));
    const int world_size = 6;
    auto world = mem::MemWorld::create(world_size, mem_options_for(scheme, 30));
    RunOptions o;
    o.world = world_size;
    o.num_minibatches = 12;
    o.count = 3000;  // 47 chunks per push and owner through 6-slot rings
    const Expected expected = expected_sums(o.seed, o.world, o.num_minibatches);
    std::vector<uint64_t> waits(static_cast<size_t>(world_size));
    const auto outcome = run_threads(world_size, [&](int rank) -> std::string {
      Communicator comm(world->join(rank), comm_options_for(scheme, world_size));
      auto acc = comm.allocate(o.count, DataType::kFloat32, true);
      if (!acc.ok()) return acc.status().message();
      std::vector<float> src(static_cast<size_t>(world_size) * o.count);
      std::vector<float> sums(src.size());
      for (int m = 0; m < o.num_minibatches; ++m) {
        if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
        for (int call = 0, calls = num_pushes(o.seed, m, rank); call < calls; ++call) {
          if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));  // "compute"
          for (size_t j = 0; j < src.size(); ++j) src[j] = value(m, rank, call, j);
          if (Status s = comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32,
                                                 acc.value(), nullptr);
              !s.ok()) {
            return s.message();
          }
        }
        if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
        if (Status s = comm.gather(sums.data(), sums.size(), acc.value(), nullptr); !s.ok()) {
          return s.message();
        }
        for (size_t j = 0; j < sums.size(); ++j) {
          const double want = expected.base[m] + static_cast<double>(expected.pushes[m]) * (j % 64);
          if (sums[j] != want) return "wrong sum in minibatch " + std::to_string(m);
        }
      }
      waits[static_cast<size_t>(rank)] = comm.staging()->credit_waits().value();
      return "";
    });
    EXPECT_EQ(describe(outcome), "");
    uint64_t waited = 0;
    for (int r = 1; r < world_size; ++r) waited += waits[static_cast<size_t>(r)];
    EXPECT_GT(waited, 0u) << "senders never ran out of credit: the test does not test flow control";
  }
}

// Streamed: collectives inside a minibatch (a barrier, an allocation, a free) while a peer still
// waits for credit: every rank meets first, folding for hungry senders, so nothing waits for a
// rank that sits in the transport's collective; the freed accumulator's chunks were all folded.
// The device's steps fold into at most kMaxFoldTargets accumulators (their table travels in the
// fold kernel's parameters): one more is refused on every rank before anything is allocated,
// naming the limit; the communicator stays usable and sums stay exact.
TEST(Streamed, DeviceFoldRefusesOneAccumulatorTooManyAndGoesOn) {
  const int world_size = 2;
  auto world = mem::MemWorld::create(world_size, mem_options_for(Scheme::kStreamedDevice, 30));
  const auto outcome = run_threads(world_size, [&](int rank) -> std::string {
    Communicator comm(world->join(rank), comm_options_for(Scheme::kStreamedDevice, world_size));
    std::vector<Buffer*> accs;
    for (int i = 0; i < kernels::kMaxFoldTargets; ++i) {
      auto acc = comm.allocate(4, DataType::kFloat32, true);
      if (!acc.ok()) return "accumulator " + std::to_string(i) + ": " + acc.status().message();
      accs.push_back(acc.value());
    }
    const Communicator::Memory before = comm.memory();
    auto extra = comm.allocate(4, DataType::kFloat32, true);
    if (extra.ok()) return std::string("one accumulator too many was accepted");
    if (extra.status().code() != StatusCode::kInvalidArgument ||
        extra.status().message().find("at most 160 accumulators") == std::string::npos) {
      return "unexpected refusal: " + extra.status().message();
    }
    if (comm.memory().buffer_bytes != before.buffer_bytes) return "the refusal allocated";
    // Still usable: a minibatch pushing into the last accumulator sums exactly.
    std::vector<float> src(static_cast<size_t>(world_size) * 4, 1.0f), sums(src.size());
    if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
    if (Status s = comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32, accs.back(),
                                           nullptr);
        !s.ok()) {
      return s.message();
    }
    if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
    if (Status s = comm.gather(sums.data(), sums.size(), accs.back(), nullptr); !s.ok()) {
      return s.message();
    }
    for (float v : sums) {
      if (v != static_cast<float>(world_size)) return "wrong sum " + std::to_string(v);
    }
    return "";
  });
  EXPECT_EQ(describe(outcome), "");
}

// The device staging's puts leave from the transport's send lane, packed into the two outbox
// slots in turn (each packed only once the lane's put of the chunk packed there before has run),
// and the end's and the meetings' signals wait for the lane on their own stream: what a device
// transport's streams rely on (DeviceStagingOps::fork_sends). Rank 0's calls are recorded over
// the in-memory transport (calls complete on return, streams are only names there): the caller
// passes a stream of its own per kind of call, and the lane gets a handle of its own.
class LaneRecorder final : public TransportWrapper, private DeviceStagingOps {
 public:
  LaneRecorder(std::unique_ptr<Transport> inner, std::vector<std::string>* log)
      : TransportWrapper(std::move(inner)), log_(log) {}
  static StreamHandle lane() { return reinterpret_cast<StreamHandle>(uintptr_t{0x1a4e}); }
  static std::string name(StreamHandle stream) {
    return stream == lane() ? "lane" : std::to_string(reinterpret_cast<uintptr_t>(stream));
  }

  DeviceStagingOps* device_staging() override { return this; }
  Status put_signal(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                    size_t bytes, const SymmetricRegion& signals, uint64_t value,
                    StreamHandle stream) override {
    note("put_signal " + address(src) + " " + name(stream));
    return inner().put_signal(src, region, peer, offset, bytes, signals, value, stream);
  }
  Status signal(const SymmetricRegion& signals, int peer, uint64_t value,
                StreamHandle stream) override {
    note("signal - " + name(stream));
    return inner().signal(signals, peer, value, stream);
  }

 private:
  DeviceStagingOps& ops() { return *inner().device_staging(); }
  Status fold_streamed(const kernels::StreamedFold& fold, StreamHandle stream) override {
    return ops().fold_streamed(fold, stream);
  }
  Result<bool> fold_streamed_if_idle(const kernels::StreamedFold& fold,
                                     StreamHandle stream) override {
    return ops().fold_streamed_if_idle(fold, stream);
  }
  Status pack_chunk(void* dst, const kernels::ChunkHeader& header, const void* src, size_t bytes,
                    StreamHandle stream) override {
    note("pack " + address(dst) + " " + name(stream));
    return ops().pack_chunk(dst, header, src, bytes, stream);
  }
  Status read_local(void* host_dst, const void* src, size_t bytes) override {
    return ops().read_local(host_dst, src, bytes);
  }
  Result<StreamHandle> fork_sends(StreamHandle stream) override {
    note("fork_sends - " + name(stream));
    auto forked = ops().fork_sends(stream);
    if (!forked.ok()) return forked;
    return lane();
  }
  Status mark_sends(int index) override {
    note("mark_sends " + std::to_string(index) + " lane");
    return ops().mark_sends(index);
  }
  Status wait_sends(int index, StreamHandle stream) override {
    note("wait_sends " + std::to_string(index) + " " + name(stream));
    return ops().wait_sends(index, stream);
  }
  Status join_sends(StreamHandle stream) override {
    note("join_sends - " + name(stream));
    return ops().join_sends(stream);
  }
  static std::string address(const void* p) {
    return std::to_string(reinterpret_cast<uintptr_t>(p));
  }
  void note(std::string entry) {
    if (log_ != nullptr) log_->push_back(std::move(entry));
  }
  std::vector<std::string>* log_;
};

// "" when `log` (one rank's calls, each "call argument stream") keeps the send lane's rules,
// else the first break and where: per chunk, on one caller stream, a wait for the lane's mark
// of the slot's turn, the pack into that turn's slot (its own, never the other turn's), the
// lane forked from that stream; the put from that slot on the lane, then that turn's mark; and
// no signal on a stream that has not joined the lane since the last put.
std::string lane_rule_break(const std::vector<std::string>& log) {
  std::string packed, slot[2], caller;
  std::vector<std::string> joined;  // streams joined since the last put
  int waited = -1, puts = 0;
  bool forked = false, marked = true;
  for (size_t i = 0; i < log.size(); ++i) {
    std::istringstream words(log[i]);
    std::string call, argument, stream;
    words >> call >> argument >> stream;
    const std::string at = " at call " + std::to_string(i) + " (" + log[i] + ")";
    const int turn = puts % 2;
    if (call == "wait_sends") {
      if (argument != std::to_string(turn) || stream == "lane") return "wrong wait" + at;
      if (!marked) return "waited before the last put was marked" + at;
      waited = turn;
      caller = stream;
    } else if (call == "pack") {
      if (waited != turn) return "packed without waiting for its slot's last put" + at;
      if (stream != caller) return "packed on another stream than it waited on" + at;
      packed = argument;
      if (slot[turn].empty()) slot[turn] = packed;
      if (packed != slot[turn]) return "a turn's slot moved" + at;
      if (slot[1 - turn] == packed) return "one slot for both turns" + at;
      forked = false;
    } else if (call == "fork_sends") {
      if (packed.empty()) return "forked before packing" + at;
      if (stream != caller) return "forked from another stream than it packed on" + at;
      forked = true;
    } else if (call == "put_signal") {
      if (argument != packed || stream != "lane") return "put not from the packed slot" + at;
      if (!forked) return "put before the lane was forked after the pack" + at;
      packed.clear();
      waited = -1;
      marked = false;
      joined.clear();
      ++puts;
    } else if (call == "mark_sends") {
      if (argument != std::to_string((puts + 1) % 2)) return "wrong mark" + at;
      marked = true;
    } else if (call == "join_sends") {
      joined.push_back(stream);
    } else if (call == "signal") {
      if (stream == "lane") return "a signal on the lane" + at;
      if (puts > 0 && std::find(joined.begin(), joined.end(), stream) == joined.end()) {
        return "a signal on a stream that has not joined the lane since the last put" + at;
      }
    } else {
      return "unexpected record" + at;
    }
  }
  if (puts < 4) return "only " + std::to_string(puts) + " puts recorded";
  return "";
}

// Two minibatches of two pushes (a barrier between them) on `world_size` ranks, pretended nodes
// of `ranks_per_node` with node-aggregated pushes where set; pushes, the barrier and
// minibatch_end each on a stream of their own. Rank 0's calls go into `log`; checks the sums.
std::string run_lane_program(int world_size, int ranks_per_node, std::vector<std::string>* log) {
  auto world = mem::MemWorld::create(world_size,
                                     mem_options_for(Scheme::kStreamedDevice, 30, ranks_per_node));
  const auto pushes = reinterpret_cast<StreamHandle>(uintptr_t{0x51});
  const auto collectives = reinterpret_cast<StreamHandle>(uintptr_t{0x52});
  const auto ends = reinterpret_cast<StreamHandle>(uintptr_t{0x53});
  const auto outcome = run_threads(world_size, [&](int rank) -> std::string {
    Communicator comm(std::make_unique<LaneRecorder>(world->join(rank), rank == 0 ? log : nullptr),
                      comm_options_for(Scheme::kStreamedDevice, world_size, 0,
                                       /*aggregate=*/ranks_per_node > 0));
    // 600 fp32 per owner: 2,400 bytes, ten chunks of the test budget's 256-byte payloads.
    const size_t count = 600;
    auto acc = comm.allocate(count, DataType::kFloat32, true);
    if (!acc.ok()) return acc.status().message();
    const auto world = static_cast<size_t>(world_size);
    std::vector<float> src(world * count), sums(src.size());
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i % 7 + rank);
    for (int minibatch = 0; minibatch < 2; ++minibatch) {
      if (Status s = comm.minibatch_begin(pushes); !s.ok()) return s.message();
      for (int push = 0; push < 2; ++push) {
        if (Status s = comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32,
                                               acc.value(), pushes);
            !s.ok()) {
          return s.message();
        }
        if (push == 0) {  // a collective inside the minibatch: its meeting's signals too
          if (Status s = comm.barrier(collectives); !s.ok()) return s.message();
        }
      }
      if (Status s = comm.minibatch_end(ends); !s.ok()) return s.message();
    }
    if (Status s = comm.gather(sums.data(), sums.size(), acc.value(), nullptr); !s.ok()) {
      return s.message();
    }
    // The last minibatch: two pushes of every rank, i % 7 + rank each.
    const float ranks = static_cast<float>(world_size * (world_size - 1) / 2);
    for (size_t i = 0; i < sums.size(); ++i) {
      const float want = 2.0f * (static_cast<float>(world_size) * (i % 7) + ranks);
      if (sums[i] != want) return "sum " + std::to_string(i) + " is " + std::to_string(sums[i]);
    }
    return "";
  });
  return describe(outcome);
}

TEST(Streamed, DevicePutsLeaveFromTheSendLaneInTurnAndSignalsWaitForIt) {
  std::vector<std::string> log;
  ASSERT_EQ(run_lane_program(2, 0, &log), "");
  EXPECT_EQ(lane_rule_break(log), "");
  // Node-aggregated pushes: rank 0 also forwards its relay rows at minibatch_end, from the lane.
  log.clear();
  ASSERT_EQ(run_lane_program(4, 2, &log), "");
  EXPECT_EQ(lane_rule_break(log), "");
}

// A progress pass copies the fold table when it is enqueued; a peer may push into an accumulator
// allocated since (it pushes once its own allocation returned, before this rank set its table).
// The pass leaves such a chunk to the caller's folds, which know the accumulator, instead of
// refusing it (ThreadSanitizer's timing found the window in RandomProgramsTinyBudgets). Rank 0's
// table is made to miss B while rank 1 pushes into it and rank 0's progress passes run.
TEST(Streamed, ProgressPassLeavesAChunkForAnAccumulatorItsTableDoesNotKnow) {
  const int world_size = 2;
  auto world = mem::MemWorld::create(world_size, mem_options_for(Scheme::kStreamedDevice, 10));
  std::promise<void> pushed;
  std::shared_future<void> pushed_seen = pushed.get_future().share();
  const auto outcome = run_threads(world_size, [&](int rank) -> std::string {
    Communicator comm(world->join(rank), comm_options_for(Scheme::kStreamedDevice, world_size));
    auto a = comm.allocate(4, DataType::kFloat32, true);
    auto b = comm.allocate(4, DataType::kFloat32, true);
    if (!a.ok() || !b.ok()) return "alloc failed";
    // The test plays the allocation's late table and the progress thread: it changes the staging.
    auto* staging = const_cast<DeviceStreamedStaging*>(
        dynamic_cast<const DeviceStreamedStaging*>(comm.staging()));
    if (staging == nullptr) return "not the device staging";
    const std::vector<kernels::FoldTarget> both = staging->targets();
    if (both.size() != 2) return "expected two fold targets";
    std::vector<float> src(static_cast<size_t>(world_size) * 4, 1.0f), sums(src.size());
    if (rank == 0 && !staging->set_targets({both.front()}).ok()) return "set_targets";
    if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
    if (rank == 1) {
      Status s =
          comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32, b.value(), nullptr);
      pushed.set_value();
      if (!s.ok()) return s.message();
    } else {
      if (pushed_seen.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
        return "rank 1 never pushed";
      }
      for (int pass = 0; pass < 20; ++pass) {
        staging->progress();  // beside the progress thread's own passes
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!staging->set_targets(both).ok()) return "set_targets back";
      Status s =
          comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32, b.value(), nullptr);
      if (!s.ok()) return s.message();  // a refusal by a pass is returned here
    }
    if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
    if (Status s = comm.gather(sums.data(), sums.size(), b.value(), nullptr); !s.ok()) {
      return s.message();
    }
    for (float v : sums) {
      if (v != static_cast<float>(world_size)) return "wrong sum " + std::to_string(v);
    }
    return "";
  });
  EXPECT_EQ(describe(outcome), "");
}

TEST(Streamed, CollectivesInsideAMinibatchWhileAPeerWaitsForCredit) {
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice}) {
    SCOPED_TRACE(scheme_label(scheme));
    const int world_size = 4;
    auto world = mem::MemWorld::create(world_size, mem_options_for(scheme, 10));
    const size_t count = 5000;  // 79 chunks per owner through 6-slot rings
    const auto outcome = run_threads(world_size, [&](int rank) -> std::string {
      Communicator comm(world->join(rank), comm_options_for(scheme, world_size));
      auto kept = comm.allocate(count, DataType::kFloat32, true);
      auto freed = comm.allocate(count, DataType::kFloat32, true);
      if (!kept.ok() || !freed.ok()) return std::string("alloc failed");
      std::vector<float> src(static_cast<size_t>(world_size) * count, 1.0f);
      for (int m = 0; m < 3; ++m) {
        if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
        if (rank == 0) {  // the only sender: runs out of credit at every owner
          for (Buffer* acc : {kept.value(), freed.value()}) {
            if (Status s = comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32, acc,
                                                   nullptr);
                !s.ok())
              return s.message();
          }
        }
        if (Status s = comm.barrier(nullptr); !s.ok()) return s.message();
        auto extra = comm.allocate(8, DataType::kFloat32, false);
        if (!extra.ok()) return extra.status().message();
        if (Status s = comm.release(extra.value()); !s.ok()) return s.message();
        if (m == 2) {
          if (Status s = comm.release(freed.value()); !s.ok()) return s.message();
        }
        if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
        const auto* sums = static_cast<const float*>(kept.value()->local());
        for (size_t j = 0; j < count; ++j) {
          if (sums[j] != 1.0f) return "wrong sum in minibatch " + std::to_string(m);
        }
      }
      return "";
    });
    EXPECT_EQ(describe(outcome), "");
  }
}

// Topology in the core: the transport's report (pretend nodes of the in-memory transport), the
// caller's ranks per node over it, and a layout that cannot be (not dividing the world, or
// different on some rank) failing every rank with the reason.
TEST(Topology, AgreedFromConfigElseTheTransportsReport) {
  const int world_size = 8;
  mem::MemOptions options;
  options.ranks_per_node = 2;  // the transport reports 4 nodes of 2
  auto world = mem::MemWorld::create(world_size, options);
  std::vector<std::string> layouts(world_size);
  auto outcome = run_threads(world_size, [&](int rank) -> std::string {
    Communicator comm(world->join(rank));
    if (Status s = comm.agree_on_topology(); !s.ok()) return s.message();
    const Topology& topology = *comm.topology();
    layouts[static_cast<size_t>(rank)] = topology.describe();
    if (topology.node(rank) != rank / 2) return "wrong node";
    for (int peer = 0; peer < world_size; ++peer) {
      if (topology.maps(peer) != (peer / 2 == rank / 2)) return "wrong direct map";
    }
    return "";
  });
  EXPECT_EQ(describe(outcome), "");
  EXPECT_EQ(layouts[0], "4 nodes (ranks per node: 2, 2, 2, 2; from transport)");
  // The caller's configuration comes first: 2 nodes of 4.
  world = mem::MemWorld::create(world_size, options);
  outcome = run_threads(world_size, [&](int rank) -> std::string {
    CommOptions config;
    config.ranks_per_node = 4;
    Communicator comm(world->join(rank), config);
    auto acc = comm.allocate(4, DataType::kFloat32, true);  // agrees on it first
    if (!acc.ok()) return acc.status().message();
    layouts[static_cast<size_t>(rank)] = comm.topology()->describe();
    return comm.topology()->node(rank) == rank / 4 ? "" : "wrong node";
  });
  EXPECT_EQ(describe(outcome), "");
  EXPECT_EQ(layouts[7], "2 nodes (ranks per node: 4, 4; from config)");
  // 3 ranks per node do not divide 8; rank 5 alone saying 2 disagrees: every rank fails, named.
  for (int odd_rank : {-1, 5}) {
    world = mem::MemWorld::create(world_size, options);
    outcome = run_threads(world_size, [&](int rank) -> std::string {
      CommOptions config;
      config.ranks_per_node = odd_rank < 0 ? 3 : (rank == odd_rank ? 2 : 4);
      Communicator comm(world->join(rank), config);
      Status s = comm.agree_on_topology();
      return s.ok() ? "agreed" : s.message();
    });
    for (int rank = 0; rank < world_size; ++rank) {
      const std::string& verdict = outcome[static_cast<size_t>(rank)];
      const std::string want = odd_rank < 0 ? "3 ranks per node (from config) does not divide"
                                            : "ranks disagree on the node layout";
      EXPECT_NE(verdict.find(want), std::string::npos) << "rank " << rank << ": " << verdict;
      if (odd_rank >= 0 && rank != odd_rank) {
        EXPECT_NE(verdict.find("rank 5 has config = 2 ranks per node"), std::string::npos)
            << verdict;
      }
    }
  }
}

// Random programs: several accumulators of awkward sizes (1, 63, 64, 65, 200 elements; chunks
// of 64 fp32 or 128 bf16), fp32 and bf16 pushes, interleaved, gathers inside the minibatch,
// ranks that push nothing, an accumulator allocated inside a minibatch, budgets down to depth 1.
void random_program(Scheme scheme, int world_size, size_t budget, uint32_t seed, int minibatches) {
  auto world = mem::MemWorld::create(world_size, mem_options_for(scheme, 10.0));
  const std::vector<size_t> counts = {1, 63, 64, 65, 200};
  const int late = 1;  // allocated inside minibatch `late`
  // contributions: deterministic from (seed, m, rank, k)
  auto plan = [&](int m, int rank) {
    std::mt19937 rng(seed * 7919u + static_cast<uint32_t>(m) * 131u + static_cast<uint32_t>(rank));
    std::vector<std::tuple<int, bool, int>> pushes;  // accumulator index, bf16, value
    const int n = static_cast<int>(rng() % 6);
    for (int k = 0; k < n; ++k) {
      const int a = static_cast<int>(rng() % (counts.size() + (m >= late ? 1 : 0)));
      pushes.emplace_back(a, rng() % 2 == 0, 1 + static_cast<int>(rng() % 7));
    }
    return pushes;
  };
  std::vector<size_t> all_counts = counts;
  all_counts.push_back(33);  // the late one
  const auto outcome = run_threads(world_size, [&](int rank) -> std::string {
    Communicator comm(world->join(rank), comm_options_for(scheme, world_size, budget));
    std::vector<Buffer*> accs;
    for (size_t c : counts) {
      auto a = comm.allocate(c, DataType::kFloat32, true);
      if (!a.ok()) return a.status().message();
      accs.push_back(a.value());
    }
    if (comm.staging()->geometry().depth < 1) return "no depth";
    auto plain_or = comm.allocate(64, DataType::kFloat32, false);
    if (!plain_or.ok()) return plain_or.status().message();
    Buffer* plain = plain_or.value();
    for (int m = 0; m < minibatches; ++m) {
      if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
      if (m == late) {
        auto a = comm.allocate(33, DataType::kFloat32, true);
        if (!a.ok()) return a.status().message();
        accs.push_back(a.value());
      }
      for (auto [a, bf16, v] : plan(m, rank)) {
        const size_t n = static_cast<size_t>(world_size) * all_counts[static_cast<size_t>(a)];
        Status s;
        if (bf16) {
          std::vector<uint16_t> src(n);
          for (size_t j = 0; j < n; ++j) {
            float f = static_cast<float>(v + static_cast<int>(j % 5));
            uint32_t w;
            std::memcpy(&w, &f, 4);
            src[j] = static_cast<uint16_t>(w >> 16);
          }
          s = comm.scatter_accumulate(src.data(), n, DataType::kBfloat16, accs[a], nullptr);
        } else {
          std::vector<float> src(n);
          for (size_t j = 0; j < n; ++j) src[j] = static_cast<float>(v + static_cast<int>(j % 5));
          s = comm.scatter_accumulate(src.data(), n, DataType::kFloat32, accs[a], nullptr);
        }
        if (!s.ok()) return s.message();
        std::vector<float> g(static_cast<size_t>(world_size) * 64);
        if (Status gs = comm.gather(g.data(), g.size(), plain, nullptr); !gs.ok())
          return gs.message();
      }
      if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
      for (size_t a = 0; a < accs.size(); ++a) {
        std::vector<float> sums(static_cast<size_t>(world_size) * all_counts[a]);
        if (Status s = comm.gather(sums.data(), sums.size(), accs[a], nullptr); !s.ok())
          return s.message();
        std::vector<std::vector<std::tuple<int, bool, int>>> plans;
        for (int r = 0; r < world_size; ++r) plans.push_back(plan(m, r));
        for (size_t j = 0; j < sums.size(); ++j) {
          double want = 0;
          for (int r = 0; r < world_size; ++r)
            for (auto [b, bf16, v] : plans[static_cast<size_t>(r)])
              if (static_cast<size_t>(b) == a) want += v + static_cast<int>(j % 5);
          if (sums[j] != want)
            return "wrong sum m=" + std::to_string(m) + " acc " + std::to_string(a) + " j " +
                   std::to_string(j) + ": " + std::to_string(sums[j]) + " want " +
                   std::to_string(want);
        }
      }
    }
    return "";
  });
  EXPECT_EQ(describe(outcome), "")
      << scheme_label(scheme) << " world " << world_size << " budget " << budget;
}

TEST(Streamed, RandomProgramsTinyBudgets) {
  for (int world_size : {1, 2, 3, 5}) {
    const size_t signals = 40 * static_cast<size_t>(world_size);  // five words per peer
    for (size_t slots : {1, 2, 3}) {
      const size_t budget = signals + static_cast<size_t>(world_size) * slots * 320;
      auto g = RingGeometry::for_budget(budget, world_size);
      ASSERT_TRUE(g.ok());
      ASSERT_EQ(g.value().depth, slots);
      // The device's steps also take two outbox slots and three words per sender (and a counter)
      // from the budget.
      const size_t device_budget = budget + 2 * 320 + (3 * static_cast<size_t>(world_size) + 1) * 8;
      for (uint32_t seed = 1; seed <= 3; ++seed) {
        random_program(Scheme::kStreamed, world_size, budget, seed, 8);
        random_program(Scheme::kStreamedDevice, world_size, device_budget, seed, 8);
      }
    }
  }
}

// Streamed: every fault kind from rank 1 (towards ranks 0 and 2) at calls spread over the first
// minibatches: never a wrong sum; all ranks fail or none does (a duplicated signal, or one lost
// and covered by a later one, is harmless); failures name rank 1 or its peer; nothing waits
// beyond a few timeouts.
TEST(Faults, StreamedFaultSweep) {
  struct Kind {
    fault::FaultKind kind;
    const char* name;
  };
  std::vector<Kind> kinds = {{fault::FaultKind::kDropSignal, "drop"},
                             {fault::FaultKind::kDuplicateSignal, "dup"},
                             {fault::FaultKind::kDropSignalsFrom, "dropfrom"},
                             {fault::FaultKind::kDieAtCall, "die"}};
  if (kInjectRacyFaults) kinds.push_back({fault::FaultKind::kInflateSignal, "inflate"});
  const int world_size = 3;
  const double timeout_s = 0.5;
  int failures = 0, successes = 0;
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice})
    for (const Kind& k : kinds) {
      for (int peer : {0, 2}) {
        for (int64_t at = 1; at <= 400; at += 40) {
          auto world = mem::MemWorld::create(world_size, mem_options_for(scheme, timeout_s));
          RunOptions o;
          o.world = world_size;
          o.num_minibatches = 6;
          o.count = 300;
          const Expected expected = expected_sums(o.seed, o.world, o.num_minibatches);
          const auto t0 = std::chrono::steady_clock::now();
          const auto outcome = run_threads(world_size, [&](int rank) {
            fault::FaultPlan mine;
            mine.max_delay_us = 100;
            mine.seed = 11 + static_cast<uint32_t>(rank) + static_cast<uint32_t>(at);
            if (rank == 1) {
              mine.kind = k.kind;
              mine.at_call = at;
              mine.peer = peer;
            }
            std::function<void()> die = [&world, rank] { world->kill(rank); };
            Communicator comm(std::make_unique<fault::FaultTransport>(world->join(rank), mine, die),
                              comm_options_for(scheme, world_size));
            return run_rank(comm, o, expected, nullptr);
          });
          const double took =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          const std::string where = std::string(scheme_label(scheme)) + " " + k.name + " peer " +
                                    std::to_string(peer) + " at " + std::to_string(at) + ":\n" +
                                    describe(outcome);
          bool any_fail = false, all_fail = true;
          for (size_t r = 0; r < outcome.size(); ++r) {
            any_fail = any_fail || !outcome[r].empty();
            all_fail = all_fail && !outcome[r].empty();
            EXPECT_EQ(outcome[r].find("wrong sum"), std::string::npos) << where;
            if (!outcome[r].empty() && r != 1) {
              const bool names =
                  outcome[r].find("rank 1") != std::string::npos ||
                  outcome[r].find("rank " + std::to_string(peer)) != std::string::npos;
              EXPECT_TRUE(names) << where;
            }
          }
          EXPECT_EQ(any_fail, all_fail) << where;
          EXPECT_LT(took, 4 * timeout_s + 1.0) << where;
          (any_fail ? failures : successes)++;
        }
      }
    }
  EXPECT_GT(failures, 0);
  EXPECT_GT(successes, 0);
}

// The node schemes (2 pretend nodes of 4: node cache; streamed: pushes aggregated per node): a
// rank that dies, whether it is fetching for its node, waiting for its node's fetchers, pushing
// or forwarding its node's pushes, is named by every survivor; no wrong sum or shard.
TEST(Faults, NodeSchemesRankDiesMidMinibatch) {
  for (Scheme scheme : kAllSchemes) {
    SCOPED_TRACE(scheme_label(scheme));
    fault::FaultPlan plan;
    plan.kind = fault::FaultKind::kDieAtCall;
    plan.at_call = is_streamed(scheme) ? 570 : 57;
    const FaultResult r = run_with_fault(8, 5, plan, scheme, true, /*ranks_per_node=*/4);
    expect_named_failure(r, 5, "died");
    for (const std::string& verdict : r.outcome) {
      EXPECT_EQ(verdict.find("wrong published"), std::string::npos) << verdict;
    }
  }
}

// A fetcher whose ready words never reach a node peer again (a broken link): the peer's next
// gather of the published buffer fails naming it (its own wait times out, or the fetcher, timed
// out in the barrier that the peer never reaches, fails first); nobody reports success.
TEST(Faults, NodeCacheLostReadyWordsAreNamed) {
  fault::FaultPlan plan;
  plan.kind = fault::FaultKind::kDropSignalsFrom;
  plan.peer = 0;
  plan.at_call = 60;
  const FaultResult r = run_with_fault(4, 1, plan, Scheme::kRemoteAdd, true, /*ranks_per_node=*/2);
  EXPECT_EQ(r.outcome[0].rfind("rank 0: gather: ", 0), 0u) << r.outcome[0];
  const bool named = r.outcome[0].find(
                         "the node's fetch of remote shards timed out after 1 s: "
                         "rank 0 waited for rank 1") != std::string::npos ||
                     r.outcome[0].find("rank 1 failed") != std::string::npos;
  EXPECT_TRUE(named) << r.outcome[0];
  EXPECT_GT(r.completed[0], 0) << "the fault should land mid-run";
  for (size_t rank = 0; rank < r.outcome.size(); ++rank) {
    EXPECT_FALSE(r.outcome[rank].empty()) << "rank " << rank << " reported success";
    EXPECT_EQ(r.outcome[rank].find("wrong"), std::string::npos) << r.outcome[rank];
  }
}

TEST(Faults, CollectiveMismatchIsNamed) {
  fault::FaultPlan plan;
  plan.kind = fault::FaultKind::kMismatch;
  plan.at_call = 45;
  const FaultResult r = run_with_fault(4, 2, plan, Scheme::kRemoteAdd);
  EXPECT_NE(r.outcome[2].find("collective mismatch"), std::string::npos) << r.outcome[2];
  for (size_t rank = 0; rank < r.outcome.size(); ++rank) {
    EXPECT_FALSE(r.outcome[rank].empty()) << "rank " << rank << " reported success";
    EXPECT_EQ(r.outcome[rank].find("wrong sum"), std::string::npos) << r.outcome[rank];
    const bool names = r.outcome[rank].find("collective mismatch") != std::string::npos ||
                       r.outcome[rank].find("rank 2") != std::string::npos;
    EXPECT_TRUE(names) << "rank " << rank << ": " << r.outcome[rank];
  }
}

TEST(Faults, NodeSchemesDeathAtEveryEarlyCallNeverHangsOrLies) {
  // As below, with 2 pretend nodes of 2, a published buffer gathered from the node cache in
  // every minibatch and streamed pushes aggregated per node: death at every one of the first
  // calls (an allocation, a fetch's get or ready word, a gather, a push, a forward) is named by
  // every survivor, and no shard or sum is ever wrong.
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice, Scheme::kRemoteAdd}) {
    for (int64_t at = 1; at <= 40; ++at) {
      fault::FaultPlan plan;
      plan.kind = fault::FaultKind::kDieAtCall;
      plan.at_call = at;
      const FaultResult r = run_with_fault(4, 1, plan, scheme, true, /*ranks_per_node=*/2);
      for (size_t rank = 0; rank < r.outcome.size(); ++rank) {
        EXPECT_EQ(r.outcome[rank].find("wrong"), std::string::npos)
            << scheme_label(scheme) << " at call " << at << ", rank " << rank << ": "
            << r.outcome[rank];
        if (rank != 1) {
          EXPECT_NE(r.outcome[rank].find("rank 1"), std::string::npos)
              << scheme_label(scheme) << " at call " << at << ", rank " << rank << ": "
              << r.outcome[rank];
        }
      }
    }
  }
}

TEST(Faults, DeathAtEveryEarlyCallNeverHangsOrLies) {
  // Sweep the point of death over the first minibatches of every scheme (streamed: every call,
  // so that a sender dies between a chunk's put and its signal, and an owner mid-fold):
  // whatever the call, every survivor fails naming the dead rank and never reports a wrong sum;
  // nothing hangs (each wait is bounded by the 1 s timeout).
  for (Scheme scheme : kAllSchemes) {
    const int64_t step = is_streamed(scheme) ? 1 : 3;
    for (int64_t at = 1; at <= 40; at += step) {
      fault::FaultPlan plan;
      plan.kind = fault::FaultKind::kDieAtCall;
      plan.at_call = at;
      const FaultResult r = run_with_fault(3, 1, plan, scheme);
      for (size_t rank = 0; rank < r.outcome.size(); ++rank) {
        EXPECT_EQ(r.outcome[rank].find("wrong sum"), std::string::npos)
            << scheme_label(scheme) << " at call " << at << ", rank " << rank << ": "
            << r.outcome[rank];
        if (rank != 1) {
          EXPECT_NE(r.outcome[rank].find("rank 1"), std::string::npos)
              << scheme_label(scheme) << " at call " << at << ", rank " << rank << ": "
              << r.outcome[rank];
        }
      }
    }
  }
}

}  // namespace
}  // namespace odc
