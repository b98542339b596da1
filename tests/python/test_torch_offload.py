"""OdcFSDP.offload() / reload() (CPU: gloo + host transport, 2 ranks, one launch): training
that offloads odc's buffers between minibatches and reloads them ends with the same parameters,
bit for bit (fp32, AdamW), as training that never did, including gradient sums held across the
offload; offloaded, memory_bytes() is zero and none of the communicator's shared memory is
mapped any more; the calls out of order raise odc.InvalidUsage naming the call."""

import os
import tempfile

import pytest

torch = pytest.importorskip("torch", reason="odc.torch tests need torch")

from tiny_lm import (  # noqa: E402
    full_parameters,
    loss_sum,
    make_model,
    minibatch_samples,
    shard_blocks,
)


def _mapped(key, rank):
    """(bytes, segments) of this rank's odc shared memory of communicator `key` still mapped."""
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


def _error(call):
    """The message of the odc.InvalidUsage `call` raises ("no error" when it raises none)."""
    import odc

    try:
        call()
    except odc.InvalidUsage as error:
        return f"InvalidUsage: {error}"
    return "no error"


def _train(rank, world, offload, found):
    """Three minibatches of this rank's half of each seeded minibatch, AdamW steps after the
    first and the third; the second's sums are still held (no zero_grad) when the third adds to
    them. `offload`: offload() and reload() after the first step and between the second and the
    third (with the sums held), checked there."""
    import odc.torch

    model = shard_blocks(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # Deterministic: sums in a fixed order (the held sums, then rank 0's push, then rank 1's),
    # so that two runs can be compared bit for bit; reload()'s new communicator is so too.
    comm = odc.torch.comm_from_process_group(deterministic=True)
    engine = odc.torch.OdcFSDP(model, comm, optimizer)

    def minibatch(step):
        samples = minibatch_samples(step)
        tokens = sum(int(t.shape[1]) - 1 for t in samples)
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, samples[rank::world]), tokens).backward()

    def offload_and_reload(where):
        key = engine.comm.key
        before = engine.memory_bytes()
        with torch.no_grad():
            loss_before = loss_sum(model, minibatch_samples(9)).item()
        engine.offload()
        found[f"{where}/state"] = engine.state.value
        found[f"{where}/memory_before"] = before
        found[f"{where}/memory"] = engine.memory_bytes()
        found[f"{where}/mapped"] = _mapped(key, rank)
        with torch.no_grad():  # offloaded: forwards gather as plain FSDP2 does
            found[f"{where}/forward"] = (loss_before, loss_sum(model, minibatch_samples(9)).item())
        found[f"{where}/twice"] = _error(engine.offload)
        found[f"{where}/minibatch"] = _error(engine.minibatch_begin)
        engine.reload()  # a new communicator on the same process group
        found[f"{where}/new_comm"] = engine.comm is not comm and engine.comm.key != key
        found[f"{where}/deterministic"] = engine.comm.deterministic
        found[f"{where}/memory_after"] = engine.memory_bytes()

    minibatch(0)
    optimizer.step()
    optimizer.zero_grad()
    if offload:
        found["mapped_before"] = _mapped(engine.comm.key, rank)
        offload_and_reload("stepped")
    minibatch(1)
    if offload:  # the sums are held in .grad (views of the accumulators) across the offload
        offload_and_reload("held")
    minibatch(2)  # adds to the second's sums
    optimizer.step()
    optimizer.zero_grad()
    params = full_parameters(model)
    if offload:  # the calls out of order
        found["reload_without_offload"] = _error(engine.reload)
        engine.minibatch_begin()
        found["offload_inside"] = _error(engine.offload)
        engine.minibatch_end()
    engine.comm.close()
    return params


def _offload_rank(rank, world, key, store_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        found = {}
        plain = _train(rank, world, offload=False, found={})
        offloaded = _train(rank, world, offload=True, found=found)
        found["equal"] = all(torch.equal(plain[n], offloaded[n]) for n in plain)
        found["max_diff"] = max(float((plain[n] - offloaded[n]).abs().max()) for n in plain)
        found["moved"] = max(
            float((plain[n] - make_model().state_dict()[n]).abs().max()) for n in plain
        )
        return found
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    import odc

    with tempfile.TemporaryDirectory() as directory:
        return odc.launch(_offload_rank, 2, os.path.join(directory, "store"), timeout=300)


def test_training_across_offload_and_reload_is_bitwise_the_same(results):
    for found in results:
        assert found["moved"] > 1e-3  # the steps did change the parameters
        assert found["equal"], found["max_diff"]
        for where in ("stepped", "held"):
            before, after = found[f"{where}/forward"]
            assert before == after
            assert found[f"{where}/new_comm"] and found[f"{where}/deterministic"]


def test_offload_releases_every_odc_byte(results):
    for found in results:
        assert found["mapped_before"][1] > 0
        for where in ("stepped", "held"):
            assert found[f"{where}/state"] == "offloaded"
            before = found[f"{where}/memory_before"]
            assert before["total"] > 0 and before["published_in_place"] > 0
            assert all(value == 0 for value in found[f"{where}/memory"].values())
            assert found[f"{where}/mapped"] == (0, 0)  # nothing of the communicator mapped
            # Reloaded: the model's buffers again (the scheme's staging grows with use).
            after = found[f"{where}/memory_after"]
            for kind in ("published", "published_in_place", "accumulators"):
                assert after[kind] == before[kind], kind


def test_calls_out_of_order_raise_naming_the_call(results):
    for found in results:
        for where in ("stepped", "held"):
            assert "offload() called twice" in found[f"{where}/twice"]
            assert "minibatch_begin() on an offloaded engine" in found[f"{where}/minibatch"]
            assert "call reload()" in found[f"{where}/minibatch"]
        assert "reload() without offload()" in found["reload_without_offload"]
        assert "offload() inside a minibatch" in found["offload_inside"]
