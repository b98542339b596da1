#!/usr/bin/env bash
# GPU runs of odc, as named stages (dev/gpu/README.md lists them: what each measures, how long it
# takes, on which machine, where its recorded results are). Run from the repository root on the
# GPU machine; every stage runs under a time limit, logs to $OUT/<stage>.log (or its folder), and
# a failed stage never stops the next one: the exit status is 1 when any failed.
#
#   dev/gpu/run.sh STAGE... [--snapshot DIR] [--old DIR]
#
# --snapshot DIR  the tree under test: libodc.so (a CUDA build), libodc_nvshmem.so, odc,
#                 odc_bench, python/ and tests/ in DIR. Default: this tree's python/ and tests/
#                 with the libraries carried in .device/.
# --old DIR       the same for the "before" build of the before/after stages (streamed,
#                 cuda-timing, bench-before-after).
# Stage knobs come from the environment: BENCH_ROUNDS, BENCH_MIN_MIB, BENCH_MAX_MIB, BENCH_ORDER
# (bench-before-after, byte-movers), SKIP_FIT=1 (torch-migration without fit), SM_BUDGET_SECONDS (sm-budget),
# BASELINE_STEPS (rl-baselines, sft-baselines); for rl-baselines RL_PROMPTS (prompts per RL step,
# 8 responses each; default 4), RL_K (update minibatches per RL step; default 2), RL_ARMS
# (baselines: ODC + LB-Mini and the four FSDP2 baselines, the default; compare: collective +
# LB-Micro and ODC + LB-Mini; all; or one arm as COMM:POLICY, e.g. odc:lb-mini; odc.train takes
# no other list, and a multi-arm command fits the cost once, in its first arm); and
# RL_SMOKE=0 (rl-baselines without its tiny run).
# and for nvshmem-train NVTRAIN_7B=1, NVTRAIN_ARMS, NVTRAIN_STEPS, NVTRAIN_MAX_LENGTH, NVTRAIN_POLICY
# (nvshmem-probe: NVPROBE_BUILDS), HOST_FLOOR_PRESET (host-floor), STEAL_SLOWDOWN (steal: the
# slowed rank's factor, default 1.3) and STEAL_STEPS (default 6); VERL_SITE (verl-gpu: the carried
# verl, a folder or scripts/pack_verl_site.sh's .tar.xz; default build/verl_site.tar.xz).
set -uo pipefail

usage() {
  sed -n '/^#   dev/,/nvshmem-probe: NVPROBE_BUILDS/p' "$0" | sed 's/^# \{0,1\}//' >&2
  echo "stages: ${stages[*]}" >&2
  exit 2
}

here=$(cd "$(dirname "$0")" && pwd)
stages=(node-schemes streamed deterministic deterministic-memory cuda-timing bench-before-after
  fit torch-migration torch-frozen torch-split gpu-suite gpu-suite-1 gpu-suite-2 gpu-suite-3
  gpu-suite-4 gpu-suite-5 gpu-suite-6
  balanced-tail small-microbatch sm-budget
  rl-baselines sft-baselines nvshmem-train nvshmem-probe host-floor steal-check steal verl-gpu
  byte-movers)
snapshot="" old="" chosen=()
while [ $# -gt 0 ]; do
  case $1 in
    --snapshot) snapshot=${2:?--snapshot needs a folder}; shift 2 ;;
    --old) old=${2:?--old needs a folder}; shift 2 ;;
    -h | --help) usage ;;
    -*) echo "run.sh: unknown option $1" >&2; usage ;;
    *) chosen+=("$1"); shift ;;
  esac
