// The core's node schemes under network-like delays on the CPU (transport/links): ranks on
// pretended nodes whose transfers to other nodes take latency + bytes / bandwidth on a serialized
// egress link per rank, delivered late for real. Flat streamed pushes, node-aggregated pushes and
// node-cached gathers give exact sums with credits running out; the bytes that crossed node links
// are the schemes' expectation; flat pushes leave during a backward-like sequence, node-aggregated
// ones inside minibatch_end (counted by the link, in modelled time, never asserted on wall time);
// a peer dying while links are slow is named, never a hang.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/communicator.h"
#include "protocol_harness.h"
#include "transport/fault/fault_transport.h"
#include "transport/links/node_links.h"
#include "transport/mem/mem_transport.h"

namespace odc {
namespace {

using testing::describe;
using testing::mem_options_for;
using testing::run_threads;
using testing::Scheme;
using testing::test_staging_bytes;

// Element j of push `call` of `sender` in minibatch `m`: small integers, exact in fp32 whatever
// the order of the additions.
float push_value(int m, int sender, int call, size_t j) {
  return static_cast<float>((m * 7 + sender * 3 + call * 5) % 17) + static_cast<float>(j % 64);
}

float published_value(int m, int owner, size_t j) {
  return static_cast<float>((m * 3 + owner * 5 + static_cast<int>(j)) % 101);
}

// Slow enough that a push's chunks are still on the wire when the next ones want their slots
// (rings of six 320-byte slots: test_staging_bytes), fast enough for a lean test.
links::LinkOptions slow_links() {
  links::LinkOptions options;
  options.latency = std::chrono::microseconds(200);
  options.bytes_per_second = 50e6;
  return options;
}

struct LinkedRun {
  int world = 8;
  int per_node = 2;
  int minibatches = 3;
  int pushes = 2;               // full-gradient pushes per rank and minibatch
  int gathers = 2;              // gathers of the published buffer per rank and minibatch
  size_t count = 1000;          // accumulator elements per owner: 16 chunks through 6 slots
  size_t published_count = 64;  // published elements per owner
  bool node_schemes = false;    // node-cached gathers and node-aggregated pushes, else flat
  double timeout_s = 30;
};

CommOptions comm_options(const LinkedRun& o) {
  CommOptions options;
  options.staging_bytes = test_staging_bytes(o.world);
  options.node_cache_bytes = o.node_schemes ? size_t{1} << 20 : 0;
  options.node_aggregation_bytes = o.node_schemes ? size_t{1} << 20 : 0;
  return options;
}

// Minibatches of: published gathers checked exactly (every other one narrowed), `pushes` pushes
// of a full gradient, minibatch_end, every owner's sums checked exactly. "" when all held.
std::string run_minibatches(Communicator& comm, const LinkedRun& o, int* completed) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  auto acc = comm.allocate(o.count, DataType::kFloat32, /*accumulator=*/true, "grads");
  if (!acc.ok()) return acc.status().message();
  auto params = comm.allocate(o.published_count, DataType::kFloat32, false, "params", true);
  if (!params.ok()) return params.status().message();
  std::vector<float> src(world * o.count), sums(world * o.count);
  std::vector<float> wide(world * o.published_count);
  std::vector<uint16_t> halves(wide.size());
  for (int m = 0; m < o.minibatches; ++m) {
    auto* shard = static_cast<float*>(params.value()->local());
    for (size_t j = 0; j < o.published_count; ++j) shard[j] = published_value(m, rank, j);
    if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
    for (int g = 0; g < o.gathers; ++g) {
      const bool narrowed = g % 2 == 1;
      Status s = narrowed ? comm.gather_as(halves.data(), halves.size(), DataType::kBfloat16,
                                           params.value(), nullptr)
                          : comm.gather(wide.data(), wide.size(), params.value(), nullptr);
      if (!s.ok()) return s.message();
      for (size_t j = 0; j < wide.size(); ++j) {
        const float got = narrowed ? bf16_to_float(halves[j]) : wide[j];
        const int owner = static_cast<int>(j / o.published_count);
        if (got != published_value(m, owner, j % o.published_count)) {
          return "wrong published shard: minibatch " + std::to_string(m) + " element " +
                 std::to_string(j);
        }
      }
    }
    for (int call = 0; call < o.pushes; ++call) {
      for (size_t j = 0; j < src.size(); ++j) src[j] = push_value(m, rank, call, j);
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
      double want = 0;
      for (int r = 0; r < world; ++r) {
        for (int call = 0; call < o.pushes; ++call) want += push_value(m, r, call, j);
      }
      if (sums[j] != want) {
        return "wrong sum: minibatch " + std::to_string(m) + " element " + std::to_string(j) +
               ": got " + std::to_string(sums[j]) + ", expected " + std::to_string(want);
      }
    }
    if (completed != nullptr) *completed = m + 1;
  }
  return "";
}

// A slice of `count` fp32 elements as the streamed scheme puts it: its bytes and a 64-byte header
// per chunk.
size_t chunked_bytes(size_t count, size_t payload_bytes) {
  const size_t bytes = count * sizeof(float);
  return bytes + (bytes + payload_bytes - 1) / payload_bytes * kChunkHeaderBytes;
}

// 8 ranks as 4 pretended nodes of 2, flat and with both node schemes: exact sums (pushes and
// published gathers), senders out of credit (flow control engaged under the delays), and the
// bytes each rank's link carried to other nodes as the schemes count them: flat, a slice per
// push to each of the 6 remote owners and every remote shard at every gather; node schemes, one
// forwarded relay row per other node and minibatch (each row it carries, once, at minibatch_end)
// instead of one slice per push and remote owner, and one fetched row per other node and
// minibatch for the published buffer. Accumulator sums are gathered flat in both (outside
// minibatches).
TEST(NodeLinks, EverySchemeExactUnderSlowLinksAndCrossesTheExpectedBytes) {
  size_t flat_put = 0, flat_fetched = 0;
  for (bool node_schemes : {false, true}) {
    SCOPED_TRACE(node_schemes ? "node schemes" : "flat");
    LinkedRun o;
    o.node_schemes = node_schemes;
    auto mem_world =
        mem::MemWorld::create(o.world, mem_options_for(Scheme::kStreamed, o.timeout_s, o.per_node));
    auto links = links::NodeLinks::create(o.world, slow_links());
    std::vector<size_t> put(o.world), fetched(o.world), payload(o.world);
    std::vector<uint64_t> credit_waits(o.world);
    const auto outcome = run_threads(o.world, [&](int rank) -> std::string {
      auto transport = links->wrap(mem_world->join(rank));
      links::LinkTransport* link = transport.get();
      Communicator comm(std::move(transport), comm_options(o));
      std::string verdict = run_minibatches(comm, o, nullptr);
      if (!verdict.empty()) return verdict;
      const bool relayed = comm.staging()->relays().size() == 1;
      const bool cached = comm.node_cache() != nullptr && comm.node_cache()->num_cached() == 1;
      if (relayed != node_schemes || cached != node_schemes) {
        return "node schemes " + std::string(relayed ? "" : "not ") + "relayed, " +
               (cached ? "" : "not ") + "cached";
      }
      put[rank] = link->bytes_put_over_links();
      fetched[rank] = link->bytes_fetched_over_links();
      payload[rank] = comm.staging()->geometry().payload_bytes();
      credit_waits[rank] = comm.staging()->credit_waits().value();
      return "";
    });
    ASSERT_EQ(describe(outcome), "");
    const int nodes = o.world / o.per_node;
    const size_t remote_owners = o.world - o.per_node;
    const size_t published_shard = o.published_count * sizeof(float);
    const size_t sums_gather = o.minibatches * remote_owners * o.count * sizeof(float);
    uint64_t waited = 0;
    size_t total_put = 0, total_fetched = 0;
    for (int rank = 0; rank < o.world; ++rank) {
      const size_t slice = chunked_bytes(o.count, payload[rank]);
      const size_t want_fetched =
          sums_gather + (node_schemes
                             ? o.minibatches * (nodes - 1) * published_shard
                             : o.minibatches * o.gathers * remote_owners * published_shard);
      const size_t want_put = node_schemes ? o.minibatches * (nodes - 1) * slice
                                           : o.minibatches * o.pushes * remote_owners * slice;
      EXPECT_EQ(put[rank], want_put) << "rank " << rank;
      EXPECT_EQ(fetched[rank], want_fetched) << "rank " << rank;
      waited += credit_waits[rank];
      total_put += put[rank];
      total_fetched += fetched[rank];
    }
    EXPECT_GT(waited, 0u) << "no sender ran out of credit: the delays did not reach flow control";
    if (!node_schemes) {
      flat_put = total_put;
      flat_fetched = total_fetched;
    } else {
      EXPECT_LT(total_put, flat_put);
      EXPECT_LT(total_fetched, flat_fetched);
    }
  }
}

// A backward-like sequence on 2 pretended nodes of 2: per microbatch, 8 layers of compute (a
// sleep) each followed by a push of that layer's gradient, 2 microbatches per minibatch. Flat
// streamed pushes leave while the rank computes: of the bytes a rank put to other nodes in a
// minibatch, at least 80% had left its link (in the link's modelled time) when minibatch_end
// began; only the last layer's may still be queued. Node-aggregated pushes, the contrast, cross
// nodes only inside minibatch_end (one relay rule for host and device: each carrier forwards its
// rows once its node's ranks ended there), so none had left, and the core's count puts every byte
// across nodes in minibatch_end. Bytes: flat puts 16 pushes x 2 remote owners slices per
// minibatch, aggregation one row per layer (a quarter). Sums exact in both.
TEST(NodeLinks, FlatPushesLeaveDuringBackwardAggregatedOnesAtMinibatchEnd) {
  const int world = 4;
  const int per_node = 2;
  const int minibatches = 3;
  const int microbatches = 2;
  const int layers = 8;
  const size_t count = 128;  // per owner and layer: two chunks
  // Every layer's compute outlasts what a push can leave queued on the link (its rings' slots to
  // the remote owners at 50 MB/s: well under 1 ms), so only the last layer's bytes can be late.
  const auto compute = std::chrono::milliseconds(2);
  for (bool aggregate : {false, true}) {
    SCOPED_TRACE(aggregate ? "aggregated" : "flat");
    auto mem_world = mem::MemWorld::create(world, mem_options_for(Scheme::kStreamed, 30, per_node));
    auto links = links::NodeLinks::create(world, slow_links());
    std::vector<size_t> put(world), left_before_end(world), payload(world), put_before_end(world);
    std::vector<NodeTraffic> counted(world);
    const auto outcome = run_threads(world, [&](int rank) -> std::string {
      auto transport = links->wrap(mem_world->join(rank));
      links::LinkTransport* link = transport.get();
      CommOptions options;
      options.staging_bytes = test_staging_bytes(world);
      options.node_aggregation_bytes = aggregate ? size_t{1} << 20 : 0;
      Communicator comm(std::move(transport), options);
      std::vector<Buffer*> grads;  // one accumulator per layer, as odc.torch has per FSDP unit
      for (int l = 0; l < layers; ++l) {
        auto made = comm.allocate(count, DataType::kFloat32, true, "layer" + std::to_string(l));
        if (!made.ok()) return made.status().message();
        grads.push_back(made.value());
      }
      if ((comm.staging()->relays().size() == static_cast<size_t>(layers)) != aggregate) {
        return std::string("aggregation not as asked");
      }
      std::vector<float> src(world * count), sums(world * count);
      for (int m = 0; m < minibatches; ++m) {
        if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
        // Everything earlier landed at the last barrier, so it has left the link too.
        const size_t put_at_begin = link->bytes_put_over_links();
        if (link->bytes_put_departed() != put_at_begin) return std::string("bytes left behind");
        for (int mb = 0; mb < microbatches; ++mb) {
          for (int l = layers - 1; l >= 0; --l) {
            std::this_thread::sleep_for(compute);
            for (size_t j = 0; j < src.size(); ++j)
              src[j] = push_value(m, rank, mb * layers + l, j);
            if (Status s = comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32,
                                                   grads[l], nullptr);
                !s.ok()) {
              return s.message();
            }
          }
        }
        left_before_end[rank] += link->bytes_put_departed() - put_at_begin;
        put_before_end[rank] += link->bytes_put_over_links() - put_at_begin;
        if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
        put[rank] += link->bytes_put_over_links() - put_at_begin;
        for (int l = 0; l < layers; ++l) {
          if (Status s = comm.gather(sums.data(), sums.size(), grads[l], nullptr); !s.ok()) {
            return s.message();
          }
          for (size_t j = 0; j < sums.size(); ++j) {
            double want = 0;
            for (int r = 0; r < world; ++r) {
              for (int mb = 0; mb < microbatches; ++mb)
                want += push_value(m, r, mb * layers + l, j);
            }
            if (sums[j] != want) return "wrong sum: layer " + std::to_string(l);
          }
        }
      }
      payload[rank] = comm.staging()->geometry().payload_bytes();
      counted[rank] = comm.staging()->node_traffic();
      return "";
    });
    ASSERT_EQ(describe(outcome), "");
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_GT(put[rank], 0u) << "rank " << rank << " put nothing across nodes";
      // The core's own count of what crossed nodes (odcCommGetNodeTraffic) is the link's, split
      // where minibatch_end began.
      EXPECT_EQ(counted[rank].during_minibatches, put_before_end[rank]) << "rank " << rank;
      EXPECT_EQ(counted[rank].in_minibatch_end, put[rank] - put_before_end[rank])
          << "rank " << rank;
      if (aggregate) {
        EXPECT_EQ(counted[rank].during_minibatches, 0u) << "rank " << rank;
      } else {
        EXPECT_EQ(counted[rank].in_minibatch_end, 0u) << "rank " << rank;
      }
      const double share = static_cast<double>(left_before_end[rank]) / put[rank];
      if (aggregate) {
        EXPECT_EQ(left_before_end[rank], 0u) << "rank " << rank;
      } else {
        EXPECT_GE(share, 0.8) << "rank " << rank << ": " << left_before_end[rank] << " of "
                              << put[rank] << " bytes left before minibatch_end";
      }
      std::printf(
          "[ share ] %s rank %d: %zu of %zu bytes across nodes left before "
          "minibatch_end (%.1f%%)\n",
          aggregate ? "aggregated" : "flat", rank, left_before_end[rank], put[rank], 100 * share);
      const size_t slice = chunked_bytes(count, payload[rank]);
      if (!aggregate) {
        EXPECT_EQ(put[rank], minibatches * microbatches * layers * (world - per_node) * slice);
      } else {
        // One row carried per rank (2 remote owners, 2 carriers on the node), once per layer.
        EXPECT_EQ(put[rank], minibatches * layers * slice) << "rank " << rank;
      }
    }
  }
}

