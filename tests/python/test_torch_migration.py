"""Moving an FSDP2 trainer to odc.torch without silent surprises (CPU: gloo + host transport,
2 ranks, one launch): each check here failed before the fix it guards.
- an FSDP2 loss normalization (loss_sum * world / global tokens, FSDP2 averaging over ranks)
  gives FSDP2's gradients, not N times them; odc.torch.scale_loss gives the same;
- clip_grad_norm_, gradient reads and optimizer.step() inside a minibatch raise naming the fix;
- gradients accumulate over consecutive minibatch blocks until zero_grad, as FSDP2's .grad does;
- a forward outside a minibatch (evaluation) works and equals one inside;
- a second engine on the same model is refused with that reason;
- a torch.distributed collective inside a minibatch raises at minibatch_end on every rank that
  issued one, with equal counts too, naming the group."""

import os
import tempfile

import pytest

torch = pytest.importorskip("torch", reason="odc.torch tests need torch")

from tiny_lm import loss_sum, make_model, minibatch_samples, shard_blocks  # noqa: E402


def _grads(model):
    """Every parameter's full gradient on the CPU (FSDP2 shards dim 0; gathered through gloo on
    CPU tensors: DTensor's own full_tensor() crashes gloo with CUDA tensors)."""
    import torch.distributed as dist

    locals_ = {n: p.grad.to_local().detach().cpu() for n, p in model.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, locals_)
    return {n: torch.cat([shards[n] for shards in gathered]) for n in locals_}


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _norm(grads):
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


def _own_shared_memory(key, rank):
    """(bytes, count) of this rank's own odc shared-memory segments mapped into this process
    (/proc/self/maps: odc unlinks the names once every rank mapped them), the 1 KB control block
    (one page) left out."""
    total = count = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or f"/odc.{key}.r{rank}.a" not in fields[5]:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            total += end - start
            count += 1
    return total, count


def _migration_rank(rank, world, key, store_path, device="cpu"):
    """One rank. device "cuda": every rank on GPU 0 (gloo carries the few torch.distributed
    calls, odc's CUDA transport the rest), and the reference is one process's gradient, which
    FSDP2's mean over ranks of (loss_sum * world / tokens) equals; on the CPU plain FSDP2 itself."""
    import torch.distributed as dist

    import odc
    import odc.torch

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(0)
    found = {}
    try:
        samples = [t.to(device) for t in minibatch_samples(0)]
        tokens = sum(int(t.shape[1]) - 1 for t in samples)
        mine = samples[rank::world]  # equal counts: plain FSDP2 can run it too

        if on_gpu:  # one process, the whole minibatch
            single = make_model().to(device)
            (loss_sum(single, samples) / tokens).backward()
            fsdp2 = {n: p.grad.cpu() for n, p in single.named_parameters()}
        else:  # plain FSDP2, averaging over ranks (its default), loss normalized as its users do
            plain = shard_blocks(make_model())
            (loss_sum(plain, mine) * world / tokens).backward()
            fsdp2 = _grads(plain)

        model = shard_blocks(make_model().to(device))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        comm = odc.Comm(rank, world, key, timeout=30, device=0 if on_gpu else None)
        engine = odc.torch.OdcFSDP(model, comm, optimizer)
        found["factor"] = engine.gradient_divide_factor
        try:
            odc.torch.OdcFSDP(model, comm)
        except RuntimeError as error:
            found["second"] = str(error)
        try:  # an engine on a part of the model is the same mistake
            odc.torch.OdcFSDP(model.blocks[0], comm)
        except RuntimeError as error:
            found["part"] = str(error)

        with engine.minibatch():  # the FSDP2 normalization, unchanged
            (loss_sum(model, mine) * world / tokens).backward()
            for name, call in (
                ("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),
                ("read", lambda: next(model.parameters()).grad.sum()),
                ("step", optimizer.step),
            ):
                try:
                    call()
                    found[name] = "no error"
                except RuntimeError as error:
                    found[name] = f"{type(error).__name__}: {error}"
            found["repr"] = repr(next(model.parameters()).grad)[:40]
        migrated = _grads(model)
        found["fsdp2_norm"], found["odc_norm"] = _norm(fsdp2), _norm(migrated)
        found["vs_fsdp2"] = _max_diff(migrated, fsdp2)
        optimizer.zero_grad()

        with engine.minibatch():  # odc's own normalization: the same gradients
            odc.torch.scale_loss(loss_sum(model, mine), tokens).backward()
        found["scale_loss_vs_fsdp2"] = _max_diff(_grads(model), fsdp2)
        optimizer.zero_grad()

        # Two blocks before one step: the second adds to the first, until zero_grad.
        first, second = mine[:2], mine[2:]
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, first), tokens).backward()
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, second), tokens).backward()
        found["two_blocks_vs_one"] = _max_diff(_grads(model), fsdp2)
        optimizer.zero_grad()
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, second), tokens).backward()
        alone = _grads(model)
        optimizer.zero_grad()
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, second), tokens).backward()
        found["after_zero_grad"] = _max_diff(_grads(model), alone)
        optimizer.zero_grad()
        # Clipped between blocks: the next block adds to the clipped sums, as into FSDP2's .grad.
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, first), tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        clipped = _grads(model)
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, second), tokens).backward()
        added = _grads(model)
        found["clipped_then_added"] = max(
            float((added[k] - clipped[k] - alone[k]).abs().max()) for k in added
        )
        optimizer.step()
        # No zero_grad after the step, then zero_grad inside the next minibatch: the carried sums
        # cannot be taken out any more; that raises, naming the fix, instead of adding them in.
        try:
            with engine.minibatch():
                optimizer.zero_grad()
                odc.torch.scale_loss(loss_sum(model, second), tokens).backward()
        except RuntimeError as error:
            found["zeroed_inside"] = str(error)
        engine.reset(odc.Comm(rank, world, key + "-2", timeout=30, device=0 if on_gpu else None))
        comm.close()
        comm = engine.comm
        optimizer.zero_grad()
        # zero_grad inside a minibatch with nothing carried over, and a loss computed outside
        # the minibatch whose backward runs inside it: both the plain gradients.
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, second), tokens).backward()
        reference = _grads(model)
        optimizer.zero_grad()
        loss = odc.torch.scale_loss(loss_sum(model, second), tokens)
        with engine.minibatch():
            optimizer.zero_grad()
            loss.backward()
        found["outside_loss_vs_inside"] = _max_diff(_grads(model), reference)
        optimizer.zero_grad()

        # Evaluation after the step: outside a minibatch and inside a forward-only one.
        with torch.no_grad():
            outside = loss_sum(model, mine).item()
            with engine.minibatch():
                inside = loss_sum(model, mine).item()
        found["eval"] = (outside, inside)

        # A collective inside a minibatch, equal counts on both ranks: it passes, and
        # minibatch_end raises on both, naming it.
        try:
            with engine.minibatch():
                total = torch.ones(1)
                dist.all_reduce(total)
        except odc.torch.CollectiveInMinibatchError as error:
            found["collective"] = str(error)
        # bfloat16 parameters: .grad is a bfloat16 copy of the sums, not a view; what it holds
        # (here halved in place) is what the next block adds to.
        model16 = shard_blocks(make_model().to(device=device, dtype=torch.bfloat16))
        comm16 = odc.Comm(rank, world, key + "-bf16", timeout=30, device=0 if on_gpu else None)
        engine16 = odc.torch.OdcFSDP(model16, comm16)
        with engine16.minibatch():
            engine16.scale_loss(loss_sum(model16, first).float(), tokens).backward()
        first16 = _grads(model16)
        for p in model16.parameters():
            p.grad.mul_(0.5)
        with engine16.minibatch():
            engine16.scale_loss(loss_sum(model16, second).float(), tokens).backward()
        both16 = _grads(model16)
        for p in model16.parameters():
            p.grad = None
        with engine16.minibatch():
            engine16.scale_loss(loss_sum(model16, second).float(), tokens).backward()
        alone16 = _grads(model16)
        found["bf16_halved_then_added"] = max(
            float((both16[k].float() - 0.5 * first16[k].float() - alone16[k].float()).abs().max())
            / max(float(alone16[k].float().abs().max()), 1e-6)
            for k in both16
        )
        comm16.close()
        found["device"] = device
        found["memory"] = engine.memory_bytes()
        found["mapped"] = _own_shared_memory(comm.key, rank)
        comm.close()
        return found
    finally:
        dist.destroy_process_group()