done
[ ${#chosen[@]} -gt 0 ] || usage
# Issue #45, correctness on any GPU count (ranks share a GPU where there are fewer): the work
# board's claims over the CUDA transport and NVSHMEM (tests/gpu/test_work_board_gpu.py), then
# odc.torch's stealing loop with CUDA models (the CPU test's body, ranks sharing the GPUs).
stage_steal_check() {
  local env_new
  env_new=$(libs "$snapshot")
  build_dirs "$snapshot"
  stage board-gpu 400 env $env_new python3 -m pytest -q -p no:cacheprovider --noconftest \
    "$src_dir/tests/gpu/test_work_board_gpu.py"
  stage torch-steal-cuda 300 env $env_new OMP_NUM_THREADS=2 python3 -c "
import os, tempfile, odc
from tiny_lm import plans, max_diff, reference_state
from test_torch_stealing import _steal_rank, STEPS
schedule = plans(3, 'lb-mini')
with tempfile.TemporaryDirectory() as d:
    results = odc.launch(_steal_rank, 3, os.path.join(d, 'store'), schedule, 0, 0.3, 'cuda',
                         timeout=280)
for step in range(STEPS):
    ran = sorted((q, i) for claims, _, _ in results for q, i, _ in claims[step])
    assert ran == sorted((q, i) for q in range(3) for i in range(len(schedule[step][q]))), step
print('max diff to the single-process reference', max_diff(results[0][1], reference_state()))
print('stolen per rank', [stats['stolen_total'] for _, _, stats in results])"
}

# Issue #45's benchmark on every GPU (2+): SFT (LongAlign-like, 1.5b) and GRPO (the shipped RL
# rollouts) with ODC + LB-Mini without and with stealing (--steal both), first with every rank at
# full speed, then with rank 1 slowed STEAL_SLOWDOWN times (default 1.3); the tables show the
# microbatches moved and each run's bubble.
stage_steal() {
  local env_new dest="$out/steal" train slow=${STEAL_SLOWDOWN:-1.3} steps=${STEAL_STEPS:-6}
  env_new=$(libs "$snapshot")
  mkdir -p "$dest"
  train_all_gpus --preset 1.5b --comm odc --policy lb-mini --steal both --steps "$steps"
  stage sft-even 590 env $env_new "${train[@]}" --lengths data/longalign_like.txt \
    --max-length 65536 --samples-per-rank 8 --output "$dest/sft_even.json"
  stage sft-slow 590 env $env_new "${train[@]}" --lengths data/longalign_like.txt \
    --max-length 65536 --samples-per-rank 8 --rank-slowdown "1:$slow" \
    --output "$dest/sft_slow.json"
  stage grpo-slow 590 env $env_new "${train[@]}" --task grpo --rollouts data/grpo_math_like.tsv \
    --max-tokens 20480 --rank-slowdown "1:$slow" --output "$dest/grpo_slow.json"
}

# Issue #44 item 6: odc's verl engine on 2 GPUs, one process per GPU as Ray places verl's workers
# (dev/gpu/verl_engine_gpu.py): against verl's stock FSDP2 engine on a tiny Qwen2, which transport
# odc used, and the update phase of a GRPO minibatch under odc and stock FSDP2 (sync deferred and
# not). The machine has no verl: VERL_SITE is the carried copy (scripts/pack_verl_site.sh), put
# first on PYTHONPATH. If odc's CUDA transport fails with one device per process, the program
# runs again with both GPUs visible to both ranks (--all-visible), within the same 240 s.
stage_verl_gpu() {
  local env_new site=${VERL_SITE:-build/verl_site.tar.xz} begin=$SECONDS left
  env_new=$(libs "$snapshot")
  build_dirs "$snapshot"  # src_dir here too (libs ran in a subshell)
  if [[ $site == *.tar.xz ]]; then  # unpacked into /tmp, not under $out (which comes back)
    stage verl-site-unpack 30 bash -c "rm -rf /tmp/odc_verl_site && mkdir -p /tmp/odc_verl_site \
      && tar -C /tmp/odc_verl_site -xJf '$site' && du -sm /tmp/odc_verl_site"
    site=/tmp/odc_verl_site/verl_site
  fi
  if ! site=$(cd "$site" 2>/dev/null && pwd); then
    echo "verl-gpu: no carried verl at ${VERL_SITE:-build/verl_site.tar.xz}" | tee -a "$log"
    status=1
    return
  fi
  # USE_JAX=0 USE_TF=0: datasets (which verl imports) would import the machine's jax and TF formatters.
  # shellcheck disable=SC2206  # $env_new: several VAR=value words, split on purpose
  local run=(env $env_new "PYTHONPATH=$site:$src_dir/python" USE_JAX=0 USE_TF=0 python3
    "$here/verl_engine_gpu.py")
  local before=$status
  status=0
  stage verl-engine 190 "${run[@]}" --timeout 180
  if [ "$status" -ne 0 ]; then  # stays failed: one device per process did not work
    left=$((235 - (SECONDS - begin)))
    [ "$left" -ge 30 ] && stage verl-engine-all-visible "$left" "${run[@]}" --all-visible \
      --timeout $((left - 10))
  fi
  status=$((status | before))
}

for name in "${chosen[@]}"; do
  [[ " ${stages[*]} " == *" $name "* ]] || { echo "run.sh: unknown stage '$name'" >&2; usage; }
done

out=${OUT:-/tmp/odc_gpu}
mkdir -p "$out"
# NVLink multicast off: it can take the shared host down (NCCL, torch's symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nccl_lib=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null || true)
nvshmem_dir=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])' 2>/dev/null || true)
export LD_LIBRARY_PATH=${nccl_lib:+$nccl_lib:}${nvshmem_dir:+$nvshmem_dir/lib:}${LD_LIBRARY_PATH:-}

# A build: its libraries (lib_dir) and its Python and tests (src_dir).
build_dirs() {  # build_dirs DIR: sets lib_dir and src_dir
  if [ -n "$1" ]; then
    lib_dir=$(cd "$1" && pwd) src_dir=$lib_dir
  else
    lib_dir=$PWD/.device src_dir=$PWD
  fi
}
libs() {  # libs DIR: the environment that selects that build (DIR empty: this tree)
  build_dirs "$1"
  echo "PYTHONPATH=$src_dir/python:$src_dir/tests/gpu:$src_dir/tests/python" \
    "ODC_LIBRARY=$lib_dir/libodc.so ODC_NVSHMEM_PLUGIN=$lib_dir/libodc_nvshmem.so" \
    "ODC_CLI=$lib_dir/odc"
}
need_old() {
  [ -n "$old" ] || { echo "run.sh: stage $1 compares two builds: give --old DIR" >&2; return 1; }
}

status=0
log=/dev/null
# stage NAME LIMIT COMMAND...: runs a command under a time limit, appends its output to $log,
# says how it ended, and on failure sets status=1 and goes on.
stage() {
  local name=$1 limit=$2 rc=0 begin=$SECONDS
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S)): $*" | tee -a "$log"
  # timeout signals its whole process group, so torchrun's and odc.launch's ranks go too.
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "=== $name FAILED (exit $rc) after $((SECONDS - begin)) s" | tee -a "$log"
    status=1
  else
    echo "=== $name done in $((SECONDS - begin)) s" | tee -a "$log"
  fi
}
header() {  # the device, date and commit at the top of a log
  { date -u; nvidia-smi -L; git rev-parse --short HEAD 2>/dev/null
    python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null; } >>"$log" 2>&1
}

