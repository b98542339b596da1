/* odc: On-Demand Communication for sharded data-parallel training with variable-length data.
 *
 * The stable C boundary of the library. Everything above it (the Python package, the torch
 * integration, other frameworks) goes through these calls. Conventions, as in NCCL:
 *   - every call returns an odcResult_t; odcGetErrorString() names the code and
 *     odcGetLastError() gives the message of the calling thread's last failure;
 *   - handles are opaque and owned by the caller until the matching Destroy call;
 *   - a failed call changes nothing the caller can observe.
 */
#ifndef ODC_ODC_H_
#define ODC_ODC_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define ODC_API __attribute__((visibility("default")))
#else
#define ODC_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define ODC_VERSION_MAJOR 0
#define ODC_VERSION_MINOR 1
#define ODC_VERSION_PATCH 0

typedef enum {
  odcSuccess = 0,
  odcInvalidArgument = 1, /* bad input from the caller; nothing was changed */
  odcSystemError = 2,     /* the operating system refused (file, memory, ...) */
  odcInternalError = 3,   /* a bug in odc: please report it with the message */
  odcInvalidUsage = 4, /* a valid call at the wrong moment (outside a minibatch, after destroy) */
  odcTimeout = 5,      /* a wait on another rank ran past the communicator's timeout */
  odcRemoteError = 6,  /* another rank died, failed, or entered a different collective */
  odcInterrupted = 7,  /* a wait on another rank was ended from outside: the interrupt check
                          (odcSetInterruptCheck) or a destroy from another thread */
  odcNumResults = 8
} odcResult_t;

/* A static, human-readable name for a result code. Never NULL. */
ODC_API const char* odcGetErrorString(odcResult_t result);

/* The message of the calling thread's most recent failed call ("" if none). The pointer stays valid
 * until the next odc call on this thread. */
ODC_API const char* odcGetLastError(void);

/* The library version as MAJOR*10000 + MINOR*100 + PATCH. */
ODC_API int odcGetVersion(void);

/* ---------------------------------------------------------------------------------------------
 * Planner: load-balancing plans and predicted bubbles (docs/design.md, "Load balancing: exact
 * definitions").
 * Pure CPU; thread-safe for distinct plan handles.
 * ------------------------------------------------------------------------------------------- */

typedef enum {
  odcPolicyLocalSort = 0, /* rank r takes samples r, r+N, ...; one sample per microbatch */
  odcPolicyLbMicro = 1,   /* equal sample and microbatch counts per rank (collective or ODC) */
  odcPolicyLbMini = 2     /* cost-balanced ranks, independent microbatch counts (ODC only) */
} odcPolicy_t;

/* Splitting outliers (docs/design.md, "Splitting outliers"): a sample costing more than its
 * minibatch's ideal per-rank share may run as context-parallel chunks on a group of ranks; the
 * plan JSON lists such samples under "splits" (docs/planner.md). */
typedef enum {
  odcSplitOff = 0, /* every sample runs whole on one rank */
  odcSplitAuto = 1 /* split where the predicted span of the minibatch drops */
} odcSplit_t;

/* How large LB-Mini may make a microbatch (activation memory follows a microbatch's tokens;
 * docs/planner.md, "Microbatch memory"). Other policies ignore it. */
typedef enum {
  odcMicrobatchMemoryLbMicro = 0, /* no LB-Mini microbatch above the largest LB-Micro builds for
                                     the same minibatch: no more activation memory than LB-Micro
                                     (default; a rank may run a few more microbatches) */
  odcMicrobatchMemoryCap = 1      /* up to max_tokens: the fastest predicted plan */
} odcMicrobatchMemory_t;

/* Minibatch size meaning "all samples form one minibatch". */
#define ODC_PLAN_ALL_SAMPLES INT64_MAX

#define ODC_PLAN_OPTIONS_MAGIC 0x0dc09a4eu
#define ODC_PLAN_OPTIONS_VERSION 2

/* Planner options, sized and versioned (as odcCommConfig_t and NCCL's ncclConfig_t): declare them
 * with ODC_PLAN_OPTIONS_INIT, which sets the header (size, magic, version) and the defaults, then
 * change the fields you need:
 *
 *   odcPlanOptions_t options = ODC_PLAN_OPTIONS_INIT;
 *   options.num_ranks = 8;
 *   options.max_tokens = 65536;
 *
 * The library reads only the fields the header's version covers, and refuses (odcInvalidArgument,
 * naming what it found and what it reads) a header it does not know: a size that is not the size
 * of that version, a version it does not know, a wrong magic.
 *
 * Compatibility (issue #29). Before version 1 the struct had no header: it began with num_ranks
 * and max_tokens, and odcPlanOptionsInit wrote the library's whole struct into the caller's.
 * A caller built against such a header and run with this library gets an error, never memory
 * written or read past its struct, because:
 *   - odcPlanOptionsInit writes nothing before it has checked the header (the first 16 bytes,
 *     which every version of the struct has): in an old caller's struct they hold num_ranks and
 *     max_tokens, or stack garbage, and are accepted only if they spell exactly a known size, the
 *     magic and its version (2^-128 for random bytes);
 *   - odcPlanCreate checks the same header before it reads any other field: in an old caller's
 *     struct `version` is the high half of max_tokens, 0 for every max_tokens below 2^32, and
 *     version 0 is never valid, so the old layout is refused deterministically.
 * Callers built against this header and run with an older library (no header) are not protected:
 * that library reads num_ranks from `size`; rebuild them together. Later versions append fields
 * only, keep accepting every earlier version's header (reading defaults for the fields it lacks),
 * and bump ODC_PLAN_OPTIONS_VERSION. Version 2 appended `steal`; a version-1 header (size 120) is
 * still accepted, planned without stealing, and odcPlanOptionsInit writes only its 120 bytes. */
