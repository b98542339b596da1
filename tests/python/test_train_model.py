"""odc.train's packed model and cost fit: a packed microbatch gives exactly the loss and gradients
of its documents run one by one through plain transformers; the cost fit recovers known
coefficients and never goes negative."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the packed model needs torch")
pytest.importorskip("transformers", reason="the packed model needs transformers")

from odc._cost_fit import (  # noqa: E402
    fit_cost,
    fit_cost_with_floor,
    floor_length,
    ladder,
    packed_ladder,
)
from odc.train.data import pack  # noqa: E402
from odc.train.model import build_model, compile_blocks, packed_attention  # noqa: E402


def _inputs(packed):
    t = torch.from_numpy
    return (
        t(packed.input_ids),
        t(packed.position_ids),
        t(packed.labels),
        t(packed.boundaries),
        packed.longest,
    )


def _plain_hf_loss(model, documents):
    """The same weights in transformers' own SDPA model, one unpacked document at a time."""
    plain = type(model.lm)._from_config(model.lm.config, attn_implementation="sdpa")
    plain.load_state_dict(model.lm.state_dict())
    total = 0.0
    for document in documents:
        ids = torch.from_numpy(document).view(1, -1)
        logits = plain(input_ids=ids).logits[0, :-1].float()
        total = total + torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
    return total, plain


def test_packed_loss_and_gradients_equal_separate_documents():
    model = build_model("tiny", seed=3)
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 1024, n) for n in (5, 17, 1, 9)]
    loss = model(*_inputs(pack(documents)))
    loss.backward()
    reference, plain = _plain_hf_loss(model, documents)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    for (name, ours), theirs in zip(model.lm.named_parameters(), plain.parameters()):
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-5, rtol=1e-4), name


def test_loss_chunks_do_not_change_the_loss(monkeypatch):
    import odc.train.model as model_module

    model = build_model("tiny", seed=1)
    documents = [np.arange(1, 40) % 1024, np.arange(7, 30) % 1024]
    whole = float(model(*_inputs(pack(documents))))
    monkeypatch.setattr(model_module, "LOSS_CHUNK_TOKENS", 7)
    assert float(model(*_inputs(pack(documents)))) == pytest.approx(whole, rel=1e-6)


def test_padding_microbatch_has_zero_loss():
    model = build_model("tiny")
    assert float(model(*_inputs(pack([])))) == 0.0


def test_packed_attention_refuses_a_mask_or_missing_boundaries():
    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(ValueError, match="not an attention mask"):
        packed_attention(None, q, q, q, torch.ones(1, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        packed_attention(None, q, q, q, None)


def test_compile_blocks_keeps_the_plain_path_on_the_cpu():
    # --compile compiles only where varlen attention runs (CUDA); on the CPU the blocks stay as
    # they were and the loss is unchanged.
    model = build_model("tiny")
    forwards = [layer.forward for layer in model.layers]
    documents = [np.arange(1, 9, dtype=np.int64), np.arange(3, 8, dtype=np.int64)]
    before = model(*_inputs(pack(documents))).item()
    assert compile_blocks(model) is False
    assert [layer.forward for layer in model.layers] == forwards
    assert model(*_inputs(pack(documents))).item() == before


def _saved_activation_bytes(rank, world_size, key, store, variant):
    """Bytes autograd saves outside activation checkpointing's regions in one forward of the
    tiny model sharded by shard_blocks (one gloo rank): checkpointing keeps its regions' tensors
    to itself, so what is left is small where it recomputes and large where it does not."""
    import torch.distributed as dist

    from odc.train.model import shard_blocks

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        model = build_model("tiny", seed=1)
        if variant != "no checkpointing":
            model.gradient_checkpointing_enable()
        compiled = shard_blocks(model, compile=variant == "compiled", backend="aot_eager")
        assert compiled == (variant == "compiled")
        documents = [np.arange(1, 200) % 1024, np.arange(7, 130) % 1024]
        saved = []

        def keep(tensor):
            saved.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            loss = model(*_inputs(pack(documents)))
        loss.backward()
        return sum(saved), loss.item()
    finally:
        dist.destroy_process_group()


@pytest.mark.long
def test_compiled_blocks_keep_recomputing_under_fully_shard(tmp_path):
    # odc.train compiles the blocks after fully_shard (shard_blocks): compiled before, a block
    # kept the pre-FSDP class's forward and transformers' checkpointing stopped recomputing,
    # silently (5.5 MB saved here instead of 0.76 MB; 8.9 MB without checkpointing). aot_eager
    # traces and partitions as inductor does, on the CPU.
    import odc

    results = {}
    for variant in ("checkpointed", "compiled", "no checkpointing"):
        store = str(tmp_path / variant.replace(" ", "_"))
        [results[variant]] = odc.launch(_saved_activation_bytes, 1, store, variant, timeout=300)
    saved = {variant: result[0] for variant, result in results.items()}
    assert saved["compiled"] <= 1.2 * saved["checkpointed"], saved
    assert saved["no checkpointing"] > 4 * saved["checkpointed"], saved
    losses = [result[1] for result in results.values()]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])


