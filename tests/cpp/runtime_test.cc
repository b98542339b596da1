// The ODC runtime on the host transport, through the C API, with one process per rank: gather,
// scatter-accumulate under uneven load and random delays, many minibatches, bf16, invalid use,
// dead and silent peers, and the lifecycle of shared-memory segments.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>
#include <utility>

#include "core/dtype.h"
#include "multiprocess.h"
#include "odc/odc.h"

namespace odc {
namespace {

using testing::run_ranks;

// Element i of the source that `sender` pushes in call `call` of minibatch `minibatch`: small
// integers, so fp32 sums are exact in any order.
float contribution(int minibatch, int sender, int call, size_t i) {
  return static_cast<float>((minibatch * 7 + sender * 3 + call * 5 + static_cast<int>(i)) % 17);
}

// Pushes per rank per minibatch: uneven, zero for some ranks in some minibatches.
int pushes(int minibatch, int rank) {
  return (minibatch + rank * 2) % 4;
}

void expect_all_ok(const std::vector<std::string>& outcome) {
  for (size_t rank = 0; rank < outcome.size(); ++rank) {
    EXPECT_EQ(outcome[rank], "") << "rank " << rank;
  }
}

bool shm_segments_left(const std::string& key) {
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    if (entry.path().filename().string().rfind("odc." + key + ".", 0) == 0) return true;
  }
  return false;
}

class Gather : public ::testing::TestWithParam<int> {};

TEST_P(Gather, EqualsConcatenatedShards) {
  expect_all_ok(run_ranks(GetParam(), [](int rank, int world, const std::string& key) {
    odcComm_t comm;
    RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), 20.0));
    const size_t count = 1000 + 3;  // not a multiple of any vector width
    odcBuffer_t params;
    void* local;
    RANK_CHECK(odcBufferAlloc(comm, count, odcFloat32, 0, &params, &local));
    for (size_t i = 0; i < count; ++i) static_cast<float*>(local)[i] = rank * 10000.0f + i;
    odcBuffer_t bf16;
    void* bf16_local;
    RANK_CHECK(odcBufferAlloc(comm, count, odcBfloat16, 0, &bf16, &bf16_local));
    for (size_t i = 0; i < count; ++i) {
      static_cast<uint16_t*>(bf16_local)[i] = float_to_bf16(static_cast<float>(rank * 8 + i % 8));
    }
    RANK_CHECK(odcBarrier(comm, nullptr));  // shards are written before anyone reads them

    std::vector<float> full(world * count);
    RANK_CHECK(odcGather(comm, full.data(), full.size(), params, nullptr));
    for (int r = 0; r < world; ++r) {
      for (size_t i = 0; i < count; ++i) {
        RANK_EXPECT(full[r * count + i] == r * 10000.0f + i, "gathered fp32 element differs");
      }
    }
    std::vector<uint16_t> full_bf16(world * count);
    RANK_CHECK(odcGather(comm, full_bf16.data(), full_bf16.size(), bf16, nullptr));
    for (int r = 0; r < world; ++r) {
      for (size_t i = 0; i < count; ++i) {
        RANK_EXPECT(bf16_to_float(full_bf16[r * count + i]) == r * 8 + i % 8,
                    "gathered bf16 element differs");
      }
    }
    // float32 shards into a bfloat16 destination, rounded to nearest even while pulled: the
    // values above 256 need rounding (bf16 keeps 8 significant bits), half of them on a tie.
    std::vector<uint16_t> narrowed(world * count);
    RANK_CHECK(odcGatherAs(comm, narrowed.data(), narrowed.size(), odcBfloat16, params, nullptr));
    for (int r = 0; r < world; ++r) {
      for (size_t i = 0; i < count; ++i) {
        RANK_EXPECT(narrowed[r * count + i] == float_to_bf16(r * 10000.0f + i),
                    "narrowed element differs from round-to-nearest-even");
      }
    }
    // The same dtype through odcGatherAs is a plain gather; widening is refused by name.
    std::vector<uint16_t> same(world * count);
    RANK_CHECK(odcGatherAs(comm, same.data(), same.size(), odcBfloat16, bf16, nullptr));
    RANK_EXPECT(same == full_bf16, "odcGatherAs with the buffer's dtype differs from odcGather");
    RANK_EXPECT(odcGatherAs(comm, full.data(), full.size(), odcFloat32, bf16, nullptr) ==
                    odcInvalidArgument,
                "widening bfloat16 into float32 was not refused");
    const std::string error = odcCommGetLastError(comm);
    RANK_EXPECT(error.find("cannot gather a bfloat16 buffer into float32") != std::string::npos,
                "the refusal does not name the dtypes: " + error);
    RANK_EXPECT(odcGatherAs(comm, same.data(), same.size(), static_cast<odcDataType_t>(7), params,
                            nullptr) == odcInvalidArgument,
                "an unknown destination dtype was not refused");
    RANK_EXPECT(std::string(odcCommGetLastError(comm)).find("unknown destination dtype 7") !=
                    std::string::npos,
                "the refusal does not name the unknown dtype");
    RANK_CHECK(odcBarrier(comm, nullptr));  // nobody frees while others read
    RANK_CHECK(odcCommDestroy(comm));
    return std::string();
  }));
}