typedef struct {
  size_t size; /* sizeof(odcPlanOptions_t) as the caller was compiled: 120 in version 1, 128 in 2 */
  unsigned int magic;   /* ODC_PLAN_OPTIONS_MAGIC: catches a struct that was never initialized */
  unsigned int version; /* ODC_PLAN_OPTIONS_VERSION */
  int64_t num_ranks;    /* >= 1 */
  int64_t max_tokens;   /* token cap per microbatch, >= 1; every sample must fit */
  odcPolicy_t policy;
  int64_t minibatch_size; /* consecutive samples per minibatch, >= 1, or ODC_PLAN_ALL_SAMPLES */
  double cost_a; /* microbatch cost = max(cost_floor, cost_c + sum(cost_a*L + cost_b*L^2)); >= 0 */
  double cost_b;
  double cost_c;
  const double* rank_speed; /* NULL (all 1.0) or positive relative speeds, one per rank; copied */
  size_t num_rank_speeds;   /* entries in rank_speed; must equal num_ranks when it is not NULL */
  odcSplit_t split;      /* odcSplitOff (default) or odcSplitAuto; auto needs LB-Mini or LB-Micro */
  double split_exchange; /* K/V exchange cost per token a chunk receives, as a fraction of cost_a;
                            >= 0, default 0.05 (docs/planner.md, "Splitting outliers") */
  odcMicrobatchMemory_t microbatch_memory; /* default odcMicrobatchMemoryLbMicro */
  double cost_floor; /* least cost of any microbatch: cost = max(cost_floor, cost_c + sum(...));
                        >= 0, default 0 (none; docs/planner.md, "Cost model") */
  int steal; /* version 2: nonzero also predicts every minibatch under ODC with work stealing
                (odcStealSimulate's rule); the JSON then has "steal" keys (docs/planner.md) */
} odcPlanOptions_t;

/* The header and the defaults: 1 rank, max_tokens 0 (must be set), LB-Mini, all samples in one
 * minibatch, cost 1,0,0 with no floor, uniform speed, no splitting (exchange 0.05), LB-Mini's
 * microbatches within LB-Micro's largest, no stealing predicted. */
#define ODC_PLAN_OPTIONS_INIT                                                             \
  {                                                                                       \
    sizeof(odcPlanOptions_t), ODC_PLAN_OPTIONS_MAGIC, ODC_PLAN_OPTIONS_VERSION, 1, 0,     \
        odcPolicyLbMini, ODC_PLAN_ALL_SAMPLES, 1.0, 0.0, 0.0, NULL, 0, odcSplitOff, 0.05, \
        odcMicrobatchMemoryLbMicro, 0.0, 0                                                \
  }

typedef struct odcPlan* odcPlan_t;

/* Local: resets `options` to the library's defaults (those of ODC_PLAN_OPTIONS_INIT), writing only
 * the fields its header's version covers. The caller sets the header first (ODC_PLAN_OPTIONS_INIT,
 * or size, magic and version by hand); an unknown header is refused and nothing is written. */
ODC_API odcResult_t odcPlanOptionsInit(odcPlanOptions_t* options);

/* Parses "local-sort", "lb-micro" or "lb-mini". */
ODC_API odcResult_t odcPolicyFromName(const char* name, odcPolicy_t* policy);

/* Plans `num_samples` samples with the given lengths (tokens). On success *plan owns the result;
 * release it with odcPlanDestroy. On failure *plan is untouched and odcGetLastError() names the
 * offending input (e.g. "sample 12 has length 70000, above max_tokens 65536"). `options` must
 * carry a header this library knows (ODC_PLAN_OPTIONS_INIT), else odcInvalidArgument. */
ODC_API odcResult_t odcPlanCreate(const int64_t* lengths, size_t num_samples,
                                  const odcPlanOptions_t* options, odcPlan_t* plan);

/* Predicted bubble over all minibatches under collective and ODC execution. */
ODC_API odcResult_t odcPlanGetBubble(odcPlan_t plan, double* collective, double* odc);

/* The plan as JSON, the same document `odc plan` prints (docs/planner.md). The string is owned by
 * the plan and valid until odcPlanDestroy. */
ODC_API odcResult_t odcPlanToJson(odcPlan_t plan, const char** json);

/* Releases a plan. NULL is accepted and ignored; a handle that is not a live plan (destroyed, or
 * never made by odcPlanCreate) is refused with odcInvalidArgument and nothing is freed. */
ODC_API odcResult_t odcPlanDestroy(odcPlan_t plan);

/* Local, pure CPU, thread-safe: work stealing within one minibatch, simulated event by event with
 * the runtime's rule (docs/planner.md, "Work stealing"). Queue r holds rank r's counts[r] items in
 * plan order; `predicted` has counts[0]+...+counts[num_ranks-1] costs, queue by queue. A free rank
 * (served in order of time, then rank) takes the front item of its own queue while it has one;
 * then the tail item of the queue whose unclaimed items have the largest predicted sum (added in
 * index order from the first unclaimed item, as the work board adds it; ties: the lowest rank); it
 * stops when nothing is unclaimed. An item lasts its actual cost divided by the speed of the rank
 * that runs it.
 *   actual:     NULL (the predicted costs) or one cost per item, as `predicted`.
 *   rank_speed: NULL (all 1) or num_ranks positive speeds.
 *   rank_start: NULL (all 0) or num_ranks times >= 0 at which each rank starts taking items.
 * Outputs (caller-owned; any may be NULL): *span, the time the last rank finishes; finish[r] and
 * busy[r] (num_ranks each): when rank r finished and the time it spent on items; runner[i] (one
 * per item): the rank that ran item i; *num_moved: items run by a rank other than their owner.
 * A bad input (a negative count or cost, a speed <= 0, ...) gives odcInvalidArgument naming it and
 * writes nothing. */
ODC_API odcResult_t odcStealSimulate(int num_ranks, const int64_t* counts, const double* predicted,
                                     const double* actual, const double* rank_speed,
                                     const double* rank_start, double* span, double* finish,
                                     double* busy, int64_t* runner, int64_t* num_moved);

/* Reads a lengths file in the `odc plan` format (one positive integer per line, blank and '#'
 * lines skipped; "-" is stdin). On success *lengths (owned by the caller, release with
 * odcLengthsFree) holds *num_samples values; errors name the file and line. odcLengthsFree takes
 * NULL (ignored) or an array from odcLengthsRead not yet freed (else odcInvalidArgument). */
