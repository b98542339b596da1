"""The streamed scheme on a device transport (NVSHMEM; issue #27), with several ranks on the GPUs
there are (one is enough: correctness, memory per process and bytes, no timings). Each check is a
subcommand; the transport and libraries come from the environment (ODC_TRANSPORT,
ODC_LIBRARY, ODC_NVSHMEM_PLUGIN, ODC_LOCAL_WORLD_SIZE, ODC_STAGING_BYTES), so the shell script
that drives it (dev/gpu/run.sh streamed) runs the same check on old and new libraries.
  memory WORLD SHARD_MIB   GPU memory per process (nvidia-smi) with a bf16 tensor to push, and
                           after one accumulator and one minibatch that pushes it (NVSHMEM maps
                           its heap in large steps: compare old and new libraries at the same
                           point, and odc's own count of what it allocated)
  sums WORLD DTYPE N       N minibatches of uneven pushes with host and device delays: exact
                           sums after every minibatch; prints the streamed flow-control counters
  inside WORLD             alloc, barrier and free inside minibatches while pushes stream
  dies                     rank 1 is killed mid-minibatch: rank 0's minibatch_end times out
                           naming it (2 s timeout), no hang
  deterministic            the pulled scheme: bitwise-identical sums across runs with different
                           delays
"""

import os
import random
import signal
import subprocess
import sys
import time

import odc


def _used_mib(pid):
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if fields and fields[0] == str(pid):
            return int(fields[1])
    return -1