INSTANTIATE_TEST_SUITE_P(Ranks, Gather, ::testing::Values(1, 2, 3, 4, 8));

// Minibatches of uneven pushes with random delays; every rank checks every owner's sum.
std::string run_minibatches(int rank, int world, const std::string& key, int num_minibatches,
                            size_t count, odcDataType_t src_dtype, bool random_delays) {
  odcComm_t comm;
  RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), 30.0));
  odcBuffer_t accumulator;
  void* local;
  RANK_CHECK(odcBufferAlloc(comm, count, odcFloat32, 1, &accumulator, &local));
  std::mt19937 rng(1234 + rank);
  std::uniform_int_distribution<int> delay_us(0, 1500);
  std::vector<float> src(world * count);
  std::vector<uint16_t> src_bf16(world * count);
  std::vector<float> everything(world * count);
  for (int minibatch = 0; minibatch < num_minibatches; ++minibatch) {
    RANK_CHECK(odcMinibatchBegin(comm, nullptr));
    for (int call = 0; call < pushes(minibatch, rank); ++call) {
      if (random_delays) std::this_thread::sleep_for(std::chrono::microseconds(delay_us(rng)));
      for (size_t i = 0; i < src.size(); ++i) {
        src[i] = contribution(minibatch, rank, call, i);
        src_bf16[i] = float_to_bf16(src[i]);
      }
      const void* data = src_dtype == odcFloat32 ? static_cast<const void*>(src.data())
                                                 : static_cast<const void*>(src_bf16.data());
      RANK_CHECK(odcScatterAccumulate(comm, data, src.size(), src_dtype, accumulator, nullptr));
    }
    RANK_CHECK(odcMinibatchEnd(comm, nullptr));
    // Sums are final everywhere: read every owner's accumulator.
    RANK_CHECK(odcGather(comm, everything.data(), everything.size(), accumulator, nullptr));
    for (size_t j = 0; j < everything.size(); ++j) {
      float expected = 0;
      for (int sender = 0; sender < world; ++sender) {
        for (int call = 0; call < pushes(minibatch, sender); ++call) {
          expected += contribution(minibatch, sender, call, j);
        }
      }
      RANK_EXPECT(everything[j] == expected, "minibatch " + std::to_string(minibatch) +
                                                 " element " + std::to_string(j) + ": got " +
                                                 std::to_string(everything[j]) + ", expected " +
                                                 std::to_string(expected));
    }
    // No barrier here: the sums stay valid for every rank until the next minibatch_end fills
    // them, whatever a faster peer's next minibatch_begin does.
  }
  RANK_CHECK(odcCommDestroy(comm));
  return std::string();
}

class ScatterAccumulate : public ::testing::TestWithParam<int> {};

