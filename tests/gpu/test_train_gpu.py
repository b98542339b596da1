"""odc.train's packed attention on a GPU: bf16 varlen flash attention over packed documents gives
the loss and gradients of the documents run one at a time (per-document causal SDPA)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch")
pytest.importorskip("transformers", reason="needs transformers")

from odc.train.data import pack  # noqa: E402
from odc.train.model import build_model, varlen_available  # noqa: E402


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
    assert varlen_available(device), "torch's varlen attention is missing on this GPU machine"
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