def _memory_rank(rank, world_size, key, shard_mib):
    import torch

    gpu = rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    count = shard_mib * (1 << 20) // 4
    with odc.Comm(rank, world_size, key, timeout=120, device=gpu) as comm:
        comm.barrier()
        torch.cuda.synchronize()
        before = _used_mib(os.getpid())
        src = torch.ones(world_size * count, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        with_source = _used_mib(os.getpid())  # the pushed tensor is the caller's, not odc's
        accumulator = comm.alloc(count, accumulator=True)
        comm.minibatch_begin()
        comm.scatter_accumulate(src, accumulator)
        comm.minibatch_end()
        torch.cuda.synchronize()
        after = _used_mib(os.getpid())
        ok = bool(torch.all(accumulator.tensor() == world_size).item())
        scheme = comm.memory_bytes()
        comm.barrier()
        torch.cuda.synchronize()
        del accumulator, src
    return before, with_source, after, ok, scheme


def _sums_rank(rank, world_size, key, dtype_name, num_minibatches, count):
    import torch

    gpu = rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    rng = random.Random(rank)
    dtype = torch.float32 if dtype_name == "float32" else torch.bfloat16
    with odc.Comm(rank, world_size, key, timeout=120, device=gpu) as comm:
        first = comm.alloc(count, accumulator=True)
        second = comm.alloc(count // 3 + 1, accumulator=True)  # chunks of two accumulators mix
        accs = [first, second]
        for minibatch in range(num_minibatches):
            comm.minibatch_begin()
            want = [torch.zeros(world_size * a.tensor().numel(), device="cuda") for a in accs]
            for sender in range(world_size):
                for call in range((minibatch + sender * 2) % 4):
                    for i, acc in enumerate(accs):
                        n = world_size * acc.tensor().numel()
                        index = torch.arange(n, device="cuda")
                        part = ((minibatch * 7 + sender * 3 + call * 5 + i + index) % 17).float()
                        want[i] += part
                        if sender == rank:
                            if rng.random() < 0.5:
                                time.sleep(rng.uniform(0, 0.002))  # host-side skew
                                torch.cuda._sleep(rng.randint(0, 200_000))  # device-side skew
                            comm.scatter_accumulate(part.to(dtype), acc)
            comm.minibatch_end()
            for i, acc in enumerate(accs):
                got = torch.empty(world_size * acc.tensor().numel(), device="cuda")
                comm.gather(got, acc)
                if not torch.equal(got, want[i]):
                    bad = (got != want[i]).nonzero()[0].item()
                    raise AssertionError(
                        f"rank {rank} minibatch {minibatch} accumulator {i} element {bad}: "
                        f"{got[bad].item()} != {want[i][bad].item()}"
                    )
            comm.barrier()
        torch.cuda.synchronize()
        stats = comm.stream_stats()
        scheme = comm.memory_bytes()
    return num_minibatches, stats, scheme


def _inside_rank(rank, world_size, key, num_minibatches):
    """Collectives inside a minibatch while pushes stream: an accumulator allocated and another
    freed mid-minibatch, and a barrier, between uneven pushes (the meeting before each)."""
    import torch

    gpu = rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    count = 200_003
    with odc.Comm(rank, world_size, key, timeout=120, device=gpu) as comm:
        kept = comm.alloc(count, accumulator=True)
        for minibatch in range(num_minibatches):
            comm.minibatch_begin()
            for _ in range(1 + (rank + minibatch) % 3):
                comm.scatter_accumulate(torch.ones(world_size * count, device="cuda"), kept)
            late = comm.alloc(count, accumulator=True)  # allocated inside the minibatch
            comm.scatter_accumulate(torch.full((world_size * count,), 2.0, device="cuda"), late)
            comm.barrier()
            comm.scatter_accumulate(torch.ones(world_size * count, device="cuda"), kept)
            comm.minibatch_end()
            late_sum = torch.empty(world_size * count, device="cuda")
            comm.gather(late_sum, late)
            want_kept = float(sum(2 + (r + minibatch) % 3 for r in range(world_size)))
            got_kept = torch.empty(world_size * count, device="cuda")
            comm.gather(got_kept, kept)
            if not torch.all(got_kept == want_kept) or not torch.all(late_sum == 2.0 * world_size):
                raise AssertionError(f"rank {rank} minibatch {minibatch}: wrong sums")
            comm.barrier()
            late.free()
        torch.cuda.synchronize()
    return num_minibatches


def _dies_rank(rank, world_size, key):
    import torch

    gpu = rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    with odc.Comm(rank, world_size, key, timeout=2.0, device=gpu) as comm:
        accumulator = comm.alloc(1 << 20, accumulator=True)
        comm.minibatch_begin()
        torch.cuda.synchronize()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-minibatch, before pushing
        comm.scatter_accumulate(torch.ones(world_size << 20, device="cuda"), accumulator)
        started = time.monotonic()
        try:
            comm.minibatch_end()
            torch.cuda.synchronize()
            comm.barrier()
        except odc.Error as error:
            return error.code, str(error), time.monotonic() - started
    return None


def main():
    what = sys.argv[1]
    if what == "memory":
        world, shard_mib = int(sys.argv[2]), int(sys.argv[3])
        for rank, (before, with_source, after, ok, scheme) in enumerate(
            odc.launch(_memory_rank, world, shard_mib, timeout=300)
        ):
            print(
                f"memory: world {world}, rank {rank}, shard {shard_mib} MiB: {before} MiB before, "
                f"{with_source} with the pushed tensor, {after} after alloc + one minibatch "
                f"(process total); sums exact: {ok}; odc's own count: "
                f"{scheme['buffers'] / 2**20:.0f} MiB shards + {scheme['scheme'] / 2**20:.1f} MiB "
                f"scheme = {scheme['scheme'] / (shard_mib << 20):.2f} x shard"
            )
    elif what == "sums":
        world, dtype_name, n = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
        count = int(sys.argv[5]) if len(sys.argv) > 5 else 65537
        for rank, (done, stats, scheme) in enumerate(
            odc.launch(_sums_rank, world, dtype_name, n, count, timeout=600)
        ):
            assert done == n, done
            print(
                f"sums: world {world} {dtype_name}, rank {rank}: {done} minibatches exact; "
                f"{stats}; {scheme}"
            )
    elif what == "inside":
        world = int(sys.argv[2])
        done = odc.launch(_inside_rank, world, 4, timeout=300)
        assert done == [4] * world, done
        print(f"inside: world {world}: alloc, barrier and free inside minibatches, sums exact")
    elif what == "dies":
        try:
            odc.launch(_dies_rank, 2, timeout=120)
            raise AssertionError("rank 1 was killed, yet the launch succeeded")
        except odc.LaunchError as error:
            code, message, seconds = error.results[0]
            print(f"dies: rank 0 after {seconds:.1f} s: code {code}: {message}")
            assert code == odc._capi.TIMEOUT and "waited for rank 1" in message, message
    elif what == "deterministic":
        import test_cuda_comm as suite  # tests/gpu on PYTHONPATH

        first = odc.launch(suite._deterministic_rank, 2, 1, 65537, timeout=300)
        second = odc.launch(suite._deterministic_rank, 2, 2, 65537, timeout=300)
        assert first == second, "deterministic sums differ between runs"
        print("deterministic: bitwise identical across runs with different delays")
    else:
        raise SystemExit(f"unknown check {what}")


if __name__ == "__main__":
    main()