ODC_API odcResult_t odcLengthsRead(const char* path, int64_t** lengths, size_t* num_samples);
ODC_API odcResult_t odcLengthsFree(int64_t* lengths);

/* Simulator (docs/simulate.md): step time, bubble and memory per GPU of training configurations at
 * many rank counts, as the document `odc simulate --format json` prints.
 *
 * The request, field for field the command's options. Fill it with odcSimulateRequestInit (the
 * command's defaults), then set what differs:
 *
 *   odcSimulateRequest_t request;
 *   odcSimulateRequestInit(&request, sizeof(request));
 *   request.lengths = lengths; request.num_samples = n;
 *   int64_t ranks[] = {8, 64}; request.ranks = ranks; request.num_rank_counts = 2;
 *
 * ODC_SIMULATE_UNSET in an optional number leaves it to the command's default; lists of names are
 * comma-separated as on the command line. Every pointer is read during the call only. Later
 * versions append fields only and bump ODC_SIMULATE_REQUEST_VERSION. */
#define ODC_SIMULATE_REQUEST_MAGIC 0x0dc05133u
#define ODC_SIMULATE_REQUEST_VERSION 1
#define ODC_SIMULATE_UNSET (-1)

typedef enum {
  odcSimulateSft = 0, /* every minibatch a training minibatch */
  odcSimulateGrpo = 1 /* GRPO's training phase: per RL step of ranks x samples_per_rank rollouts,
                         2 forward-only minibatches and minibatches_per_step updates */
} odcSimulateTask_t;

typedef struct {
  size_t size;            /* sizeof(odcSimulateRequest_t) as the caller was compiled */
  unsigned int magic;     /* ODC_SIMULATE_REQUEST_MAGIC */
  unsigned int version;   /* ODC_SIMULATE_REQUEST_VERSION */
  const int64_t* lengths; /* the samples' lengths (positive), num_samples of them; required */
  size_t num_samples;
  int64_t samples_per_rank; /* a minibatch is ranks x this many consecutive samples; default 4 */
  int64_t max_tokens;       /* token cap per microbatch; UNSET: the longest sample */
  int64_t max_length;       /* drop samples longer than this; UNSET: keep every sample */
  const char* model; /* a preset ("1.5b", default; "7b", ...) unless the three below are set */
  int64_t layers;    /* a custom model: all three set, or all UNSET */
  double layer_params;
  double other_params;
  double cost_a; /* microbatch cost in seconds, max(floor, c + sum(a*L + b*L^2)); cost_a */
  double cost_b; /* UNSET: the preset's fit on 4 H200s (a custom model needs a cost) */
  double cost_c;
  double cost_floor; /* >= 0, default 0 */
  int64_t
      cost_calibrated_on; /* GPUs the cost was fitted on; UNSET: 4 with the preset's cost, else 0 */
  const int64_t* ranks;   /* rank counts; NULL: 8, 16, ..., 1024 */
  size_t num_rank_counts;
  int64_t minibatches;    /* per rank count (RL steps with odcSimulateGrpo); default 20 */
  const char* policies;   /* NULL: "local-sort,lb-micro,lb-mini,lb-mini-padded" */
  const char* modes;      /* NULL: "collective,fsdp2-deferred,fsdp2-unsharded,odc,odc-hybrid" */
  odcSimulateTask_t task; /* default odcSimulateSft */
  int64_t minibatches_per_step; /* odcSimulateGrpo: update minibatches per RL step; default 2 */
  odcSplit_t split;             /* odcSplitAuto: also simulate the split arms; default off */
  double split_exchange;        /* default 0.05 */
  odcMicrobatchMemory_t microbatch_memory; /* default odcMicrobatchMemoryLbMicro */
  const double* rank_speed; /* NULL, or one relative speed per rank (one rank count) */
  size_t num_rank_speeds;
  int64_t gpus_per_node;           /* default 8 */
  double nvlink_gbytes;            /* ODC pull/push bandwidth per GPU within a node; default 290 */
  double nvlink_collective_gbytes; /* NCCL bus bandwidth within a node; default 300 */
  double network_gbits;            /* NIC bandwidth per GPU; default 400 */
  double nvlink_latency_us;        /* default 10 */
  double network_latency_us;       /* default 10 */
  double forward_fraction;         /* a forward's share of a microbatch's cost; default 0.25 */
  const char* transport_path;      /* measured curves (JSON); NULL: the NVLink constants */
  double gpu_memory_gbytes;        /* default 141 (an H200) */
} odcSimulateRequest_t;

/* Local: writes the header and the command's defaults into `request`; `size` is
 * sizeof(odcSimulateRequest_t) as the caller was compiled (another size: odcInvalidArgument,
 * nothing written). */
ODC_API odcResult_t odcSimulateRequestInit(odcSimulateRequest_t* request, size_t size);

/* Local, CPU only, thread-safe: runs the sweep `request` describes. On success *json (release with
 * odcSimulateFree) is the document; on failure *json is untouched and odcGetLastError() holds the
 * message `odc simulate` prints for the same configuration (naming the command's options). */
ODC_API odcResult_t odcSimulateSweep(const odcSimulateRequest_t* request, char** json);

/* The same from the command's options as strings (no program or subcommand name), parsed by the
 * command's own table, e.g. {"--ranks", "8", "--policies", "lb-mini"}; with `lengths`
 * (num_samples values, positive) they replace --lengths, which must then be absent. */
ODC_API odcResult_t odcSimulate(const char* const* args, size_t num_args, const int64_t* lengths,
                                size_t num_samples, char** json);

/* Takes NULL (ignored) or a live document from odcSimulateSweep or odcSimulate (else
 * odcInvalidArgument, nothing freed). */
ODC_API odcResult_t odcSimulateFree(char* json);

/* ---------------------------------------------------------------------------------------------
 * Communicator: ranks, symmetric buffers and the ODC operations (docs/design.md, "Semantics of
 * the operations").
 * One process per rank. A communicator is used by one thread at a time (odcCommDestroy may come
 * from another thread while a call is in flight: that call ends with odcInterrupted): a call that
 * enters while another thread is inside a call of the same communicator returns odcInvalidUsage at
 * once, naming both threads (kernel ids and names) and the call in flight, and changes nothing
 * (that call goes on; odcCommGetLastError keeps its message). Calls marked
 * "collective" must be made by every rank, in the same order. Errors name the rank and the
 * operation. After a timeout or a peer's failure the communicator is failed: every later call
 * returns odcRemoteError with the original message; destroy it.
 * ------------------------------------------------------------------------------------------- */