TEST_P(ScatterAccumulate, UnevenPushesWithDelaysSumExactly) {
  expect_all_ok(run_ranks(GetParam(), [](int rank, int world, const std::string& key) {
    return run_minibatches(rank, world, key, 6, 257, odcFloat32, /*random_delays=*/true);
  }));
}

TEST_P(ScatterAccumulate, Bf16Sources) {
  expect_all_ok(run_ranks(GetParam(), [](int rank, int world, const std::string& key) {
    return run_minibatches(rank, world, key, 4, 129, odcBfloat16, /*random_delays=*/true);
  }));
}

INSTANTIATE_TEST_SUITE_P(Ranks, ScatterAccumulate, ::testing::Values(1, 2, 4, 8));

TEST(ScatterAccumulate, ThousandMinibatchesLoseNothing) {
  expect_all_ok(run_ranks(
      4,
      [](int rank, int world, const std::string& key) {
        return run_minibatches(rank, world, key, 1000, 33, odcFloat32, /*random_delays=*/false);
      },
      std::chrono::seconds(240)));
}

TEST(ScatterAccumulate, ThreadsAsRanks) {
  // Ranks as threads of one process: the same protocol, visible to ThreadSanitizer.
  const int world = 3;
  const std::string key = testing::unique_key("threads");
  std::vector<std::string> outcome(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      outcome[rank] = run_minibatches(rank, world, key, 50, 64, odcFloat32, false);
    });
  }
  for (auto& thread : threads) thread.join();
  expect_all_ok(outcome);
}