frozen_check() {  # frozen_check RANKS [MESH]: the CPU test's body with CUDA models
  local mesh=${2:+, mesh=($2)}
  echo "
from test_torch_fsdp2_frozen import check_frozen_unused_and_adapter_parameters as check
check($1, 'cuda', tolerance=1e-4$mesh)
print('odc.torch: frozen, unused and adapter parameters ok on $1 ranks ${2:+(mesh $2)}')"
}

# The core's node schemes on one GPU, ranks sharing it, pretended nodes (ODC_LOCAL_WORLD_SIZE):
# node-cached gathers and node-aggregated pushes over NVSHMEM and the CUDA transport, memory
# with and without the cache, odc.torch served from the cache, the streamed sums unchanged.
stage_node_schemes() {
  local env_new check="$here/node_schemes_check.py" streamed="$here/streamed_check.py"
  local nv="ODC_TRANSPORT=nvshmem"
  env_new=$(libs "$snapshot")
  for direct in 1 0; do
    stage "nvshmem-nodes2-direct$direct" 400 env $env_new $nv ODC_NVSHMEM_DIRECT=$direct \
      ODC_LOCAL_WORLD_SIZE=2 python3 "$check" windows 4 2 12 1
  done
  for world in 2 4; do
    stage "nvshmem-nodes1-$world" 400 env $env_new $nv ODC_LOCAL_WORLD_SIZE=1 \
      python3 "$check" windows "$world" 1 12 1
  done
  stage nvshmem-one-node 400 env $env_new $nv ODC_LOCAL_WORLD_SIZE=4 \
    python3 "$check" windows 4 4 8 1
  stage nvshmem-nodes2-cache-off 400 env $env_new $nv ODC_LOCAL_WORLD_SIZE=2 \
    ODC_NODE_CACHE_BYTES=0 python3 "$check" windows 4 2 8 1
  stage nvshmem-nodes2-late-fetch 400 env $env_new $nv ODC_LOCAL_WORLD_SIZE=2 \
    ODC_NVSHMEM_TEST_FETCH_DELAY_US=20000 python3 "$check" windows 4 2 8 0
  stage cuda-nodes2 400 env $env_new ODC_TRANSPORT=cuda ODC_LOCAL_WORLD_SIZE=2 \
    python3 "$check" windows 4 2 12 1
  stage cuda-nodes2-late 400 env $env_new ODC_TRANSPORT=cuda ODC_LOCAL_WORLD_SIZE=2 \
    python3 "$check" windows 4 2 8 0
  for shape in "4 2" "4 1" "2 1"; do
    stage "nvshmem-aggregation-${shape// /x}" 400 env $env_new $nv \
      ODC_LOCAL_WORLD_SIZE=${shape#* } python3 "$check" aggregation $shape
  done
  stage nvshmem-aggregation-tiny-staging 400 env $env_new $nv ODC_LOCAL_WORLD_SIZE=2 \
    ODC_STAGING_BYTES=256K python3 "$check" aggregation 4 2
  stage nvshmem-aggregation-relayed-and-direct 400 env $env_new $nv ODC_LOCAL_WORLD_SIZE=2 \
    ODC_STAGING_BYTES=256K ODC_NODE_AGGREGATION_BYTES=300000 python3 "$check" aggregation-mixed 4
  stage memory-cuda-nodes2-cache-default 300 env $env_new ODC_TRANSPORT=cuda \
    ODC_LOCAL_WORLD_SIZE=2 python3 "$check" memory 4 64
  stage memory-cuda-nodes2-cache-0 300 env $env_new ODC_TRANSPORT=cuda ODC_LOCAL_WORLD_SIZE=2 \
    ODC_NODE_CACHE_BYTES=0 python3 "$check" memory 4 64
  for ranks in 2 4; do
    stage "torch-nvshmem-nodes1-$ranks" 400 env $env_new $nv ODC_LOCAL_WORLD_SIZE=1 \
      OMP_NUM_THREADS=2 python3 -c "$(frozen_check "$ranks")"
  done
  stage streamed-sums-nvshmem 300 env $env_new $nv ODC_LOCAL_WORLD_SIZE=1 \
    python3 "$streamed" sums 4 bfloat16 6
  stage streamed-dies 200 env $env_new $nv ODC_LOCAL_WORLD_SIZE=1 python3 "$streamed" dies
  stage cuda-sums 300 env $env_new ODC_TRANSPORT=cuda python3 "$streamed" sums 2 bfloat16 6
}

# The streamed scheme over NVSHMEM, several ranks per GPU: memory per process before (--old) and
# after, exact sums with delays (fp32, bf16, default and tiny staging), 1,000 minibatches, a rank
# killed mid-minibatch, the deterministic scheme, odc.torch over NVSHMEM, the CUDA sums unchanged.
stage_streamed() {
  need_old streamed || { status=1; return; }
  local env_new env_old check="$here/streamed_check.py"
  local nodes1="ODC_TRANSPORT=nvshmem ODC_LOCAL_WORLD_SIZE=1"  # every rank its own node
  env_new=$(libs "$snapshot") env_old=$(libs "$old")
  for world in 2 4; do
    stage "memory-old-$world" 300 env $env_old $nodes1 python3 "$check" memory "$world" 256
    stage "memory-new-$world" 300 env $env_new $nodes1 python3 "$check" memory "$world" 256
  done
  for direct in 0 1; do
    for world in 2 4; do
      for dtype in float32 bfloat16; do
        stage "sums-direct$direct-$world-$dtype" 300 env $env_new $nodes1 \
          ODC_NVSHMEM_DIRECT=$direct python3 "$check" sums "$world" "$dtype" 6
        stage "sums-tiny-direct$direct-$world-$dtype" 300 env $env_new $nodes1 \
          ODC_NVSHMEM_DIRECT=$direct ODC_STAGING_BYTES=256K python3 "$check" sums "$world" "$dtype" 6
      done
    done
  done
  stage thousand 500 env $env_new $nodes1 ODC_STAGING_BYTES=64K \
    python3 "$check" sums 2 float32 1000 1024
  for world in 2 4; do
    stage "inside-$world" 300 env $env_new $nodes1 python3 "$check" inside "$world"
  done
  stage dies 200 env $env_new $nodes1 python3 "$check" dies
  stage deterministic 300 env $env_new $nodes1 python3 "$check" deterministic
  for ranks in 2 4; do
    stage "torch-nvshmem-$ranks" 300 env $env_new $nodes1 OMP_NUM_THREADS=2 \
      python3 -c "$(frozen_check "$ranks")"
  done
  stage cuda-sums 300 env $env_new ODC_TRANSPORT=cuda python3 "$check" sums 2 bfloat16 6
}

# Deterministic mode (the pulled scheme) and the default scheme, two ranks on one GPU, over the
# CUDA transport and over NVSHMEM (two pretended one-rank nodes): exact integer sums with random
# delays, and bitwise-identical non-integer sums across two runs with different delays. Then a
# collective mismatch in the device barrier, named on both ranks, on CUDA and NVSHMEM.
stage_deterministic() {
  local env_new
  env_new=$(libs "$snapshot")
  local check='
import odc, test_cuda_comm as suite
for deterministic in (True, False):
    done = odc.launch(suite._minibatch_rank, 2, 12, 65537, "bfloat16", True, deterministic,
                      timeout=300)
    assert done == [12, 12], done
    print("exact sums, deterministic" if deterministic else "exact sums, default scheme", done)
first = odc.launch(suite._deterministic_rank, 2, 1, 65537, timeout=300)
second = odc.launch(suite._deterministic_rank, 2, 2, 65537, timeout=300)
assert first == second, "deterministic sums differ between runs"
print("deterministic: bitwise identical across runs with different delays")
'
  stage cuda 300 env $env_new python3 -c "$check"
  stage nvshmem-two-nodes 300 env $env_new ODC_TRANSPORT=nvshmem ODC_NVSHMEM_DIRECT=0 \
    ODC_LOCAL_WORLD_SIZE=1 ODC_NVSHMEM_HIERARCHICAL=1 python3 -c "$check"
  # barrier() on one rank, minibatch_begin() on the other: both name the mismatch, on CUDA and
  # on NVSHMEM's device barrier (through NVSHMEM's puts, and over its NVLink mappings).
  local mismatch='
import test_hardening_gpu as t
t.test_device_barrier_mismatch_names_both_collectives()
print("collective mismatch named on both ranks")
'
  stage mismatch-cuda 120 env $env_new python3 -c "$mismatch"
  stage mismatch-nvshmem-two-nodes 120 env $env_new ODC_TRANSPORT=nvshmem ODC_NVSHMEM_DIRECT=0 \
    ODC_LOCAL_WORLD_SIZE=1 python3 -c "$mismatch"
  stage mismatch-nvshmem-direct 120 env $env_new ODC_TRANSPORT=nvshmem ODC_NVSHMEM_DIRECT=1 \
    python3 -c "$mismatch"
}

# GPU memory per process (as the driver counts it) of one deterministic accumulator.
stage_deterministic_memory() {
  local env_new
  env_new=$(libs "$snapshot")
  stage memory 300 env $env_new python3 "$here/deterministic_memory.py" 256
}

# The CUDA transport's data paths, --old against the snapshot, two ranks sharing one GPU,
# alternated three times each: a same-basis ratio, not a bandwidth figure.
stage_cuda_timing() {
  need_old cuda-timing || { status=1; return; }
  local round build env_build
  for round in 1 2 3; do
    for build in old new; do
      if [ "$build" = old ]; then env_build=$(libs "$old"); else env_build=$(libs "$snapshot"); fi
      stage "$build-$round" 300 env $env_build python3 "$here/cuda_transport_timing.py" "$build"
    done
  done
}

# odc_bench on the CUDA transport, --old and the snapshot alternated BENCH_ROUNDS times (one
# process per GPU), sizes BENCH_MIN_MIB..BENCH_MAX_MIB, BENCH_ORDER "old new" or "new old".
stage_bench_before_after() {
  need_old bench-before-after || { status=1; return; }
  local round build dir
  for round in $(seq "${BENCH_ROUNDS:-2}"); do
    for build in ${BENCH_ORDER:-old new}; do
      if [ "$build" = old ]; then build_dirs "$old"; else build_dirs "$snapshot"; fi
      dir=$lib_dir
      stage "$build-$round" 280 bash -c "LD_LIBRARY_PATH=$dir:\$LD_LIBRARY_PATH $dir/odc_bench \
        ${BENCH_MIN_MIB:-1} ${BENCH_MAX_MIB:-256} > $out/bench_${build}_${round}.txt 2>&1"
    done
  done
}

# Issue #47's byte movers, before/after on one machine: odc_bench on the CUDA transport with every
# GPU and (with more than 2) with 2, then over NVSHMEM with every rank its own pretended node, for
# --old (when given) and the snapshot, alternated BENCH_ROUNDS times (default 2) in BENCH_ORDER;
# sizes BENCH_MIN_MIB..BENCH_MAX_MIB (default 1..1024; NVSHMEM up to 256). One file per run in
# $out/byte_movers/ (the tables carry both sides' share of the links).
stage_byte_movers() {
  local dest="$out/byte_movers" round build dir gpus builds max=${BENCH_MAX_MIB:-1024}
  mkdir -p "$dest"
  gpus=$(nvidia-smi -L | wc -l)
  builds="new"
  [ -n "$old" ] && builds=${BENCH_ORDER:-old new}
  for round in $(seq "${BENCH_ROUNDS:-2}"); do
    for build in $builds; do
      if [ "$build" = old ]; then build_dirs "$old"; else build_dirs "$snapshot"; fi
      dir=$lib_dir
      stage "cuda-$build-$round" 150 bash -c "LD_LIBRARY_PATH=$dir:\$LD_LIBRARY_PATH \
        $dir/odc_bench ${BENCH_MIN_MIB:-1} $max > $dest/cuda_${gpus}gpus_${build}_$round.txt 2>&1"
      [ "$gpus" -gt 2 ] && stage "cuda-2gpus-$build-$round" 150 bash -c \
        "LD_LIBRARY_PATH=$dir:\$LD_LIBRARY_PATH $dir/odc_bench ${BENCH_MIN_MIB:-1} $max 2 \
        > $dest/cuda_2gpus_${build}_$round.txt 2>&1"
      stage "nvshmem-$build-$round" 150 bash -c "LD_LIBRARY_PATH=$dir:\$LD_LIBRARY_PATH \
        ODC_NVSHMEM_PLUGIN=$dir/libodc_nvshmem.so ODC_LOCAL_WORLD_SIZE=1 $dir/odc_bench \
        --transport nvshmem ${BENCH_MIN_MIB:-1} $((max < 256 ? max : 256)) \
        > $dest/nvshmem_${gpus}nodes_${build}_$round.txt 2>&1"
    done
  done
}

# python -m odc.fit on a Qwen2-1.5B-shaped model (random weights) up to 32K-token microbatches,
# with and without gradient checkpointing; each --cost through the planner and beside
# docs/planner.md's 1.5b row.
stage_fit() {
  local env_new config=data/configs/qwen2_1_5b.json
  env_new=$(libs "$snapshot")
  local fit=(python3 -m odc.fit "$config" --max-tokens 32768 --dtype bfloat16 --device cuda
    --repeats 3)
  stage fit-1.5b-gc 300 env $env_new "${fit[@]}" --gradient-checkpointing \
    --json "$out/fit_1_5b_gc.json"
  stage fit-1.5b-no-gc 300 env $env_new "${fit[@]}" --no-gradient-checkpointing \
    --json "$out/fit_1_5b_no_gc.json"
  stage plan-and-compare 120 env $env_new python3 "$here/summarize_runs.py" fit "$out"
}

# odc.torch's FSDP2-migration behaviour with CUDA models (2 ranks sharing a GPU), failure and
# recovery, the default collectives check's cost on NCCL; then the fit stage (SKIP_FIT=1: not).
stage_torch_migration() {
  local env_new name
  env_new=$(libs "$snapshot")
  for name in migration failure check-cost; do
    stage "$name" 240 env $env_new python3 "$here/torch_migration_check.py" "$name"
  done
  [ "${SKIP_FIT:-0}" = 1 ] || stage_fit
}

# odc.torch with frozen, unused and adapter parameters (2 and 4 ranks, an HSDP mesh 2 x 2) and a
# failing minibatch, several ranks per GPU (gloo for FSDP2's few collectives); an aborting rank.
stage_torch_frozen() {
  local env_new ranks
  env_new=$(libs "$snapshot")
  for ranks in 2 4; do
    stage "frozen-$ranks-ranks" 240 env $env_new OMP_NUM_THREADS=2 \
      python3 -c "$(frozen_check "$ranks")"
  done
  stage frozen-hsdp-2x2 240 env $env_new OMP_NUM_THREADS=2 python3 -c "$(frozen_check 4 "2, 2")"
  stage failure-on-gpu 240 env $env_new OMP_NUM_THREADS=2 python3 -c "
import os, tempfile, odc
from test_torch_fsdp2_frozen import _failure_rank
with tempfile.TemporaryDirectory() as d:
    results = odc.launch(_failure_rank, 2, os.path.join(d, 'store'), 'cuda', 20, timeout=200)
for rank, (seen, _) in enumerate(results):
    print('rank', rank, {k: v for k, v in seen.items()})"
  stage abort-cuda 200 env $env_new python3 -c "
import time, odc, test_cuda_comm as suite
start = time.monotonic()
suite.test_aborting_rank_ends_peers_device_waits_at_once()
print(f'aborting rank named by its peer\'s device barrier in {time.monotonic() - start:.1f} s')"
}

# odc.torch.split on GPUs: a sample split over the planner's group gives the whole sample's loss
# and gradients (tests/gpu/test_train_split_gpu.py, run without the 2-GPU gate: with one GPU its
# 2 ranks share it and K/V go through odc sub-communicators over the CUDA transport; with 2+ GPUs
# through NCCL subgroups too), then the CPU suite of odc.torch.split on this machine.
stage_torch_split() {
  local env_new
  env_new=$(libs "$snapshot")
  build_dirs "$snapshot"  # src_dir here (libs ran in a subshell)
  stage split-gpu 480 env $env_new python3 -m pytest -q -p no:cacheprovider --noconftest \
    "$src_dir/tests/gpu/test_train_split_gpu.py"
  stage split-cpu 300 env $env_new python3 -m pytest -q -p no:cacheprovider \
    "$src_dir/tests/python/test_torch_split.py"
}

# The GPU test suite (tests/gpu, 2+ GPUs; tests/gpu/README.md), then the C++ CUDA smoke test.
stage_gpu_suite() {
  local env_new
  env_new=$(libs "$snapshot")
  build_dirs "$snapshot"  # lib_dir and src_dir here too (libs ran in a subshell)
  stage pytest-gpu 900 env $env_new python3 -m pytest -rs -q "$src_dir/tests/gpu"
  [ -x "$lib_dir/odc_cuda_smoke" ] && stage cuda-smoke 120 "$lib_dir/odc_cuda_smoke"
}
# The same suite in six shards, each to fit one device call with room to spare (a 300 s limit
# each; tests/gpu/README.md lists them): 1 the CUDA transport and its hardening, 2-5 NVSHMEM by
# data path (its calls, direct loads and stores, pretended nodes of two, nodes of one with the
# node tests), 6 odc.torch and odc.train on GPUs and odc_cuda_smoke. Together they run what
# gpu-suite runs. On 2 x H200 the whole NVSHMEM file took over 300 s (2026-11-29).
gpu_suite_shard() {  # gpu_suite_shard NAME PYTEST_K_EXPRESSION FILE... ("" selects every test)
  local name=$1 select=$2 env_new
  shift 2
  env_new=$(libs "$snapshot")
  build_dirs "$snapshot"
  stage "$name" 300 env $env_new python3 -m pytest -rs -q ${select:+-k "$select"} \
    "${@/#/$src_dir/tests/gpu/}"
}
stage_gpu_suite_1() {
  gpu_suite_shard pytest-gpu-1 "" test_cuda_comm.py test_hardening_gpu.py test_work_board_gpu.py
}
# The NVSHMEM fixture's parameter names the data path ([api], [direct-...], [nodes2], [nodes1]).
stage_gpu_suite_2() { gpu_suite_shard pytest-gpu-2 "api" test_nvshmem_comm.py; }
stage_gpu_suite_3() { gpu_suite_shard pytest-gpu-3 "direct" test_nvshmem_comm.py; }
stage_gpu_suite_4() { gpu_suite_shard pytest-gpu-4 "nodes2" test_nvshmem_comm.py; }
stage_gpu_suite_5() {
  gpu_suite_shard pytest-gpu-5 "not api and not direct and not nodes2" test_nvshmem_comm.py
}
stage_gpu_suite_6() {
  gpu_suite_shard pytest-gpu-6 "" test_torch_gpu.py test_torch_hybrid_gpu.py test_train_gpu.py \
    test_train_split_gpu.py
  [ -x "$lib_dir/odc_cuda_smoke" ] && stage cuda-smoke 120 "$lib_dir/odc_cuda_smoke"
}

# train: odc.train on 4 GPUs under torchrun, 1.5b preset, 4 samples per rank, the 1.5b cost fit
# given (docs/benchmarks-archive.md, issue #7), no timeline file; each stage adds its data and runs.
train_1_5b() {
  train=(python3 -m torch.distributed.run --standalone --nproc_per_node 4 -m odc.train
    --preset 1.5b --samples-per-rank 4 --cost "3.123e-05,1.187e-09,0.07082"
    --lengths data/longalign_like.txt --timeline "" "$@")
}

# Where ODC's minibatch tail goes on balanced data: collective + lb-micro, odc + lb-mini with
# all SMs and with ODC_CUDA_SMS=32, each run's tail phases printed.
stage_balanced_tail() {
  local env_new dest="$out/balanced_tail"
  env_new=$(libs "$snapshot")
  mkdir -p "$dest"
  local train
  train_1_5b --constant-length 8192 --steps 4
  stage collective 120 env $env_new "${train[@]}" --comm collective --policy lb-micro \
    --output "$dest/collective.json"
  stage odc-all-sms 120 env $env_new "${train[@]}" --comm odc --policy lb-mini \
    --output "$dest/odc_all.json"
  stage odc-32-sms 120 env $env_new ODC_CUDA_SMS=32 "${train[@]}" --comm odc --policy lb-mini \
    --output "$dest/odc_32.json"
  stage tails 60 python3 "$here/summarize_runs.py" tails "$dest"
}

# Where a microbatch's time goes (issue #42): FSDP2 against OdcFSDP on the 1.5b preset, 2 ranks,
# at 512, 2K, 8K and 32K tokens: wall, host and GPU busy time of one microbatch, then the same at
# 512 tokens with the host profile of each arm (HOST_FLOOR_PRESET overrides the preset); then
# odc.train --compare on 2 GPUs with compiled blocks (the default) and with --no-compile: the cost
# fit's floor ("fitted cost: max(FLOOR, ...)") and the step times, after and before.
stage_host_floor() {
  local env_new dest="$out/host_floor"
  mkdir -p "$dest"
  env_new=$(libs "$snapshot")
  stage host-floor 900 env $env_new python3 "$here/host_floor.py" \
    --preset "${HOST_FLOOR_PRESET:-1.5b}" --compile both
  stage host-floor-profile 600 env $env_new python3 "$here/host_floor.py" \
    --preset "${HOST_FLOOR_PRESET:-1.5b}" --tokens 512 --compile both --profile
  local compare=(python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m odc.train
    --preset "${HOST_FLOOR_PRESET:-1.5b}" --samples-per-rank 4 --lengths data/longalign_like.txt
    --max-length 16384 --steps 3 --timeline "" --compare)
  stage host-floor-train-compiled 600 env $env_new "${compare[@]}" --output "$dest/compiled.json"
  stage host-floor-train-eager 600 env $env_new "${compare[@]}" --no-compile \
    --output "$dest/eager.json"
}

# Why a short microbatch costs ODC more: one 1,024-token sample per rank per minibatch,
# collective against ODC (--compare), then ODC with all SMs against odc.train's 32.
stage_small_microbatch() {
  local env_new dest="$out/small"
  env_new=$(libs "$snapshot")
  mkdir -p "$dest"
  local train
  train_1_5b --constant-length 1024 --steps 6  # the later --samples-per-rank 1 wins
  stage compare 150 env $env_new OMP_NUM_THREADS=4 "${train[@]}" --samples-per-rank 1 --compare \
    --output "$dest/compare.json"
  stage odc-all-sms 100 env $env_new OMP_NUM_THREADS=4 ODC_CUDA_SMS=132 "${train[@]}" \
    --samples-per-rank 1 --comm odc --policy lb-mini --output "$dest/odc_all_sms.json"
  stage spans 60 python3 "$here/summarize_runs.py" spans "$dest"
}

# Does the SM budget of odc's data kernels (ODC_CUDA_SMS) cost or win training speed: odc_bench
# 16..256 MiB with all SMs, 32 and 16; odc.train balanced, collective and odc at each budget,
# twice each, interleaved (drift shows as the two collective runs differing).
stage_sm_budget() {
  local env_new dest="$out/sm_budget" round sms begin=$SECONDS
  local budget=${SM_BUDGET_SECONDS:-540}
  env_new=$(libs "$snapshot")
  build_dirs "$snapshot"  # lib_dir here too (libs ran in a subshell)
  mkdir -p "$dest"
  stage "odc_bench sms=all" 45 env $env_new "$lib_dir/odc_bench" --transport cuda 16 256 4
  for sms in 32 16; do
    stage "odc_bench sms=$sms" 45 env $env_new ODC_CUDA_SMS=$sms "$lib_dir/odc_bench" \
      --transport cuda 16 256 4
  done
  local train
  train_1_5b --constant-length 8192 --steps 4
  for round in 1 2; do
    [ $((SECONDS - begin)) -lt "$budget" ] || { echo "sm-budget: time budget spent" >>"$log"; break; }
    stage "collective-$round" 60 env $env_new "${train[@]}" --comm collective --policy lb-micro \
      --output "$dest/collective_$round.json"
    for sms in all 32 16; do
      local knob=""
      [ "$sms" = all ] || knob="ODC_CUDA_SMS=$sms"
      stage "odc-sms-$sms-$round" 60 env $env_new $knob "${train[@]}" --comm odc \
        --policy lb-mini --output "$dest/odc_${sms}_$round.json"
    done
  done
  stage table 60 python3 "$here/summarize_runs.py" sm-budget "$dest"
}

# torchrun over every GPU of the machine, odc.train; each stage adds its data and arms.
train_all_gpus() {
  train=(python3 -m torch.distributed.run --standalone --nproc_per_node "$(nvidia-smi -L | wc -l)"
    -m odc.train --timeline "" "$@")
}

# odc.train's options for RL_ARMS (see the header), or a message and status 1.
rl_arms() {
  local arms=${RL_ARMS:-baselines}
  case $arms in
    baselines | compare | all) echo "--$arms" ;;
    ?*:?*) echo "--comm ${arms%%:*} --policy ${arms#*:}" ;;
    *) echo "run.sh: RL_ARMS must be baselines, compare, all or COMM:POLICY, not '$arms'" >&2
      return 1 ;;
  esac
}

