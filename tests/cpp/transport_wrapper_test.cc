// The test wrappers (fault injection, node links) forward every method of the transport table and
// every device staging hook to the wrapped transport's own, not to Transport's defaults (which
// would hand a wrapped device transport a host-side poll for wait_signals, put then signal for
// put_signal, one get per source for get_from): a probe transport records which of its methods
// each call on the wrapper reached.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/device_staging_ops.h"
#include "transport/fault/fault_transport.h"
#include "transport/links/node_links.h"

namespace odc {
namespace {

constexpr int kWorldSize = 2;
constexpr size_t kRegionBytes = 64;
constexpr std::chrono::seconds kTimeout{7};

class ProbeRegion final : public SymmetricRegion {
 public:
  explicit ProbeRegion(std::vector<void*> peers)
      : SymmetricRegion(std::move(peers), /*local_rank=*/0, kRegionBytes) {}
};

// Rank 0 of 2, on a node of its own, with every capability; each method records its name and
// does nothing else.
class ProbeTransport final : public Transport, private DeviceStagingOps {
 public:
  explicit ProbeTransport(std::vector<std::string>* calls)
      : Transport(TransportTraits{0, kWorldSize, TransportCaps{true, true}, kTimeout}),
        calls_(calls) {}

  uint64_t node_key() const override { return 42; }
  bool maps_directly(int) const override { return false; }

  Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord&) override {
    note("exchange");
    return std::vector<ExchangeRecord>(kWorldSize);
  }
  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t) override {
    note("allocate");
    return std::unique_ptr<SymmetricRegion>(new ProbeRegion({memory_, memory_}));
  }
  Status barrier(CollectiveOp, StreamHandle) override { return record("barrier"); }
  Status host_barrier(CollectiveOp) override { return record("host_barrier"); }
  Result<std::unique_ptr<Transport>> split(const SplitGroup&) override {
    note("split");
    return std::unique_ptr<Transport>();  // not a member
  }
  Status drain() override { return record("drain"); }
  Status poll_error() override { return record("poll_error"); }
  void mark_failed(const std::string&) override { note("mark_failed"); }
  Status get_all(void*, const SymmetricRegion&, size_t, DataType, DataType, StreamHandle) override {
    return record("get_all");
  }
  Status get(void*, const SymmetricRegion&, int, size_t, size_t, StreamHandle) override {
    return record("get");
  }
  Status get_from(void*, const std::vector<GatherSource>&, size_t, DataType, DataType,
                  StreamHandle) override {
    return record("get_from");
  }
  Status put(const void*, const SymmetricRegion&, int, size_t, size_t, StreamHandle) override {
    return record("put");
  }
  Status put_signal(const void*, const SymmetricRegion&, int, size_t, size_t,
                    const SymmetricRegion&, uint64_t, StreamHandle) override {
    return record("put_signal");
  }
  Status signal(const SymmetricRegion&, int, uint64_t, StreamHandle) override {
    return record("signal");
  }
  Status add_all(const void*, DataType, const SymmetricRegion&, size_t, StreamHandle) override {
    return record("add_all");
  }
  Status compare_swap(const std::vector<CompareSwapOp>&, uint64_t*) override {
    return record("compare_swap");
  }
  Result<bool> poll_signals(const std::vector<SignalWatch>& watches, size_t,
                            std::chrono::duration<double>, std::vector<uint64_t>* seen) override {
    note("poll_signals");
    seen->assign(watches.size(), UINT64_MAX);
    return true;
  }
  Status wait_signals(const SymmetricRegion&, const std::vector<int>&, uint64_t, const std::string&,
                      StreamHandle) override {
    return record("wait_signals");
  }
  Result<StreamHandle> fork_background(StreamHandle stream) override {
    note("fork_background");
    return stream;
  }
  Status join_background(StreamHandle) override { return record("join_background"); }
  Status zero(void*, size_t, StreamHandle) override { return record("zero"); }
  Status accumulate(float*, const void*, DataType, size_t, StreamHandle) override {
    return record("accumulate");
  }
  DeviceStagingOps* device_staging() override { return this; }

 private:
  Status fold_streamed(const kernels::StreamedFold&, StreamHandle) override {
    return record("fold_streamed");
  }
  Result<bool> fold_streamed_if_idle(const kernels::StreamedFold&, StreamHandle) override {
    note("fold_streamed_if_idle");
    return true;
  }
  Status pack_chunk(void*, const kernels::ChunkHeader&, const void*, size_t,
                    StreamHandle) override {
    return record("pack_chunk");
  }
  Status read_local(void*, const void*, size_t) override { return record("read_local"); }
  Result<StreamHandle> fork_sends(StreamHandle stream) override {
    note("fork_sends");
    return stream;
  }
  Status mark_sends(int) override { return record("mark_sends"); }
  Status wait_sends(int, StreamHandle) override { return record("wait_sends"); }
  Status join_sends(StreamHandle) override { return record("join_sends"); }

