"""odc.train's packed attention on a GPU: bf16 varlen flash attention over packed documents gives
the loss and gradients of the documents run one at a time (per-document causal SDPA); aten's
flash op, called directly, gives torch's varlen_attn's results bit for bit; compiled blocks give
the eager loss, and after odc.train's compile warm-up no packed microbatch compiles again."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch")
pytest.importorskip("transformers", reason="needs transformers")

from odc.train.data import pack  # noqa: E402
from odc import _packed_attention as packed_attention_module  # noqa: E402
from odc.train import model as train_model  # noqa: E402
from odc.train.model import build_model, compile_blocks, varlen_available  # noqa: E402

pytestmark = pytest.mark.one_gpu  # one model on one device


def _loss_and_grads(model, documents):
    packed = pack(documents)
    t = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    model.zero_grad()
    loss = model(
        t(packed.input_ids), t(packed.position_ids), t(packed.labels), t(packed.boundaries),
        packed.longest,
    )  # fmt: skip
    loss.backward()
    return loss.detach().item(), [p.grad.float().clone() for p in model.parameters()]


def test_varlen_packed_equals_documents_one_by_one():
    device = torch.device("cuda", 0)
    assert varlen_available(device), "flash attention is missing on this GPU machine"
    with device:
        model = build_model("tiny", seed=5).to(torch.bfloat16)
    rng = np.random.default_rng(1)
    documents = [rng.integers(0, 1024, n) for n in (300, 17, 1, 900, 64)]
    packed_loss, packed_grads = _loss_and_grads(model, documents)  # one varlen call per layer
    separate = [_loss_and_grads(model, [d]) for d in documents]
    separate_loss = sum(loss for loss, _ in separate)
    separate_grads = [sum(g) for g in zip(*(grads for _, grads in separate))]
    assert packed_loss == pytest.approx(separate_loss, rel=1e-2)  # bf16 compute
    for ours, theirs in zip(packed_grads, separate_grads):
        scale = float(theirs.abs().max()) + 1e-6
        assert float((ours - theirs).abs().max()) / scale < 5e-2
    # And against the fp32 per-document SDPA path (the CPU one), so varlen is really compared
    # with a different kernel: the loss agrees to bf16 precision.
    with device:
        reference = build_model("tiny", seed=5)
    reference_loss = sum(_loss_and_grads(reference, [d])[0] for d in documents)
    assert packed_loss == pytest.approx(reference_loss, rel=2e-2)


def test_direct_flash_op_equals_torch_varlen_attn_bit_for_bit():
    # odc.train calls aten's flash op itself (less host time: docs/benchmarks.md, "5. The host
    # floor"); torch's public varlen_attn runs the same kernels through Python custom ops. Same
    # outputs and gradients, bit for bit (dq up to the flash backward's atomic accumulation order,
    # which varies run to run).
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        pytest.skip("torch < 2.10 has no varlen_attn to compare with")
    device = torch.device("cuda", 0)
    torch.manual_seed(1)
    shapes = [(700, 12, 128), (700, 2, 128), (700, 2, 128)]  # GQA: 12 query heads, 2 kv heads
    inputs = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]
    boundaries = torch.tensor([0, 300, 650, 651, 700], dtype=torch.int32, device=device)
    results = []
    for attend in (
        lambda q, k, v: packed_attention_module._flash_varlen_causal(q, k, v, boundaries, 350, 0.1),
        lambda q, k, v: varlen_attn(
            q, k, v, boundaries, boundaries, 350, 350, scale=0.1, window_size=(-1, 0)
        ),
    ):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = attend(*leaves)
        out.float().pow(2).sum().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
    (out, dq, dk, dv), (ref_out, ref_dq, ref_dk, ref_dv) = results
    assert torch.equal(out, ref_out)
    assert torch.equal(dk, ref_dk) and torch.equal(dv, ref_dv)
    assert float((dq.float() - ref_dq.float()).abs().max()) <= 1e-3 * float(ref_dq.abs().max())


def test_compiled_blocks_give_the_eager_loss_at_new_sizes():
    device = torch.device("cuda", 0)
    with device:
        eager = build_model("tiny", seed=5).to(torch.bfloat16)
        compiled = build_model("tiny", seed=5).to(torch.bfloat16)
    for model in (eager, compiled):
        model.gradient_checkpointing_enable()
    assert compile_blocks(compiled)
    rng = np.random.default_rng(2)
    for lengths in ((300, 17, 1), (900, 64), (2000,), (5, 7)):  # new sizes: no recompile limit hit
        documents = [rng.integers(0, 1024, n) for n in lengths]
        eager_loss, eager_grads = _loss_and_grads(eager, documents)
        compiled_loss, compiled_grads = _loss_and_grads(compiled, documents)
        assert compiled_loss == pytest.approx(eager_loss, rel=1e-2)
        for ours, theirs in zip(compiled_grads, eager_grads):
            scale = float(theirs.abs().max()) + 1e-6
            assert float((ours - theirs).abs().max()) / scale < 5e-2
    from torch._dynamo.utils import counters

    assert counters["frames"]["ok"] >= 1, "compile_blocks compiled nothing"


def test_compile_warm_up_leaves_nothing_to_compile_for_packed_microbatches(monkeypatch):
    # odc.train runs compile_warm_up_microbatches before its measured minibatches: afterwards a
    # microbatch of any size in the range, packing any number of documents, must find compiled
    # code (a recompile inside a measured minibatch cost 8-11 s on 4 H200s). The 1.5b preset's
    # width (inductor's size heuristics depend on it), two layers.
    from torch._dynamo.utils import counters

    monkeypatch.setitem(
        train_model.PRESETS, "1.5b", dict(train_model.PRESETS["1.5b"], num_hidden_layers=2)
    )
    torch._dynamo.reset()
    device = torch.device("cuda", 0)
    with device:
        model = build_model("1.5b", seed=3).to(torch.bfloat16)
    model.gradient_checkpointing_enable()
    assert compile_blocks(model)
    smallest, largest = 300, 9000  # across the preset's thresholds (3,414 and 4,096 tokens)
    for packed in train_model.compile_warm_up_microbatches(smallest, largest, 1000, seed=1):
        documents = np.split(packed.input_ids, packed.boundaries[1:-1])
        _loss_and_grads(model, documents)
    compiled = counters["stats"]["unique_graphs"]
    rng = np.random.default_rng(4)
    for _ in range(12):
        tokens = int(rng.integers(smallest, largest + 1))
        count = int(rng.integers(1, 17))
        cuts = np.sort(rng.choice(np.arange(1, tokens), size=count - 1, replace=False))
        documents = np.split(rng.integers(0, 1000, tokens), cuts)
        _loss_and_grads(model, documents)
        assert counters["stats"]["unique_graphs"] == compiled, (tokens, count)
