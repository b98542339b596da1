// A communicator's whole configuration in one place: what the caller gave (CommConfig: an unset
// field is std::nullopt, the one "unset" convention), resolved against the ODC_* environment by
// resolve() (the only code in src that reads an ODC_* variable, each through one parser), and
// agreed by every rank in one exchange at init (agree_config), which names every mismatch.
// Invariant: transports and the communicator take ResolvedConfig's values and read no variable
// themselves. A new knob: a CommConfig field read in resolve(), a field of odcCommConfig_t (a
// new config version), an argument of odc.Comm (CONTRIBUTING.md, "Adding a knob").
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "core/topology.h"
#include "core/transport.h"

namespace odc {

// Heap NVSHMEM reserves per GPU when neither the config nor a variable says (ODC_NVSHMEM_HEAP_GIB's
// default).
inline constexpr size_t kDefaultNvshmemHeapBytes = size_t{4} << 30;
inline constexpr double kDefaultTimeoutSeconds = 60.0;

struct CommConfig {
  std::optional<std::string> transport;   // "shm", "cuda", "nvshmem"; unset: picked by device
  int device = -1;                        // CUDA device; -1: none (host transport)
  std::optional<double> timeout_seconds;  // > 0 or inf; unset: $ODC_TIMEOUT, else 60 s
  bool deterministic = false;
  std::optional<size_t> staging_bytes;           // unset: $ODC_STAGING_BYTES, else 256 MiB
  std::optional<int> ranks_per_node;             // unset: $ODC_LOCAL_WORLD_SIZE, ...
  std::optional<size_t> node_cache_bytes;        // unset: $ODC_NODE_CACHE_BYTES, else 256 MiB
  std::optional<size_t> node_aggregation_bytes;  // unset: $ODC_NODE_AGGREGATION_BYTES, else 0
  std::optional<int> cuda_sms;                   // unset: $ODC_CUDA_SMS, else all SMs
  std::optional<size_t> nvshmem_heap_bytes;      // unset: $ODC_NVSHMEM_HEAP_GIB, else 4 GiB
};

// Where the ranks per node came from (the topology's source order, core/topology.h).
enum class RanksPerNodeSource : uint64_t {
  kConfig = 1,
  kOdcEnv = 2,       // ODC_LOCAL_WORLD_SIZE
  kLauncherEnv = 3,  // torchrun's LOCAL_WORLD_SIZE
  kTransport = 4,    // the transport's report
};
const char* ranks_per_node_source_name(RanksPerNodeSource source);

// A budget or count as resolved: its value, or why it could not be read (the error names the
// knob). A knob that cannot be read fails init on every rank, but only where it is used (agree).
struct ResolvedBytes {
  size_t value = 0;
  std::string invalid;  // "" when valid
};

// What the NVSHMEM transport takes (its process-wide setup reads nothing itself).
struct NvshmemSettings {
  // The heap NVSHMEM reserves per GPU, as NVSHMEM_SYMMETRIC_SIZE's text: the user's own
  // NVSHMEM_SYMMETRIC_SIZE (kept as given), else the config's, else ODC_NVSHMEM_HEAP_GIB's.
  std::string heap_size;
  bool direct = true;           // ODC_NVSHMEM_DIRECT: same-node peers with odc's kernels
  bool signal_put = false;      // ODC_NVSHMEM_SIGNAL_PUT
  bool stats = false;           // ODC_NVSHMEM_STATS
  double fetch_delay_us = 0.0;  // ODC_NVSHMEM_TEST_FETCH_DELAY_US (tests)
  std::string plugin_path;      // ODC_NVSHMEM_PLUGIN ("": next to libodc.so, then the loader)
};

struct ResolvedConfig {
  std::string transport;  // "shm", "cuda" or "nvshmem"
  int device = -1;
  double timeout_seconds = kDefaultTimeoutSeconds;
  bool deterministic = false;
  ResolvedBytes staging_bytes;
  ResolvedBytes node_cache_bytes;
  ResolvedBytes node_aggregation_bytes;
  RanksPerNodeSource ranks_per_node_source = RanksPerNodeSource::kTransport;
  int ranks_per_node = 0;              // 0 with kTransport
  std::string ranks_per_node_invalid;  // "" when valid
  int cuda_sms = 0;                    // 0: all of the device's SMs
  NvshmemSettings nvshmem;
  bool node_stats = false;  // ODC_NODE_STATS
  // ODC_JOB_ID and the launcher's job variables (torchrun's, Slurm's): two launches never pair
  // on one key (bootstrap/shm_bootstrap.h). "" when none is set.
  std::string launch_identity;
};

// How resolve() reads a variable: its text, or nullopt when unset or empty (one convention: an
// empty variable is an unset one). The default reads the process's environment.
using Environment = std::function<std::optional<std::string>(const char* name)>;
std::optional<std::string> process_environment(const char* name);

// Local. Fills every unset field from its variable, else its default. Fails (nothing else done)
// on a timeout or transport that cannot be used; budgets and counts that cannot be read are
// carried (ResolvedBytes::invalid) so that agree_config fails every rank alike.
Result<ResolvedConfig> resolve(const CommConfig& config,
                               const Environment& environment = process_environment);

// What a communicator with this config needs per rank, by kind (docs/multinode.md, "Heap
// size"), for buffers of `published_bytes` (every non-accumulator shard) and
// `accumulator_elements` (fp32 elements of every accumulator shard) in `world_size` ranks of
// `ranks_per_node` (0: the config's, else one node per rank: every node scheme counted). The
// node schemes are upper bounds.
struct MemoryNeed {
  size_t published = 0;
  size_t accumulators = 0;
  size_t staging = 0;
  size_t node_cache = 0;
  size_t aggregation = 0;
  size_t deterministic = 0;
  size_t subtotal() const {
    return published + accumulators + staging + node_cache + aggregation + deterministic;
  }
  // The NVSHMEM heap to ask for: the subtotal, 5% and 64 MiB more (odc's signals and control
  // words, NVSHMEM's alignment, fragmentation), rounded up to 64 MiB.
  size_t heap_bytes() const;
};
Result<MemoryNeed> memory_need(const ResolvedConfig& config, int world_size, size_t published_bytes,
                               size_t accumulator_elements);

// Collective (one exchange through the transport): every rank's node layout source and value,
// budgets and scheme. Fails every rank, naming every rank and knob that differs or could not be
// read, where it is used: the staging and aggregation budgets only with streamed pushes
// (`streamed`), the node cache only with several nodes. Returns the agreed topology.
Result<Topology> agree_config(Transport& transport, const ResolvedConfig& config, bool streamed);

}  // namespace odc