# Issue #30: GRPO's training phase, ODC + LB-Mini against the four FSDP2 baselines (--baselines;
# RL_ARMS) on every GPU, the cost model fitted on this machine. First a tiny-preset smoke run of
# the same arms (short rollouts: every arm's forward-only and update paths on CUDA), then the 1.5b
# preset on the shipped RL lengths: RL_PROMPTS prompts x 8 responses per RL step (default 4), K =
# RL_K update minibatches (default 2: 4 rollouts per rank per update on 4 GPUs), microbatches up
# to 20,480 tokens (the longest rollout).
stage_rl_baselines() {
  local env_new dest="$out/rl_baselines" train arms
  arms=$(rl_arms) || { status=1; return; }
  env_new=$(libs "$snapshot")
  mkdir -p "$dest"
  echo "rl-baselines: RL_PROMPTS=${RL_PROMPTS:-4} RL_K=${RL_K:-2} arms: $arms" | tee -a "$log"
  # shellcheck disable=SC2086  # $arms: one or more options, split on purpose
  train_all_gpus --task grpo --rollouts data/grpo_math_like.tsv $arms \
    --prompts-per-step "${RL_PROMPTS:-4}"
  [ "${RL_SMOKE:-1}" = 0 ] || stage grpo-smoke-tiny 120 env $env_new "${train[@]}" --preset tiny --length-scale 0.05 \
    --steps 1 --cost 1,0.01,0 --output "$dest/grpo_tiny.json"
  # 590 s: the blocks compile (odc.train's default) in every arm's fresh model, and GRPO's
  # forward-only passes compile their own variants.
  stage grpo-1.5b 590 env $env_new "${train[@]}" --preset 1.5b \
    --minibatches-per-step "${RL_K:-2}" --max-tokens 20480 --steps "${BASELINE_STEPS:-4}" \
    --output "$dest/grpo_1.5b.json"
}