def test_compile_sizes_meet_every_range_torch_guards_on():
    from odc.errors import InvalidArgument
    from odc.train.model import DENSE_COMPILE_TOKENS, compile_sizes

    sizes = compile_sizes(300, 65536)
    assert sizes[0] == 300 and sizes[-1] == 65536 and sizes == sorted(set(sizes))
    # Every range 1.2x wide (inductor's narrowest seen: 3,414-4,095 tokens) holds a size below
    # DENSE_COMPILE_TOKENS; the 1.5b preset's two thresholds each get a size on both sides.
    for low in range(300, DENSE_COMPILE_TOKENS - 1):
        assert any(low <= n <= 1.2 * low for n in sizes), low
    assert any(3414 <= n <= 4095 for n in sizes) and any(n < 3414 for n in sizes)
    assert len(sizes) < 50  # a warm-up of seconds, not minutes
    assert compile_sizes(512, 512) == [512]
    with pytest.raises(InvalidArgument, match="smallest <= largest"):
        compile_sizes(10, 5)


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        build_model("huge")


def test_fit_cost_recovers_coefficients():
    lengths = ladder(65536)
    seconds = [0.069 + 1.69e-5 * n + 9.75e-10 * n * n for n in lengths]
    a, b, c = fit_cost(lengths, seconds)
    assert a == pytest.approx(1.69e-5, rel=1e-6)
    assert b == pytest.approx(9.75e-10, rel=1e-6)
    assert c == pytest.approx(0.069, rel=1e-6)


def test_packed_rungs_separate_linear_from_quadratic():
    """Rung times of c + sum(a L + b L^2) off by an alternating +-2% (a noisy GPU): on single
    samples only, L and L^2 rise together and the fit trades a for b, so packed microbatches
    (sum of L^2 well under T^2) come out 5-10% off; with the packed rungs they stay within 2%.
    Noise-free, the fit recovers a, b, c exactly (packed documents' lengths as lists)."""
    # Near the 1.5b preset's on 4 H100s (dev/analysis/packed_rungs.py).
    a, b, c = 3.2e-5, 1.2e-9, 0.08
    single = [[n] for n in ladder(65536)]
    rungs = single + packed_ladder(65536)

    def seconds(rung):
        return c + sum(a * n + b * n * n for n in rung)

    assert fit_cost(rungs, [seconds(r) for r in rungs]) == pytest.approx((a, b, c), rel=1e-6)
    probes = [[16384] * 4, [8192] * 6, [4096] * 8, [65536]]  # packed, as LB-Mini makes them

    def worst_error(ladder_rungs, pattern):
        noisy = [seconds(r) * (1 + 0.02 * pattern[i % 2]) for i, r in enumerate(ladder_rungs)]
        fa, fb, fc = fit_cost(ladder_rungs, noisy)
        return max(abs(fc + sum(fa * n + fb * n * n for n in p) - seconds(p)) / seconds(p)
                   for p in probes)  # fmt: skip

    for pattern in ((1, -1), (-1, 1)):
        assert worst_error(single, pattern) > 0.05
        assert worst_error(rungs, pattern) < 0.02


