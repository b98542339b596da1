"""A tiny packed-document causal LM, its seeded data, LB plans and a single-process reference:
shared by the odc.torch tests on the CPU (tests/python) and on GPUs (tests/gpu)."""

import os
import tempfile

import numpy as np
import torch

import odc

VOCAB, DIM, HIDDEN, HEADS = 29, 12, 20, 2  # odd sizes: FSDP2 pads the dim-0 shards
MINIBATCH, MAX_TOKENS, STEPS, LR, MAX_NORM = 8, 26, 5, 0.02, 1.0


def make_model(vocab=None, dim=None, hidden=None, heads=None, layers=2):
    """The test LM; the defaults are tiny (odd sizes), bench/torch_memory.py passes larger ones."""
    from torch import nn

    VOCAB_, DIM_, HIDDEN_, HEADS_ = vocab or VOCAB, dim or DIM, hidden or HIDDEN, heads or HEADS

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(DIM_), nn.LayerNorm(DIM_)
            # No qkv bias: the key bias has an exactly-zero gradient (softmax shift invariance),
            # whose rounding noise AdamW would amplify into lr-sized, order-dependent updates.
            self.qkv = nn.Linear(DIM_, 3 * DIM_, bias=False)
            self.proj = nn.Linear(DIM_, DIM_)
            self.up, self.down = nn.Linear(DIM_, HIDDEN_), nn.Linear(HIDDEN_, DIM_)

        def forward(self, x, mask):  # x: [1, L, DIM_]; mask: [L, L], True = may attend
            q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
            split = lambda t: t.view(1, -1, HEADS_, DIM_ // HEADS_).transpose(1, 2)  # noqa: E731
            attention = torch.nn.functional.scaled_dot_product_attention(
                split(q), split(k), split(v), attn_mask=mask
            )
            x = x + self.proj(attention.transpose(1, 2).reshape(1, -1, DIM_))
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB_, DIM_)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.head = nn.Linear(DIM_, VOCAB_)

        def forward(self, tokens, document_ids):
            # Packed documents: causal attention within each document only.
            same = document_ids.view(-1, 1) == document_ids.view(1, -1)
            mask = same & torch.ones_like(same).tril()
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(x)

    torch.manual_seed(0)
    return TinyLM()


