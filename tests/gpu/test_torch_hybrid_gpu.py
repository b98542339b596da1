"""odc.torch on an FSDP2 HSDP mesh on GPUs, 2 "nodes" x 2 GPUs (the CUDA transport inside each
pair, NCCL across): LB-Mini plans over all 4 ranks give the single-process result; with bf16 mixed
precision the loss curve follows plain FSDP2 HSDP's."""

import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="odc.torch GPU tests need torch")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))

from tiny_lm import max_diff, plans, reference_state, train  # noqa: E402

MESH = (2, 2)  # (replicate, shard)


@pytest.fixture(autouse=True)
def _four_gpus():
    if torch.cuda.device_count() < 4:
        pytest.skip(f"a 2 x 2 HSDP mesh needs 4 CUDA devices, found {torch.cuda.device_count()}")


def test_hybrid_unequal_counts_fp32_equal_single_process():
    results = train(4, plans(4, "lb-mini"), use_odc=True, device="cuda", mesh=MESH)
    counts = [result[0] for result in results]
    assert any(a != b for a, b in zip(counts[0], counts[2])), "nodes must run different counts"
    for result in results:  # both replicas: the flat GPU test's tolerance
        assert max_diff(result[1], reference_state()) < 1e-4


def test_hybrid_bf16_loss_curve_follows_plain_fsdp2_hsdp():
    schedule = plans(4, "lb-micro")  # equal counts: plain FSDP2 HSDP can run it
    options = dict(device="cuda", bf16=True, mesh=MESH)
    odc_results = train(4, schedule, use_odc=True, **options)
    hsdp_results = train(4, schedule, use_odc=False, **options)
    odc_losses, hsdp_losses = odc_results[0][2], hsdp_results[0][2]
    print(f"losses odc hybrid {odc_losses}\nlosses fsdp2 hsdp {hsdp_losses}")
    assert np.allclose(odc_losses, hsdp_losses, rtol=1e-3, atol=0)
    assert max_diff(odc_results[0][1], hsdp_results[0][1]) < 1e-3