TEST(InvalidUse, ReturnsErrorsAndChangesNothing) {
  expect_all_ok(run_ranks(2, [](int rank, int world, const std::string& key) {
    odcComm_t comm;
    RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), 20.0));
    odcBuffer_t buffer;
    void* local;
    // Count and dtype must agree across ranks: every rank fails, nothing is allocated.
    odcResult_t result = odcBufferAlloc(comm, rank == 0 ? 10 : 12, odcFloat32, 1, &buffer, &local);
    RANK_EXPECT(result == odcInvalidArgument, odcGetErrorString(result));
    RANK_EXPECT(std::strstr(odcCommGetLastError(comm), "buffers differ across ranks") != nullptr,
                odcCommGetLastError(comm));
    result = odcBufferAlloc(comm, 10, rank == 0 ? odcFloat32 : odcBfloat16, 0, &buffer, &local);
    RANK_EXPECT(result == odcInvalidArgument, odcGetErrorString(result));
    RANK_EXPECT(odcBufferAlloc(comm, 10, odcBfloat16, 1, &buffer, &local) == odcInvalidArgument,
                "a bf16 accumulator must be refused");
    RANK_EXPECT(odcBufferAlloc(comm, 0, odcFloat32, 1, &buffer, &local) == odcInvalidArgument,
                "a zero count must be refused");
    RANK_EXPECT(odcBufferAlloc(comm, 10, odcFloat32, 1, nullptr, nullptr) == odcInvalidArgument,
                "NULL outputs must be refused");

    odcBuffer_t accumulator, params;
    void* accumulator_local;
    void* params_local;
    RANK_CHECK(odcBufferAlloc(comm, 10, odcFloat32, 1, &accumulator, &accumulator_local));
    RANK_CHECK(odcBufferAlloc(comm, 10, odcFloat32, 0, &params, &params_local));
    std::vector<float> src(world * 10, 1.0f);

    // Outside a minibatch.
    result = odcScatterAccumulate(comm, src.data(), src.size(), odcFloat32, accumulator, nullptr);
    RANK_EXPECT(result == odcInvalidUsage, odcGetErrorString(result));
    RANK_EXPECT(std::strstr(odcGetLastError(), "outside a minibatch") != nullptr,
                odcGetLastError());
    RANK_EXPECT(std::strstr(odcGetLastError(), ("rank " + std::to_string(rank)).c_str()),
                "errors name the rank");
    RANK_EXPECT(odcMinibatchEnd(comm, nullptr) == odcInvalidUsage, "end without begin");

    RANK_CHECK(odcMinibatchBegin(comm, nullptr));
    RANK_EXPECT(odcMinibatchBegin(comm, nullptr) == odcInvalidUsage, "begin twice");
    // Wrong source size, NULL source, non-accumulator target.
    result =
        odcScatterAccumulate(comm, src.data(), src.size() - 1, odcFloat32, accumulator, nullptr);
    RANK_EXPECT(result == odcInvalidArgument, odcGetErrorString(result));
    RANK_EXPECT(std::strstr(odcGetLastError(), "expected world size x shard = 2 x 10 = 20"),
                odcGetLastError());
    RANK_EXPECT(odcScatterAccumulate(comm, nullptr, src.size(), odcFloat32, accumulator, nullptr) ==
                    odcInvalidArgument,
                "NULL source");
    RANK_EXPECT(odcScatterAccumulate(comm, src.data(), src.size(), odcFloat32, params, nullptr) ==
                    odcInvalidArgument,
                "target must be an accumulator");
    RANK_EXPECT(odcScatterAccumulate(comm, src.data(), src.size(), static_cast<odcDataType_t>(9),
                                     accumulator, nullptr) == odcInvalidArgument,
                "unknown dtype");
    // Gather: wrong size, NULL destination.
    std::vector<float> out(world * 10);
    RANK_EXPECT(odcGather(comm, out.data(), out.size() + 1, params, nullptr) == odcInvalidArgument,
                "gather size");
    RANK_EXPECT(odcGather(comm, nullptr, out.size(), params, nullptr) == odcInvalidArgument,
                "NULL dst");

    // A buffer of another communicator.
    odcComm_t other;
    RANK_CHECK(odcCommInit(&other, rank, world, (key + "-other").c_str(), 20.0));
    odcBuffer_t foreign;
    void* foreign_local;
    RANK_CHECK(odcBufferAlloc(other, 10, odcFloat32, 1, &foreign, &foreign_local));
    result = odcScatterAccumulate(comm, src.data(), src.size(), odcFloat32, foreign, nullptr);
    RANK_EXPECT(result == odcInvalidArgument, odcGetErrorString(result));
    RANK_EXPECT(std::strstr(odcGetLastError(), "does not belong to this communicator"),
                odcGetLastError());
    RANK_CHECK(odcBarrier(other, nullptr));
    RANK_CHECK(odcCommDestroy(other));
    // Use after destroy.
    RANK_EXPECT(odcBarrier(other, nullptr) == odcInvalidUsage, "use after destroy");
    RANK_EXPECT(std::strstr(odcGetLastError(), "after destroy"), odcGetLastError());
    RANK_EXPECT(odcCommDestroy(other) == odcInvalidUsage, "double destroy");
    RANK_EXPECT(odcBarrier(nullptr, nullptr) == odcInvalidArgument, "NULL comm");
    RANK_EXPECT(odcCommInit(nullptr, rank, world, key.c_str(), 1) == odcInvalidArgument, "NULL");

    // None of the above changed anything: this minibatch still sums exactly.
    RANK_CHECK(
        odcScatterAccumulate(comm, src.data(), src.size(), odcFloat32, accumulator, nullptr));
    RANK_CHECK(odcMinibatchEnd(comm, nullptr));
    for (int i = 0; i < 10; ++i) {
      RANK_EXPECT(static_cast<float*>(accumulator_local)[i] == world, "sum after errors");
    }
    RANK_CHECK(odcBarrier(comm, nullptr));
    RANK_CHECK(odcBufferFree(comm, params));
    RANK_EXPECT(odcBufferFree(comm, params) == odcInvalidArgument, "double free");
    RANK_CHECK(odcCommDestroy(comm));
    return std::string();
  }));
}

TEST(InvalidUse, BadInitArguments) {
  odcComm_t comm = nullptr;
  EXPECT_EQ(odcCommInit(&comm, 2, 2, "k", 1.0), odcInvalidArgument);
  EXPECT_STREQ(odcGetLastError(), "rank 2: init: rank 2 is outside world size 2");
  EXPECT_EQ(odcCommInit(&comm, 0, 0, "k", 1.0), odcInvalidArgument);
  EXPECT_EQ(odcCommInit(&comm, 0, 1, "bad/key", 1.0), odcInvalidArgument);
  EXPECT_EQ(odcCommInit(&comm, 0, 1, "", 1.0), odcInvalidArgument);
  EXPECT_EQ(odcCommInit(&comm, 0, 1, nullptr, 1.0), odcInvalidArgument);
  EXPECT_EQ(comm, nullptr);
}

