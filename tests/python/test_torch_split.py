"""odc.torch.split: split samples run over groups of ranks give the whole sample's loss
and gradients, through odc sub-communicators (each exchange moves k shards for a group of k,
counted) or torch.distributed subgroups; groups of several sizes, concurrent and overlapping;
errors name the problem. 4 CPU processes, fp32, gloo + odc's shared-memory transport."""

import functools
import os
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="odc.torch.split needs torch")

import odc  # noqa: E402
from odc.errors import InvalidArgument, InvalidUsage  # noqa: E402

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 31, 16, 4, 2, 2
HEAD_DIM = DIM // HEADS
KV_WIDTH = 2 * KV_HEADS * HEAD_DIM

# Two "minibatches": two disjoint groups of 2 at once (one sub-communicator split makes both),
# then a group of 3 overlapping both; zigzag-like pieces of uneven sizes.
SPLITS = [
    [
        {"sample": 0, "ranks": [0, 1], "chunks": [[[0, 7], [20, 26]], [[7, 20]]]},
        {"sample": 1, "ranks": [3, 2], "chunks": [[[0, 4]], [[4, 17]]]},
    ],
    [{"sample": 2, "ranks": [1, 2, 3], "chunks": [[[0, 5], [25, 30]], [[5, 15]], [[15, 25]]]}],
]
LENGTHS = [26, 17, 30]


