"""Hardening of the binding, the planner and the CLI against hostile input.

Views that outlive their owners, no silent truncation in the binding, the planner and the CLI on
extreme input, buffers told apart by name across ranks, and asynchronous failures reported by
poll_error (host side); each test failed before its fix. Crashes are run in a child process so a
regression shows as a failed test, not a dead test runner.
"""

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import odc


def _key(name):
    return f"hard-{name}-{os.getpid()}"


def _run_python(code):
    """Runs `code` in a fresh interpreter with this test's environment; returns the result."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )


# -- views outlive their Python owners ----------------------------------------------------------


def test_view_of_a_dropped_comm_stays_valid():
    # The one-liner: the Comm and Buffer objects die at once, the array must not.
    result = _run_python(
        f"""
        import gc, odc
        a = odc.Comm(0, 1, {_key('dropped')!r}).alloc(1 << 20).array
        gc.collect()
        a[:] = 1
        print(float(a.sum()))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(float(1 << 20))


def test_free_refuses_while_views_live_then_succeeds():
    with odc.Comm(0, 1, _key("free"), timeout=5) as comm:
        buffer = comm.alloc(8)
        view = buffer.array
        part = view[2:4]  # a view of the view counts too
        del view
        gc.collect()
        with pytest.raises(odc.Error) as raised:
            buffer.free()
        assert raised.value.code == odc._capi.INVALID_USAGE
        assert "1 view(s) of this buffer" in str(raised.value)
        part[:] = 5  # still mapped: free() was refused
        del part
        gc.collect()
        buffer.free()
        with pytest.raises(odc.Error):
            buffer.array


