"""The GPU protocol suite (tests/gpu/test_cuda_comm.py) over the NVSHMEM transport, selected the
way a user selects it, by the launch environment (ODC_TRANSPORT=nvshmem), in both of its data
paths: NVSHMEM's own get / put-with-signal calls (ODC_NVSHMEM_DIRECT=0, the calls that cross
nodes) and direct NVLink loads/stores over NVSHMEM's mappings (ODC_NVSHMEM_DIRECT=1), and with
pretended node boundaries (ODC_LOCAL_WORLD_SIZE=2: on 4 GPUs two "nodes" of two): peers on the
other "node" through NVSHMEM's calls, pushes to them pre-reduced on the node (hierarchical).
NVSHMEM is staged (no remote float add), so every sum here goes through put-with-signal and the
owner's fold. Skipped where the plugin libodc_nvshmem.so is not next to libodc.so (or $ODC_NVSHMEM_PLUGIN).
"""

import os
from pathlib import Path

import pytest

import odc

import test_cuda_comm as suite


def _plugin_path():
    given = os.environ.get("ODC_NVSHMEM_PLUGIN")
    if given:
        return Path(given)
    return Path(odc._capi.lib._name).resolve().parent / "libodc_nvshmem.so"


pytestmark = pytest.mark.skipif(
    not _plugin_path().is_file(), reason=f"no NVSHMEM plugin at {_plugin_path()}"
)


@pytest.fixture(params=["api", "direct", "nodes2"])
def nvshmem(request, monkeypatch):
    # odc.launch spawns the ranks, which inherit this environment.
    monkeypatch.setenv("ODC_TRANSPORT", "nvshmem")
    monkeypatch.setenv("ODC_NVSHMEM_DIRECT", "0" if request.param == "api" else "1")
    if request.param == "nodes2":
        monkeypatch.setenv("ODC_LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("ODC_NVSHMEM_HIERARCHICAL", "1")
    else:
        monkeypatch.delenv("ODC_LOCAL_WORLD_SIZE", raising=False)
    return request.param


@pytest.mark.parametrize("world_size", [2, 4])
def test_nvshmem_gather(nvshmem, world_size):
    suite.test_gather_equals_concatenated_shards(world_size)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("src_dtype", ["float32", "bfloat16"])
def test_nvshmem_scatter_accumulate_uneven_with_delays(nvshmem, world_size, src_dtype):
    suite.test_scatter_accumulate_uneven_with_delays(world_size, src_dtype)


@pytest.mark.parametrize("deterministic", [False, True])
def test_nvshmem_sums_valid_after_minibatch_end_without_barrier(nvshmem, deterministic):
    suite.test_sums_valid_after_minibatch_end_without_barrier(deterministic)


def test_nvshmem_deterministic_bitwise_identical(nvshmem):
    suite.test_deterministic_sums_bitwise_identical_under_random_delays()


def test_nvshmem_thousand_minibatches(nvshmem):
    suite.test_thousand_minibatches_lose_nothing()


def test_nvshmem_silent_rank_times_out(nvshmem):
    suite.test_silent_rank_reports_timeout_instead_of_hanging()


def test_nvshmem_bad_input(nvshmem):
    suite.test_bad_input_is_refused_and_changes_nothing()


def test_nvshmem_dead_rank_named(nvshmem):
    suite.test_dead_rank_reports_timeout_naming_it()


def _which_transport(rank, world_size, key):
    import torch

    torch.cuda.set_device(rank)
    with odc.Comm(rank, world_size, key, timeout=30, device=rank, transport="nvshmem") as comm:
        accumulator = comm.alloc(8, accumulator=True)
        comm.minibatch_begin()
        comm.scatter_accumulate(
            torch.full((world_size * 8,), rank + 1.0, device="cuda"), accumulator
        )
        comm.minibatch_end()
        torch.cuda.synchronize()
        total = accumulator.tensor().sum().item()
        comm.barrier()
        torch.cuda.synchronize()
    return total


def test_nvshmem_by_argument():
    # transport="nvshmem" without the environment: every owner holds 8 x (1 + 2) = 24.
    assert odc.launch(_which_transport, 2, timeout=180) == [24.0, 24.0]