class AttentionStack(torch.nn.Module):
    """Embeddings (token + position), LAYERS grouped-query attention layers, an LM head: with a
    chunk, attention is odc.torch.split.attention; without, causal SDPA over the whole sample."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.position = torch.nn.Embedding(64, DIM)
        self.q = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.kv = torch.nn.ModuleList(torch.nn.Linear(DIM, KV_WIDTH) for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens, positions, labels, chunk=None):
        from odc.torch import split

        x = self.embed(tokens) + self.position(positions)
        n = tokens.shape[0]
        for q_proj, kv_proj in zip(self.q, self.kv):
            q = q_proj(x).view(n, HEADS, HEAD_DIM).transpose(0, 1)
            k, v = kv_proj(x).view(n, 2 * KV_HEADS, HEAD_DIM).transpose(0, 1).chunk(2)
            if chunk is None:
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True
                )
            else:
                out = split.attention(q, k, v, chunk)
            x = x + out.transpose(0, 1).reshape(n, DIM)
        return torch.nn.functional.cross_entropy(
            self.head(x), labels, ignore_index=-100, reduction="sum"
        )


def _sample(index):
    tokens = torch.from_numpy(np.random.default_rng(index).integers(0, VOCAB, LENGTHS[index]))
    labels = torch.cat([tokens[1:], torch.tensor([-100])])
    return tokens, labels


def _rank(rank, world_size, key, store, exchange, prepare_each=False):
    import torch.distributed as dist

    from odc.torch.split import SplitGroups

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    comm = odc.Comm(rank, world_size, key, timeout=60)
    try:
        model = AttentionStack()
        if exchange == "odc":
            groups = SplitGroups(comm, kv_width=KV_WIDTH, dtype=torch.float32)
        else:
            groups = SplitGroups(exchange="process-group")
        if not prepare_each:
            groups.prepare([entry for minibatch in SPLITS for entry in minibatch])
        results, held = {}, []
        for minibatch in SPLITS:
            if prepare_each:  # buffers for this minibatch's groups only
                groups.prepare(minibatch)
            held.append(groups.memory_bytes())
            for entry in minibatch:
                chunk = groups.chunk(entry)
                if chunk is None:
                    continue
                tokens, labels = _sample(entry["sample"])
                model.zero_grad(set_to_none=True)
                loss = model(chunk.take(tokens), chunk.positions(), chunk.take(labels), chunk)
                loss.backward()
                grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
                results[entry["sample"]] = (float(loss.detach()), grads)
        stats = groups.stats()
        groups.close()
        return results, stats, held
    finally:
        comm.close()
        dist.destroy_process_group()


@functools.lru_cache(maxsize=None)  # one launch per arrangement for the tests below
def _launch(exchange, prepare_each=False):
    with tempfile.TemporaryDirectory() as directory:
        return odc.launch(_rank, 4, os.path.join(directory, "store"), exchange, prepare_each)


@pytest.mark.parametrize("exchange,prepare_each", [("odc", True), ("process-group", False)])
def test_split_groups_give_the_whole_samples_loss_and_gradients(exchange, prepare_each):
    per_rank = _launch(exchange, prepare_each)
    model = AttentionStack()
    for minibatch in SPLITS:
        for entry in minibatch:
            tokens, labels = _sample(entry["sample"])
            model.zero_grad(set_to_none=True)
            whole = model(tokens, torch.arange(len(tokens)), labels)
            whole.backward()
            members = [per_rank[r][0][entry["sample"]] for r in entry["ranks"]]
            assert sum(loss for loss, _ in members) == pytest.approx(
                float(whole.detach()), rel=1e-5
            )
            for name, parameter in model.named_parameters():
                summed = sum(grads[name] for _, grads in members)
                np.testing.assert_allclose(
                    summed, parameter.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name
                )


def test_odc_exchange_moves_k_shards_and_holds_the_current_groups_buffers():
    """Each exchange, forward and backward, gathers k shards for a group of k out of 4 ranks (the
    benchmark's former exchange pulled all 4 forward and 4 x k backward). Prepared per
    minibatch, a rank holds buffers for the group it is in now only, 2 x (1 + k) shards of the
    group's longest chunk (fp32 here), and nothing outside its groups."""
    per_rank = _launch("odc", True)
    for rank, (_, stats, held) in enumerate(per_rank):
        rows_of = {}
        for minibatch in SPLITS:
            for entry in minibatch:
                rows_of[tuple(entry["ranks"])] = max(
                    sum(e - b for b, e in c) for c in entry["chunks"]
                )
        mine = {m: rows for m, rows in rows_of.items() if rank in m}
        assert set(stats) == set(mine)
        for members, rows in mine.items():
            record, k = stats[members], len(members)
            assert record["members"] == k < 4
            assert record["forward"] == record["backward"] == LAYERS
            assert record["elements_pulled"] == 2 * LAYERS * k * rows * KV_WIDTH  # fwd + bwd
        for minibatch, memory in zip(SPLITS, held):
            current = [tuple(e["ranks"]) for e in minibatch if rank in e["ranks"]]
            expected = sum(2 * (1 + len(m)) * rows_of[m] * KV_WIDTH * 4 for m in current)
            assert memory == expected, (rank, memory, expected)


def _errors_rank(rank, world_size, key, store):
    from odc.torch.split import SplitChunk, SplitGroups

    comm = odc.Comm(rank, world_size, key, timeout=60)
    try:
        found = []
        for bad in (
            dict(kv_width=None, dtype=torch.float32),
            dict(kv_width=8, dtype=torch.float16),
            dict(kv_width=8, dtype=torch.float32, exchange="nccl"),
        ):
            try:
                SplitGroups(comm, **bad)
            except InvalidArgument as error:
                found.append(str(error))
        groups = SplitGroups(comm, kv_width=8, dtype=torch.float32)
        for entry in (
            {"ranks": [0], "chunks": [[[0, 3]]]},
            {"ranks": [0, 5], "chunks": [[[0, 2]], [[2, 4]]]},
            {"ranks": [0, 1]},
            {"ranks": [0, 1], "chunks": [[[0, 4]], []]},
            {"ranks": [0, 1], "chunks": [[[0, 2]], [[3, 4]]]},
        ):
            try:
                groups.prepare([entry])
            except InvalidArgument as error:
                found.append(str(error))
        try:
            groups.chunk({"ranks": [0, 1], "chunks": [[[0, 2]], [[2, 4]]]})
        except InvalidUsage as error:
            found.append(str(error))
        try:
            SplitChunk(None, 0, [[(0, 2)], [(3, 4)]])
        except InvalidArgument as error:
            found.append(str(error))
        # A chunk whose group got new buffers (a longer chunk came) refuses to exchange.
        entry = {"ranks": [0, 1], "chunks": [[[0, 2]], [[2, 4]]]}
        groups.prepare([entry])
        stale = groups.chunk(entry)
        groups.prepare([{"ranks": [0, 1], "chunks": [[[0, 6]], [[6, 12]]]}])
        try:
            stale.gather_sample(torch.zeros(1, 2, 8))
        except InvalidUsage as error:
            found.append(str(error))
        groups.close()
        try:
            groups.chunk(entry)
        except InvalidUsage as error:
            found.append(str(error))
        return found
    finally:
        comm.close()


def test_bad_input_is_named():
    with tempfile.TemporaryDirectory() as directory:
        found = odc.launch(_errors_rank, 2, os.path.join(directory, "store"))[0]
    assert len(found) == 12, found
    assert "kv_width" in found[0] and "float32 or bfloat16" in found[1]
    assert "exchange must be one of" in found[2]
    assert "2 or more distinct ranks" in found[3] and "outside the job's 2" in found[4]
    assert "'ranks' and 'chunks'" in found[5]
    assert "member 1" in found[6] and "no tokens" in found[6]
    assert "do not tile" in found[7]
    assert "not among the last prepare()'s splits" in found[8] and "tile" in found[9]
    assert "released its buffers in a later prepare()" in found[10]
    assert "chunk() after close()" in found[11]


def _mismatch_rank(rank, world_size, key, store):
    from odc.torch.split import SplitGroups

    comm = odc.Comm(rank, world_size, key, timeout=20)
    try:
        groups = SplitGroups(comm, kv_width=8, dtype=torch.float32)
        mine = [{"ranks": [0, 1], "chunks": [[[0, 2]], [[2, 4]]]}] if rank == 0 else []
        try:
            groups.prepare(mine)  # rank 1 passes other splits: named, not a transport fault
        except odc.Error as error:
            return str(error)
        return None
    finally:
        comm.close()


def test_ranks_preparing_different_splits_fail_without_blaming_the_transport():
    with tempfile.TemporaryDirectory() as directory:
        messages = odc.launch(_mismatch_rank, 2, os.path.join(directory, "store"))
    assert messages[0] is not None, messages
    assert all("--kv-exchange nccl" not in (m or "") for m in messages), messages


def test_transformers_helpers_name_bad_input():
    """The public transformers helpers (docs/torch.md runs them on a tiny Qwen2 over 3 ranks):
    the keywords they build, and a model without set_attn_implementation refused by name."""
    from odc.torch.split import transformers_attention_kwargs, use_transformers_attention

    kwargs = transformers_attention_kwargs([3, 1, 4])
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 4, 8]
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 4
    with pytest.raises(InvalidArgument, match="exactly one"):
        transformers_attention_kwargs()
    with pytest.raises(InvalidArgument, match="positive token counts"):
        transformers_attention_kwargs([3, 0])
    with pytest.raises(InvalidUsage, match="takes a transformers PreTrainedModel"):
        use_transformers_attention(torch.nn.Linear(2, 2))