// odcCommConfigInit writes only the fields of the caller's declared version, and nothing at all
// for a header it does not know (a caller built against an older header, an uninitialized struct).
TEST(Config, InitWritesOnlyWhatTheHeaderDeclares) {
  const size_t sizes[] = {offsetof(odcCommConfig_t, bootstrap),
                          offsetof(odcCommConfig_t, staging_bytes),
                          offsetof(odcCommConfig_t, node_cache_bytes),
                          offsetof(odcCommConfig_t, cuda_sms), sizeof(odcCommConfig_t)};
  EXPECT_EQ(sizes[0], 40u);  // the sizes odc.h names
  EXPECT_EQ(sizes[3], 80u);
  EXPECT_EQ(sizes[4], 96u);
  for (unsigned version = 1; version <= ODC_COMM_CONFIG_VERSION; ++version) {
    unsigned char bytes[sizeof(odcCommConfig_t) + 16];
    std::memset(bytes, 0xa5, sizeof(bytes));
    odcCommConfig_t header{};
    header.size = sizes[version - 1];
    header.version = version;
    std::memcpy(bytes, &header, offsetof(odcCommConfig_t, transport));
    auto* config = reinterpret_cast<odcCommConfig_t*>(bytes);
    ASSERT_EQ(odcCommConfigInit(config), odcSuccess) << odcGetLastError();
    EXPECT_EQ(config->size, sizes[version - 1]);
    EXPECT_EQ(config->version, version);
    EXPECT_EQ(config->device, -1);
    EXPECT_EQ(config->key, nullptr);
    for (size_t i = sizes[version - 1]; i < sizeof(bytes); ++i) {
      ASSERT_EQ(bytes[i], 0xa5) << "version " << version << " wrote byte " << i;
    }
  }
  const std::pair<size_t, unsigned> unknown[] = {{0, 0},
                                                 {80, 0},
                                                 {80, 3},
                                                 {40, 4},
                                                 {88, 5},
                                                 {sizeof(odcCommConfig_t) + 8, 4},
                                                 {0xa5a5a5a5a5a5a5a5ull, 0xa5a5a5a5u}};
  for (const auto& [size, version] : unknown) {
    unsigned char bytes[sizeof(odcCommConfig_t)];
    std::memset(bytes, 0xa5, sizeof(bytes));
    odcCommConfig_t header{};
    header.size = size;
    header.version = version;
    std::memcpy(bytes, &header, offsetof(odcCommConfig_t, transport));
    unsigned char before[sizeof(bytes)];
    std::memcpy(before, bytes, sizeof(bytes));
    EXPECT_EQ(odcCommConfigInit(reinterpret_cast<odcCommConfig_t*>(bytes)), odcInvalidArgument)
        << size << " " << version;
    EXPECT_NE(std::string(odcGetLastError()).find("declare it with ODC_COMM_CONFIG_INIT"),
              std::string::npos)
        << odcGetLastError();
    EXPECT_EQ(std::memcmp(before, bytes, sizeof(bytes)), 0) << size << " " << version;
  }
}

