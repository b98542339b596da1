"""Issue #28 on one GPU (several ranks share it: gloo carries the few torch.distributed calls,
odc's CUDA transport the gathers and pushes): the FSDP2-migration checks of
tests/python/test_torch_migration.py and the failure/recovery run of test_torch_fsdp2_frozen.py
with CUDA models, then the cost of the default collectives check on NCCL process groups.
Run from the repository root with tests/python on sys.path (dev/gpu/run.sh torch-migration)."""

import os
import statistics
import sys
import tempfile
import time

import torch

import odc

sys.path.insert(0, os.path.join(os.getcwd(), "tests", "python"))


def migration():
    import test_torch_migration as migration

    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(
            migration._migration_rank, 2, os.path.join(directory, "store"), "cuda", timeout=300
        )
    for rank, found in enumerate(results):
        shown = {k: v for k, v in found.items() if k not in ("clip", "read", "collective")}
        print(f"rank {rank}: {shown}")
        print(f"  clip inside: {found['clip'][:110]}...")
        print(f"  collective: {found['collective'][:110]}...")
    migration.check_migration(results, tolerance=1e-5)
    print("migration checks on CUDA: passed")


def failure_and_recovery():
    import test_torch_fsdp2_frozen as frozen

    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(
            frozen._failure_rank, 2, os.path.join(directory, "store"), "cuda", 60, timeout=400
        )
    for rank, (seen, _) in enumerate(results):
        # On GPUs a peer learns of the failure at its next step (check_minibatch), not in
        # minibatch_end: only the failing rank has "failure".
        print(
            f"rank {rank}: outside-minibatch loss {seen['outside']:.6f}, carried grads "
            f"{seen['carried']}, failure: {seen.get('failure', '-')[:90]}, step: "
            f"{seen.get('step', '-')[:90]}"
        )
        assert seen["outside"] > 0 and seen["carried"] > 0 and seen["eval_grads"] == 0
    print("failure, recovery, forward outside and carried sums on CUDA: passed")


def _check_cost_rank(rank, world, key, store_path):
    """NCCL on one GPU, one rank per group: sequence numbers move with NCCL collectives, and
    what the default check costs per minibatch (two reads of every group)."""
    import torch.distributed as dist

    from odc.torch import debug

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store_path}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    groups = [dist.new_group([0]) for _ in range(3)]  # a mesh's few groups
    before = debug._sequence_numbers()
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    dist.all_reduce(x, group=groups[1])
    torch.cuda.synchronize()
    after = debug._sequence_numbers()
    moved = {k: after[k][1] - before[k][1] for k in after if k in before}
    guard = debug.CollectiveGuard("check")
    samples = []
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(1000):
            guard.start()
            guard.check()
        samples.append((time.perf_counter() - start) / 1000 * 1e6)
    dist.destroy_process_group()
    return len(after), sorted(moved.values()), samples


def check_cost():
    with tempfile.TemporaryDirectory() as directory:
        ((groups, moved, samples),) = odc.launch(
            _check_cost_rank, 1, os.path.join(directory, "store"), timeout=120
        )
    print(
        f"NCCL: {groups} process groups; sequence numbers moved by {moved} after one "
        "all_reduce on the default group and one on a subgroup"
    )
    print(
        f"default check, per minibatch (start + check): median "
        f"{statistics.median(samples):.2f} us, min {min(samples):.2f}, max {max(samples):.2f} "
        f"(20 x 1000)"
    )
    assert moved.count(1) == 2, moved


if __name__ == "__main__":
    stage = sys.argv[1]
    {"migration": migration, "failure": failure_and_recovery, "check-cost": check_cost}[stage]()
