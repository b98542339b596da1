// The configuration spine (core/comm_config.h): resolve() reads every variable through one parser
// with one "unset" convention, from an environment given as a table (no setenv); agree_config()
// fails every rank in one exchange, naming every knob that differs or cannot be read.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

#include "core/comm_config.h"
#include "protocol_harness.h"

namespace odc {
namespace {

using testing::run_threads;

Environment table(std::map<std::string, std::string> values) {
  return [values](const char* name) -> std::optional<std::string> {
    const auto found = values.find(name);
    if (found == values.end() || found->second.empty()) return std::nullopt;
    return found->second;
  };
}

TEST(CommConfig, UnsetFieldsTakeTheirVariableElseTheDefault) {
  auto plain = resolve(CommConfig{}, table({}));
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_EQ(plain.value().transport, "shm");
  EXPECT_EQ(plain.value().timeout_seconds, 60.0);
  EXPECT_EQ(plain.value().staging_bytes.value, kDefaultStagingBytes);
  EXPECT_EQ(plain.value().node_cache_bytes.value, size_t{256} << 20);
  EXPECT_EQ(plain.value().node_aggregation_bytes.value, 0u);
  EXPECT_EQ(plain.value().ranks_per_node_source, RanksPerNodeSource::kTransport);
  EXPECT_EQ(plain.value().nvshmem.heap_size, std::to_string(size_t{4} << 30));

  const Environment environment =
      table({{"ODC_TIMEOUT", "inf"},
             {"ODC_STAGING_BYTES", "64K"},
             {"ODC_NODE_CACHE_BYTES", "00"},  // 0 in any spelling: off
             {"ODC_NODE_AGGREGATION_BYTES", "1M"},
             {"ODC_LOCAL_WORLD_SIZE", "2"},
             {"LOCAL_WORLD_SIZE", "4"},  // ODC_LOCAL_WORLD_SIZE comes first
             {"ODC_NVSHMEM_HEAP_GIB", "1.5"},
             {"ODC_NODE_STATS", "1"}});
  auto knobs = resolve(CommConfig{}, environment);
  ASSERT_TRUE(knobs.ok()) << knobs.status().message();
  EXPECT_TRUE(std::isinf(knobs.value().timeout_seconds));
  EXPECT_EQ(knobs.value().staging_bytes.value, size_t{64} << 10);
  EXPECT_EQ(knobs.value().node_cache_bytes.value, 0u);
  EXPECT_EQ(knobs.value().node_aggregation_bytes.value, size_t{1} << 20);
  EXPECT_EQ(knobs.value().ranks_per_node_source, RanksPerNodeSource::kOdcEnv);
  EXPECT_EQ(knobs.value().ranks_per_node, 2);
  EXPECT_EQ(knobs.value().nvshmem.heap_size, std::to_string(size_t{3} << 29));
  EXPECT_TRUE(knobs.value().node_stats);

  // The config wins over every variable; an empty variable is an unset one.
  CommConfig given;
  given.timeout_seconds = 5.0;
  given.staging_bytes = 4096;
  given.node_cache_bytes = 0;
  given.ranks_per_node = 1;
  given.nvshmem_heap_bytes = size_t{2} << 30;
  auto configured = resolve(given, environment);
  ASSERT_TRUE(configured.ok()) << configured.status().message();
  EXPECT_EQ(configured.value().timeout_seconds, 5.0);
  EXPECT_EQ(configured.value().staging_bytes.value, 4096u);
  EXPECT_EQ(configured.value().node_cache_bytes.value, 0u);
  EXPECT_EQ(configured.value().ranks_per_node_source, RanksPerNodeSource::kConfig);
  EXPECT_EQ(configured.value().nvshmem.heap_size, std::to_string(size_t{2} << 30));
  auto empty = resolve(CommConfig{}, table({{"ODC_STAGING_BYTES", ""}}));
  EXPECT_EQ(empty.value().staging_bytes.value, kDefaultStagingBytes);
  // NVSHMEM's own variable is kept as the user wrote it.
  auto user = resolve(given, table({{"NVSHMEM_SYMMETRIC_SIZE", "8G"}}));
  EXPECT_EQ(user.value().nvshmem.heap_size, "8G");
}

TEST(CommConfig, KnobsThatCannotBeReadAreNamed) {
  auto bad = resolve(CommConfig{}, table({{"ODC_STAGING_BYTES", "12 apples"},
                                          {"ODC_NODE_CACHE_BYTES", "lots"},
                                          {"ODC_LOCAL_WORLD_SIZE", "0"}}));
  ASSERT_TRUE(bad.ok());  // carried to agree_config, which fails every rank alike
  EXPECT_EQ(bad.value().staging_bytes.invalid,
            "ODC_STAGING_BYTES='12 apples' is not a positive number of bytes (e.g. 268435456 or "
            "256M)");
  EXPECT_NE(bad.value().node_cache_bytes.invalid.find("ODC_NODE_CACHE_BYTES='lots' is not a "
                                                      "number of bytes"),
            std::string::npos);
  EXPECT_EQ(bad.value().ranks_per_node_invalid, "ODC_LOCAL_WORLD_SIZE='0'");
  auto timeout = resolve(CommConfig{}, table({{"ODC_TIMEOUT", "-5"}}));
  ASSERT_FALSE(timeout.ok());
  EXPECT_NE(timeout.status().message().find("ODC_TIMEOUT='-5' is not a timeout"),
            std::string::npos);
  CommConfig device;
  device.device = 0;
  auto transport = resolve(device, table({{"ODC_TRANSPORT", "carrier-pigeon"}}));
  ASSERT_FALSE(transport.ok());
  EXPECT_EQ(transport.status().message(),
            "ODC_TRANSPORT='carrier-pigeon' is not a device transport (cuda, nvshmem)");
  EXPECT_EQ(resolve(device, table({{"ODC_TRANSPORT", "nvshmem"}})).value().transport, "nvshmem");
  device.transport = "cuda";
  auto sms = resolve(device, table({{"ODC_CUDA_SMS", "many"}}));
  ASSERT_FALSE(sms.ok());
  EXPECT_NE(sms.status().message().find("ODC_CUDA_SMS='many': expected a positive integer"),
            std::string::npos);
  EXPECT_EQ(resolve(device, table({{"ODC_CUDA_SMS", "32"}})).value().cuda_sms, 32);
}

// One exchange names every problem: a staging budget that differs and a node layout that differs.
TEST(CommConfig, AgreeNamesEveryMismatchOnEveryRank) {
  mem::MemOptions options;
  auto world = mem::MemWorld::create(4, options);
  const auto outcome = run_threads(4, [&](int rank) {
    auto transport = world->join(rank);
    CommConfig config;
    config.staging_bytes = rank == 3 ? 8192 : 4096;
    config.ranks_per_node = rank == 1 ? 4 : 2;
    auto resolved = resolve(config, table({}));
    auto agreed = agree_config(*transport, resolved.value(), /*streamed=*/true);
    if (agreed.ok()) return std::string("agreed");
    return agreed.status().message();
  });
  for (int rank = 0; rank < 4; ++rank) {
    const std::string& message = outcome[static_cast<size_t>(rank)];
    EXPECT_NE(message.find("ranks disagree on the node layout"), std::string::npos) << message;
    EXPECT_NE(message.find("staging budgets differ across ranks"), std::string::npos) << message;
  }
}

TEST(CommConfig, AgreeChecksABudgetOnlyWhereItIsUsed) {
  mem::MemOptions options;
  auto world = mem::MemWorld::create(2, options);
  const auto outcome = run_threads(2, [&](int rank) {
    auto transport = world->join(rank);
    // An unreadable staging budget with remote adds (no rings), and one node (no cache).
    auto resolved =
        resolve(CommConfig{}, table({{"ODC_STAGING_BYTES", "abc"}, {"ODC_NODE_CACHE_BYTES", "x"}}));
    auto agreed = agree_config(*transport, resolved.value(), /*streamed=*/false);
    if (!agreed.ok()) return agreed.status().message();
    return std::to_string(agreed.value().num_nodes);
  });
  EXPECT_EQ(outcome, (std::vector<std::string>{"1", "1"}));
}

TEST(CommConfig, MemoryNeedCountsEachKind) {
  CommConfig config;
  config.staging_bytes = 1000;
  config.node_cache_bytes = 1 << 20;
  config.node_aggregation_bytes = 1 << 20;
  config.ranks_per_node = 2;
  auto resolved = resolve(config, table({}));
  auto need = memory_need(resolved.value(), 8, 4096, 100);
  ASSERT_TRUE(need.ok());
  EXPECT_EQ(need.value().published, 4096u);
  EXPECT_EQ(need.value().accumulators, 400u);
  EXPECT_EQ(need.value().staging, 1000u);
  EXPECT_EQ(need.value().node_cache, 3 * 4096u);  // 4 nodes: 3 rows
  EXPECT_EQ(need.value().aggregation, 3 * 400u);
  EXPECT_EQ(need.value().deterministic, 0u);
  EXPECT_EQ(need.value().heap_bytes(), size_t{128} << 20);  // sum + 5% + 64 MiB, to 64 MiB
  config.deterministic = true;
  auto pulled = memory_need(resolve(config, table({})).value(), 8, 4096, 100);
  EXPECT_EQ(pulled.value().staging, 0u);
  EXPECT_EQ(pulled.value().aggregation, 0u);
  EXPECT_EQ(pulled.value().deterministic, 8 * 400u + (4u << 20));
}

}  // namespace
}  // namespace odc