// odcCommConfigResolve and odcMemoryNeed read the config first, the environment only for what it
// leaves unset (none of the knobs is set here), and an older version's fields only.
TEST(Config, ResolveAndMemoryNeedTakeTheConfigsValues) {
  odcCommConfig_t config = ODC_COMM_CONFIG_INIT;
  config.staging_bytes = size_t{1} << 20;
  config.ranks_per_node = 2;
  config.node_cache_bytes = 0;
  odcCommConfig_t resolved = ODC_COMM_CONFIG_INIT;
  ASSERT_EQ(odcCommConfigResolve(&config, &resolved), odcSuccess) << odcGetLastError();
  EXPECT_EQ(resolved.transport, odcTransportShm);
  EXPECT_EQ(resolved.timeout_seconds, 60.0);
  EXPECT_EQ(resolved.staging_bytes, size_t{1} << 20);
  EXPECT_EQ(resolved.ranks_per_node, 2);
  EXPECT_EQ(resolved.node_cache_bytes, 0u);
  EXPECT_EQ(resolved.node_aggregation_bytes, 0u);
  EXPECT_EQ(resolved.nvshmem_heap_bytes, size_t{4} << 30);
  odcMemoryNeed_t need{};
  ASSERT_EQ(odcMemoryNeed(&config, 4, 4096, 100, &need), odcSuccess) << odcGetLastError();
  EXPECT_EQ(need.published, 4096u);
  EXPECT_EQ(need.accumulators, 400u);
  EXPECT_EQ(need.staging, size_t{1} << 20);
  EXPECT_EQ(need.node_cache, 0u);  // off in the config, whatever the environment says
  EXPECT_EQ(need.heap_bytes, size_t{128} << 20);
  // Version 4 ends before cuda_sms: what lies beyond is never read.
  odcCommConfig_t version4 = config;
  version4.version = 4;
  version4.size = offsetof(odcCommConfig_t, cuda_sms);
  version4.cuda_sms = -7;
  ASSERT_EQ(odcMemoryNeed(&version4, 4, 4096, 100, &need), odcSuccess) << odcGetLastError();
  EXPECT_EQ(odcCommConfigResolve(&version4, &resolved), odcInvalidArgument);  // other header
  EXPECT_EQ(odcMemoryNeed(nullptr, 4, 0, 0, &need), odcInvalidArgument);
  EXPECT_EQ(odcMemoryNeed(&config, 0, 0, 0, &need), odcInvalidArgument);
}

TEST(Config, VersionedConfigIsCheckedAndDeterministicModeSums) {
  odcCommConfig_t config = ODC_COMM_CONFIG_INIT;
  ASSERT_EQ(odcCommConfigInit(&config), odcSuccess);
  EXPECT_EQ(config.size, sizeof(odcCommConfig_t));
  EXPECT_EQ(config.version, static_cast<unsigned>(ODC_COMM_CONFIG_VERSION));
  EXPECT_EQ(config.transport, odcTransportAuto);
  EXPECT_EQ(config.device, -1);
  EXPECT_EQ(config.deterministic, 0);
  config.key = "unused";
  odcComm_t comm = nullptr;
  odcCommConfig_t old = config;
  old.version = 0;
  EXPECT_EQ(odcCommInitConfig(&comm, 0, 1, &old), odcInvalidArgument);
  EXPECT_NE(std::string(odcGetLastError()).find("declare it with ODC_COMM_CONFIG_INIT"),
            std::string::npos)
      << odcGetLastError();
  odcCommConfig_t host_with_device = config;
  host_with_device.transport = odcTransportShm;
  host_with_device.device = 0;
  EXPECT_EQ(odcCommInitConfig(&comm, 0, 1, &host_with_device), odcInvalidArgument);
  odcCommConfig_t unknown = config;
  unknown.transport = static_cast<odcTransport_t>(7);
  EXPECT_EQ(odcCommInitConfig(&comm, 0, 1, &unknown), odcInvalidArgument);
  EXPECT_NE(std::string(odcGetLastError()).find("unknown transport 7"), std::string::npos);
  if (!odcHasCuda()) {
    odcCommConfig_t cuda = config;
    cuda.transport = odcTransportCuda;
    cuda.device = 0;
    EXPECT_EQ(odcCommInitConfig(&comm, 0, 1, &cuda), odcInvalidUsage);
    EXPECT_NE(std::string(odcGetLastError()).find("'cuda' is not in this build"), std::string::npos)
        << odcGetLastError();
  }
  EXPECT_EQ(comm, nullptr);

  expect_all_ok(run_ranks(3, [](int rank, int world, const std::string& key) {
    odcCommConfig_t deterministic = ODC_COMM_CONFIG_INIT;
    RANK_CHECK(odcCommConfigInit(&deterministic));
    deterministic.key = key.c_str();
    deterministic.timeout_seconds = 20.0;
    deterministic.deterministic = 1;
    odcComm_t comm;
    RANK_CHECK(odcCommInitConfig(&comm, rank, world, &deterministic));
    odcBuffer_t accumulator;
    void* local;
    RANK_CHECK(odcBufferAlloc(comm, 5, odcFloat32, 1, &accumulator, &local));
    std::vector<float> src(world * 5, 0.5f);
    for (int minibatch = 0; minibatch < 3; ++minibatch) {
      RANK_CHECK(odcMinibatchBegin(comm, nullptr));
      for (int call = 0; call <= rank; ++call) {
        RANK_CHECK(
            odcScatterAccumulate(comm, src.data(), src.size(), odcFloat32, accumulator, nullptr));
      }
      RANK_CHECK(odcMinibatchEnd(comm, nullptr));
      for (int i = 0; i < 5; ++i) {
        RANK_EXPECT(static_cast<float*>(local)[i] == 0.5f * 6, "deterministic sum");
      }
    }
    RANK_CHECK(odcCommDestroy(comm));
    return std::string();
  }));
}