// A rank dies mid-run while the links are slow (transfers in flight, credits late, the node cache
// fetching, relays waiting for their node), with both node schemes on 2 pretended nodes of 2:
// every other rank fails naming it, none reports a wrong sum, nothing hangs (1 s timeout).
TEST(NodeLinks, PeerDyingWhileLinksAreSlowIsNamed) {
  LinkedRun o;
  o.world = 4;
  o.minibatches = 8;
  o.node_schemes = true;
  o.timeout_s = 1;
  const int dying = 3;
  auto mem_world =
      mem::MemWorld::create(o.world, mem_options_for(Scheme::kStreamed, o.timeout_s, o.per_node));
  auto links = links::NodeLinks::create(o.world, slow_links());
  std::vector<int> completed(o.world, 0);
  const auto outcome = run_threads(o.world, [&](int rank) -> std::string {
    fault::FaultPlan plan;
    if (rank == dying) {
      plan.kind = fault::FaultKind::kDieAtCall;
      plan.at_call = 1500;  // in the fourth minibatch (about 450 calls each)
    }
    auto die = [&mem_world, rank] { mem_world->kill(rank); };
    Communicator comm(
        std::make_unique<fault::FaultTransport>(links->wrap(mem_world->join(rank)), plan, die),
        comm_options(o));
    return run_minibatches(comm, o, &completed[rank]);
  });
  for (int rank = 0; rank < o.world; ++rank) {
    const std::string& verdict = outcome[rank];
    EXPECT_FALSE(verdict.empty()) << "rank " << rank << " reported success";
    EXPECT_EQ(verdict.find("wrong"), std::string::npos) << "rank " << rank << ": " << verdict;
    if (rank == dying) continue;
    EXPECT_NE(verdict.find("rank 3"), std::string::npos) << "rank " << rank << ": " << verdict;
    EXPECT_GT(completed[rank], 0) << "rank " << rank << ": the death should land mid-run";
  }
}

}  // namespace
}  // namespace odc