  void note(const char* name) { calls_->push_back(name); }
  Status record(const char* name) {
    note(name);
    return Status::Ok();
  }

  std::vector<std::string>* calls_;
  alignas(16) char memory_[kRegionBytes] = {};
};

// One call on a transport, named by the method it calls.
struct Call {
  std::string method;
  std::function<Status(Transport&)> run;
};

template <typename T>
Status status_of(const Result<T>& result) {
  return result.ok() ? Status::Ok() : result.status();
}

DeviceStagingOps& staging_of(Transport& transport) {
  return *transport.device_staging();
}

// A call of every method of the table that acts (the queries are compared by value instead),
// and of every device staging hook, each with arguments that every wrapper passes on as they
// are (peer 1, on this rank's node).
std::vector<Call> every_call(const SymmetricRegion* region, float* data) {
  constexpr StreamHandle kStream = nullptr;
  static const kernels::StreamedFold kFold{};
  static const kernels::ChunkHeader kHeader{};
  const SymmetricRegion& r = *region;
  return {
      {"exchange", [](Transport& t) { return status_of(t.exchange(ExchangeRecord{})); }},
      {"allocate", [](Transport& t) { return status_of(t.allocate(kRegionBytes)); }},
      {"barrier", [](Transport& t) { return t.barrier(CollectiveOp::kBarrier, kStream); }},
      {"host_barrier", [](Transport& t) { return t.host_barrier(CollectiveOp::kBarrier); }},
      {"split", [](Transport& t) { return status_of(t.split(SplitGroup{})); }},
      {"drain", [](Transport& t) { return t.drain(); }},
      {"poll_error", [](Transport& t) { return t.poll_error(); }},
      {"mark_failed",
       [](Transport& t) {
         t.mark_failed("probe");
         return Status::Ok();
       }},
      {"get_all",
       [&r, data](Transport& t) {
         return t.get_all(data, r, 1, DataType::kFloat32, DataType::kBfloat16, kStream);
       }},
      {"get", [&r, data](Transport& t) { return t.get(data, r, 1, 0, 4, kStream); }},
      {"get_from",
       [&r, data](Transport& t) {
         return t.get_from(data, {{&r, 1, 0}, {&r, 0, 0}}, 1, DataType::kFloat32,
                           DataType::kFloat32, kStream);
       }},
      {"put", [&r, data](Transport& t) { return t.put(data, r, 1, 0, 4, kStream); }},
      {"put_signal",
       [&r, data](Transport& t) { return t.put_signal(data, r, 1, 0, 4, r, 1, kStream); }},
      {"signal", [&r](Transport& t) { return t.signal(r, 1, 1, kStream); }},
      {"add_all",
       [&r, data](Transport& t) { return t.add_all(data, DataType::kFloat32, r, 1, kStream); }},
      {"compare_swap",
       [&r](Transport& t) {
         uint64_t old = 0;
         return t.compare_swap({{&r, 1, 0, 0, 0}}, &old);
       }},
      {"poll_signals",
       [&r](Transport& t) {
         std::vector<uint64_t> seen;
         return status_of(t.poll_signals({{&r, 1, 1}}, 1, std::chrono::seconds(0), &seen));
       }},
      {"wait_signals", [&r](Transport& t) { return t.wait_signals(r, {1}, 1, "probe", kStream); }},
      {"fork_background", [](Transport& t) { return status_of(t.fork_background(kStream)); }},
      {"join_background", [](Transport& t) { return t.join_background(kStream); }},
      {"zero", [data](Transport& t) { return t.zero(data, 4, kStream); }},
      {"accumulate",
       [data](Transport& t) { return t.accumulate(data, data, DataType::kFloat32, 1, kStream); }},
      {"fold_streamed", [](Transport& t) { return staging_of(t).fold_streamed(kFold, kStream); }},
      {"fold_streamed_if_idle",
       [](Transport& t) { return status_of(staging_of(t).fold_streamed_if_idle(kFold, kStream)); }},
      {"pack_chunk",
       [data](Transport& t) { return staging_of(t).pack_chunk(data, kHeader, data, 4, kStream); }},
      {"read_local", [data](Transport& t) { return staging_of(t).read_local(data, data, 4); }},
      {"fork_sends", [](Transport& t) { return status_of(staging_of(t).fork_sends(kStream)); }},
      {"mark_sends", [](Transport& t) { return staging_of(t).mark_sends(1); }},
      {"wait_sends", [](Transport& t) { return staging_of(t).wait_sends(1, kStream); }},
      {"join_sends", [](Transport& t) { return staging_of(t).join_sends(kStream); }},
  };
}

