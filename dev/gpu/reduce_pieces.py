"""Host time of the pieces of FSDP2's foreach_reduce, one at a time, on one GPU (issue #42): the
1.5b preset's block parameter shapes (12 tensors), 2 ranks' layout. Per piece: microseconds of host
time per call (median of 200, the device synchronized before each batch of 20), so that the
~1 ms per parameter group measured inside odc's per-microbatch reduce can be split into what
each step costs here: the copy-in (torch.ops.fsdp.chunk_cat) bf16 into float32 and bf16 into
bf16, an allocation, a fill, one as_strided view per parameter, a stream switch and event.

  python dev/gpu/reduce_pieces.py
"""

import statistics
import sys
import time

import torch


def shapes_1_5b():
    hidden, inter, heads_kv, head = 1536, 8960, 2, 128
    kv = heads_kv * head
    return [
        (hidden, hidden), (hidden,), (kv, hidden), (kv,), (kv, hidden), (kv,), (hidden, hidden),
        (inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,),
    ]  # fmt: skip


def per_call_us(function, calls=20, batches=10):
    samples = []
    for _ in range(batches):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            function()
        samples.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(samples), min(samples)


def main() -> int:
    if not torch.cuda.is_available():
        print("reduce_pieces.py needs a GPU", file=sys.stderr)
        return 1
    import importlib

    importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")  # fsdp ops

    device = torch.device("cuda", 0)
    world = 2
    grads = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes_1_5b()]
    numel = sum(g.numel() for g in grads)
    out32 = torch.empty(numel, device=device, dtype=torch.float32)
    out16 = torch.empty(numel, device=device, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    pieces = {
        "chunk_cat bf16 -> float32": lambda: torch.ops.fsdp.chunk_cat(
            grads, dim=0, num_chunks=world, out=out32.view(world, -1)
        ),
        "chunk_cat bf16 -> bf16": lambda: torch.ops.fsdp.chunk_cat(
            grads, dim=0, num_chunks=world, out=out16.view(world, -1)
        ),
        "empty (float32, group size)": lambda: torch.empty(numel, device=device),
        "zero_ (a shard)": lambda: out32[: numel // world].zero_(),
        "12 as_strided views": lambda: [
            torch.as_strided(out32, (g.numel() // world,), (1,), 0) for g in grads
        ],
        "stream switch + record_event": lambda: (
            stream.wait_stream(torch.cuda.current_stream()),
            stream.record_event(),
        ),
        "empty kernel launch (zero_ of 1 element)": lambda: out32[:1].zero_(),
    }
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; host us per call, "
          "median (min) of 10 batches of 20")  # fmt: skip
    for name, function in pieces.items():
        function()
        median, least = per_call_us(function)
        print(f"  {name:42s} {median:8.1f} ({least:7.1f})")
    from torch.profiler import ProfilerActivity, profile

    for name in ("chunk_cat bf16 -> float32", "chunk_cat bf16 -> bf16"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            pieces[name]()
            torch.cuda.synchronize()
        runtime = [e.name for e in prof.events() if e.name.startswith(("cuda", "cu"))]
        print(f"  {name}: runtime calls {len(runtime)}: {sorted(set(runtime))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