# Issue #30: the same five arms for SFT on LongAlign-like lengths (up to 64K tokens), 1.5b, 4
# samples per rank per minibatch, the cost model fitted on this machine.
stage_sft_baselines() {
  local env_new dest="$out/sft_baselines" train
  env_new=$(libs "$snapshot")
  mkdir -p "$dest"
  train_all_gpus --preset 1.5b --lengths data/longalign_like.txt --max-length 65536 \
    --samples-per-rank 4 --baselines
  stage sft-1.5b 590 env $env_new "${train[@]}" --steps "${BASELINE_STEPS:-4}" \
    --output "$dest/sft_1.5b.json"
}

# Issue #31: odc.train over NVSHMEM on pretended nodes (2 x 2 on 4 GPUs, 2 x 1 on 2), one torchrun
# per arm so each process's driver memory is that arm's: FSDP2, ODC over the CUDA transport, ODC
# over NVSHMEM flat and with the node schemes; the same lb-micro plan, 1.5b, LongAlign-like
# lengths; nvidia-smi per process every 200 ms, odc's byte counters at close (ODC_NVSHMEM_STATS,
# ODC_NODE_STATS). NVTRAIN_7B=1 adds FSDP2 and both NVSHMEM arms on the 7b preset. Then the table.
stage_nvshmem_train() {
  local env_new dest="$out/nvshmem_train" arm script="$here/nvshmem_train.py"
  env_new=$(libs "$snapshot")
  mkdir -p "$dest"
  # NVTRAIN_ARMS: the arms to run, in order (default: the four 1.5b arms, with NVTRAIN_7B=1
  # also fsdp2-7b nvshmem-flat-7b nvshmem-nodes-7b).
  local arms="fsdp2 cuda nvshmem-flat nvshmem-nodes"
  [ "${NVTRAIN_7B:-0}" = 1 ] && arms="$arms fsdp2-7b nvshmem-flat-7b nvshmem-nodes-7b"
  for arm in ${NVTRAIN_ARMS:-$arms}; do
    stage "$arm" "$([[ $arm == *-7b ]] && echo 360 || echo 240)" \
      env $env_new python3 "$script" arm "$arm" "$dest"
  done
  stage table 60 python3 "$script" table "$dest"
}