// Every call on `wrapper` reaches the probe's method of the same name, and only it, except the
// methods in `refused`, which must fail and reach nothing.
void expect_forwards_every_call(Transport& wrapper, std::vector<std::string>* calls,
                                const std::vector<std::string>& refused = {}) {
  EXPECT_EQ(wrapper.rank(), 0);
  EXPECT_EQ(wrapper.world_size(), kWorldSize);
  EXPECT_TRUE(wrapper.caps().remote_fp32_add);
  EXPECT_TRUE(wrapper.caps().stream_ordered);
  EXPECT_EQ(wrapper.timeout(), kTimeout);
  EXPECT_EQ(wrapper.node_key(), 42u);
  EXPECT_FALSE(wrapper.maps_directly(1));
  ASSERT_NE(wrapper.device_staging(), nullptr);

  auto region = wrapper.allocate(kRegionBytes);
  ASSERT_TRUE(region.ok()) << region.status().message();
  float data[4] = {};
  for (const Call& call : every_call(region.value().get(), data)) {
    calls->clear();
    const Status status = call.run(wrapper);
    if (std::find(refused.begin(), refused.end(), call.method) != refused.end()) {
      EXPECT_FALSE(status.ok()) << call.method;
      EXPECT_TRUE(calls->empty()) << call.method;
      continue;
    }
    EXPECT_TRUE(status.ok()) << call.method << ": " << status.message();
    EXPECT_EQ(*calls, std::vector<std::string>{call.method}) << "called " << call.method;
  }
}

TEST(GatherDtypes, OnlyTheCopyAndTheNarrowingPairsAreAccepted) {
  EXPECT_TRUE(Transport::check_gather_dtypes(DataType::kFloat32, DataType::kFloat32).ok());
  EXPECT_TRUE(Transport::check_gather_dtypes(DataType::kBfloat16, DataType::kBfloat16).ok());
  EXPECT_TRUE(Transport::check_gather_dtypes(DataType::kFloat32, DataType::kBfloat16).ok());
  const Status widening = Transport::check_gather_dtypes(DataType::kBfloat16, DataType::kFloat32);
  EXPECT_EQ(widening.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(widening.message().find("bfloat16 -> float32"), std::string::npos)
      << widening.message();
  const Status unknown =
      Transport::check_gather_dtypes(static_cast<DataType>(7), DataType::kFloat32);
  EXPECT_EQ(unknown.code(), StatusCode::kInvalidArgument);
}

TEST(TransportWrapper, FaultTransportWithoutFaultsForwardsEveryCall) {
  std::vector<std::string> calls;
  fault::FaultTransport wrapper(std::make_unique<ProbeTransport>(&calls), fault::FaultPlan{});
  expect_forwards_every_call(wrapper, &calls);
}

TEST(TransportWrapper, LinkTransportWithinANodeForwardsEveryCall) {
  // Peer 1 never joins the links, so no transfer crosses one: everything passes straight through.
  // Splitting is refused: a group would need links of its own.
  std::vector<std::string> calls;
  auto links = links::NodeLinks::create(kWorldSize, links::LinkOptions{});
  auto wrapper = links->wrap(std::make_unique<ProbeTransport>(&calls));
  expect_forwards_every_call(*wrapper, &calls, /*refused=*/{"split"});
}

TEST(TransportWrapper, FaultTransportCountsAGatherFromSourcesAsOneCall) {
  // get_from is one call of the protocol, reading its parts from their peers.
  std::vector<std::string> calls;
  fault::FaultTransport wrapper(std::make_unique<ProbeTransport>(&calls), fault::FaultPlan{});
  auto region = wrapper.allocate(kRegionBytes);
  ASSERT_TRUE(region.ok());
  const int64_t before = wrapper.calls();
  float data[4] = {};
  const std::vector<GatherSource> sources = {{region.value().get(), 1, 0},
                                             {region.value().get(), 1, 8}};
  ASSERT_TRUE(
      wrapper.get_from(data, sources, 2, DataType::kFloat32, DataType::kFloat32, nullptr).ok());
  EXPECT_EQ(wrapper.calls(), before + 1);
  EXPECT_EQ(wrapper.bytes_read_from(1), 2 * 2 * sizeof(float));
  EXPECT_EQ(wrapper.bytes_read_from(0), 0u);
}

TEST(TransportWrapper, FaultTransportDropsTheSignalOfAPutWithSignal) {
  // A put-with-signal carries its signal through the plan's signal faults: the data lands, the
  // dropped signal does not.
  std::vector<std::string> calls;
  fault::FaultPlan plan;
  plan.kind = fault::FaultKind::kDropSignal;
  plan.peer = 1;
  fault::FaultTransport wrapper(std::make_unique<ProbeTransport>(&calls), plan);
  auto region = wrapper.allocate(kRegionBytes);
  ASSERT_TRUE(region.ok());
  float data[1] = {};
  calls.clear();
  ASSERT_TRUE(wrapper.put_signal(data, *region.value(), 1, 0, 4, *region.value(), 1, nullptr).ok());
  EXPECT_EQ(calls, std::vector<std::string>{"put"});
  calls.clear();
  ASSERT_TRUE(wrapper.put_signal(data, *region.value(), 1, 0, 4, *region.value(), 2, nullptr).ok());
  EXPECT_EQ(calls, (std::vector<std::string>{"put", "signal"}));  // dropped once only
}

}  // namespace
}  // namespace odc
