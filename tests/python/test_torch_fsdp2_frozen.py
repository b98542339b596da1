"""odc.torch where FSDP2 reduces fewer than all parameters, when a minibatch has no
microbatches, and when a minibatch fails, on the CPU (gloo + host transport):
- frozen parameters (a LayerNorm inside a trained unit, a whole frozen unit, the base weights
  under LoRA-style adapters in the same unit) stay bitwise unchanged under AdamW's weight decay,
  and cost no gradient memory;
- requires_grad changed between minibatches, an expert some microbatches skip (on one rank and
  not the other) and a parameter no microbatch uses train as in one process, where the last one
  gets no .grad (AdamW leaves it alone), and so does every parameter of a minibatch without
  microbatches;
- an exception inside `with engine.minibatch()` fails the communicator at once: the peer raises
  naming the rank and the exception, not a timeout; reset() with a new communicator trains on
  from the last completed step;
- forwards outside a minibatch raise (they could read a mix of pre- and post-step shards); a
  forward-only minibatch evaluates; a minibatch that would discard unstepped sums raises.
Every rank's wait is bounded (communicator timeouts, launch timeouts): a regression fails, never
hangs."""

import os
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="odc.torch tests need torch")

import odc  # noqa: E402
from tiny_lm import LR, loss_sum, make_model  # noqa: E402
from tiny_lm import minibatch_samples as tiny_minibatch_samples  # noqa: E402

VOCAB, DIM, RANK_LORA = 23, 10, 2
STEPS = 6
WEIGHT_DECAY = 0.5  # large: a frozen parameter handed a .grad would visibly move
FROZEN = ("blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.1.base.weight", "tower.lin.weight")
FROZEN_FROM_STEP_3 = ("blocks.0.lora_a.weight",)  # frozen between minibatches, after step 2
NEVER_USED = ("blocks.1.never.weight", "blocks.1.never.bias")


def _make_net():
    from torch import nn

    class Block(nn.Module):
        """A frozen base with a LoRA-style adapter, and two experts a router picks between."""

        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.base = nn.Linear(DIM, DIM)
            self.lora_a = nn.Linear(DIM, RANK_LORA, bias=False)
            self.lora_b = nn.Linear(RANK_LORA, DIM, bias=False)
            self.experts = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])
            self.never = nn.Linear(DIM, DIM)  # trainable, used by no microbatch

        def forward(self, x, route):
            h = self.norm(x)
            y = self.base(h) + self.lora_b(self.lora_a(h)) + self.experts[route](h)
            return x + torch.nn.functional.gelu(y)

    class Tower(nn.Module):  # a whole frozen FSDP unit
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(DIM, DIM, bias=False)

        def forward(self, x):
            return x + torch.tanh(self.lin(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.tower = Tower()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, tokens, route):
            x = self.tower(self.embed(tokens))
            for block in self.blocks:
                x = block(x, route)
            return self.head(x)

    torch.manual_seed(0)
    net = Net()
    for name, param in net.named_parameters():
        param.requires_grad_(name not in FROZEN)
    return net


def _samples(step):
    return tiny_minibatch_samples(step, num_samples=6, shortest=3, longest=12, vocab=VOCAB)


def _route(microbatch):
    return microbatch[0] % 2  # which expert this microbatch uses


def _net_loss(net, samples, microbatch):
    inputs = torch.cat([samples[i][:, :-1] for i in microbatch], dim=1)
    targets = torch.cat([samples[i][:, 1:] for i in microbatch], dim=1)
    logits = net(inputs, _route(microbatch))
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum"
    )


def _schedule(world_size):
    """Per step, per rank, its microbatches; the last step has none on any rank."""
    schedule = []
    for step in range(STEPS - 1):
        lengths = [int(t.shape[1]) for t in _samples(step)]
        plan = odc.plan(
            lengths, ranks=world_size, max_tokens=20, policy="lb-mini", samples_per_rank=None
        )
        schedule.append([rank["microbatches"] for rank in plan["minibatches"][0]["ranks"]])
    schedule.append([[] for _ in range(world_size)])
    return schedule