# Issue #31: what the streamed scheme's pushes cost over NVSHMEM, and where an NVSHMEM process's
# memory goes. odc_bench (one process per GPU) on the CUDA transport, then over NVSHMEM with every
# rank its own pretended node (pushes streamed through the staging rings, folded by the owner's
# device) for each build in NVPROBE_BUILDS (folders of libodc.so and libodc_nvshmem.so; default
# the snapshot); then dev/gpu/nvshmem_memory_probe.py: the driver's count per process after each
# start-up step, on the CUDA transport and over NVSHMEM with two heap sizes (NVSHMEM_INFO=1 on
# the first prints NVSHMEM's knobs and their values).
stage_nvshmem_probe() {
  local env_new dir builds probe="$here/nvshmem_memory_probe.py" gpus
  env_new=$(libs "$snapshot")
  build_dirs "$snapshot"
  builds=${NVPROBE_BUILDS:-$lib_dir}
  gpus=$(nvidia-smi -L | wc -l)
  stage bench-cuda 120 bash -c "LD_LIBRARY_PATH=$lib_dir:\$LD_LIBRARY_PATH $lib_dir/odc_bench \
    --transport cuda 1 256 > $out/probe_bench_cuda.txt 2>&1"
  for dir in $builds; do
    dir=$(cd "$dir" && pwd)
    stage "bench-nvshmem-$(basename "$dir")" 120 bash -c "LD_LIBRARY_PATH=$dir:\$LD_LIBRARY_PATH \
      ODC_NVSHMEM_PLUGIN=$dir/libodc_nvshmem.so ODC_LOCAL_WORLD_SIZE=1 ODC_NVSHMEM_STATS=1 \
      $lib_dir/odc_bench --transport nvshmem 1 256 \
      > $out/probe_bench_nvshmem_$(basename "$dir").txt 2>&1"
  done
  local run=(python3 -m torch.distributed.run --standalone --nproc_per_node "$gpus" "$probe")
  stage memory-cuda 120 env $env_new ODC_TRANSPORT=cuda "${run[@]}" cuda
  stage memory-nvshmem-3.4g 120 env $env_new ODC_TRANSPORT=nvshmem ODC_LOCAL_WORLD_SIZE=1 \
    ODC_NVSHMEM_HEAP_GIB=3.4 NVSHMEM_INFO=1 "${run[@]}" nvshmem-3.4g
  stage memory-nvshmem-1g 120 env $env_new ODC_TRANSPORT=nvshmem ODC_LOCAL_WORLD_SIZE=1 \
    ODC_NVSHMEM_HEAP_GIB=1 "${run[@]}" nvshmem-1g
}

for name in "${chosen[@]}"; do
  log="$out/$name.log"
  header
  echo "##### stage $name -> $log"
  "stage_${name//-/_}"
done
exit $status