TEST(Faults, DeadRankFailsTheOthersWithItsName) {
  const double timeout = 5.0;
  const auto outcome = run_ranks(3, [&](int rank, int world, const std::string& key) {
    odcComm_t comm;
    RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), timeout));
    odcBuffer_t accumulator;
    void* local;
    RANK_CHECK(odcBufferAlloc(comm, 16, odcFloat32, 1, &accumulator, &local));
    RANK_CHECK(odcMinibatchBegin(comm, nullptr));
    if (rank == 2) raise(SIGKILL);  // dies mid-minibatch, before its pushes
    std::vector<float> src(world * 16, 1.0f);
    RANK_CHECK(
        odcScatterAccumulate(comm, src.data(), src.size(), odcFloat32, accumulator, nullptr));
    const auto start = std::chrono::steady_clock::now();
    const odcResult_t result = odcMinibatchEnd(comm, nullptr);
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    RANK_EXPECT(result == odcRemoteError, odcGetErrorString(result));
    const std::string message = odcGetLastError();
    RANK_EXPECT(message.find("rank 2") != std::string::npos, message);
    RANK_EXPECT(message.find("died") != std::string::npos, message);
    RANK_EXPECT(message.find("minibatch_end") != std::string::npos, message);
    RANK_EXPECT(waited < timeout + 1.0, "reported after " + std::to_string(waited) + " s");
    // The communicator stays failed: no partial sum is ever reported as success.
    RANK_EXPECT(odcBarrier(comm, nullptr) == odcRemoteError, "later calls fail too");
    RANK_EXPECT(std::string(odcGetLastError()).find("failed earlier") != std::string::npos,
                odcGetLastError());
    RANK_CHECK(odcCommDestroy(comm));
    return std::string();
  });
  EXPECT_EQ(outcome[0], "");
  EXPECT_EQ(outcome[1], "");
  EXPECT_EQ(outcome[2], "killed by signal 9");
}

TEST(Faults, SilentRankTimesOut) {
  const double timeout = 1.5;
  const auto outcome = run_ranks(2, [&](int rank, int world, const std::string& key) {
    odcComm_t comm;
    RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), timeout));
    if (rank == 1) {
      // Alive but never arrives.
      std::this_thread::sleep_for(std::chrono::duration<double>(timeout + 2.0));
      return std::string();
    }
    const auto start = std::chrono::steady_clock::now();
    const odcResult_t result = odcMinibatchBegin(comm, nullptr);
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    RANK_EXPECT(result == odcTimeout, odcGetErrorString(result));
    const std::string message = odcGetLastError();
    RANK_EXPECT(message.find("rank 0: minibatch_begin: timed out") == 0, message);
    RANK_EXPECT(message.find("waiting for rank 1") != std::string::npos, message);
    RANK_EXPECT(waited >= timeout && waited < timeout + 1.0,
                "reported after " + std::to_string(waited) + " s");
    RANK_CHECK(odcCommDestroy(comm));
    return std::string();
  });
  expect_all_ok(outcome);
}

