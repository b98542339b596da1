"""odc.train's data and metrics building blocks (no torch needed)."""

import json

import numpy as np
import pytest

from odc.train import MinibatchTiming, load_token_ids, pack, schedule, summarize, synthetic_tokens
from odc.train.data import IGNORE_INDEX


def test_pack_keeps_documents_apart():
    a, b = np.array([5, 6, 7]), np.array([8, 9])
    packed = pack([a, b])
    assert packed.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert packed.document_ids.tolist() == [0, 0, 0, 1, 1]
    # No document predicts the next one's first token.
    assert packed.labels.tolist() == [6, 7, IGNORE_INDEX, 9, IGNORE_INDEX]
    assert packed.num_tokens == 5 and packed.num_predicted == 3 and packed.num_documents == 2


def test_pack_empty_microbatch_has_no_loss():
    packed = pack([])
    assert packed.num_tokens == 1 and packed.num_predicted == 0 and packed.num_documents == 0


def test_synthetic_tokens_are_reproducible():
    first = synthetic_tokens([3, 5], vocab_size=11, seed=4)
    second = synthetic_tokens([3, 5], vocab_size=11, seed=4)
    assert [len(s) for s in first] == [3, 5]
    assert all(np.array_equal(x, y) for x, y in zip(first, second))
    assert all(s.max() < 11 for s in first)


def test_load_token_ids(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps([1, 2, 3]) + "\n\n" + json.dumps({"input_ids": [4, 5]}) + "\n")
    samples = load_token_ids(str(path))
    assert [s.tolist() for s in samples] == [[1, 2, 3], [4, 5]]
    path.write_text("[1, 2]\n{not json\n")
    with pytest.raises(ValueError, match="line 2: not JSON"):
        load_token_ids(str(path))
    path.write_text("[1]\n")
    with pytest.raises(ValueError, match="line 1: expected at least 2"):
        load_token_ids(str(path))
    path.write_text("\n")
    with pytest.raises(ValueError, match="no samples"):
        load_token_ids(str(path))


def test_load_token_ids_names_ids_out_of_range_and_deep_nesting(tmp_path):
    # These were tracebacks (OverflowError, RecursionError, or an IndexError inside the
    # ranks' embedding for an id beyond the vocabulary).
    path = tmp_path / "data.jsonl"
    path.write_text("[1, 2]\n[1, 1024]\n")
    assert len(load_token_ids(str(path))) == 2
    with pytest.raises(ValueError, match="line 2: token id 1024 is beyond the vocabulary of 1024"):
        load_token_ids(str(path), vocab_size=1024)
    path.write_text(f"[1, {2**63}]\n")
    with pytest.raises(ValueError, match=f"line 1: token id {2**63} is beyond the largest int64"):
        load_token_ids(str(path))
    path.write_text("[1, 2]\n" + "[" * 100000 + "]" * 100000 + "\n")
    with pytest.raises(ValueError, match="line 2: not a list of token ids .nested too deeply"):
        load_token_ids(str(path))
    path.write_text("[1, 1" + "0" * 5000 + "]\n")
    with pytest.raises(ValueError, match="line 1: not JSON"):
        load_token_ids(str(path))


def test_schedule_is_the_planner_plan():
    plan = schedule(
        [5, 9, 3, 7, 2, 8], ranks=2, samples_per_minibatch=3, max_tokens=10, policy="lb-mini"
    )
    assert [mb["samples"] for mb in plan["minibatches"]] == [[0, 1, 2], [3, 4, 5]]


def test_measured_bubble_and_summary():
    # Two ranks: 3 s and 1 s of compute in a 4 s minibatch: bubble 1 - 4 / (2 * 4) = 0.5.
    first = MinibatchTiming(busy_seconds=[3.0, 1.0], span_seconds=4.0, samples=4, tokens=400)
    second = MinibatchTiming(busy_seconds=[2.0, 2.0], span_seconds=2.0, samples=4, tokens=200)
    assert first.bubble == pytest.approx(0.5)
    assert second.bubble == pytest.approx(0.0)
    summary = summarize([first, second])
    assert summary["bubble"] == pytest.approx(1 - 8.0 / (2 * 6.0))
    assert summary["samples_per_second"] == pytest.approx(8 / 6.0)
    assert summary["tokens_per_second"] == pytest.approx(100.0)
    assert summary["idle_seconds"] == pytest.approx([1.0, 3.0])
    with pytest.raises(ValueError, match="no minibatches"):
        summarize([])


