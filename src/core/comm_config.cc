// Every ODC_* variable of a communicator read, parsed and agreed here (see comm_config.h).
#include "core/comm_config.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "common/env.h"
#include "core/node_gather_cache.h"
#include "core/streamed_staging.h"

namespace odc {
namespace {

// The most ranks per node a knob may say.
constexpr uint64_t kMaxRanksPerNode = uint64_t{1} << 30;

// A number as the switches and the NVSHMEM heap in GiB read it (strtod's syntax, the whole text);
// nullopt when it is not one. The flags' convention: a number, nonzero is on; anything else is
// the default.
std::optional<double> parse_number(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0') return std::nullopt;
  return value;
}

double number_or(const Environment& environment, const char* name, double fallback) {
  const std::optional<std::string> text = environment(name);
  if (!text) return fallback;
  return parse_number(*text).value_or(fallback);
}

// A positive byte budget: the config's, else $`knob` (bytes, or with a K, M or G suffix), else
// `fallback`.
ResolvedBytes positive_bytes(const std::optional<size_t>& configured,
                             const Environment& environment, const char* knob, size_t fallback) {
  if (configured) return {*configured, ""};
  const std::optional<std::string> text = environment(knob);
  if (!text) return {fallback, ""};
  const uint64_t value = positive_integer(*text, SIZE_MAX, /*size_suffix=*/true);
  if (value == 0) {
    return {0, std::string(knob) + "='" + *text +
                   "' is not a positive number of bytes (e.g. 268435456 or 256M)"};
  }
  return {static_cast<size_t>(value), ""};
}

// A byte budget where 0 (in any spelling: "0", "00", "0K") is "off".
ResolvedBytes any_bytes(const std::optional<size_t>& configured, const Environment& environment,
                        const char* knob, size_t fallback) {
  if (configured) return {*configured, ""};
  const std::optional<std::string> text = environment(knob);
  if (!text) return {fallback, ""};
  const std::optional<uint64_t> value = parse_count(*text, SIZE_MAX, /*size_suffix=*/true);
  if (!value) {
    return {0, std::string(knob) + "='" + *text +
                   "' is not a number of bytes: digits, optionally followed by K, M or G, below "
                   "2^64 (e.g. 0, 268435456 or 256M)"};
  }
  return {static_cast<size_t>(*value), ""};
}

Status resolve_timeout(const CommConfig& config, const Environment& environment,
                       ResolvedConfig& resolved) {
  if (config.timeout_seconds) {
    const double seconds = *config.timeout_seconds;
    if (std::isnan(seconds)) {
      return Status::InvalidArgument(
          "timeout_seconds is NaN: give a positive number of seconds, INFINITY (no timeout), or "
          "<= 0 for the default ($ODC_TIMEOUT, else 60 s)");
    }
    if (seconds > 0) {
      resolved.timeout_seconds = seconds;
      return Status::Ok();
    }
  }
  const std::optional<std::string> text = environment("ODC_TIMEOUT");
  if (!text) return Status::Ok();  // the default
  const std::optional<double> value = parse_number(*text);
  if (!value || !(*value > 0)) {
    return Status::InvalidArgument("ODC_TIMEOUT='" + *text +
                                   "' is not a timeout: set it to a positive number of seconds "
                                   "or 'inf' (no timeout), or unset it (60 s)");
  }
  resolved.timeout_seconds = *value;
  return Status::Ok();
}

// Without a transport: shm without a device; with one, $ODC_TRANSPORT ("cuda", "nvshmem"), so a
// launch can switch transports without code changes, else "cuda".
Status resolve_transport(const CommConfig& config, const Environment& environment,
                         ResolvedConfig& resolved) {
  if (config.transport) {
    resolved.transport = *config.transport;
  } else if (config.device < 0) {
    resolved.transport = "shm";
  } else {
    const std::string chosen = environment("ODC_TRANSPORT").value_or("cuda");
    if (chosen != "cuda" && chosen != "nvshmem") {
      return Status::InvalidArgument("ODC_TRANSPORT='" + chosen +
                                     "' is not a device transport (cuda, nvshmem)");
    }
    resolved.transport = chosen;
  }
  if (resolved.transport == "shm" && config.device >= 0) {
    return Status::InvalidArgument("the shm transport takes no device (got " +
                                   std::to_string(config.device) + ")");
  }
  return Status::Ok();
}

// The config's, else ODC_LOCAL_WORLD_SIZE, else torchrun's LOCAL_WORLD_SIZE, else the transport's
// report (core/topology.h).
void resolve_ranks_per_node(const CommConfig& config, const Environment& environment,
                            ResolvedConfig& resolved) {
  if (config.ranks_per_node && *config.ranks_per_node != 0) {
    resolved.ranks_per_node_source = RanksPerNodeSource::kConfig;
    resolved.ranks_per_node = *config.ranks_per_node;
    if (resolved.ranks_per_node < 0) {
      resolved.ranks_per_node_invalid =
          "ranks per node " + std::to_string(resolved.ranks_per_node) + " in the config";
    }
    return;
  }
  for (const auto& [name, source] :
       {std::pair{"ODC_LOCAL_WORLD_SIZE", RanksPerNodeSource::kOdcEnv},
        std::pair{"LOCAL_WORLD_SIZE", RanksPerNodeSource::kLauncherEnv}}) {
    const std::optional<std::string> text = environment(name);
    if (!text) continue;
    resolved.ranks_per_node_source = source;
    resolved.ranks_per_node = static_cast<int>(positive_integer(*text, kMaxRanksPerNode));
    if (resolved.ranks_per_node == 0) {
      resolved.ranks_per_node_invalid = std::string(name) + "='" + *text + "'";
    }
    return;
  }
}

// ODC_CUDA_SMS: the SMs odc's data kernels size their grids for (unset: all of them). Training
// overlaps gathers and pushes with compute, where a grid over every SM delays the compute kernels
// beside it. Read for the CUDA transport only (the others ignore it).
Status resolve_cuda_sms(const CommConfig& config, const Environment& environment,
                        ResolvedConfig& resolved) {
  if (resolved.transport != "cuda") return Status::Ok();
  if (config.cuda_sms && *config.cuda_sms != 0) {
    if (*config.cuda_sms < 0) {
      return Status::InvalidArgument("cuda_sms " + std::to_string(*config.cuda_sms) +
                                     ": expected a positive integer (SMs; more than the device "
                                     "has means all)");
    }
    resolved.cuda_sms = *config.cuda_sms;
    return Status::Ok();
  }
  const std::optional<std::string> text = environment("ODC_CUDA_SMS");
  if (!text) return Status::Ok();
  char* end = nullptr;
  const long budget = std::strtol(text->c_str(), &end, 10);
  if (*end != '\0' || budget < 1 || end == text->c_str()) {
    return Status::InvalidArgument("ODC_CUDA_SMS='" + *text +
                                   "': expected a positive integer (SMs; more than the device "
                                   "has means all)");
  }
  resolved.cuda_sms = static_cast<int>(std::min<long>(budget, 1 << 20));
  return Status::Ok();
}

// NVSHMEM reads NVSHMEM_SYMMETRIC_SIZE itself: a value the user set is kept as it is; else the
// config's heap, else ODC_NVSHMEM_HEAP_GIB (GiB, default 4).
void resolve_nvshmem(const CommConfig& config, const Environment& environment,
                     ResolvedConfig& resolved) {
  NvshmemSettings& nvshmem = resolved.nvshmem;
  if (const std::optional<std::string> given = environment("NVSHMEM_SYMMETRIC_SIZE")) {
    nvshmem.heap_size = *given;
  } else if (config.nvshmem_heap_bytes) {
    nvshmem.heap_size = std::to_string(*config.nvshmem_heap_bytes);
  } else {
    const double gib = number_or(environment, "ODC_NVSHMEM_HEAP_GIB", 4.0);
    nvshmem.heap_size = std::to_string(static_cast<unsigned long long>(gib * (1 << 30)));
  }
  nvshmem.direct = number_or(environment, "ODC_NVSHMEM_DIRECT", 1.0) != 0.0;
  nvshmem.signal_put = number_or(environment, "ODC_NVSHMEM_SIGNAL_PUT", 0.0) != 0.0;
  nvshmem.stats = number_or(environment, "ODC_NVSHMEM_STATS", 0.0) != 0.0;
  nvshmem.fetch_delay_us = number_or(environment, "ODC_NVSHMEM_TEST_FETCH_DELAY_US", 0.0);
  nvshmem.plugin_path = environment("ODC_NVSHMEM_PLUGIN").value_or("");
}

// The launch this process belongs to, from the variables its launcher sets identically in every
// rank of one job and differently in two jobs (torchrun: the rendezvous store's address and the
// run id; Slurm: job and step; ODC_JOB_ID: the user's own, for ranks started by hand). "" when
// none is set (ranks started by hand without it, odc.launch).
std::string launch_identity(const Environment& environment) {
  std::string identity;
  for (const char* name : {"ODC_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                           "SLURM_JOB_ID", "SLURM_STEP_ID"}) {
    const std::optional<std::string> value = environment(name);
    if (!value) continue;
    if (!identity.empty()) identity += ' ';
    identity.append(name).append("=").append(*value);
  }
  return identity;
}

// The config words of agree_config's record (words 0-2 are the topology's).
constexpr int kDeterministicWord = 3;
constexpr int kStagingValidWord = 4;
constexpr int kStagingWord = 5;
constexpr int kNodeCacheValidWord = 6;
constexpr int kNodeCacheWord = 7;
constexpr int kAggregationValidWord = 8;
constexpr int kAggregationWord = 9;
constexpr int kConfigMarkWord = 15;
constexpr uint64_t kConfigMark = 0x676966636e6f6364ull;  // "odcconfig"

struct AgreedBudget {
  const ResolvedBytes& mine;
  int valid_word;
  int value_word;
  const char* what;  // "staging budget"
  const char* knob;  // where it comes from, for the message
};

// Appends to `problems` every rank whose budget is invalid or differs from this rank's.
void check_budget(const std::vector<ExchangeRecord>& all, const AgreedBudget& budget,
                  std::vector<std::string>& problems) {
  if (!budget.mine.invalid.empty()) {
    problems.push_back(budget.mine.invalid);
    return;
  }
  for (size_t r = 0; r < all.size(); ++r) {
    const ExchangeRecord& theirs = all[r];
    if (theirs.words[budget.valid_word] == 0) {
      problems.push_back("rank " + std::to_string(r) + " has an invalid " + budget.what +
                         " (its error names it)");
    } else if (theirs.words[budget.value_word] != budget.mine.value) {
      problems.push_back(
          std::string(budget.what) + "s differ across ranks: rank " + std::to_string(r) + " has " +
          std::to_string(theirs.words[budget.value_word]) + " bytes, this rank " +
          std::to_string(budget.mine.value) + " (" + budget.knob + " must be the same everywhere)");
    }
  }
}

}  // namespace

const char* ranks_per_node_source_name(RanksPerNodeSource source) {
  switch (source) {
    case RanksPerNodeSource::kConfig:
      return "config";
    case RanksPerNodeSource::kOdcEnv:
      return "ODC_LOCAL_WORLD_SIZE";
    case RanksPerNodeSource::kLauncherEnv:
      return "LOCAL_WORLD_SIZE";
    case RanksPerNodeSource::kTransport:
      return "transport";
  }
  return "unknown";
}

std::optional<std::string> process_environment(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  return std::string(text);
}

Result<ResolvedConfig> resolve(const CommConfig& config, const Environment& environment) {
  ResolvedConfig resolved;
  resolved.device = config.device;
  resolved.deterministic = config.deterministic;
  ODC_RETURN_IF_ERROR(resolve_timeout(config, environment, resolved));
  ODC_RETURN_IF_ERROR(resolve_transport(config, environment, resolved));
  resolved.staging_bytes =
      positive_bytes(config.staging_bytes, environment, "ODC_STAGING_BYTES", kDefaultStagingBytes);
  resolved.node_cache_bytes = any_bytes(config.node_cache_bytes, environment,
                                        "ODC_NODE_CACHE_BYTES", kDefaultNodeCacheBytes);
  resolved.node_aggregation_bytes =
      any_bytes(config.node_aggregation_bytes, environment, "ODC_NODE_AGGREGATION_BYTES", 0);
  resolve_ranks_per_node(config, environment, resolved);
  ODC_RETURN_IF_ERROR(resolve_cuda_sms(config, environment, resolved));
  resolve_nvshmem(config, environment, resolved);
  resolved.node_stats = number_or(environment, "ODC_NODE_STATS", 0.0) != 0.0;
  resolved.launch_identity = launch_identity(environment);
  return resolved;
}

size_t MemoryNeed::heap_bytes() const {
  constexpr size_t kMargin = size_t{64} << 20;
  constexpr size_t kRound = size_t{64} << 20;
  const size_t sum = subtotal();
  const size_t raw = sum + (sum + 19) / 20 + kMargin;  // ceil(5%)
  return (raw + kRound - 1) / kRound * kRound;
}

Result<MemoryNeed> memory_need(const ResolvedConfig& config, int world_size, size_t published_bytes,
                               size_t accumulator_elements) {
  if (world_size < 1) return Status::InvalidArgument("memory_need: world_size must be positive");
  for (const ResolvedBytes* budget :
       {&config.staging_bytes, &config.node_cache_bytes, &config.node_aggregation_bytes}) {
    if (!budget->invalid.empty()) return Status::InvalidArgument(budget->invalid);
  }
  int ranks_per_node = config.ranks_per_node > 0 ? config.ranks_per_node : 1;
  ranks_per_node = std::min(ranks_per_node, world_size);
  const int num_nodes = world_size % ranks_per_node == 0 ? world_size / ranks_per_node : world_size;
  MemoryNeed need;
  need.published = published_bytes;
  need.accumulators = 4 * accumulator_elements;
  need.staging = config.staging_bytes.value;
  if (num_nodes > 1) {
    // Rows: the most remote owners one rank fetches (or relays for), nodes - 1 with equal nodes
    // (NodeRoutes::max_rows).
    const size_t rows = static_cast<size_t>(num_nodes - 1);
    need.node_cache = std::min(config.node_cache_bytes.value, rows * published_bytes);
    if (ranks_per_node > 1) {  // aggregation pays only with several ranks per node
      need.aggregation = std::min(config.node_aggregation_bytes.value, rows * need.accumulators);
    }
  }
  if (config.deterministic) {  // the pulled scheme: no staging rings, so no relay rows either
    need.deterministic = need.accumulators * static_cast<size_t>(world_size) + (size_t{4} << 20);
    need.staging = need.aggregation = 0;
  }
  return need;
}

Result<Topology> agree_config(Transport& transport, const ResolvedConfig& config, bool streamed) {
  ExchangeRecord mine;
  put_topology_source(mine, config, transport);
  mine.words[kDeterministicWord] = config.deterministic ? 1 : 0;
  auto put = [&](const ResolvedBytes& budget, int valid_word, int value_word) {
    mine.words[valid_word] = budget.invalid.empty() ? 1 : 0;
    mine.words[value_word] = budget.invalid.empty() ? budget.value : 0;
  };
  put(config.staging_bytes, kStagingValidWord, kStagingWord);
  put(config.node_cache_bytes, kNodeCacheValidWord, kNodeCacheWord);
  put(config.node_aggregation_bytes, kAggregationValidWord, kAggregationWord);
  mine.words[kConfigMarkWord] = kConfigMark;
  auto exchanged = transport.exchange(mine);
  if (!exchanged.ok()) return exchanged.status();
  const std::vector<ExchangeRecord>& all = exchanged.value();
  const int rank = transport.rank();
  auto topology = topology_from_records(transport, all, config.ranks_per_node_invalid);
  std::vector<std::string> problems;
  if (!topology.ok()) problems.push_back(topology.status().message());
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].words[kDeterministicWord] != mine.words[kDeterministicWord]) {
      problems.push_back("rank " + std::to_string(r) + " is " +
                         (all[r].words[kDeterministicWord] != 0 ? "" : "not ") +
                         "deterministic, this rank (" + std::to_string(rank) + ") " +
                         (config.deterministic ? "is" : "is not") +
                         " (the config's deterministic must be the same everywhere)");
      break;
    }
  }
  if (streamed) {
    check_budget(all,
                 {config.staging_bytes, kStagingValidWord, kStagingWord, "staging budget",
                  "ODC_STAGING_BYTES or the config's staging_bytes"},
                 problems);
  }
  // The node cache's budget matters only with several nodes (a layout that could not be agreed
  // reports itself above), the aggregation budget with streamed pushes (as the staging budget).
  if (topology.ok() && topology.value().num_nodes > 1) {
    check_budget(all,
                 {config.node_cache_bytes, kNodeCacheValidWord, kNodeCacheWord, "node cache budget",
                  "ODC_NODE_CACHE_BYTES or the config's node_cache_bytes"},
                 problems);
  }
  if (streamed) {
    check_budget(all,
                 {config.node_aggregation_bytes, kAggregationValidWord, kAggregationWord,
                  "node aggregation budget",
                  "ODC_NODE_AGGREGATION_BYTES or the config's node_aggregation_bytes"},
                 problems);
  }
  if (problems.empty()) return topology;
  std::string message;
  for (const std::string& problem : problems) message += (message.empty() ? "" : "; ") + problem;
  return Status::InvalidArgument(message);
}

}  // namespace odc
