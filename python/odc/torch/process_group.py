"""odc communicators for the ranks of a `torch.distributed` process group (e.g. torchrun's).

The communicator's key is drawn per job: rank 0 of the group picks a random key and publishes it
in the group's own store (torchrun's rendezvous store under env://), and its peers read it there.
Two concurrent jobs therefore never share a key, whatever their run ids, ports or settings.
Invariant: `comm_from_process_group` is collective over the group, and every rank derives the
same key from the same store entry.
"""

from __future__ import annotations

import functools
import inspect
import secrets
import socket
import weakref
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from ..comm import Comm, default_transport
from ..errors import InvalidArgument, InvalidUsage
from ._errors import MismatchError
from .heap import size_nvshmem_heap

# Store entries live under this prefix of the group's store (already prefixed per group by c10d).
STORE_PREFIX = "odc/comm_from_process_group"
# How many communicators this process built per group: the n-th call on every rank of a group
# reads the n-th entry, so several communicators of one job get distinct keys.
_calls: Dict[object, int] = {}
# How to make another communicator like each one comm_from_process_group made (same group,
# device and options): what OdcFSDP.reload() calls when it is given none.
_remakes: "weakref.WeakKeyDictionary[Comm, Callable[[], Comm]]" = weakref.WeakKeyDictionary()


def remake_comm(comm: Comm) -> Optional[Comm]:
    """Collective over the group `comm` was made for: a new communicator made as
    comm_from_process_group made `comm` (same group, device, timeout and options), or None when
    `comm` was not made by it (then the caller must supply one)."""
    make = _remakes.get(comm)
    return None if make is None else make()


def group_store(group: dist.ProcessGroup) -> dist.Store:
    """The store `group` was created with. c10d keeps it in a private table (_world.pg_map:
    group -> (backend, store), torch 2.x); no public accessor exists. Checked against 2.9 and
    2.11; tests/python/test_torch_process_group.py fails naming it if it moves."""
    from torch.distributed import distributed_c10d as c10d

    entry = c10d._world.pg_map.get(group)
    if entry is None:
        raise InvalidUsage(
            "odc.torch: this process group has no store in torch.distributed's group table "
            "(is it initialized, and is this rank a member?)"
        )
    return entry[1]


def job_key(group: dist.ProcessGroup, store: dist.Store) -> str:
    """Collective over `group`: the key of this job's next communicator on this group. Rank 0
    draws it at random and publishes it in `store`; the others block on the store until it is
    there (the store's own timeout bounds the wait). Helper #11's external bootstrap replaces
    the key with the store itself; this is the one place that changes then."""
    index = _calls.get(group, 0)
    _calls[group] = index + 1
    entry = f"{STORE_PREFIX}/{index}/key"
    if group.rank() == 0:
        key = f"pg-{secrets.token_hex(16)}"
        store.set(entry, key)
        return key
    return store.get(entry).decode()


def _hosts(group: dist.ProcessGroup, store: dist.Store, key: str) -> list:
    """The group's host names, rank by rank. Every rank publishes its own and reads all of them,
    so every rank takes the same decision (one host: local transports; several: NVSHMEM)."""
    entry = f"{STORE_PREFIX}/{key}/host"
    store.set(f"{entry}/{group.rank()}", socket.gethostname())
    return [store.get(f"{entry}/{r}").decode() for r in range(group.size())]


def comm_from_process_group(
    group: Optional[dist.ProcessGroup] = None,
    *,
    device: Optional[int] = None,
    timeout: Optional[float] = None,
    deterministic: bool = False,
    model: Optional[torch.nn.Module] = None,
    cuda_sms: Optional[int] = None,
) -> Comm:
    """Collective over `group` (default: the world group): an odc.Comm over the same ranks.

    rank and size are the group's; device is this rank's CUDA device index (default: the
    current CUDA device when the group's backend is NCCL, else None, a host communicator);
    timeout: seconds any wait on another rank may take (odc.Comm's default when None).
    deterministic: a fixed summation order, where the odc core offers it (odc.Comm's
    `deterministic` argument); raises NotImplementedError naming that where it does not.
    model: the fully_shard model OdcFSDP will run on this communicator. Where the communicator is
    over NVSHMEM (the group spans hosts, or $ODC_TRANSPORT=nvshmem), NVSHMEM's heap is sized to
    what odc will hold for it (size_nvshmem_heap) unless the user set NVSHMEM_SYMMETRIC_SIZE or
    ODC_NVSHMEM_HEAP_GIB; without it the heap is ODC_NVSHMEM_HEAP_GIB's default, 4 GiB.
    cuda_sms: the CUDA transport's SM budget (odc.Comm's `cuda_sms`; None: $ODC_CUDA_SMS, else
    all).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidUsage(
            "comm_from_process_group needs an initialized torch.distributed process group "
            "(dist.init_process_group, e.g. under torchrun)"
        )
    group = group if group is not None else dist.group.WORLD
    if group.rank() < 0:
        raise InvalidArgument("comm_from_process_group: this rank is not a member of the group")
    if device is None and "nccl" in str(dist.get_backend(group)).lower():
        device = torch.cuda.current_device()
    options = {}
    if deterministic:
        if "deterministic" not in inspect.signature(Comm).parameters:
            raise NotImplementedError(
                "comm_from_process_group(deterministic=True): this odc build's Comm has no "
                "deterministic mode"
            )
        options["deterministic"] = True
    if cuda_sms is not None:
        options["cuda_sms"] = cuda_sms
    store = group_store(group)
    key = job_key(group, store)
    hosts = set(_hosts(group, store, key))
    across_hosts = len(hosts) > 1
    nvshmem = across_hosts or (device is not None and default_transport(device) == "nvshmem")
    if model is not None and device is not None and nvshmem:
        # Nodes as the core will see them: $ODC_LOCAL_WORLD_SIZE, else torchrun's
        # $LOCAL_WORLD_SIZE (else one rank per node: every node scheme counted).
        size_nvshmem_heap(model, group.size(), deterministic=deterministic)
    comm = _make(group, store, key, across_hosts, hosts, device, timeout, options)
    _remakes[comm] = functools.partial(
        comm_from_process_group,
        group,
        device=device,
        timeout=timeout,
        deterministic=deterministic,
        cuda_sms=cuda_sms,
    )
    return comm


def _make(group, store, key, across_hosts, hosts, device, timeout, options) -> Comm:
    """The communicator itself: local transports on one host, NVSHMEM across hosts."""
    if across_hosts:
        if device is None:
            raise MismatchError(
                f"odc.torch: the process group spans {len(hosts)} hosts "
                f"({', '.join(sorted(hosts))}); host communicators join the processes of one "
                "host (GPU communicators span hosts over NVSHMEM)"
            )
        # Across hosts: flat ODC over NVSHMEM, meeting through the group's store (a key names
        # local shared memory only). docs/multinode.md.
        return Comm(
            group.rank(),
            group.size(),
            store=store,
            timeout=timeout,
            device=device,
            transport="nvshmem",
            **options,
        )
    return Comm(group.rank(), group.size(), key, timeout=timeout, device=device, **options)