def shard_blocks(model):
    """FSDP2 as the tests use it: each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def full_parameters(model):
    """Every parameter in full, as CPU copies (FSDP2 shards dim 0; gathered through gloo on CPU
    tensors: DTensor's own full_tensor() crashes gloo with CUDA tensors). Collective."""
    import torch.distributed as dist

    local = {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {n: torch.cat([shards[n] for shards in gathered]) for n in local}


def minibatch_samples(step, num_samples=MINIBATCH, shortest=4, longest=24, vocab=VOCAB):
    """`num_samples` token sequences of shortest..longest tokens (seeded by step)."""
    rng = np.random.default_rng(100 + step)
    lengths = rng.integers(shortest, longest + 1, size=num_samples)
    return [torch.from_numpy(rng.integers(0, vocab, size=n)).view(1, -1) for n in lengths]


def loss_sum(model, samples):
    """Next-token cross entropy summed over every predicted token of `samples`, packed into one
    sequence (one forward per microbatch, as FSDP2 needs the same number on every rank)."""
    inputs = torch.cat([tokens[:, :-1] for tokens in samples], dim=1)
    targets = torch.cat([tokens[:, 1:] for tokens in samples], dim=1)
    document_ids = torch.cat(
        [torch.full((int(t.shape[1]) - 1,), i, device=inputs.device) for i, t in enumerate(samples)]
    )
    logits = model(inputs, document_ids)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )


def plans(world_size, policy, max_tokens=MAX_TOKENS, **data):
    """Per step, per rank, its microbatches (sample index lists) from the C++ planner."""
    result = []
    for step in range(STEPS):
        lengths = [int(t.shape[1]) for t in minibatch_samples(step, **data)]
        # A per-microbatch cost (c = 2 tokens' worth), as in real training: with c = 0 LB-Mini
        # may split every rank down to the longest sample, which here evens the counts out. LB-Mini
        # packs up to the cap: the tests want its unequal counts, which LB-Micro's microbatch
        # bound (the default) can even out on minibatches this small.
        plan = odc.plan(
            lengths,
            ranks=world_size,
            max_tokens=max_tokens,
            policy=policy,
            samples_per_rank=None,  # the step is one minibatch
            cost=(1.0, 0.0, 2.0),
            microbatch_memory="cap",
        )
        result.append([rank["microbatches"] for rank in plan["minibatches"][0]["ranks"]])
    return result


def reference_state():
    """One process, the whole minibatch per step, token-mean loss."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        samples = minibatch_samples(step)
        tokens = sum(int(t.shape[1]) - 1 for t in samples)
        (loss_sum(model, samples) / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _train_rank(rank, world_size, key, store_path, schedule, use_odc, options):
    """One rank of a training run: FSDP2 (per block + root), plain or with odc.torch. Returns
    (microbatch counts, final full state as numpy, per-step losses, peak device memory).
    options["mesh"] = (R, S): an HSDP mesh (replicate, shard) instead of a 1-D one; odc.torch
    then runs one communicator per replica (odc.torch.node_comm)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import odc.torch

    on_gpu = options.get("device") == "cuda"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(rank)
    torch.manual_seed(0)
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        device_id=device if on_gpu else None,
    )
    try:
        model = make_model(**options.get("model", {})).to(device)
        mesh = None
        if options.get("mesh"):
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(
                device.type, tuple(options["mesh"]), mesh_dim_names=("replicate", "shard")
            )
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if options.get("bf16") else None,
            reduce_dtype=torch.float32 if options.get("bf16") else None,
        )
        reshard = options.get("reshard_after_forward", True)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        optimizer = torch.optim.AdamW(model.parameters(), lr=options.get("lr", LR))
        if use_odc:
            if mesh is None:
                comm = odc.Comm(rank, world_size, key, timeout=60, device=rank if on_gpu else None)
            else:
                comm = odc.torch.node_comm(mesh, key, timeout=60, device=rank if on_gpu else None)
            engine = odc.torch.OdcFSDP(model, comm, optimizer)
        else:
            odc.torch.sum_gradients(model)  # the same sums as ODC: no averaging
        counts, losses = [], []
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        for step in range(STEPS):
            samples = [t.to(device) for t in minibatch_samples(step, **options.get("data", {}))]
            tokens = sum(int(t.shape[1]) - 1 for t in samples)
            mine = schedule[step][rank]
            counts.append(len(mine))
            if use_odc:
                engine.minibatch_begin()
            step_loss = torch.zeros((), device=device)
            for microbatch in mine:
                if not microbatch:  # LB-Micro padding: join FSDP2's collectives, add nothing
                    (loss_sum(model, [samples[0][:, :2]]) * 0).backward()
                    continue
                picked = [samples[i] for i in microbatch]
                loss = odc.torch.scale_loss(loss_sum(model, picked), tokens)
                loss.backward()
                step_loss += loss.detach()
            if use_odc:
                engine.minibatch_end()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(step_loss)  # the minibatch's token-mean loss (outside the minibatch)
            losses.append(float(step_loss))
        # Peak device memory: torch's allocations plus odc's symmetric buffers (libodc's own).
        peak = torch.cuda.max_memory_allocated() if on_gpu else 0
        if use_odc:
            peak += engine.symmetric_bytes
        state = {
            k: v.full_tensor().float().cpu().numpy().copy() for k, v in model.state_dict().items()
        }
        if options.get("checkpoint"):
            directory = os.path.join(os.path.dirname(store_path), "ckpt")
            dcp.save(model.state_dict(), checkpoint_id=directory)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.zero_()
            loaded = model.state_dict()
            dcp.load(loaded, checkpoint_id=directory)
            model.load_state_dict(loaded)
            after = {
                k: v.full_tensor().float().cpu().numpy() for k, v in model.state_dict().items()
            }
            assert all(np.array_equal(after[k], state[k]) for k in state), "checkpoint round trip"
        if use_odc:
            comm.close()
        return counts, state, losses, peak
    finally:
        dist.destroy_process_group()


def train(world_size, schedule, use_odc, **options):
    """Runs _train_rank on `world_size` local processes; returns their results by rank."""
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        return odc.launch(_train_rank, world_size, store, schedule, use_odc, options, timeout=600)


def max_diff(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