TEST(Faults, MissingRankAtInitTimesOut) {
  const auto outcome = run_ranks(1, [](int, int, const std::string& key) {
    odcComm_t comm;
    const odcResult_t result = odcCommInit(&comm, 0, 2, key.c_str(), 1.0);
    RANK_EXPECT(result == odcTimeout, odcGetErrorString(result));
    RANK_EXPECT(
        std::string(odcGetLastError()).find("waiting for rank 1 to join") != std::string::npos,
        odcGetLastError());
    return std::string();
  });
  expect_all_ok(outcome);
}

TEST(Faults, CollectiveMismatchNamesBoth) {
  expect_all_ok(run_ranks(2, [](int rank, int world, const std::string& key) {
    odcComm_t comm;
    RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), 10.0));
    const odcResult_t result =
        rank == 0 ? odcBarrier(comm, nullptr) : odcMinibatchBegin(comm, nullptr);
    RANK_EXPECT(result == odcRemoteError, odcGetErrorString(result));
    RANK_EXPECT(std::string(odcGetLastError()).find("collective mismatch") != std::string::npos,
                odcGetLastError());
    RANK_CHECK(odcCommDestroy(comm));
    return std::string();
  }));
}

TEST(Segments, RemovedOnNormalExit) {
  const std::string label = "clean";
  std::string key_seen;
  const auto outcome = run_ranks(
      3,
      [&](int rank, int world, const std::string& key) {
        odcComm_t comm;
        RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), 10.0));
        odcBuffer_t buffer;
        void* local;
        RANK_CHECK(odcBufferAlloc(comm, 100, odcFloat32, 1, &buffer, &local));
        RANK_CHECK(odcBarrier(comm, nullptr));
        RANK_CHECK(odcCommDestroy(comm));
        return std::string();
      },
      std::chrono::seconds(30), label);
  expect_all_ok(outcome);
  // Keys are "t-<label>-<pid>-<n>": nothing of this process's runs may remain.
  EXPECT_FALSE(shm_segments_left("t-" + label + "-" + std::to_string(getpid())));
}

TEST(Segments, PrivateRefusedWhileLiveReclaimedAfterCrash) {
  const std::string key = testing::unique_key("stale");
  // A rank 0 that waits forever for rank 1 (its segment exists, named, owner alive).
  std::fflush(nullptr);
  const pid_t waiter = fork();
  if (waiter == 0) {
    odcComm_t comm;
    (void)odcCommInit(&comm, 0, 2, key.c_str(), 30.0);
    _exit(0);
  }
  const std::string path = "/dev/shm/odc." + key + ".r0";
  struct stat info {};
  for (int i = 0; i < 500 && stat(path.c_str(), &info) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(stat(path.c_str(), &info), 0) << "rank 0 never created its segment";
  EXPECT_EQ(info.st_mode & 0777, 0600u);

  odcComm_t comm = nullptr;
  EXPECT_EQ(odcCommInit(&comm, 0, 2, key.c_str(), 2.0), odcInvalidUsage);
  EXPECT_NE(std::string(odcGetLastError()).find("is in use"), std::string::npos)
      << odcGetLastError();

  // The crash: the segment stays behind with a dead owner...
  kill(waiter, SIGKILL);
  waitpid(waiter, nullptr, 0);
  ASSERT_EQ(stat(path.c_str(), &info), 0);
  // ...and the next run with the same key reclaims it.
  const auto outcome = run_ranks(2, [&](int rank, int world, const std::string&) {
    odcComm_t fresh;
    RANK_CHECK(odcCommInit(&fresh, rank, world, key.c_str(), 10.0));
    RANK_CHECK(odcBarrier(fresh, nullptr));
    RANK_CHECK(odcCommDestroy(fresh));
    return std::string();
  });
  expect_all_ok(outcome);
  EXPECT_FALSE(shm_segments_left(key));
}

}  // namespace
}  // namespace odc