def test_packed_ladder():
    # The two longest rungs as 4 and 16 equal documents: the same tokens, sum of L^2 4x/16x less.
    assert packed_ladder(65536) == [[9196, 9195, 9195, 9195], [2299] * 13 + [2298] * 3,
                                    [16384] * 4, [4096] * 16]  # fmt: skip
    assert [sum(r) for r in packed_ladder(65536)] == [ladder(65536)[-2]] * 2 + [65536] * 2
    assert packed_ladder(16) == [[4, 3, 3, 3], [4] * 4]  # documents of at least 2 tokens
    assert all(min(r) >= 2 for n in (8, 40, 1000) for r in packed_ladder(n))


def test_fit_cost_stays_non_negative():
    # Times that fall with length would need a negative slope: the fit drops that term instead.
    a, b, c = fit_cost([100, 200, 400, 800], [0.5, 0.4, 0.45, 0.41])
    assert min(a, b, c) >= 0.0
    with pytest.raises(ValueError, match="at least three"):
        fit_cost([1, 2], [1, 2])
    with pytest.raises(ValueError, match="positive lengths"):
        fit_cost([0, 1, 2], [1, 1, 1])


def test_fit_with_floor_leaves_host_bound_rungs_out():
    """Times that follow max(floor, c + a L + b L^2): the short rungs sit on the floor, and the
    fit on the others recovers a, b, c; the floor is the short microbatch's time as measured."""
    lengths = ladder(65536)
    floor = 0.3
    seconds = [max(floor, 0.07 + 3e-5 * n + 1.2e-9 * n * n) for n in lengths]
    assert seconds[0] == floor  # the 2K rung is floor-bound: it would pull c up
    a, b, c, fitted_floor = fit_cost_with_floor(lengths, seconds, floor)
    assert (a, b, c) == pytest.approx((3e-5, 1.2e-9, 0.07), rel=1e-6)
    assert fitted_floor == floor
    # All rungs near the floor: too few remain, so every rung is fitted.
    a, b, c, _ = fit_cost_with_floor([100, 200, 400], [0.30, 0.31, 0.33], 0.3)
    assert c > 0
    with pytest.raises(ValueError, match="floor"):
        fit_cost_with_floor(lengths, seconds, float("nan"))
    assert floor_length(65536) == 256 and floor_length(64) >= 2


def test_ladder():
    assert ladder(65536) == sorted(ladder(65536))
    assert ladder(65536)[0] == 2048 and ladder(65536)[-1] == 65536
    assert ladder(40)[0] == 10 and ladder(40)[-1] == 40
    assert len(ladder(8)) >= 3 and ladder(16)[-1] == 16
    with pytest.raises(ValueError, match="at least 8"):
        ladder(7)


@pytest.mark.parametrize(
    "extra, compiled",
    [([], True), (["--no-compile"], False), (["--split", "auto"], False), (["--compile"], True)],
)
def test_cli_compiles_the_blocks_by_default_where_they_can_run(extra, compiled):
    # The fast path (compiled blocks) is the default (every arm alike), --no-compile shows the eager
    # floor beside it; split samples run eagerly unless --compile is asked for (refused then).
    from odc.train.__main__ import _check_options, parse_args, parse_cost

    args = parse_args(["--lengths", "lengths.txt", *extra])
    _check_options(args, parse_cost(args.cost))
    assert args.compile is compiled