typedef enum { odcFloat32 = 0, odcBfloat16 = 1 } odcDataType_t;

typedef struct odcComm* odcComm_t;
typedef struct odcBuffer* odcBuffer_t;

/* The stream that orders an operation: a cudaStream_t on device communicators (NULL = the legacy
 * default stream); ignored by host communicators (pass NULL). Device operations are enqueued and
 * return without waiting; their completion follows stream order. */
typedef void* odcStream_t;

/* Collective. Joins `world_size` ranks on this machine that pass the same `key` (1-200 letters,
 * digits, '_', '-', '.'; unique per job: e.g. from the launcher). Host shared-memory transport.
 * `timeout_seconds` bounds every wait on another rank; <= 0 takes $ODC_TIMEOUT, else 60 s; INFINITY
 * waits forever (finite values beyond 100 years are clamped to it). NaN, or an $ODC_TIMEOUT that
 * is not a positive number of seconds or "inf", is refused (odcInvalidArgument) naming it. On
 * failure *comm is untouched and odcGetLastError() says which rank was missing or why. */
ODC_API odcResult_t odcCommInit(odcComm_t* comm, int rank, int world_size, const char* key,
                                double timeout_seconds);

/* Collective. As odcCommInit, on GPU `cuda_device` with the CUDA transport (one process per GPU,
 * at most 8 GPUs of one node): buffers are device memory mapped into every rank through CUDA IPC;
 * data operations are enqueued on the stream they are given and return without waiting. A device
 * wait that times out is reported by the next call on the communicator. odcInvalidUsage when the
 * library was built without CUDA. */
ODC_API odcResult_t odcCommInitCuda(odcComm_t* comm, int rank, int world_size, const char* key,
                                    double timeout_seconds, int cuda_device);

/* Which transport a communicator uses.
 *   odcTransportAuto:    config.device >= 0: $ODC_TRANSPORT if set ("cuda", "nvshmem"), else
 *                        "cuda"; config.device < 0: "shm".
 *   odcTransportShm:     host shared memory: local processes, host pointers.
 *   odcTransportCuda:    CUDA IPC within a node: one process per GPU, device pointers.
 *   odcTransportNvshmem: NVSHMEM, one node or many: one process per GPU, device pointers; needs
 *                        the plugin libodc_nvshmem.so (docs/multinode.md). */
typedef enum {
  odcTransportAuto = 0,
  odcTransportShm = 1,
  odcTransportCuda = 2,
  odcTransportNvshmem = 3
} odcTransport_t;

#define ODC_COMM_CONFIG_VERSION 5

/* A byte budget of odcCommConfig_t that comes from its environment variable (else its default):
 * the one "unset" of the byte fields (staging_bytes also takes 0 for it, as before version 5). */
#define ODC_BYTES_FROM_ENVIRONMENT ((size_t)-1)

/* An external bootstrap: how ranks meet when the caller already has a rendezvous (a
 * torch.distributed store, MPI, ...). Contract for both callbacks: collective (every rank calls
 * them, in the same order, with the same `bytes`), blocking, and bounded: on failure, or when a
 * peer does not arrive within the caller's own timeout, return nonzero instead of hanging (0 is
 * success). allgather: recv[r*bytes : (r+1)*bytes] = rank r's `send`, for every rank r (recv holds
 * world_size * bytes). mark_failed (optional, may be NULL): called at most once, when this rank
 * fails (init or later), so peers waiting in the callbacks can end with an error naming it instead
 * of a timeout. The callbacks run on the thread that called into odc; odc uses them during
 * odcCommInitConfig and, for mark_failed, until odcCommDestroy, so `ctx` must live that long.
 * With a bootstrap, local transports name their shared memory with a random key that rank 0 makes
 * and sends through allgather, so two jobs with different bootstraps never meet. */
#define ODC_BOOTSTRAP_VERSION 1
typedef struct {
  unsigned int version; /* ODC_BOOTSTRAP_VERSION */
  void* ctx;            /* passed back to every callback */
  int (*allgather)(void* ctx, const void* send, void* recv, size_t bytes);
  int (*barrier)(void* ctx);
  void (*mark_failed)(void* ctx, const char* reason);
} odcBootstrap_t;

/* Versioned communicator configuration (NCCL style): declare it with ODC_COMM_CONFIG_INIT (the
 * header and the defaults), change the fields you need, pass it to odcCommInitConfig:
 *
 *   odcCommConfig_t config = ODC_COMM_CONFIG_INIT;
 *   config.key = "job-42";
 *
 * `size` and `version` let later library versions add fields without breaking callers compiled
 * against this header: the library reads and writes only the fields the caller's version has.
 *
 * Compatibility (issue #29). Before, odcCommConfigInit set `size` and `version` itself and wrote
 * the library's whole struct, so a caller built against an older header (a smaller struct) got
 * memory written past its struct. Now odcCommConfigInit writes only after it has checked the
 * caller's header, which must be exactly one that a version of this header declared: (size 40,
 * version 1), (48, 2), (64, 3), (80, 4) or (96, 5). A caller built against an earlier header calls
 * it on a struct it never initialized: the check refuses it (an error, nothing written) unless the
 * 12 bytes of garbage spell exactly such a pair; a caller that ignores the error and sets fields
 * itself is then refused by odcCommInitConfig for the same reason, which only ever reads. For a
 * caller of version 4's header (the same 80-byte layout, version 4) even such a pair names no more
 * than its own struct; a caller of an older header relies on the check alone. */