def test_close_with_live_views_defers_unmapping():
    result = _run_python(
        f"""
        import gc, odc
        comm = odc.Comm(0, 1, {_key('close')!r})
        view = comm.alloc(1 << 16).array
        comm.close()
        view[:] = 3  # the memory stays mapped while the view lives
        try:
            comm.barrier()
        except odc.Error as error:
            print("closed:", error)
        print(float(view[-1]))
        del view
        gc.collect()
        print("released:", comm._deferred_handle is None)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "communicator used after close()" in result.stdout
    assert "3.0" in result.stdout
    assert "released: True" in result.stdout


def test_torch_view_keeps_buffer_alive():
    torch = pytest.importorskip("torch")
    result = _run_python(
        f"""
        import gc, odc, torch
        t = odc.Comm(0, 1, {_key('torch')!r}).alloc(1 << 16).tensor()
        gc.collect()
        t.fill_(2)
        print(float(t.sum()))
        """
    )
    assert torch is not None
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(float(2 << 16))


# -- no silent truncation in the binding ---------------------------------------------------------


@pytest.mark.parametrize(
    "rank,world_size,key,message",
    [
        (0, 2**32 + 1, "k", "world_size must be in [1, 2147483647], got 4294967297"),
        (2**32, 2**32 + 1, "k", "world_size must be in"),
        (2**32 + 1, 2, "k", "rank must be in [-2147483648, 2147483647], got 4294967297"),
        (0, 1.5, "k", "world_size must be an integer, got 1.5"),
        (True, 2, "k", "rank must be an integer, got True"),
        (0, 1, "job\0other", "key must not contain a NUL character"),
    ],
)
def test_comm_arguments_are_checked_before_c(rank, world_size, key, message):
    with pytest.raises(odc.Error) as raised:
        odc.Comm(rank, world_size, key)
    assert raised.value.code == odc._capi.INVALID_ARGUMENT
    assert message in str(raised.value)


def test_device_index_is_checked_before_c():
    with pytest.raises(odc.Error, match="device must be in"):
        odc.Comm(0, 1, _key("device"), device=2**32)
    with pytest.raises(odc.Error, match="timeout must be a number of seconds, got nan"):
        odc.Comm(0, 1, _key("nan"), timeout=float("nan"))


def test_alloc_count_is_not_truncated():
    with odc.Comm(0, 1, _key("count"), timeout=5) as comm:
        # ctypes would pass 2**64 + 1 as 1 and hand back a 1-element buffer.
        with pytest.raises(odc.Error, match="count must be an integer in"):
            comm.alloc(2**64 + 1)
        # 2**62 + 1 float32 elements wrap to 4 bytes in C: refused by the C API.
        with pytest.raises(odc.Error, match="is too large"):
            comm.alloc(2**62 + 1, accumulator=True)
        assert comm.alloc(4).count == 4  # the communicator is still usable


# -- the planner and the CLI ---------------------------------------------------------------------


def test_many_samples_in_one_minibatch_plan(odc_cli, tmp_path):
    # 100,000 short samples in one minibatch, 4 ranks, cap 4,096: over 100 s and 4.9 GB before.
    rng = np.random.default_rng(5)
    lengths = np.clip(rng.lognormal(np.log(900), 0.9, 100_000).astype(np.int64), 1, 4096)
    plan = odc.plan(
        lengths.tolist(), ranks=4, max_tokens=4096, policy="lb-mini", samples_per_rank=None
    )
    microbatches = [mb for rank in plan["minibatches"][0]["ranks"] for mb in rank["microbatches"]]
    assert sorted(i for mb in microbatches for i in mb) == list(range(len(lengths)))
    assert max(int(lengths[mb].sum()) for mb in microbatches) <= 4096
    lower_bound = -(-int(lengths.sum()) // 4096)
    assert len(microbatches) <= 1.01 * lower_bound + 4


def _cli(odc_cli, *args, stdin=None):
    return subprocess.run(
        [odc_cli, *args], input=stdin, capture_output=True, timeout=60, check=False
    )


def test_int64_overflow_exits_2(odc_cli):
    most = str(2**63 - 1)
    result = _cli(
        odc_cli, "plan", "--lengths", "-", "--ranks", "1", "--max-tokens", most,
        "--policy", "lb-mini", stdin=f"{most}\n{most}\n{most}\n".encode(),
    )  # fmt: skip
    assert result.returncode == 2
    assert b"add up to more than 9223372036854775807 tokens" in result.stderr


def test_infinite_costs_exit_2_not_nan(odc_cli):
    result = _cli(
        odc_cli, "plan", "--lengths", "-", "--ranks", "2", "--max-tokens", "100",
        "--policy", "lb-mini", "--cost", "1e308,1e308,0", stdin=b"50\n60\n",
    )  # fmt: skip
    assert result.returncode == 2
    assert b"costs overflow" in result.stderr
    assert b"nan" not in result.stdout.lower()
    with pytest.raises(ValueError, match="costs overflow"):
        odc.plan([50, 60], ranks=2, max_tokens=100, policy="lb-mini", cost=(1e308, 1e308, 0))


def test_endless_line_fails_at_once(odc_cli):
    result = _cli(
        odc_cli, "plan", "--lengths", "/dev/zero", "--ranks", "2", "--max-tokens", "100",
        "--policy", "lb-mini",
    )  # fmt: skip
    assert result.returncode == 2
    assert b"line 1 is longer than 65536 bytes" in result.stderr
    with pytest.raises(ValueError, match="longer than 65536 bytes"):
        odc.read_lengths("/dev/zero")


@pytest.mark.parametrize(
    "args,stdin",
    [
        (["--policy", "lb\nmini"], b"10\n"),
        (["--policy", "lb-mini", "--ranks", "2\n3"], b"10\n"),
        (["--policy", "lb-mini"], b"10\n1\x1b[2J\rX\n"),
        (["--policy", "lb-mini", "--cost", "1,\x1b,0"], b"10\n"),
    ],
)
def test_echoed_control_bytes_are_escaped(odc_cli, args, stdin):
    base = ["plan", "--lengths", "-", "--ranks", "2", "--max-tokens", "100"]
    merged = base + args
    if "--ranks" in args:  # the later --ranks replaces the default one
        del merged[3:5]
    result = _cli(odc_cli, *merged, stdin=stdin)
    assert result.returncode == 2
    message = result.stderr.decode()
    assert message.endswith("\n") and message.count("\n") == 1, message
    assert "\x1b" not in message and "\r" not in message


# -- buffers of the same size allocated in a different order ----------------------------------


def _swapped_names_rank(rank, world_size, key):
    outcome = {}
    with odc.Comm(rank, world_size, key, timeout=20) as comm:
        # Rank 0 allocates its parameters first, rank 1 its gradients: the sizes agree.
        order = (
            ["layer0:params", "layer0:grads"] if rank == 0 else ["layer0:grads", "layer0:params"]
        )
        try:
            comm.alloc(64, name=order[0])
            outcome["swapped"] = None
        except odc.Error as error:
            outcome["swapped"] = (error.code, str(error))
        buffer = comm.alloc(64, name="layer0:params")  # agreed: allocated, works as before
        buffer.array[:] = rank + 1
        comm.barrier()
        full = np.empty(world_size * 64, dtype=np.float32)
        comm.gather(full, buffer)
        outcome["gathered"] = full.tolist() == [1.0] * 64 + [2.0] * 64
        outcome["name"] = buffer.name
        comm.barrier()
    return outcome


def test_alloc_names_are_checked_across_ranks():
    results = odc.launch(_swapped_names_rank, 2, timeout=60)
    for rank, outcome in enumerate(results):
        assert outcome["swapped"] is not None, f"rank {rank}: swapped buffers paired up"
        code, message = outcome["swapped"]
        assert code == odc._capi.INVALID_ARGUMENT
        assert f"rank {rank}: alloc: buffers differ across ranks: rank {1 - rank}" in message
        assert 'named "layer0:params"' in message and 'named "layer0:grads"' in message
        assert outcome["gathered"] and outcome["name"] == "layer0:params"


def _published_rank(rank, world_size, key):
    outcome = {}
    with odc.Comm(rank, world_size, key, timeout=20) as comm:
        try:
            comm.alloc(8, accumulator=True, published=True)
            outcome["both"] = None
        except odc.Error as error:
            outcome["both"] = str(error)
        try:  # rank 0 publishes, rank 1 does not: refused on both, naming the kinds
            comm.alloc(8, published=rank == 0)
            outcome["mixed"] = None
        except odc.Error as error:
            outcome["mixed"] = str(error)
        params = comm.alloc(8, published=True, name="params")
        params.array[:] = rank + 1
        comm.minibatch_begin()
        full = np.empty(world_size * 8, dtype=np.float32)
        comm.gather(full, params)
        comm.minibatch_end()
        outcome["gathered"] = full.tolist() == [1.0] * 8 + [2.0] * 8
        comm.barrier()
    return outcome


def test_published_buffers_are_agreed_and_gathered():
    for rank, outcome in enumerate(odc.launch(_published_rank, 2, timeout=60)):
        assert "either an accumulator or published" in outcome["both"], outcome
        assert "8 float32 (published) elements" in outcome["mixed"], outcome
        assert f"rank {rank}: alloc: buffers differ across ranks" in outcome["mixed"], outcome
        assert outcome["gathered"], outcome


@pytest.mark.parametrize(
    "name, message",
    [
        ("", "1-256 printable ASCII"),
        ("a\nb", "1-256 printable ASCII"),
        ("caf\u00e9", "1-256 printable ASCII"),
        ("x" * 257, "1-256 printable ASCII"),
        (b"params", "name must be a string"),
    ],
)
def test_alloc_name_is_checked_before_c(name, message):
    with odc.Comm(0, 1, _key("name"), timeout=5) as comm:
        with pytest.raises(odc.Error, match=message):
            comm.alloc(8, name=name)
        assert comm.alloc(8, name="x" * 256).name == "x" * 256


def _torch_names_rank(rank, world_size, key, store_path, rename):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from tiny_lm import make_model

    import odc.torch

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        model = make_model()
        if rename and rank == 1:  # another model on rank 1: same sizes, other module names
            model.layers = model.blocks
            del model.blocks
        for block in model.layers if hasattr(model, "layers") else model.blocks:
            fully_shard(block)
        fully_shard(model)
        with odc.Comm(rank, world_size, key, timeout=20) as comm:
            try:
                engine = odc.torch.OdcFSDP(model, comm)
            except odc.Error as error:
                return error.code, str(error)
            names = [(g.published.name, g.accumulator.name) for g in engine._groups]
            del engine
            return names
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rename", [False, True])
def test_odc_torch_names_its_buffers(tmp_path, rename):
    pytest.importorskip("torch")
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    results = odc.launch(_torch_names_rank, 2, str(tmp_path / "store"), rename, timeout=120)
    if not rename:
        assert results[0] == results[1]
        assert results[0] == [  # model.modules() order: the root first
            ("odc.torch/<root>:params", "odc.torch/<root>:grads"),
            ("odc.torch/blocks.0:params", "odc.torch/blocks.0:grads"),
            ("odc.torch/blocks.1:params", "odc.torch/blocks.1:grads"),
        ]
        return
    for rank, (code, message) in enumerate(results):
        assert code == odc._capi.INVALID_ARGUMENT, message
        assert "buffers differ across ranks" in message
        assert 'named "odc.torch/blocks.0:params"' in message
        assert 'named "odc.torch/layers.0:params"' in message


# -- a failure found asynchronously is reported by poll_error ---------------------------------


def _poll_rank(rank, world_size, key):
    with odc.Comm(rank, world_size, key, timeout=20) as comm:
        comm.poll_error()  # healthy: nothing to report
        if rank == 1:
            return None  # leaves: rank 0's barrier fails naming it
        with pytest.raises(odc.Error) as first:
            comm.barrier()
        with pytest.raises(odc.Error) as again:
            comm.poll_error()
        return first.value.code, str(first.value), again.value.code, str(again.value)


def test_poll_error_reports_the_communicators_failure():
    code, message, poll_code, poll_message = odc.launch(_poll_rank, 2, timeout=60)[0]
    assert code == odc._capi.REMOTE_ERROR and "rank 1" in message
    assert poll_code == odc._capi.REMOTE_ERROR
    assert "rank 0: poll_error: communicator failed earlier" in poll_message