def _set_freezing(net, step):
    for name, param in net.named_parameters():
        frozen = name in FROZEN or (step >= 3 and name in FROZEN_FROM_STEP_3)
        param.requires_grad_(not frozen)


def _optimizer(net):
    return torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=WEIGHT_DECAY)


def _reference(schedule):
    """One process: the union of all ranks' microbatches per step, the same scaling."""
    net = _make_net()
    optimizer = _optimizer(net)
    for step, ranks in enumerate(schedule):
        _set_freezing(net, step)
        samples = _samples(step)
        tokens = sum(int(t.shape[1]) - 1 for t in samples)
        for microbatches in ranks:
            for microbatch in microbatches:
                (_net_loss(net, samples, microbatch) / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def _full_state(net):
    """The full parameters without a collective (gloo may lack CUDA ones): this rank's dim-0
    shards, which the caller concatenates in rank order."""
    return {k: v.to_local().detach().cpu().numpy().copy() for k, v in net.state_dict().items()}


def _join_shards(states):
    return {k: np.concatenate([state[k] for state in states]) for k in states[0]}


def _join(rank, world_size, store_path, device):
    """Joins the gloo process group; returns this rank's GPU (rank % count: several ranks may
    share one) for device "cuda", else None."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    if device != "cuda":
        return None
    gpu = rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    return gpu


def _frozen_rank(rank, world_size, key, store_path, schedule, device="cpu", mesh=None):
    """One rank; device "cuda": every rank on GPU rank % count (several may share one: gloo
    carries FSDP2's few collectives, odc's CUDA transport the gathers and pushes). mesh (R, S):
    HSDP, one odc communicator per replica; the last rank's torch.distributed all-reduces are
    slowed down, so that a rank reading its node peers' flags before their cross-replica
    reduction finished would see it."""
    import time

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import odc.torch

    gpu = _join(rank, world_size, store_path, device)
    try:
        net = _make_net().to(device if gpu is None else f"cuda:{gpu}")
        device_mesh = None
        if mesh is not None:
            from torch.distributed.device_mesh import init_device_mesh

            device_mesh = init_device_mesh(
                net.head.weight.device.type, mesh, mesh_dim_names=("replicate", "shard")
            )
        for block in net.blocks:
            fully_shard(block, mesh=device_mesh)
        fully_shard(net.tower, mesh=device_mesh)
        fully_shard(net, mesh=device_mesh)
        optimizer = _optimizer(net)
        if device_mesh is None:
            comm = odc.Comm(rank, world_size, key, timeout=120, device=gpu)
        else:
            comm = odc.torch.node_comm(device_mesh, key, timeout=120, device=gpu)
            if rank == world_size - 1:
                all_reduce = dist.all_reduce

                def late_all_reduce(*args, **kwargs):
                    time.sleep(0.3)
                    return all_reduce(*args, **kwargs)

                dist.all_reduce = late_all_reduce
        engine = odc.torch.OdcFSDP(net, comm, optimizer)
        memory = [engine.memory_bytes()["accumulators"]]
        grads = []  # per step: names of the parameters with a .grad after minibatch_end
        for step, ranks in enumerate(schedule):
            _set_freezing(net, step)
            samples = [t.to(net.head.weight.device) for t in _samples(step)]
            tokens = sum(int(t.shape[1]) - 1 for t in samples)
            with engine.minibatch():
                for microbatch in ranks[rank]:
                    loss = odc.torch.scale_loss(_net_loss(net, samples, microbatch), tokens)
                    loss.backward()
            grads.append(sorted(n for n, p in net.named_parameters() if p.grad is not None))
            memory.append(engine.memory_bytes()["accumulators"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        state = _full_state(net)
        comm.close()
        return state, grads, memory
    finally:
        dist.destroy_process_group()


def test_frozen_unused_and_adapter_parameters_train_as_in_one_process():
    check_frozen_unused_and_adapter_parameters(2, "cpu", tolerance=1e-5)


@pytest.mark.long
def test_hsdp_expert_used_on_one_replica_only():
    # Step 0 routes replica 0 (ranks 0, 1) to expert 1 only and replica 1 to expert 0 only.
    check_frozen_unused_and_adapter_parameters(4, "cpu", tolerance=1e-5, mesh=(2, 2))


def check_frozen_unused_and_adapter_parameters(world_size, device, tolerance, mesh=None):
    """The test's body; tests/gpu and dev/gpu run it with device "cuda"."""
    schedule = _schedule(world_size)
    # The data must exercise what the test claims: unequal counts, and in some step an expert
    # one rank (one replica) uses and another does not.
    assert any(len({len(r) for r in ranks}) > 1 for ranks in schedule[:-1])
    routes = [[{_route(m) for m in r} for r in ranks] for ranks in schedule[:-1]]
    half = world_size // 2
    used = [(set().union(*r[:half]), set().union(*r[half:])) for r in routes]
    assert any(len(a ^ b) > 0 for a, b in used), routes
    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(
            _frozen_rank,
            world_size,
            os.path.join(directory, "store"),
            schedule,
            device,
            mesh,
            timeout=400,
        )
    reference = _reference(schedule)
    initial = {k: v.detach().numpy().copy() for k, v in _make_net().state_dict().items()}
    shards = [result[0] for result in results]
    if mesh is not None:  # HSDP: every replica holds the whole state, sharded alike
        replicas, size = mesh
        for replica in range(1, replicas):
            for mine, theirs in zip(shards[:size], shards[replica * size : (replica + 1) * size]):
                assert all(np.array_equal(mine[k], theirs[k]) for k in mine), "replicas differ"
        shards = shards[:size]
    state = _join_shards(shards)
    for name in FROZEN + NEVER_USED:
        assert np.array_equal(state[name], initial[name]), f"{name} moved"
    diff = max(float(np.max(np.abs(state[k] - reference[k]))) for k in reference)
    assert diff < tolerance, diff
    for _, grads, memory in results:
        for step, names in enumerate(grads):
            assert not set(names) & set(FROZEN + NEVER_USED), (step, names)
            if step >= 3:
                assert not set(names) & set(FROZEN_FROM_STEP_3), (step, names)
        assert grads[-1] == [], "a minibatch without microbatches must hand out no gradients"
        assert "blocks.0.experts.1.weight" in grads[0] and "blocks.0.lora_a.weight" in grads[0]
        # Gradient memory follows the trainable parameters (frozen ones cost none): it shrank
        # when lora_a was frozen, and stays below fp32 sums of every parameter's padded shard
        # (FSDP2 pads dim 0 to a multiple of the world size).
        num_shards = world_size if mesh is None else mesh[1]
        everything = 4 * sum(
            -(-v.shape[0] // num_shards) * (v.size // v.shape[0]) for v in initial.values()
        )
        assert memory[4] < memory[3] < everything, (memory, everything)


def _failure_rank(rank, world_size, key, store_path, device="cpu", timeout=300):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import odc.torch

    gpu = _join(rank, world_size, store_path, device)
    where = "cpu" if gpu is None else f"cuda:{gpu}"

    def minibatch_samples(step):
        return [t.to(where) for t in tiny_minibatch_samples(step)]

    seen = {}
    try:
        model = make_model().to(where)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        # A long timeout: a peer that learned of the failure only by waiting would take 300 s
        # and report a timeout, which the test tells apart.
        comm = odc.Comm(rank, world_size, key, timeout=timeout, device=gpu)
        engine = odc.torch.OdcFSDP(model, comm, optimizer)

        def train_step(step):
            samples = minibatch_samples(step)
            tokens = sum(int(t.shape[1]) - 1 for t in samples)
            with engine.minibatch():
                for i in range(rank, len(samples), world_size):
                    odc.torch.scale_loss(loss_sum(model, [samples[i]]), tokens).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        train_step(0)
        # A forward outside a minibatch: FSDP2's collective all-gather, after every step.
        seen["outside"] = float(loss_sum(model, minibatch_samples(0)[:1]))
        # The failing minibatch: rank 1 raises in the middle of its second backward (after
        # block 1's gradients were pushed, before block 0's: FSDP2's end-of-backward callback
        # never runs there, R9).
        samples = minibatch_samples(1)

        def boom(grad):
            raise ValueError("boom on rank 1")

        def arm(module, inputs, output):
            if rank == 1 and armed:
                output.register_hook(boom)

        armed = False
        hook = model.blocks[0].register_forward_hook(arm)
        try:
            with engine.minibatch():
                odc.torch.scale_loss(loss_sum(model, [samples[rank]]), 100).backward()
                armed = True
                odc.torch.scale_loss(loss_sum(model, [samples[2]]), 100).backward()
        except (ValueError, odc.Error) as error:
            seen["failure"] = f"{type(error).__name__}: {error}"
        hook.remove()
        seen["state"] = engine.state.value
        seen["grads"] = sum(p.grad is not None for p in model.parameters())
        try:
            optimizer.step()
        except odc.Error as error:
            seen["step"] = str(error)
        try:
            engine.minibatch_begin()
        except odc.Error as error:
            seen["begin"] = str(error)
        # Recovery: a new communicator on every rank; the failed minibatch is dropped.
        fresh = odc.Comm(rank, world_size, key + "-reset", timeout=60, device=gpu)
        engine.reset(fresh)
        comm.close()
        train_step(1)
        # Evaluation: a forward-only minibatch gives no gradients.
        with engine.minibatch():
            with torch.no_grad():
                seen["eval"] = float(loss_sum(model, minibatch_samples(0)[:2]))
        seen["eval_grads"] = sum(p.grad is not None for p in model.parameters())
        # A minibatch whose sums no step used, then another: they carry over (FSDP2 adds into
        # .grad until zero_grad), never silently dropped.
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, [samples[rank]]), 100).backward()
        engine.minibatch_begin()
        engine.minibatch_end()
        seen["carried"] = sum(p.grad is not None for p in model.parameters())
        optimizer.zero_grad(set_to_none=True)
        with engine.minibatch():
            pass
        state = _full_state(model)
        fresh.close()
        return seen, state
    finally:
        dist.destroy_process_group()