typedef struct {
  size_t size; /* sizeof(odcCommConfig_t) as the caller was compiled (ODC_COMM_CONFIG_INIT) */
  unsigned int version; /* ODC_COMM_CONFIG_VERSION (ODC_COMM_CONFIG_INIT) */
  odcTransport_t transport;
  const char* key;        /* rendezvous of local ranks (as odcCommInit); copied */
  double timeout_seconds; /* bounds every wait on another rank; <= 0: $ODC_TIMEOUT, else 60 s */
  int device;             /* CUDA device for odcTransportCuda; -1 (default) for none */
  /* 1: every owner adds the contributions in a fixed order (sender rank, then push index), so
   * sums are bitwise identical whatever the timing. Pushes are then summed at the sender, and at
   * odcMinibatchEnd each owner pulls its slices from the senders in rank order: world_size x count
   * fp32 of extra memory per accumulator and rank (4 bytes per full-gradient element), plus 4 MiB
   * per communicator. 0 (default): the fastest exact scheme the transport has (CUDA: remote fp32
   * atomic adds, no extra memory; shm: streamed through bounded staging rings, staging_bytes). */
  int deterministic;
  /* Version 2. NULL (default): ranks meet through `key` in local shared memory. Else the caller's
   * bootstrap (copied; its ctx must outlive the communicator); `key` must then be NULL. */
  const odcBootstrap_t* bootstrap;
  /* Version 3. Staging budget per rank of the streamed scheme (host transports without a remote
   * fp32 add: pushes travel during the minibatch in chunks through a ring per sender at each
   * owner): the most symmetric memory its rings and signals take, whatever the model and the
   * world size. ODC_BYTES_FROM_ENVIRONMENT (default; 0 means the same): $ODC_STAGING_BYTES
   * (bytes, or with a K, M or G suffix), else 256 MiB. Must be equal on every rank (agreed at
   * init); a budget too small for the world size is refused at the first accumulator, naming what
   * it needs. */
  size_t staging_bytes;
  /* Version 3. Ranks per node (consecutive ranks share a node), for the topology every rank
   * agrees on at init (odcCommGetTopology). 0 (default): $ODC_LOCAL_WORLD_SIZE, else the
   * launcher's $LOCAL_WORLD_SIZE (torchrun), else the transport's report (the host). */
  int ranks_per_node;
  /* Version 4. With more than one node: the node cache's budget per rank (published buffers'
   * remote shards fetched once per node and minibatch; docs/runtime.md "Node schemes"); 0: off.
   * ODC_BYTES_FROM_ENVIRONMENT (default): $ODC_NODE_CACHE_BYTES, else 256 MiB. Equal on every
   * rank. */
  size_t node_cache_bytes;
  /* Version 4. Streamed scheme with more than one node: the budget per rank of the relay rows of
   * node-aggregated pushes (one node-summed slice per other node, sent at odcMinibatchEnd); 0:
   * off. ODC_BYTES_FROM_ENVIRONMENT (default): $ODC_NODE_AGGREGATION_BYTES, else 0. Equal on
   * every rank. */
  size_t node_aggregation_bytes;
  /* Version 5. CUDA transport: the SMs odc's data kernels size their grids for (fewer leave room
   * for compute kernels running beside gathers and pushes; more than the device has: all). 0
   * (default): $ODC_CUDA_SMS, else all. */
  int cuda_sms;
  /* Version 5. NVSHMEM transport: the symmetric heap per GPU NVSHMEM reserves when the process's
   * first NVSHMEM communicator starts it (later ones cannot change it), unless
   * NVSHMEM_SYMMETRIC_SIZE is set (NVSHMEM's own, kept). ODC_BYTES_FROM_ENVIRONMENT (default):
   * $ODC_NVSHMEM_HEAP_GIB, else 4 GiB. odcMemoryNeed says what a model needs. */
  size_t nvshmem_heap_bytes;
} odcCommConfig_t;

/* The header and the defaults: auto transport, no key, default timeout, no device, not
 * deterministic, no bootstrap, and every budget and count from its environment variable, else its
 * default. */
#define ODC_COMM_CONFIG_INIT                                                                      \
  {                                                                                               \
    sizeof(odcCommConfig_t), ODC_COMM_CONFIG_VERSION, odcTransportAuto, NULL, 0.0, -1, 0, NULL,   \
        ODC_BYTES_FROM_ENVIRONMENT, 0, ODC_BYTES_FROM_ENVIRONMENT, ODC_BYTES_FROM_ENVIRONMENT, 0, \
        ODC_BYTES_FROM_ENVIRONMENT                                                                \
  }

/* Local: resets `config` to the defaults (those of ODC_COMM_CONFIG_INIT), writing only the fields
 * of its header's version and leaving the header as it is. The caller sets the header first
 * (ODC_COMM_CONFIG_INIT, or size and version by hand); a header that is not one of the pairs
 * above is refused (odcInvalidArgument, naming it) and nothing is written. */
ODC_API odcResult_t odcCommConfigInit(odcCommConfig_t* config);

/* Local: the topology the ranks agreed on at init: *num_nodes (may be NULL) and, when node_of is
 * not NULL, node_of[r] = the node of rank r for every rank (world_size entries; nodes are
 * numbered from 0 in order of their lowest rank). */
ODC_API odcResult_t odcCommGetTopology(odcComm_t comm, int* num_nodes, int* node_of);

/* Collective. As odcCommInit / odcCommInitCuda, configured by `config` (not retained). A config
 * with an unknown version, a size smaller than version 1's, or a transport this build lacks is
 * refused with a message naming the problem. Version 1 configs (no `bootstrap`), version 2
 * configs (no `staging_bytes`), version 3 configs (no node budgets) and version 4 configs (no SM
 * budget or heap) are accepted. Every field left to the environment is read here, once (docs/
 * env.md), and every rank agrees on the node layout, the scheme and the budgets it uses in one
 * exchange: a rank whose knob cannot be read, or whose budget differs, fails every rank's init
 * with an error naming each mismatch. With a bootstrap every rank's init fails when one rank's
 * does (the failure goes through mark_failed and the init barrier). */
ODC_API odcResult_t odcCommInitConfig(odcComm_t* comm, int rank, int world_size,
                                      const odcCommConfig_t* config);