def check_migration(results, tolerance=1e-6):
    """The assertions, shared with the one-GPU run (dev/gpu/torch_migration_check.py)."""
    for found in results:
        assert found["factor"] == 2.0
        assert "already has an OdcFSDP engine" in found["second"]
        assert "already has an OdcFSDP engine" in found["part"]
        assert "zero_grad() (or .grad = None) inside a minibatch" in found["zeroed_inside"]
        assert "before `with engine.minibatch():`" in found["zeroed_inside"]
        assert found["outside_loss_vs_inside"] < tolerance
        assert found["vs_fsdp2"] < tolerance, found
        assert abs(found["odc_norm"] - found["fsdp2_norm"]) < tolerance * found["fsdp2_norm"]
        assert found["scale_loss_vs_fsdp2"] < tolerance
        for name in ("clip", "read"):
            assert found[name].startswith("GradientsNotReadyError"), found[name]
            assert "after the `with engine.minibatch():` block" in found[name]
        assert "before minibatch_end()" in found["step"]
        assert found["repr"].startswith("DTensor(") or "SumsPending" in found["repr"]
        assert found["two_blocks_vs_one"] < tolerance
        assert found["after_zero_grad"] < tolerance
        assert found["clipped_then_added"] < tolerance
        assert found["bf16_halved_then_added"] < 0.02, found["bf16_halved_then_added"]
        outside, inside = found["eval"]
        assert outside == pytest.approx(inside, rel=1e-6)
        assert (
            "collectives ran inside this minibatch (1 on the default group" in found["collective"]
        ), found["collective"]
        assert "ODC_DEBUG_COLLECTIVES=0" in found["collective"]
        # memory_bytes() counts every byte of shared memory odc maps for this rank (to the page).
        memory, (mapped, segments) = found["memory"], found["mapped"]
        if found["device"] == "cpu":
            assert segments > 0
            assert 0 <= mapped - memory["total"] < segments * 4096, (memory, mapped, segments)


def test_an_fsdp2_trainer_moves_without_silent_surprises():
    import odc

    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(_migration_rank, 2, os.path.join(directory, "store"), timeout=300)
    check_migration(results)