def _two_step_reference():
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(2):
        samples = tiny_minibatch_samples(step)
        tokens = sum(int(t.shape[1]) - 1 for t in samples)
        (loss_sum(model, samples) / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_exception_inside_a_minibatch_fails_fast_and_reset_recovers():
    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(_failure_rank, 2, os.path.join(directory, "store"), timeout=200)
    reference = _two_step_reference()
    for rank, (seen, _) in enumerate(results):
        assert seen["outside"] > 0
        if rank == 1:
            assert seen["failure"] == "ValueError: boom on rank 1"
        else:  # the peer names the rank and its exception, and did not wait for a timeout
            assert "rank 1 failed" in seen["failure"], seen["failure"]
            assert "ValueError inside a minibatch: boom on rank 1" in seen["failure"]
            assert "timed out" not in seen["failure"]
        assert seen["state"] == "failed" and seen["grads"] == 0
        assert "partial" in seen["step"] or "failed" in seen["step"]
        assert "reset(" in seen["begin"]
        assert seen["eval"] > 0 and seen["eval_grads"] == 0
        assert seen["carried"] == len(list(make_model().parameters()))
    # The failed minibatch changed nothing: two completed steps equal one process's two.
    state = _join_shards([result[1] for result in results])
    diff = max(float(np.max(np.abs(state[k] - reference[k]))) for k in reference)
    assert diff < 1e-5, diff