/* Local: *resolved = *config with every field it leaves to the environment filled in as
 * odcCommInitConfig reads it (the one reader of odc's variables, docs/env.md): the transport,
 * the timeout, the budgets, the ranks per node (0: the transport's report, known only at init),
 * the SM budget (0: all) and the NVSHMEM heap (ODC_BYTES_FROM_ENVIRONMENT: NVSHMEM_SYMMETRIC_SIZE,
 * NVSHMEM's own, is set). `resolved` must carry the same header (size, version) as `config`.
 * An ODC_TIMEOUT or ODC_TRANSPORT that init would refuse is refused here, naming it; a budget
 * that cannot be read stays ODC_BYTES_FROM_ENVIRONMENT (init names it, where it is used). Meets no
 * rank and reads no device: what a binding asks before init (the Python package's store
 * bootstrap bounds its waits by the resolved timeout). */
ODC_API odcResult_t odcCommConfigResolve(const odcCommConfig_t* config, odcCommConfig_t* resolved);

/* What a communicator configured by `config` holds per rank, in bytes, for buffers of
 * `published_bytes` per rank (the shards of every non-accumulator buffer) and
 * `accumulator_elements` per rank (fp32 elements of every accumulator's shard), in a world of
 * `world_size` ranks; the node schemes are counted as upper bounds (the core caches and relays
 * buffer by buffer while its budget lasts). Budgets the config leaves to the environment are read
 * as odcCommInitConfig reads them; ranks per node unset: one node per rank (every node scheme
 * counted). heap_bytes: the NVSHMEM heap to ask for, the total plus 5% and 64 MiB, rounded up to
 * 64 MiB. Local; reads no device. */
typedef struct {
  size_t published;     /* the shards of the buffers given */
  size_t accumulators;  /* 4 bytes per accumulator shard element (fp32 sums) */
  size_t staging;       /* the streamed scheme's rings: the staging budget */
  size_t node_cache;    /* other nodes' published shards, at most the node cache budget */
  size_t aggregation;   /* relay rows of node-aggregated pushes, at most their budget */
  size_t deterministic; /* the pulled scheme's pending sums and scratch */
  size_t heap_bytes;    /* the NVSHMEM heap that holds all of it with a margin */
} odcMemoryNeed_t;
ODC_API odcResult_t odcMemoryNeed(const odcCommConfig_t* config, int world_size,
                                  size_t published_bytes, size_t accumulator_elements,
                                  odcMemoryNeed_t* need);

/* Process-wide: `check` (NULL: none, the default) is called on the waiting thread, at most every
 * 20 ms, while a call waits on another rank on the host (init, barriers, minibatch_end, signal
 * waits; not device-side waits). A nonzero return ends the wait: the call returns odcInterrupted,
 * naming what it waited for, and the communicator is failed (peers waiting on this rank fail naming
 * it). The Python package installs one that runs Python's signal handlers, so Ctrl-C raises
 * KeyboardInterrupt in a rank waiting inside odc, even with an infinite timeout. `check` must not
 * call odc. */
ODC_API odcResult_t odcSetInterruptCheck(int (*check)(void* ctx), void* ctx);

/* 1 when the library was built with the CUDA transport, else 0. */
ODC_API int odcHasCuda(void);

/* Frees the communicator and its buffers; the handle is invalid afterwards (calls with it return
 * odcInvalidUsage). Peers still waiting on this rank fail with odcRemoteError. A call of this
 * communicator in flight on another thread ends its wait on other ranks with odcInterrupted, and
 * destroy frees nothing before it has returned. A communicator belongs to the process that created
 * it: in a forked child every call with it returns odcInvalidUsage, and destroy only forgets the
 * handle there (success), leaving the parent's communicator and its shared state untouched. Host
 * communicators: local. Device communicators: collective (destroy them in the same order on every
 * rank): first completes this rank's queued work and, unless the communicator has failed, meets
 * every peer in a final barrier, so no peer's queued gather or push still uses this rank's memory
 * when it is freed; the wait is bounded by the timeout and ends early when a peer failed or died
 * (memory is then freed anyway: that peer has failed or will, naming this rank). */
ODC_API odcResult_t odcCommDestroy(odcComm_t comm);

ODC_API odcResult_t odcCommRank(odcComm_t comm, int* rank);
ODC_API odcResult_t odcCommWorldSize(odcComm_t comm, int* world_size);

/* Local: the symmetric memory this communicator holds on this rank right now, in bytes (either
 * pointer may be NULL). *buffer_bytes: the shards of every live buffer. *scheme_bytes: what the
 * accumulation scheme adds on top: the streamed scheme's rings and signals (at most the staging
 * budget, once per communicator) and the relay rows of node-aggregated pushes (at most their
 * budget), the deterministic (pulled) scheme's pending buffers and scratch; 0 with remote adds. */
ODC_API odcResult_t odcCommGetMemory(odcComm_t comm, size_t* buffer_bytes, size_t* scheme_bytes);

/* Local: the streamed scheme's flow control on this rank so far (either pointer may be NULL):
 * *chunks_sent, the chunks it put into owners' rings; *credit_waits, the times a push found a
 * ring full and waited for its owner's credit. Both 0 under the other schemes. */
ODC_API odcResult_t odcCommGetStreamStats(odcComm_t comm, uint64_t* chunks_sent,
                                          uint64_t* credit_waits);

/* Local: the bytes of this rank's streamed chunks (header and payload) put into the staging rings
 * of ranks on other nodes so far (either pointer may be NULL): *during_minibatches, sent by pushes
 * while minibatches ran (they overlap backward; a stream-ordered transport counts a chunk when it
 * is enqueued among the caller's kernels); *in_minibatch_end, sent inside minibatch_end (what the
 * tail waits for: the rows of node-aggregated pushes, all forwarded there). Both 0 with
 * one node and under the other schemes. ODC_NODE_STATS=1 prints them per rank at destroy. */
ODC_API odcResult_t odcCommGetNodeTraffic(odcComm_t comm, uint64_t* during_minibatches,
                                          uint64_t* in_minibatch_end);

/* Local: *bytes = the symmetric memory the node cache holds on this rank now (with more than one
 * node: the rows of other nodes' published shards this rank fetches for its node each minibatch,
 * and one ready word per rank), at most its budget ($ODC_NODE_CACHE_BYTES, default 256 MiB; 0
 * turns the cache off). 0 on one node. Not part of odcCommGetMemory's counts. */
