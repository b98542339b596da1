"""odc.Comm and odc.launch on the host transport: real processes, real shared memory."""

import os
import random
import signal
import time

import numpy as np
import pytest

import odc


def _contribution(minibatch, sender, call, size):
    return ((minibatch * 7 + sender * 3 + call * 5 + np.arange(size)) % 17).astype(np.float32)


def _pushes(minibatch, rank):
    return (minibatch + rank * 2) % 4


def _bf16_bits(values):
    # Exact for the small integers used here: bf16 is the top half of the fp32 bits.
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _nearest_even_bf16(values):
    """bf16 bits of float32 `values` (finite), by comparing the two neighbours in float64: an
    independent statement of round-to-nearest-even, not the bit trick the library uses."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.int64)
    lower = bits & ~0xFFFF
    upper = lower + 0x10000
    as_float = lambda b: b.astype(np.uint32).view(np.float32).astype(np.float64)  # noqa: E731
    exact = values.astype(np.float64)
    below, above = np.abs(exact - as_float(lower)), np.abs(as_float(upper) - exact)
    even_is_upper = ((upper >> 16) & 1) == 0
    pick_upper = (above < below) | ((above == below) & even_is_upper)
    return (np.where(pick_upper, upper, lower) >> 16).astype(np.uint16)


def _gather_rank(rank, world_size, key):
    with odc.Comm(rank, world_size, key, timeout=20) as comm:
        count = 1003
        params = comm.alloc(count)
        params.array[:] = rank * 10000 + np.arange(count)
        halves = comm.alloc(count, dtype="bfloat16")
        halves.array.view(np.uint16)[:] = _bf16_bits(np.full(count, rank + 1.0))
        comm.barrier()
        full = np.empty(world_size * count, dtype=np.float32)
        comm.gather(full, params)
        expected = np.concatenate([r * 10000 + np.arange(count) for r in range(world_size)])
        assert np.array_equal(full, expected.astype(np.float32))
        full_bits = np.empty(world_size * count, dtype=np.uint16)
        comm.gather(full_bits, halves)
        assert np.array_equal(
            full_bits,
            np.concatenate([_bf16_bits(np.full(count, r + 1.0)) for r in range(world_size)]),
        )
        # float32 shards into a bfloat16 destination: narrowed while pulled, nearest even (the
        # values need rounding: 10000 and up have more bits than bfloat16 keeps; odd counts).
        narrowed = np.empty(world_size * count, dtype=np.uint16)
        comm.gather(narrowed, params)
        assert np.array_equal(narrowed, _nearest_even_bf16(expected.astype(np.float32)))
        with pytest.raises(odc.Error, match="out holds float32, the buffer holds bfloat16"):
            comm.gather(full, halves)
        comm.barrier()
    return rank


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_gather_equals_concatenated_shards(world_size):
    assert odc.launch(_gather_rank, world_size, timeout=120) == list(range(world_size))


def _minibatch_rank(
    rank,
    world_size,
    key,
    num_minibatches,
    count,
    src_dtype,
    delays,
    deterministic=False,
    staging_bytes=None,
):
    rng = random.Random(rank)
    with odc.Comm(
        rank, world_size, key, timeout=30, deterministic=deterministic, staging_bytes=staging_bytes
    ) as comm:
        accumulator = comm.alloc(count, accumulator=True)
        everything = np.empty(world_size * count, dtype=np.float32)
        for minibatch in range(num_minibatches):
            comm.minibatch_begin()
            for call in range(_pushes(minibatch, rank)):
                if delays:
                    time.sleep(rng.uniform(0, 0.002))
                src = _contribution(minibatch, rank, call, world_size * count)
                if src_dtype == "bfloat16":
                    comm.scatter_accumulate(_bf16_bits(src), accumulator, src_dtype="bfloat16")
                else:
                    comm.scatter_accumulate(src, accumulator)
            comm.minibatch_end()
            comm.gather(everything, accumulator)
            expected = sum(
                (
                    _contribution(minibatch, sender, call, world_size * count)
                    for sender in range(world_size)
                    for call in range(_pushes(minibatch, sender))
                ),
                np.zeros(world_size * count, dtype=np.float32),
            )
            # No barrier: the sums stay valid until the next minibatch_end fills them.
            assert np.array_equal(everything, expected), f"minibatch {minibatch}"
    return num_minibatches


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("src_dtype", ["float32", "bfloat16"])
def test_scatter_accumulate_uneven_with_delays(world_size, src_dtype):
    results = odc.launch(_minibatch_rank, world_size, 5, 129, src_dtype, True, timeout=180)
    assert results == [5] * world_size


@pytest.mark.parametrize("src_dtype", ["float32", "bfloat16"])
def test_streamed_pushes_through_a_tiny_staging_budget(src_dtype):
    # The shm transport streams pushes through rings cut from the staging budget: 16 KiB for 4
    # ranks is a few slots of a few hundred bytes per sender, so each push of 1,000 elements per
    # owner travels in several chunks and senders wait for credit. Sums stay exact.
    results = odc.launch(_minibatch_rank, 4, 4, 1000, src_dtype, True, False, 16384, timeout=180)
    assert results == [4] * 4


def _stream_stats_rank(rank, world_size, key, staging_bytes):
    with odc.Comm(rank, world_size, key, timeout=30, staging_bytes=staging_bytes) as comm:
        accumulator = comm.alloc(4096, accumulator=True)
        src = np.ones(world_size * 4096, np.float32)
        for _ in range(3):
            comm.minibatch_begin()
            for _ in range(4):
                comm.scatter_accumulate(src, accumulator)
            comm.minibatch_end()
            assert float(accumulator.array[0]) == 4 * world_size
        return comm.stream_stats()


def test_stream_stats_count_chunks_and_credit_waits():
    # 3 minibatches x 4 pushes x 3 peers of 16 KiB each. A roomy budget: one chunk per push and
    # peer, never a wait. A tiny one: 64 chunks of 256 B per push and peer through 2-slot rings.
    roomy = odc.launch(_stream_stats_rank, 4, 64 << 20, timeout=120)
    assert all(s == {"chunks_sent": 36, "credit_waits": 0} for s in roomy), roomy
    tiny = odc.launch(_stream_stats_rank, 4, 4 * (2 * 320 + 40), timeout=120)
    assert all(s["chunks_sent"] == 36 * 64 and s["credit_waits"] > 0 for s in tiny), tiny


def _staging_budget_rank(rank, world_size, key, budgets):
    # Budgets are agreed at init (one exchange), the rings cut at the first accumulator: either
    # names what is wrong on every rank.
    try:
        with odc.Comm(rank, world_size, key, timeout=30, staging_bytes=budgets[rank]) as comm:
            comm.alloc(8, accumulator=True)
    except odc.Error as error:
        return str(error)
    return "allocated"


def test_staging_budgets_that_differ_or_do_not_fit_are_named():
    mismatch = odc.launch(_staging_budget_rank, 2, [1 << 20, 1 << 21], timeout=120)
    assert all("staging budgets differ across ranks" in m for m in mismatch), mismatch
    assert "1048576" in mismatch[0] and "2097152" in mismatch[0], mismatch
    small = odc.launch(_staging_budget_rank, 2, [512, 512], timeout=120)
    assert all("too small for 2 ranks" in m for m in small), small
    with pytest.raises(odc.Error, match="staging_bytes must be in"):
        odc.Comm(0, 1, "unused-key", staging_bytes=0)


def _staging_env_rank(rank, world_size, key, value):
    os.environ["ODC_STAGING_BYTES"] = value  # read at init, in this process
    return _staging_budget_rank(rank, world_size, key, [None] * world_size)


def test_staging_budget_from_the_environment_is_checked():
    assert odc.launch(_staging_env_rank, 2, "64K", timeout=120) == ["allocated"] * 2
    bad = odc.launch(_staging_env_rank, 2, "12 apples", timeout=120)
    assert all("ODC_STAGING_BYTES='12 apples' is not a positive number" in m for m in bad), bad


def _topology_rank(rank, world_size, key, env, ranks_per_node):
    os.environ.update(env)  # read at init, in this process
    try:
        with odc.Comm(rank, world_size, key, timeout=30, ranks_per_node=ranks_per_node) as comm:
            return comm.topology
    except odc.Error as error:
        return str(error)


def test_topology_from_config_then_environment_then_transport():
    # The host transport reports one node (the host); the launcher's LOCAL_WORLD_SIZE comes
    # before it, ODC_LOCAL_WORLD_SIZE before that, the caller's ranks_per_node first.
    assert odc.launch(_topology_rank, 4, {}, None, timeout=120) == [[0, 0, 0, 0]] * 4
    env = {"LOCAL_WORLD_SIZE": "2"}
    assert odc.launch(_topology_rank, 4, env, None, timeout=120) == [[0, 0, 1, 1]] * 4
    env = {"LOCAL_WORLD_SIZE": "2", "ODC_LOCAL_WORLD_SIZE": "1"}
    assert odc.launch(_topology_rank, 4, env, None, timeout=120) == [[0, 1, 2, 3]] * 4
    assert odc.launch(_topology_rank, 4, env, 4, timeout=120) == [[0, 0, 0, 0]] * 4
    bad = odc.launch(_topology_rank, 4, {"ODC_LOCAL_WORLD_SIZE": "3"}, None, timeout=120)
    assert all("does not divide the world size 4" in m for m in bad), bad


def _memory_rank(rank, world_size, key, deterministic, staging_bytes):
    with odc.Comm(
        rank, world_size, key, timeout=30, deterministic=deterministic, staging_bytes=staging_bytes
    ) as comm:
        before = comm.memory_bytes()
        comm.alloc(1000, accumulator=True)
        comm.alloc(1000, accumulator=True)
        comm.alloc(500)
        return before, comm.memory_bytes()


def test_memory_bytes_count_the_scheme():
    # Streamed (shm's default): the rings, what the accumulators need up to the budget: 16 slots
    # per sender of a 64-byte header and a payload of the 4,000-byte shard rounded up to 64
    # bytes, and five signal words per peer (the budget alone would cut 8 slots of 32 KiB).
    for before, after in odc.launch(_memory_rank, 4, False, 1 << 20, timeout=120):
        assert before == {"buffers": 0, "scheme": 0, "node_cache": 0}
        assert after["buffers"] == (2 * 1000 + 500) * 4
        assert after["scheme"] == 4 * 16 * (64 + 4032) + 4 * 5 * 8, after
    # Deterministic: world x count fp32 of pending sums per accumulator, and a 4 MiB scratch.
    for _, after in odc.launch(_memory_rank, 4, True, None, timeout=120):
        assert after["scheme"] == 2 * 4 * 1000 * 4 + (4 << 20), after


def _node_cache_rank(rank, world_size, key, **options):
    import numpy as np

    with odc.Comm(rank, world_size, key, timeout=30, **options) as comm:
        params = comm.alloc(1000, published=True)
        plain = comm.alloc(300)
        seen = []
        for minibatch in range(3):
            params.array[:] = np.arange(1000) + 10_000 * rank + minibatch
            plain.array[:] = rank
            comm.minibatch_begin()
            out = np.empty(world_size * 1000, dtype=np.float32)
            comm.gather(out, params)
            seen.append(
                all(
                    np.array_equal(
                        out[o * 1000 : (o + 1) * 1000], np.arange(1000) + 10_000 * o + minibatch
                    )
                    for o in range(world_size)
                )
            )
            comm.minibatch_end()
        return seen, comm.memory_bytes()


def test_node_cache_on_pretend_nodes(monkeypatch):
    # 2 pretend nodes of 2 (the topology's launcher knob): the published buffer's remote shards
    # come from the node cache, exact; it holds one row of 1000 fp32 (rows start 256-byte
    # aligned) per rank and one ready word per rank; the plain buffer is never cached.
    monkeypatch.setenv("ODC_LOCAL_WORLD_SIZE", "2")
    for seen, memory in odc.launch(_node_cache_rank, 4, timeout=120):
        assert seen == [True] * 3
        assert memory["node_cache"] == 4096 + 4 * 8, memory
    monkeypatch.setenv("ODC_NODE_CACHE_BYTES", "0")
    for seen, memory in odc.launch(_node_cache_rank, 4, timeout=120):
        assert seen == [True] * 3
        assert memory["node_cache"] == 0, memory
    # The argument wins over the environment, and the layout may come from it too.
    monkeypatch.delenv("ODC_LOCAL_WORLD_SIZE")
    options = {"node_cache_bytes": 1 << 20, "ranks_per_node": 2}
    for seen, memory in odc.launch(_node_cache_rank_with, 4, options, timeout=120):
        assert seen == [True] * 3
        assert memory["node_cache"] == 4096 + 4 * 8, memory


def _bad_node_cache_knob_rank(rank, world_size, key):
    try:  # agreed at init (with more than one node), where every rank names it
        with odc.Comm(rank, world_size, key, timeout=30) as comm:
            comm.alloc(100, published=True)
    except odc.Error as error:
        return str(error)
    return "allocated"


def test_bad_node_cache_knob_is_named(monkeypatch):
    monkeypatch.setenv("ODC_LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("ODC_NODE_CACHE_BYTES", "lots")
    for message in odc.launch(_bad_node_cache_knob_rank, 2, timeout=120):
        assert "ODC_NODE_CACHE_BYTES='lots' is not a number of bytes" in message or (
            "invalid node cache budget" in message
        ), message
    # 0 written another way is still 0 (the cache off), not "not a number of bytes".
    monkeypatch.setenv("ODC_NODE_CACHE_BYTES", "00")
    assert odc.launch(_bad_node_cache_knob_rank, 2, timeout=120) == ["allocated"] * 2


def _node_cache_rank_with(rank, world_size, key, options):
    return _node_cache_rank(rank, world_size, key, **options)


def _aggregation_rank(rank, world_size, key, budget):
    import numpy as np

    with odc.Comm(
        rank, world_size, key, timeout=30, ranks_per_node=2, node_aggregation_bytes=budget
    ) as comm:
        acc = comm.alloc(1000, accumulator=True)
        ok = []
        for minibatch in range(3):
            comm.minibatch_begin()
            for push in range(rank % 3):  # 0, 1 or 2 pushes: uneven, some ranks none
                src = np.arange(world_size * 1000, dtype=np.float32) % 7 + rank + push
                comm.scatter_accumulate(src, acc)
            comm.minibatch_end()
            out = np.empty(world_size * 1000, dtype=np.float32)
            comm.gather(out, acc)
            want = np.zeros(world_size * 1000, dtype=np.float32)
            for r in range(world_size):
                for push in range(r % 3):
                    want += np.arange(world_size * 1000, dtype=np.float32) % 7 + r + push
            ok.append(bool(np.array_equal(out, want)))
        return ok, comm.memory_bytes()["scheme"], comm.node_traffic()


def test_node_aggregated_pushes_on_pretend_nodes():
    # shm streams; 2 pretend nodes of 2: pushes to the other node go through the carrier's relay
    # row (1,000 fp32 per rank: one remote owner per rank), sums exact; off by default.
    on = odc.launch(_aggregation_rank, 4, 1 << 20, timeout=120)
    off = odc.launch(_aggregation_rank, 4, 0, timeout=120)
    for rank, ((ok_on, scheme_on, _), (ok_off, scheme_off, flat)) in enumerate(zip(on, off)):
        assert ok_on == [True] * 3 and ok_off == [True] * 3
        assert scheme_on - scheme_off == 1000 * 4, (scheme_on, scheme_off)
        # Flat: every push's slices for the 2 owners on the other node leave during the
        # minibatch, one chunk (64 B header + 4,000 B) each; nothing in minibatch_end.
        want = 3 * (rank % 3) * 2 * (64 + 4000)
        assert flat == {"during_minibatches": want, "in_minibatch_end": 0}, (rank, flat)
    # Aggregated: each rank carries one owner of the other node and forwards its row (one chunk)
    # inside every minibatch_end, pushed into or not (one relay rule, host and device); nothing
    # crosses during the minibatch; fewer bytes across nodes in all.
    for rank, (_, _, aggregated) in enumerate(on):
        want = {"during_minibatches": 0, "in_minibatch_end": 3 * (64 + 4000)}
        assert aggregated == want, (rank, aggregated)
    total = [t["in_minibatch_end"] for _, _, t in on]
    assert sum(total) < sum(t["during_minibatches"] for _, _, t in off), (on, off)


def test_deterministic_option():
    results = odc.launch(_minibatch_rank, 3, 5, 33, "float32", True, True, timeout=180)
    assert results == [5] * 3


class _FileStore:
    """A duck-typed store on a directory (no torch): set/get(wait)/add, as torch's stores."""

    def __init__(self, path):
        self.path = path

    def _file(self, key):
        return os.path.join(self.path, key.replace("/", "_"))

    def set(self, key, value):
        temporary = self._file(key) + f".tmp{os.getpid()}"
        with open(temporary, "wb") as out:
            out.write(value.encode() if isinstance(value, str) else value)
        os.replace(temporary, self._file(key))

    def get(self, key):
        deadline = time.monotonic() + 30
        while not os.path.exists(self._file(key)):
            if time.monotonic() > deadline:
                raise TimeoutError(key)
            time.sleep(0.01)
        with open(self._file(key), "rb") as data:
            return data.read()

    def add(self, key, amount):  # atomic across processes, as a store's counter must be
        import fcntl

        with open(os.path.join(self.path, ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            value = int(self.get(key)) + amount if os.path.exists(self._file(key)) else amount
            self.set(key, str(value))
            return value


def _store_rank(rank, world_size, key, path):
    store = _FileStore(path)
    sums = []
    for _ in range(2):  # two communicators in a row: each gets its own key
        with odc.Comm(rank, world_size, store=store, timeout=20) as comm:
            accumulator = comm.alloc(4, accumulator=True)
            comm.minibatch_begin()
            comm.scatter_accumulate(np.full(world_size * 4, rank + 1.0, np.float32), accumulator)
            comm.minibatch_end()
            sums.append(float(accumulator.array.sum()))
            comm.barrier()
    return sums


def test_comm_from_a_store_needs_no_key(tmp_path):
    expected = 4.0 * sum(range(1, 4))
    assert odc.launch(_store_rank, 3, str(tmp_path), timeout=120) == [[expected, expected]] * 3


def test_comm_needs_a_key_or_a_store():
    with pytest.raises(odc.Error, match="rendezvous key"):
        odc.Comm(0, 1)
    with pytest.raises(odc.Error, match="not both"):
        odc.Comm(0, 1, "k", store=object())
    with pytest.raises(odc.Error, match="store has no set"):
        odc.Comm(0, 1, store=object())


def _two_jobs_rank(rank, world_size, key, root):
    job, job_rank = divmod(rank, 2)  # ranks 0-1: job 0, ranks 2-3: job 1, each with its store
    store = _FileStore(os.path.join(root, f"job{job}"))
    with odc.Comm(job_rank, 2, store=store, timeout=30) as comm:
        accumulator = comm.alloc(4, accumulator=True)
        for _ in range(3):
            comm.minibatch_begin()
            comm.scatter_accumulate(np.full(2 * 4, 10.0**job, np.float32), accumulator)
            comm.minibatch_end()
        return float(accumulator.array.sum())


def test_two_jobs_with_their_own_stores_never_meet(tmp_path):
    for job in range(2):
        (tmp_path / f"job{job}").mkdir()
    # Same local ranks, no key, concurrently: each job's sums hold only its own pushes.
    assert odc.launch(_two_jobs_rank, 4, str(tmp_path), timeout=120) == [8.0, 8.0, 80.0, 80.0]


class _BrokenStore(_FileStore):
    """A store whose set() fails for the bootstrap's records (a store that went away)."""

    def set(self, key, value):
        if "/round" in key:
            raise ConnectionError("store connection lost")
        super().set(key, value)


def _broken_store_rank(rank, world_size, key, path):
    store = (_BrokenStore if rank == 1 else _FileStore)(path)
    try:
        odc.Comm(rank, world_size, store=store, timeout=30)
    except odc.Error as error:
        return str(error)
    return "no error"


def test_store_failure_fails_every_rank_naming_it(tmp_path):
    errors = odc.launch(_broken_store_rank, 3, str(tmp_path), timeout=120)
    assert errors[1].startswith("rank 1: init: bootstrap allgather (agree on key) failed")
    assert "store connection lost" in errors[1]
    for rank in (0, 2):  # released by rank 1's failure flag, long before their 30 s timeout
        assert errors[rank].startswith(f"rank {rank}: init: bootstrap allgather"), errors[rank]
        assert "rank 1 failed: rank 1: init:" in errors[rank], errors[rank]
        assert "timed out" not in errors[rank], errors[rank]


def test_store_wait_is_bounded_and_names_what_it_waited_for(tmp_path):
    with pytest.raises(odc.Error) as raised:  # rank 1 never comes
        odc.Comm(0, 2, store=_FileStore(str(tmp_path)), timeout=0.5)
    message = str(raised.value)
    assert message.startswith("rank 0: init: bootstrap allgather (agree on key) failed"), message
    assert "timed out after 0.5 s: rank 0 waited for 1 of 2 ranks" in message


def test_thousand_minibatches_lose_nothing():
    assert odc.launch(_minibatch_rank, 2, 1000, 16, "float32", False, timeout=300) == [1000, 1000]


def _invalid_use_rank(rank, world_size, key):
    errors = {}
    with odc.Comm(rank, world_size, key, timeout=20) as comm:

        def record(name, function):
            try:
                function()
            except odc.Error as error:
                errors[name] = (error.code, str(error))
            else:
                errors[name] = None

        record("mismatched count", lambda: comm.alloc(10 + rank, accumulator=True))
        record("mismatched dtype", lambda: comm.alloc(10, dtype=["float32", "bfloat16"][rank]))
        record("bf16 accumulator", lambda: comm.alloc(10, dtype="bfloat16", accumulator=True))
        record("unknown dtype", lambda: comm.alloc(10, dtype="float64"))
        accumulator = comm.alloc(10, accumulator=True)
        params = comm.alloc(10)
        src = np.ones(world_size * 10, dtype=np.float32)
        record("outside minibatch", lambda: comm.scatter_accumulate(src, accumulator))
        record("end without begin", comm.minibatch_end)
        comm.minibatch_begin()
        record("begin twice", comm.minibatch_begin)
        record("wrong source size", lambda: comm.scatter_accumulate(src[:-1], accumulator))
        record("not an accumulator", lambda: comm.scatter_accumulate(src, params))
        record(
            "float64 source", lambda: comm.scatter_accumulate(src.astype(np.float64), accumulator)
        )
        record("wrong gather size", lambda: comm.gather(np.empty(7, np.float32), params))
        record(
            "wrong gather dtype", lambda: comm.gather(np.empty(world_size * 10, np.float64), params)
        )
        with odc.Comm(rank, world_size, key + "-other", timeout=20) as other:
            foreign = other.alloc(10, accumulator=True)
            record("foreign buffer", lambda: comm.scatter_accumulate(src, foreign))
            other.barrier()
        record("buffer after its comm closed", lambda: comm.scatter_accumulate(src, foreign))
        comm.scatter_accumulate(src, accumulator)  # nothing above changed anything
        comm.minibatch_end()
        assert np.array_equal(accumulator.array, np.full(10, world_size, np.float32))
        comm.barrier()
    record("after close", comm.barrier)
    return errors


def test_invalid_use_raises_and_changes_nothing():
    for errors in odc.launch(_invalid_use_rank, 2, timeout=120):
        expected_codes = {
            "mismatched count": odc._capi.INVALID_ARGUMENT,
            "mismatched dtype": odc._capi.INVALID_ARGUMENT,
            "bf16 accumulator": odc._capi.INVALID_ARGUMENT,
            "unknown dtype": odc._capi.INVALID_ARGUMENT,
            "outside minibatch": odc._capi.INVALID_USAGE,
            "end without begin": odc._capi.INVALID_USAGE,
            "begin twice": odc._capi.INVALID_USAGE,
            "wrong source size": odc._capi.INVALID_ARGUMENT,
            "not an accumulator": odc._capi.INVALID_ARGUMENT,
            "float64 source": odc._capi.INVALID_ARGUMENT,
            "wrong gather size": odc._capi.INVALID_ARGUMENT,
            "wrong gather dtype": odc._capi.INVALID_ARGUMENT,
            "foreign buffer": odc._capi.INVALID_ARGUMENT,
            "buffer after its comm closed": odc._capi.INVALID_USAGE,
            "after close": odc._capi.INVALID_USAGE,
        }
        for name, code in expected_codes.items():
            assert errors[name] is not None, f"{name}: no error raised"
            assert errors[name][0] == code, f"{name}: {errors[name]}"
        assert "buffers differ across ranks" in errors["mismatched count"][1]
        assert "outside a minibatch" in errors["outside minibatch"][1]
        assert "does not belong to this communicator" in errors["foreign buffer"][1]


def _dies_rank(rank, world_size, key):
    with odc.Comm(rank, world_size, key, timeout=5) as comm:
        accumulator = comm.alloc(16, accumulator=True)
        comm.minibatch_begin()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.scatter_accumulate(np.ones(world_size * 16, np.float32), accumulator)
        start = time.monotonic()
        try:
            comm.minibatch_end()
        except odc.Error as error:
            return error.code, str(error), time.monotonic() - start
        return None


def test_killed_rank_makes_the_others_fail():
    with pytest.raises(odc.LaunchError) as raised:
        odc.launch(_dies_rank, 3, timeout=60)
    error = raised.value
    assert list(error.failures) == [1]
    assert "exited with code -9" in error.failures[1]
    for rank in (0, 2):
        code, message, waited = error.results[rank]
        assert code == odc._capi.REMOTE_ERROR
        # Directly, or through a peer that saw it first ("rank 0 failed: ... rank 1 (pid) died").
        assert message.startswith(f"rank {rank}: minibatch_end: "), message
        assert "rank 1 (pid" in message and "died" in message, message
        assert waited < 5 + 1


def _silent_rank(rank, world_size, key):
    with odc.Comm(rank, world_size, key, timeout=1.0) as comm:
        if rank == 1:
            time.sleep(3.0)  # alive, never arrives
            return None
        try:
            comm.barrier()
        except odc.Error as error:
            return error.code, str(error)
    return None


def test_silent_rank_times_out():
    code, message = odc.launch(_silent_rank, 2, timeout=60)[0]
    assert code == odc._capi.TIMEOUT
    assert message.startswith("rank 0: barrier: timed out after 1 s waiting for rank 1")


def _raises_rank(rank, world_size, key):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    return rank


def test_launch_reports_exceptions_with_traceback():
    with pytest.raises(odc.LaunchError) as raised:
        odc.launch(_raises_rank, 3, timeout=60)
    assert list(raised.value.failures) == [1]
    assert "RuntimeError: boom on rank 1" in raised.value.failures[1]
    assert "Traceback" in raised.value.failures[1]
    assert raised.value.results == {0: 0, 2: 2}


def _sleeps_rank(rank, world_size, key):
    time.sleep(30)


def test_launch_timeout_kills():
    start = time.monotonic()
    with pytest.raises(odc.LaunchError) as raised:
        odc.launch(_sleeps_rank, 2, timeout=2)
    assert time.monotonic() - start < 20
    assert "did not finish within 2 s" in raised.value.failures[0]


def test_bad_comm_arguments():
    with pytest.raises(odc.Error) as raised:
        odc.Comm(3, 2, "some-key")
    assert raised.value.code == odc._capi.INVALID_ARGUMENT
    assert "rank 3 is outside world size 2" in str(raised.value)
    with pytest.raises(odc.Error):
        odc.Comm(0, 1, "bad key with spaces")
    with pytest.raises(ValueError):
        odc.launch(_raises_rank, 0)


def test_single_rank_roundtrip():
    with odc.Comm(0, 1, f"single-{os.getpid()}", timeout=5) as comm:
        assert comm.over_nvshmem is False  # host shared memory: no NVSHMEM heap to check
        buffer = comm.alloc(4, accumulator=True)
        comm.minibatch_begin()
        comm.scatter_accumulate(np.arange(4, dtype=np.float32), buffer)
        comm.scatter_accumulate(np.arange(4, dtype=np.float32), buffer)
        comm.minibatch_end()
        assert buffer.array.tolist() == [0.0, 2.0, 4.0, 6.0]
        buffer.free()
        with pytest.raises(odc.Error):
            buffer.array


def _threads_rank(rank, world_size, key):
    return os.environ.get("OMP_NUM_THREADS")


def test_launch_shares_cpu_cores_like_torchrun(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    expected = str(max(1, (os.cpu_count() or 1) // 2))
    assert odc.launch(_threads_rank, 2, timeout=60) == [expected, expected]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's setting wins
    assert odc.launch(_threads_rank, 2, timeout=60) == ["3", "3"]


def _tcp_store_rank(rank, world_size, key, port):
    from datetime import timedelta

    import torch.distributed as dist

    # Generous timeouts: importing torch in freshly spawned processes is slow on a busy machine.
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=180),
        wait_for_workers=False,
    )
    with odc.Comm(rank, world_size, store=store, timeout=20) as comm:
        params = comm.alloc(8)
        params.array[:] = rank
        comm.barrier()
        full = np.empty(world_size * 8, np.float32)
        comm.gather(full, params)
        comm.barrier()
        return full.tolist()


def test_comm_from_a_torch_store():
    pytest.importorskip("torch.distributed")
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    expected = [float(r) for r in range(2) for _ in range(8)]
    assert odc.launch(_tcp_store_rank, 2, port, timeout=300) == [expected, expected]


def test_torch_store_wait_names_the_missing_rank():
    dist = pytest.importorskip("torch.distributed")
    from datetime import timedelta

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    with pytest.raises(odc.Error) as raised:  # a 3-rank job in which ranks 1 and 2 never come
        odc.Comm(0, 3, store=store, timeout=0.5)
    message = str(raised.value)
    assert message.startswith("rank 0: init: bootstrap allgather (agree on key) failed"), message
    assert "timed out after 0.5 s: rank 0 waited for ranks 1, 2" in message


def _split_rank(rank, world_size, key):
    with odc.Comm(rank, world_size, key, timeout=20) as comm:
        acc = comm.alloc(8, accumulator=True)
        comm.minibatch_begin()
        comm.scatter_accumulate(np.ones(world_size * 8, dtype=np.float32), acc)
        # Inside the parent's minibatch: ranks 0-2 form a group ranked by a descending key, rank 3
        # joins none.
        group = comm.split(None if rank == 3 else 0, key=-rank)
        seen = None
        if group is not None:
            with group:
                kv = group.alloc(5, name="kv")
                kv.array[:] = rank * 100 + np.arange(5)
                group.barrier()
                shards = np.empty(group.world_size * 5, dtype=np.float32)
                group.gather(shards, kv)
                grads = group.alloc(4, accumulator=True)
                group.minibatch_begin()
                group.scatter_accumulate(
                    np.full(group.world_size * 4, rank + 1, dtype=np.float32), grads
                )
                group.minibatch_end()
                sums = np.empty(group.world_size * 4, dtype=np.float32)
                group.gather(sums, grads)
                memory = group.memory_bytes()["buffers"]
                seen = (group.rank, group.world_size, shards.tolist(), sums.tolist(), memory)
        comm.minibatch_end()
        total = np.empty(world_size * 8, dtype=np.float32)
        comm.gather(total, acc)
        return seen, total.tolist(), comm.memory_bytes()["buffers"]


def test_split_groups_gather_their_members_shards_inside_a_minibatch():
    results = odc.launch(_split_rank, 4, timeout=120)
    order = [2, 1, 0]  # key = -rank
    shards = [float(r * 100 + j) for r in order for j in range(5)]
    for rank, (seen, total, parent_memory) in enumerate(results):
        assert total == [4.0] * 32
        assert parent_memory == 8 * 4  # the group's buffers are not the parent's
        if rank == 3:
            assert seen is None
            continue
        assert seen == (order.index(rank), 3, shards, [6.0] * 12, (5 + 4) * 4)


def _split_failure_rank(rank, world_size, key):
    with odc.Comm(rank, world_size, key, timeout=20) as comm:
        group = comm.split(0)
        if rank == 0:
            comm.abort("boom in the step")
        try:
            group.barrier()
        except odc.Error as error:
            return str(error)
        finally:
            group.close()
        return "no error"


def test_split_fails_with_its_parent_naming_the_rank():
    own, peer = odc.launch(_split_failure_rank, 2, timeout=120)
    assert "split from failed" in own and "boom in the step" in own
    assert "rank 0 failed" in peer and "boom in the step" in peer
