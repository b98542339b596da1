"""Issue #44 item 4 on one GPU: what OdcFSDP.offload() frees and that training goes on after
reload(). Two ranks share GPU 0 (gloo carries the few torch.distributed calls, odc's CUDA
transport the gathers and pushes); a 4-block tiny LM (about 12.6M parameters, fp32, AdamW).

Per rank it prints torch.cuda.memory_allocated() (torch's allocator: odc's buffers are not in
it, FSDP2's shards are while offloaded), torch.cuda.mem_get_info() (the whole device, both ranks)
and engine.memory_bytes()["total"] at four points: before offload(), after it, after
model.to("cpu") (what verl's param_offload then moves; FSDP2's shards leave the GPU) and after
model.to("cuda") + reload(). Both ranks reach each point together (a barrier) before measuring.
Then it checks that training across offload/reload ends with the same parameters, bit for bit,
as training without (deterministic sums), and exits 1 if not.

Run from the repository root with odc's CUDA build (dev/gpu/run.sh's environment):
    python3 dev/gpu/offload_memory.py            # GPU 0, 2 ranks
    python3 dev/gpu/offload_memory.py --cpu      # the same flow on the CPU (host transport)
"""

import os
import sys
import tempfile

import torch

import odc

sys.path.insert(0, os.path.join(os.getcwd(), "tests", "python"))

MIB = 1 << 20
DIM, HIDDEN, LAYERS = 512, 2048, 4


def _measure(engine, device):
    import torch.distributed as dist

    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
    else:
        free = total = allocated = 0
    dist.barrier()  # no rank moves on before every rank measured
    return dict(
        allocated_mib=allocated / MIB,
        device_used_mib=(total - free) / MIB,
        odc_mib=engine.memory_bytes()["total"] / MIB,
    )


def _train(rank, world, device, offload):
    """Three minibatches, steps after the first and third (the second's sums held across the
    offload, as in tests/python/test_torch_offload.py); returns (parameters, measurements)."""
    import odc.torch
    from tiny_lm import full_parameters, loss_sum, make_model, minibatch_samples, shard_blocks

    model = shard_blocks(make_model(dim=DIM, hidden=HIDDEN, layers=LAYERS).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    comm = odc.torch.comm_from_process_group(
        device=device.index if device.type == "cuda" else None, deterministic=True
    )
    engine = odc.torch.OdcFSDP(model, comm, optimizer)
    points = {}

    def minibatch(step):
        samples = [t.to(device) for t in minibatch_samples(step)]
        tokens = sum(int(t.shape[1]) - 1 for t in samples)
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, samples[rank::world]), tokens).backward()

    minibatch(0)
    optimizer.step()
    optimizer.zero_grad()
    minibatch(1)
    if offload:
        points["odc kinds (MiB)"] = {
            k: v / MIB for k, v in engine.memory_bytes().items() if k != "total"
        }
        points["before offload"] = _measure(engine, device)
        engine.offload()
        points["after offload"] = _measure(engine, device)
        model.to("cpu")  # what verl's param_offload does next
        points["after model.to(cpu)"] = _measure(engine, device)
        model.to(device)
        engine.reload()
        points["after reload"] = _measure(engine, device)
    minibatch(2)
    optimizer.step()
    optimizer.zero_grad()
    params = full_parameters(model)
    engine.comm.close()
    return params, points


def _rank(rank, world, key, store_path, use_cpu):
    import torch.distributed as dist

    device = torch.device("cpu") if use_cpu else torch.device("cuda", 0)
    if not use_cpu:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        plain, _ = _train(rank, world, device, offload=False)
        offloaded, points = _train(rank, world, device, offload=True)
        diff = max(float((plain[n] - offloaded[n]).abs().max()) for n in plain)
        equal = all(torch.equal(plain[n], offloaded[n]) for n in plain)
        return dict(points=points, equal=equal, max_diff=diff)
    finally:
        dist.destroy_process_group()


def main() -> int:
    use_cpu = "--cpu" in sys.argv[1:]
    if not use_cpu and not torch.cuda.is_available():
        print("no GPU: run with --cpu for the same flow on the host transport")
        return 1
    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(_rank, 2, os.path.join(directory, "store"), use_cpu, timeout=600)
    for rank, found in enumerate(results):
        print(f"rank {rank}:")
        for point, values in found["points"].items():
            shown = ", ".join(f"{k} {v:.1f}" for k, v in values.items())
            print(f"  {point:>22}: {shown}")
        print(f"  parameters equal to training without offload: {found['equal']}")
    before = results[0]["points"]["before offload"]
    after = results[0]["points"]["after offload"]
    print(
        f"device memory freed by offload() (both ranks): "
        f"{before['device_used_mib'] - after['device_used_mib']:.1f} MiB; "
        f"odc's own count: {sum(r['points']['before offload']['odc_mib'] for r in results):.1f} MiB"
    )
    ok = all(r["equal"] for r in results) and all(
        r["points"]["after offload"]["odc_mib"] == 0 for r in results
    )
    print("offload/reload:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