def test_prediction_is_time_weighted_like_the_measurement():
    # docs/design.md ("Measuring"): over several minibatches bubble = 1 - sum(busy) / (N * sum(T))
    # on both sides.
    # Cost a=1 per token: minibatch 1 is rank 0 = 9, rank 1 = 1 (ODC span 9, bubble 4/9);
    # minibatch 2 is 1 and 1 (span 1, bubble 0). Time-weighted: 1 - 12 / (2 * 10) = 0.4; the
    # plain mean of per-minibatch bubbles would be 2/9 = 0.222.
    from odc.train.metrics import compare_prediction, predict_minibatch

    lengths = [9, 1, 1, 1]
    first = [{"microbatches": [[0]]}, {"microbatches": [[1]]}]
    second = [{"microbatches": [[2]]}, {"microbatches": [[3]]}]
    predicted = [predict_minibatch(r, lengths, (1.0, 0.0, 0.0), "odc") for r in (first, second)]
    assert [p.span_seconds for p in predicted] == [9.0, 1.0]
    measured = [
        MinibatchTiming(busy_seconds=[9.0, 1.0], span_seconds=10.0, samples=2, tokens=10),
        MinibatchTiming(busy_seconds=[1.0, 1.0], span_seconds=1.0, samples=2, tokens=2),
    ]
    result = compare_prediction(measured, predicted)
    assert result["predicted_bubble"] == pytest.approx(0.4)
    assert result["predicted_seconds"] == pytest.approx(10.0)
    assert result["span_error"] == pytest.approx(10.0 / 11.0 - 1.0)
    rows = result["per_minibatch"]
    assert [r["relative_error"] for r in rows] == pytest.approx([-0.1, 0.0])
    assert rows[0]["predicted_bubble"] == pytest.approx(4 / 9)
    assert rows[0]["measured_bubble"] == pytest.approx(0.5)
    assert result["span_error_worst"] == pytest.approx(-0.1)
    assert result["span_error_mean_abs"] == pytest.approx(0.05)
    with pytest.raises(ValueError, match="one prediction per measured minibatch"):
        compare_prediction(measured, predicted[:1])


def test_collective_prediction_waits_for_the_slowest_rank_per_step():
    from odc.train.metrics import predict_minibatch

    # Rank 0 runs microbatches of cost 1+3 and 5; rank 1 runs 4 and 1, plus c = 1 each.
    lengths = [1, 3, 5, 4, 1]
    ranks = [{"microbatches": [[0, 1], [2]]}, {"microbatches": [[3], [4]]}]
    collective = predict_minibatch(ranks, lengths, (1.0, 0.0, 1.0), "collective")
    odc = predict_minibatch(ranks, lengths, (1.0, 0.0, 1.0), "odc")
    assert collective.busy_seconds == [11.0, 7.0]
    assert collective.span_seconds == pytest.approx(max(5, 5) + max(6, 2))
    assert odc.span_seconds == pytest.approx(11.0)
    with pytest.raises(ValueError, match="mode"):
        predict_minibatch(ranks, lengths, (1.0, 0.0, 1.0), "nccl")


def test_loss_verdict_names_every_kind_of_disagreement():
    """The table's agreement line: differences relative to each value, or to the mean magnitude
    where the values cross zero (GRPO); a non-finite value or a missing one is a difference."""
    from odc.train.__main__ import _loss_verdict

    sft = {"device": "cpu", "losses": [10.0, 10.0, 10.0, 0.5], "grad_norms": [1.0] * 4}
    assert "AGREE" in _loss_verdict([sft, dict(sft)])
    # 10% on a small loss of a run that does not cross zero: no mean-magnitude floor there.
    assert "DIFFER" in _loss_verdict([sft, {**sft, "losses": [10.0, 10.0, 10.0, 0.55]}])
    assert "DIFFER" in _loss_verdict([sft, {**sft, "losses": [float("nan")] * 4}])
    assert "DIFFER" in _loss_verdict([sft, {**sft, "grad_norms": [1.0, 1.0]}])
    assert "DIFFER" in _loss_verdict([sft, {k: v for k, v in sft.items() if k != "grad_norms"}])
    # GRPO's losses cross zero: 2e-4 absolute near zero is 2% of -0.0085 but 0.2% of the scale.
    grpo = {"device": "cuda", "losses": [-0.169, -0.0085, 0.178, 0.0115], "grad_norms": [1.3] * 4}
    assert "AGREE" in _loss_verdict([grpo, {**grpo, "losses": [-0.169, -0.0087, 0.178, 0.0115]}])
    assert "DIFFER" in _loss_verdict([grpo, {**grpo, "losses": [-0.169, -0.0085, 0.1, 0.0115]}])
