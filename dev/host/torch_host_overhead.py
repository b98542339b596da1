"""Host time per microbatch of odc.torch (OdcFSDP) against plain FSDP2, on the CPU (issue #42
item 1): the benchmark model's layer count with a tiny width, so that the model's own arithmetic
is small and what remains is the host's per-layer work (FSDP2's hooks, odc's hooks and calls,
autograd). 2 ranks over gloo (FSDP2) and the host transport (odc), bf16 parameters with fp32
reduction as odc.train runs them, activation checkpointing off. Per arm: the median and the
spread of one microbatch's forward + backward over the repeats (the minibatch's begin and end
are timed apart, once per minibatch), and with --profile the functions that took the most time
inside odc.torch and FSDP2, from cProfile on rank 0.

On a CPU the collectives of FSDP2 (gloo) are host time too, so the absolute numbers are not a
GPU's; the difference between the arms and the profile of odc's own hooks are what this shows.

  python dev/host/torch_host_overhead.py [--layers 28] [--tokens 64] [--microbatches 8]
      [--minibatches 4] [--profile] [--arms fsdp2,odc]
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch

import odc


def _build(layers: int, seed: int = 0):
    """odc.train's model (build_model) with the tiny preset's width and `layers` layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from odc.train import model as train_model

    train_model._register_attention()
    shape = dict(train_model.PRESETS["tiny"], num_hidden_layers=layers)
    config = Qwen2Config(**shape, max_position_embeddings=4096, rope_theta=1_000_000.0)
    torch.manual_seed(seed)
    lm = Qwen2ForCausalLM._from_config(config, attn_implementation=train_model.ATTENTION_NAME)
    return train_model.PackedCausalLM(lm)


def _rank(rank, world_size, key, store, arm, layers, tokens, microbatches, minibatches, profile):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import odc.torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        model = _build(layers)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        engine = None
        if arm == "odc":
            engine = odc.torch.OdcFSDP(
                model, odc.Comm(rank, world_size, key, timeout=120), optimizer
            )
        generator = torch.Generator().manual_seed(rank)
        vocab = model.config.vocab_size

        positions = torch.arange(tokens)
        boundaries = torch.tensor([0, tokens], dtype=torch.int32)

        def microbatch():
            ids = torch.randint(0, vocab, (tokens,), generator=generator)
            loss_sum = model(ids, positions, torch.roll(ids, -1), boundaries, tokens)
            (loss_sum / (tokens * microbatches)).backward()

        def run_minibatch(times, ends):
            started = time.perf_counter()
            if engine is not None:
                engine.minibatch_begin()
            else:
                model.set_requires_gradient_sync(False)
            begun = time.perf_counter()
            for index in range(microbatches):
                if engine is None and index == microbatches - 1:
                    model.set_requires_gradient_sync(True)
                one = time.perf_counter()
                microbatch()
                times.append(time.perf_counter() - one)
            before_end = time.perf_counter()
            if engine is not None:
                engine.minibatch_end()
            ends.append((begun - started) + (time.perf_counter() - before_end))
            optimizer.step()
            optimizer.zero_grad()

        run_minibatch([], [])  # warm-up: lazy initialization, first allocations
        times, ends = [], []
        profiler = cProfile.Profile() if profile and rank == 0 else None
        if profiler is not None:
            profiler.enable()
        for _ in range(minibatches):
            run_minibatch(times, ends)
        if profiler is not None:
            profiler.disable()
            text = tempfile.NamedTemporaryFile("w+", suffix=".txt", delete=False)
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(25)
            text.flush()
            profile_path = text.name
        else:
            profile_path = None
        return times, ends, profile_path
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--arms", default="fsdp2,odc")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    for arm in arms:
        if arm not in ("fsdp2", "odc"):
            parser.error(f"--arms: unknown arm '{arm}' (fsdp2, odc)")
    print(
        f"host time per microbatch, {args.layers} layers of the tiny width, {args.tokens} tokens, "
        f"{args.microbatches} microbatches x {args.minibatches} minibatches, 2 ranks, CPU "
        f"({os.cpu_count()} cores)"
    )
    print(f"{'arm':6} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'begin+end ms':>13}")
    results = {}
    for arm in arms:
        with tempfile.TemporaryDirectory() as folder:
            out = odc.launch(
                _rank,
                2,
                os.path.join(folder, "store"),
                arm,
                args.layers,
                args.tokens,
                args.microbatches,
                args.minibatches,
                args.profile,
                timeout=1200,
            )
        times = sorted(t * 1e3 for rank_times, _, _ in out for t in rank_times)
        ends = [e * 1e3 for _, rank_ends, _ in out for e in rank_ends]
        deciles = statistics.quantiles(times, n=10)
        results[arm] = statistics.median(times)
        print(
            f"{arm:6} {results[arm]:10.2f} {deciles[0]:8.2f} {deciles[-1]:8.2f} "
            f"{statistics.median(ends):13.2f}"
        )
        if out[0][2] is not None:
            with open(out[0][2]) as profile_text:
                print(f"--- {arm}, rank 0, cProfile by own time:")
                sys.stdout.write(profile_text.read())
            os.unlink(out[0][2])
    if "fsdp2" in results and "odc" in results:
        print(f"odc / fsdp2 per microbatch: {results['odc'] / results['fsdp2']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
