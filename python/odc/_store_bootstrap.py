"""An odc bootstrap (odcBootstrap_t) over a torch.distributed-style store, so ranks that torchrun
(or any launcher with a store) started meet without a rendezvous of odc's own.

The store is duck-typed: `set(key, value)`, `get(key)` and `add(key, amount)` (an atomic counter;
`add(key, 0)` reads it without waiting), as torch's TCPStore / FileStore / PrefixStore provide.
Every collective is a round under the communicator's own prefix: each rank sets its record, bumps
the round's arrival counter and polls it (never a blocking get) until every rank arrived, the
job's failure counter moves (a rank that failed names itself there, `mark_failed`; peers report
the first failure, the cause), or the timeout
passes; the error then names this rank, the operation and the ranks that did not arrive.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, List, Optional

from . import _capi
from .errors import InvalidArgument


# A timeout names at most this many missing ranks, found with at most this many store look-ups.
_NAMED_MISSING = 5
_MAX_CHECKS = 64


# Communicators being created on each store object in this process (id(store) -> bootstraps).
# Each rank numbers its communicators with its own counter, so two created at the same time from
# two threads pair up by the order in which their threads reached the counter, which differs
# across ranks: they would pair crosswise, silently. Every creation that overlaps another on the
# same store therefore fails, on every rank (through the store's failure record).
_creating_lock = threading.Lock()
_creating: dict = {}
CONCURRENT_INIT = (
    "another odc.Comm was being created on this store at the same time (another thread): "
    "communicators meeting through one store must be created one at a time, in the same order "
    "on every rank, else they pair up across ranks at random"
)


class StoreBootstrap:
    """One rank's view of one communicator's rendezvous through `store`. Keep it alive as long as
    the communicator (its callbacks are called until the communicator is destroyed)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float):
        for method in ("set", "get", "add"):
            if not callable(getattr(store, method, None)):
                raise InvalidArgument(
                    f"rank {rank}: init: store has no {method}(): odc needs a "
                    "torch.distributed-style store with set/get/add"
                )
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.concurrent = False  # another creation on this store overlapped this one (above)
        with _creating_lock:  # before the number is taken, so an overlap is always seen
            creating = _creating.setdefault(id(store), [])
            for other in creating:
                other.concurrent = self.concurrent = True
            creating.append(self)
        # Communicators are created collectively, so every rank's own counter names the same one.
        sequence = int(store.add(f"odc/comm/sequence/{rank}", 1))
        self.prefix = f"odc/comm/{sequence}"
        self.rounds = 0
        self.error: Optional[str] = None  # why the last callback failed (Python side)
        self._failed = False
        self.struct = _capi.Bootstrap(
            _capi.BOOTSTRAP_VERSION,
            None,
            _capi.BOOTSTRAP_ALLGATHER(self._allgather_cb),
            _capi.BOOTSTRAP_BARRIER(self._barrier_cb),
            _capi.BOOTSTRAP_MARK_FAILED(self._mark_failed_cb),
        )

    def init_done(self) -> None:
        """The communicator's init has returned (either way): no longer being created."""
        with _creating_lock:
            creating = _creating.get(id(self.store), [])
            if self in creating:
                creating.remove(self)
            if not creating:
                _creating.pop(id(self.store), None)

    # -- the collectives (Python) ------------------------------------------------------------
    def allgather(self, data: bytes, operation: str) -> List[bytes]:
        if self.concurrent:
            raise RuntimeError(CONCURRENT_INIT)
        round_prefix = f"{self.prefix}/round{self.rounds}"
        self.rounds += 1
        self.store.set(f"{round_prefix}/{self.rank}", data)
        self.store.add(f"{round_prefix}/arrived", 1)
        self._wait_for_all(round_prefix, operation)
        return [_as_bytes(self.store.get(f"{round_prefix}/{r}")) for r in range(self.world_size)]

    def mark_failed(self, reason: str) -> None:
        if self._failed:
            return
        self._failed = True
        # Numbered in failure order: peers report the first, the cause (later ones are echoes).
        order = int(self.store.add(f"{self.prefix}/failed", 1))
        self.store.set(f"{self.prefix}/failure/{order}", f"rank {self.rank} failed: {reason}")

    def _wait_for_all(self, round_prefix: str, operation: str) -> None:
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while True:
            if int(self.store.add(f"{round_prefix}/arrived", 0)) >= self.world_size:
                return
            if int(self.store.add(f"{self.prefix}/failed", 0)) > 0:
                reason = _as_bytes(self.store.get(f"{self.prefix}/failure/1")).decode(
                    "utf-8", "replace"
                )
                raise RuntimeError(f"bootstrap {operation}: {reason}")
            if time.monotonic() >= deadline:
                missing = self._missing(round_prefix)
                raise TimeoutError(
                    f"bootstrap {operation} timed out after {self.timeout:g} s: rank {self.rank} "
                    f"waited for {missing}"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _missing(self, round_prefix: str) -> str:
        """Who did not arrive, in a bounded message at a bounded cost (a declared world of a million
        ranks must not take a store look-up per rank): the count from the round's counter, and the
        first few missing ranks where the store can tell (`check`)."""
        count = max(self.world_size - int(self.store.add(f"{round_prefix}/arrived", 0)), 0)
        named = []
        check = getattr(self.store, "check", None)
        if callable(check):
            for r in range(min(self.world_size, _MAX_CHECKS)):
                if not check([f"{round_prefix}/{r}"]):
                    named.append(r)
                    if len(named) == _NAMED_MISSING:
                        break
        ranks = ", ".join(map(str, named))
        if named and len(named) >= count:
            return ("ranks " if len(named) > 1 else "rank ") + ranks
        text = f"{count} of {self.world_size} ranks"
        if named:
            text += f" (rank{'s' if len(named) > 1 else ''} {ranks}, ...)"
        return text

    # -- the C callbacks: never raise into C --------------------------------------------------
    @_capi.c_callback
    def _allgather_cb(self, _ctx, send, recv, num_bytes) -> int:
        try:
            data = ctypes.string_at(send, num_bytes) if num_bytes else b""
            records = self.allgather(data, "allgather")
            for r, record in enumerate(records):
                if len(record) != num_bytes:
                    raise RuntimeError(
                        f"bootstrap allgather: rank {r} sent {len(record)} bytes, this rank "
                        f"{num_bytes} (not the same collective)"
                    )
                ctypes.memmove(recv + r * num_bytes, record, num_bytes)
            return 0
        except Exception as error:  # noqa: BLE001 - reported through the result code
            self.error = f"{type(error).__name__}: {error}" if not str(error) else str(error)
            return 1
        except BaseException as error:  # Ctrl-C while polling the store: re-raised by Comm()
            self.error = f"interrupted ({type(error).__name__})"
            _capi.hold_interrupt(error)
            return 1

    @_capi.c_callback
    def _barrier_cb(self, _ctx) -> int:
        try:
            self.allgather(b"\x01", "barrier")
            return 0
        except Exception as error:  # noqa: BLE001 - reported through the result code
            self.error = str(error) or type(error).__name__
            return 1
        except BaseException as error:  # Ctrl-C while polling the store: re-raised by Comm()
            self.error = f"interrupted ({type(error).__name__})"
            _capi.hold_interrupt(error)
            return 1

    @_capi.c_callback
    def _mark_failed_cb(self, _ctx, reason) -> None:
        try:
            text = reason.decode("utf-8", "replace") if reason else "unknown reason"
            if self.error:  # what the store said, which the library only saw as a code
                text = f"{text}: {self.error}"
            self.mark_failed(text)
        except Exception:  # noqa: BLE001 - the store may be gone; peers then time out
            pass
        except BaseException as error:  # Ctrl-C: re-raised by the caller, never into C
            _capi.hold_interrupt(error)


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
