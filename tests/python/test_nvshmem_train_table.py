"""dev/gpu/nvshmem_train.py's table on recorded-looking inputs (the stage itself needs GPUs): driver
peaks from nvidia-smi samples, odc's byte counters from the ranks' stderr (the core's line
optional), ratios against FSDP2 and the CUDA transport, a failed arm, and each arm's command."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "dev" / "gpu" / "nvshmem_train.py"


@pytest.fixture(scope="module")
def nvtrain():
    spec = importlib.util.spec_from_file_location("nvshmem_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HEADER = "# gpu 0 GPU-aaa\n# gpu 1 GPU-bbb\n"


def samples(*blocks):
    """One sampler file: each block a {pid: [(MiB, uuid), ...]} sample."""
    text = HEADER
    for t, block in enumerate(blocks):
        text += f"# t={0.2 * t:.2f}\n"
        for pid, rows in block.items():
            text += "".join(f"{pid}, {mib}, {uuid}\n" for mib, uuid in rows)
    return text


def result(seconds, torch_gib, odc_gib=0.0, ranks=2):
    gib = 1 << 30
    return {
        "minibatch_seconds": seconds,
        "memory": {"torch_peak_bytes": int(torch_gib * gib), "odc_total_bytes": int(odc_gib * gib)},
        "peak_memory_bytes": int((torch_gib + odc_gib) * gib),
        "ranks": ranks,
        "warmup_steps": 1,
        "steps_measured": len(seconds),
        "losses": [1.0] * (len(seconds) + 1),
    }


NVSHMEM_STDERR = """[W init] some warning
odc.train: NVSHMEM heap 6.25 GiB per GPU (sized by odc to the model); odc needs 6.25 GiB (...)
odc nvshmem rank 1: to/from other nodes: 5000000000 bytes put, 20000000000 bytes fetched (1 ranks per node, 0 direct peers)
odc nvshmem rank 0: to/from other nodes: 4000000000 bytes put, 20000000000 bytes fetched (1 ranks per node, 0 direct peers)
"""
CORE_STDERR = """odc rank 0: streamed chunks to other nodes: 3600000000 bytes during minibatches, 400000000 bytes in minibatch_end (4 minibatches)
odc rank 1: streamed chunks to other nodes: 4500000000 bytes during minibatches, 500000000 bytes in minibatch_end (4 minibatches)
"""


def test_driver_peaks_sum_a_process_over_its_gpus_and_keep_the_max(nvtrain):
    text = samples(
        {10: [(1000, "GPU-aaa")], 11: [(900, "GPU-bbb"), (300, "GPU-aaa")]},  # 11: 1200 on bbb
        {10: [(5000, "GPU-aaa")], 11: [(4000, "GPU-bbb")]},
        {10: [(4500, "GPU-aaa")]},
    )
    text += "[N/A], [N/A], GPU-aaa\n"  # a row nvidia-smi could not fill: skipped
    peaks = nvtrain.driver_peaks(text)
    assert peaks == {0: {"peak_mib": 5000, "pid": 10}, 1: {"peak_mib": 4000, "pid": 11}}
    assert nvtrain.driver_peaks(HEADER) == {}


def test_stderr_counters_parsed_and_optional(nvtrain):
    stats = nvtrain.parse_stderr("[rank0]: " + NVSHMEM_STDERR + CORE_STDERR)
    assert stats["heap_gib"] == 6.25
    assert stats["nvshmem"][0] == {"put": 4000000000, "fetched": 20000000000}
    assert stats["core"][1] == {"during": 4500000000, "at_end": 500000000, "minibatches": 4}
    empty = nvtrain.parse_stderr("nothing from odc here\n")
    assert empty == {"nvshmem": {}, "core": {}, "heap_gib": None}


def _write_arm(folder, name, run, stderr, sampled):
    if run is not None:
        (folder / f"{name}.json").write_text(json.dumps([run]))
    (folder / f"{name}.stderr").write_text(stderr)
    (folder / f"{name}.samples").write_text(sampled)


def test_table_of_recorded_arms(nvtrain, tmp_path):
    mem = lambda a, b: samples({1: [(a, "GPU-aaa")], 2: [(b, "GPU-bbb")]})  # noqa: E731
    _write_arm(tmp_path, "fsdp2", result([2.0, 2.0, 2.0], 10.0), "", mem(20480, 19456))
    _write_arm(tmp_path, "cuda", result([1.0, 2.0, 1.0], 9.0, 2.0), "", mem(20480, 20480))
    # NVSHMEM flat: the core's line present (4 minibatches), 5% slower in total.
    flat = result([1.05, 2.1, 1.05], 9.0, 2.5)
    _write_arm(tmp_path, "nvshmem-flat", flat, NVSHMEM_STDERR + CORE_STDERR, mem(22528, 21504))
    # With the node schemes, no core line (an older core): minibatches from the JSON (1 + 3).
    nodes = result([1.0, 2.0, 1.1], 9.0, 3.0)
    _write_arm(tmp_path, "nvshmem-nodes", nodes, NVSHMEM_STDERR, mem(23552, 23552))
    # A 7b arm that failed: no results, its samples still there.
    _write_arm(tmp_path, "nvshmem-flat-7b", None, "Traceback ...\n", mem(70000, 69000))

    printed = nvtrain.table(tmp_path)
    summary = json.loads((tmp_path / "nvshmem_train.json").read_text())
    assert (tmp_path / "nvshmem_train.txt").read_text().strip() == printed.strip()
    rows = {r["arm"]: r for r in summary["arms"]}
    assert list(rows) == ["fsdp2", "cuda", "nvshmem-flat", "nvshmem-nodes", "nvshmem-flat-7b"]

    fl = rows["nvshmem-flat"]
    assert fl["driver_peak_gib"] == 22.0 and fl["driver_vs_fsdp2"] == pytest.approx(22 / 20)
    assert fl["time_vs_cuda"] == pytest.approx(4.2 / 4.0)
    assert fl["time_vs_cuda_range"] == pytest.approx([1.05, 1.05])
    assert fl["heap_gib"] == 6.25 and fl["odc_symmetric_gib"] == pytest.approx(2.5)
    assert fl["minibatches_counted"] == 4
    assert fl["put_gb_per_minibatch"] == {"0": 1.0, "1": 1.25}  # JSON keys are strings
    assert fl["fetched_gb_per_minibatch"]["0"] == 5.0
    assert fl["sent_before_end_percent"] == {"0": 90.0, "1": 90.0}
    assert fl["streamed_gb_per_minibatch"]["1"] == 1.25

    nd = rows["nvshmem-nodes"]
    assert nd["minibatches_counted"] == 4 and nd["sent_before_end_percent"] == {}
    assert nd["put_gb_per_minibatch"]["1"] == 1.25
    assert rows["cuda"]["driver_vs_fsdp2"] == pytest.approx(1.0)
    assert rows["fsdp2"]["time_vs_cuda"] == pytest.approx(6.0 / 4.0)
    assert not rows["nvshmem-flat-7b"]["ok"]

    lines = printed.splitlines()
    flat_line = next(x for x in lines if x.startswith("nvshmem-flat "))
    assert "1.050 [1.05-1.05]" in flat_line and "1.100x" in flat_line and "22.0 21.0" in flat_line
    assert any(x.startswith("nvshmem-flat-7b") and "FAILED" in x for x in lines)
    bytes_line = [x for x in lines if x.startswith("nvshmem-flat ")][1]
    assert bytes_line.split()[1:] == ["1.00-1.25", "5.00", "1.00-1.25", "90.0", "4"]


def test_arm_commands(nvtrain):
    argv, env, removed = nvtrain.arm_command("nvshmem-flat", 4, Path("o.json"), {})
    assert env["ODC_LOCAL_WORLD_SIZE"] == "2" and env["ODC_TRANSPORT"] == "nvshmem"
    assert env["ODC_NODE_CACHE_BYTES"] == "0" and env["ODC_NODE_AGGREGATION_BYTES"] == "0"
    assert env["ODC_NVSHMEM_STATS"] == env["ODC_NODE_STATS"] == "1"
    assert argv[argv.index("--nproc_per_node") + 1] == "4"
    assert argv[argv.index("--comm") + 1] == "odc" and argv[argv.index("--preset") + 1] == "1.5b"
    _, env, removed = nvtrain.arm_command("nvshmem-nodes", 2, Path("o.json"), {})
    assert env["ODC_LOCAL_WORLD_SIZE"] == "1" and "ODC_NODE_CACHE_BYTES" in removed
    assert env["ODC_NODE_AGGREGATION_BYTES"] == "1G"
    argv, env, removed = nvtrain.arm_command("fsdp2-7b", 4, Path("o.json"), {})
    assert (
        argv[argv.index("--comm") + 1] == "collective" and argv[argv.index("--preset") + 1] == "7b"
    )
    assert argv[argv.index("--steps") + 1] == "3" and "ODC_LOCAL_WORLD_SIZE" in removed
    _, env, removed = nvtrain.arm_command("cuda", 4, Path("o.json"), {"NVTRAIN_STEPS": "2"})
    assert env["ODC_TRANSPORT"] == "cuda" and "ODC_LOCAL_WORLD_SIZE" in removed
    _, env, removed = nvtrain.arm_command("nvshmem-one-node", 4, Path("o.json"), {})
    assert env["ODC_LOCAL_WORLD_SIZE"] == "4" and env["ODC_TRANSPORT"] == "nvshmem"
    with pytest.raises(SystemExit):
        nvtrain.arm_command("nccl", 4, Path("o.json"), {})