ODC_API odcResult_t odcCommGetNodeCacheBytes(odcComm_t comm, size_t* bytes);

/* The message of this communicator's most recent failed call ("" if none); valid until the next
 * call on the communicator. */
ODC_API const char* odcCommGetLastError(odcComm_t comm);

/* Collective. A symmetric buffer of `count` elements of `dtype` on every rank (zeroed); every rank
 * must pass the same count, dtype and accumulator flag, else all fail with odcInvalidArgument and
 * nothing is allocated. Accumulators (accumulator != 0) must be odcFloat32. *local receives this
 * rank's shard, valid until odcBufferFree / odcCommDestroy. */
ODC_API odcResult_t odcBufferAlloc(odcComm_t comm, size_t count, odcDataType_t dtype,
                                   int accumulator, odcBuffer_t* buffer, void** local);

/* Collective. As odcBufferAlloc, with a name that every rank must give too: buffers of the same
 * size allocated in a different order on different ranks (parameters on one, gradients on
 * another) then fail with odcInvalidArgument on every rank, naming both ranks' requests, and
 * nothing is allocated. `name`: 1-256 printable ASCII characters (copied), or NULL for an unnamed
 * buffer (odcBufferAlloc; an unnamed buffer also differs from every named one). */
ODC_API odcResult_t odcBufferAllocNamed(odcComm_t comm, size_t count, odcDataType_t dtype,
                                        int accumulator, const char* name, odcBuffer_t* buffer,
                                        void** local);

/* What a buffer holds (odcBufferAllocKind). */
typedef enum {
  /* Shards their owners may rewrite whenever the caller's own synchronization allows (as
   * odcBufferAlloc with accumulator = 0): every gather reads the owners' shards as they are. */
  odcBufferShards = 0,
  /* An fp32 accumulator (as accumulator = 1). */
  odcBufferAccumulator = 1,
  /* Shards their owners rewrite only between minibatches (after odcMinibatchEnd, before the
   * next odcMinibatchBegin), e.g. published parameters. Gathers inside a minibatch may then be
   * served from a copy fetched once at odcMinibatchBegin: with more than one node, each remote
   * node's shard is fetched once per node and minibatch into the node cache and read from there
   * by the node's ranks ($ODC_NODE_CACHE_BYTES, docs/runtime.md "Node schemes"). A shard
   * rewritten inside a minibatch is then seen with its value at odcMinibatchBegin by other
   * nodes: use odcBufferShards for such buffers. */
  odcBufferPublished = 2,
} odcBufferKind_t;

/* Collective. As odcBufferAllocNamed, with the buffer's kind (every rank must give the same). */
ODC_API odcResult_t odcBufferAllocKind(odcComm_t comm, size_t count, odcDataType_t dtype,
                                       odcBufferKind_t kind, const char* name, odcBuffer_t* buffer,
                                       void** local);

/* Collective: peers may read the buffer until every rank has called it. Buffer handles are checked
 * before use by every call that takes one: a freed handle, one of another communicator, or any
 * other value gives odcInvalidArgument (handles are never reused within a process). */
ODC_API odcResult_t odcBufferFree(odcComm_t comm, odcBuffer_t buffer);

/* Local (reads peers' memory). dst[r*count:(r+1)*count] = rank r's shard, for every r; `dst` holds
 * dst_count = world_size * count elements of the buffer's dtype. Valid while owners do not rewrite
 * their shards. Inside a minibatch, a gather of an odcBufferPublished buffer may return the shards
 * as they were at odcMinibatchBegin (the node cache fetches other nodes' shards once per node
 * and minibatch); other buffers are read as they are when the gather runs. */
ODC_API odcResult_t odcGather(odcComm_t comm, void* dst, size_t dst_count, odcBuffer_t buffer,
                              odcStream_t stream);

/* As odcGather, with `dst` holding dst_count elements of `dst_dtype`: the buffer's dtype, or
 * odcBfloat16 for an odcFloat32 buffer (each element rounded to nearest even while it is pulled,
 * with no float32 copy of the result: mixed-precision parameters kept in float32). Other pairs fail
 * with odcInvalidArgument. */
ODC_API odcResult_t odcGatherAs(odcComm_t comm, void* dst, size_t dst_count,
                                odcDataType_t dst_dtype, odcBuffer_t buffer, odcStream_t stream);

/* Local (writes to peers), inside a minibatch, any number of times, concurrently with every other
 * rank: for every owner r, accumulator@r += src[r*count:(r+1)*count], accumulated in fp32 whatever
 * `src_dtype`. src_count must be world_size * count. The sums are visible after odcMinibatchEnd.
 * GPU transports: a rank's pushes are ordered on the streams they are given (several pushes on
 * streams not ordered with each other are not allowed: without a remote add they share one
 * outbox), odcMinibatchEnd's stream is ordered after every push, and work on any stream of the
 * minibatch is ordered after odcMinibatchBegin's stream (which zeroes the sums). FSDP2's
 * reduce-scatter and all-gather streams are. */
ODC_API odcResult_t odcScatterAccumulate(odcComm_t comm, const void* src, size_t src_count,
                                         odcDataType_t src_dtype, odcBuffer_t accumulator,
                                         odcStream_t stream);

/* Local, between minibatches: the next odcMinibatchBegin leaves this accumulator's sums on this
 * rank as they are instead of zeroing them, so that minibatch's contributions add to them
 * (gradient accumulation across minibatches; odc.torch uses it where .grad was not zeroed, as
 * FSDP2 accumulates into .grad). Applies once. odcInvalidArgument for a buffer that is not an
 * accumulator, odcInvalidUsage inside a minibatch. */
ODC_API odcResult_t odcAccumulatorKeepSums(odcComm_t comm, odcBuffer_t accumulator);

/* Collective: zeroes this rank's accumulators (except those odcAccumulatorKeepSums kept), waits
 * for every rank, opens the minibatch. */
ODC_API odcResult_t odcMinibatchBegin(odcComm_t comm, odcStream_t stream);

/* Collective: returns when every contribution of every rank in this minibatch has been added at
 * its owner, on every rank. The one synchronization per minibatch. */
ODC_API odcResult_t odcMinibatchEnd(odcComm_t comm, odcStream_t stream);

/* Collective: returns when every rank has called it. */
ODC_API odcResult_t odcBarrier(odcComm_t comm, odcStream_t stream);

/* ---- The work board: work stealing inside a minibatch (docs/runtime.md "The work board") ---
 * Queue r holds rank r's microbatches of the minibatch's plan, indices 0..counts[r]-1. A rank
 * takes the front of its own queue while it has one, then the tail of the open queue with the
 * most predicted cost left (ties: lowest rank). Every take is one atomic claim at the queue's
 * owner, so each microbatch is claimed exactly once whatever the timing (host-blocking, never on
 * the caller's stream). A rank that dies holding a claim fails the communicator as any death
 * does: its peers' odcWorkBoardTake or odcMinibatchEnd fails naming it. Sub-communicators have
 * boards of their own. */

/* Collective per minibatch (every rank, after odcMinibatchBegin, same plan): opens this
 * minibatch's board. costs: counts[0]+...+counts[n-1] values, queue by queue, or NULL (all 1.0).
 * num_queues must equal the communicator's world size; counts[r] in 0..65535; costs finite and
 * >= 0 (else odcInvalidArgument, nothing changed). The first open of a communicator allocates its
 * claim words (8 bytes of symmetric memory per rank; device memory on GPU transports) and meets
 * every rank; later ones are local. odcInvalidUsage outside a minibatch, a second time in one
 * minibatch, and in deterministic mode (work stealing changes which rank pushes a microbatch).
 * A failure of a peer fails the communicator. */
ODC_API odcResult_t odcWorkBoardOpen(odcComm_t comm, int num_queues, const int32_t* counts,
                                     const double* costs);

/* Local, host-blocking (never waits for work on any stream, nor on a peer): claims one
 * microbatch, *queue (the rank whose queue it was) and *index (in that queue). *queue = -1 (and
 * *index = -1) when none is left for this rank: every open queue is claimed to the end, and
 * queues whose owners have not opened this minibatch yet are left to them. odcInvalidUsage before
 * this minibatch's odcWorkBoardOpen; odcInvalidUsage naming the queue where ranks passed different
 * plans (the communicator fails: ranks no longer agree on the work); a failed or dead peer:
 * odcRemoteError naming it, and the communicator fails. */
ODC_API odcResult_t odcWorkBoardTake(odcComm_t comm, int32_t* queue, int32_t* index);

/* Local: microbatches this rank took from its own queue and from others', in the minibatch whose
 * board it opened last and in total (any pointer may be NULL). */
ODC_API odcResult_t odcWorkBoardStats(odcComm_t comm, int64_t* own_this, int64_t* stolen_this,
                                      int64_t* own_total, int64_t* stolen_total);

/* The colour of a rank that joins no sub-communicator in odcCommSplit (as NCCL_SPLIT_NOCOLOR);
 * any negative colour means the same. */
#define ODC_SPLIT_NOCOLOR (-1)

/* Collective over `comm` (every rank, same order), host-blocking; between minibatches or inside
 * one (every rank meets first, as for odcBufferAlloc). The ranks that pass the same `color` (>= 0)
 * form a sub-communicator, ranked by `key` (then by their rank in `comm`): on them *child receives
 * a new communicator of those ranks only (destroy it with odcCommDestroy); a rank passing
 * ODC_SPLIT_NOCOLOR receives NULL. After the colours are exchanged, members meet only each other.
 * The sub-communicator is used like any communicator: its buffers exist on its members only (a
 * gather reads k shards for k members), its minibatches and barriers meet its members only and
 * run independently of `comm`'s (e.g. inside one of `comm`'s minibatches), with `comm`'s
 * transport and device, accumulation scheme (deterministic too), budgets and timeout, and its
 * members' node layout in `comm`. Either may be destroyed first. Errors: as any communicator's,
 * prefixed "split colour C, parent ranks a, b, ...: rank R" (R counts members from 0); a member
 * that dies or fails fails its peers naming it; a failure of `comm` on this rank (a fault,
 * odcCommAbort) fails the sub-communicators split from it on this rank too, and their peers then
 * name this rank; a sub-communicator's failure leaves `comm` as it is. Transports: shm and cuda
 * (members meet in local shared memory under a random name); nvshmem returns odcInvalidUsage
 * (not supported). On failure *child is untouched; a fault fails `comm` as any collective's. */
ODC_API odcResult_t odcCommSplit(odcComm_t comm, int color, int key, odcComm_t* child);

/* Local; never blocks and makes no CUDA call (reads a host-mapped flag). Reports a failure of
 * this communicator's device work found on the device: a wait on another rank that timed out
 * (odcTimeout) or ranks that met in different collectives (odcRemoteError); the communicator is
 * failed from then on. odcSuccess when there is none so far. Device operations return before
 * they run, so to know that a minibatch's sums are complete on the host, wait for its
 * odcMinibatchEnd first (e.g. cudaEventSynchronize on an event recorded after it on its stream),
 * then call this: odcSuccess means every rank's contributions were added; otherwise no optimizer
 * step may use the sums (odc.torch checks this before every step). Host communicators report
 * failures from the call that failed: this returns their earlier failure or odcSuccess. */
ODC_API odcResult_t odcCommPollError(odcComm_t comm);

/* Local; never blocks. Fails this communicator on purpose, for a reason of the caller's (e.g. an
 * exception inside a minibatch): every later call on this rank reports it, and peers waiting on
 * this rank (minibatch_end, barrier) end with odcRemoteError naming this rank and `reason` (may be
 * NULL; truncated to 200 bytes) instead of waiting out their timeout. Host waits and the CUDA
 * transport's device barriers see it at once (this rank writes a "failed" word into its slot of
 * every peer's barrier words); NVSHMEM's device waits end at their timeout, naming this rank.
 * No partial sum
 * is reported as success afterwards. A communicator that failed already keeps its first failure.
 * The communicator cannot be revived: destroy it (odcCommDestroy does not wait for peers then)
 * and build a new one. */
ODC_API odcResult_t odcCommAbort(odcComm_t comm, const char* reason);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ODC_ODC_H_ */
