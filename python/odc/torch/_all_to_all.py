"""Python objects between ranks in one all-to-all: what LB-Mini from local samples
(odc.torch.lb_mini) and odc as a verl backend (odc.verl.engine) move when a plan sends samples, or
their results, to other ranks. Objects travel serialized (torch.save, tensors on the CPU) in one
all_to_all_single with split sizes (nothing padded), after one all_to_all_single of the byte
counts. Collective over `group`; call it outside any odc minibatch (docs/torch.md, "Collectives
and minibatches").
"""

from __future__ import annotations

import io
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ..errors import InvalidArgument


def collective_device(group) -> torch.device:
    """Where the group's collectives take tensors: the current CUDA device under NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(obj, device: torch.device):
    """Tensors (also inside dicts, lists and tuples) moved to `device`; anything else as is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    if type(obj) is tuple:  # a named tuple's constructor takes fields, not one iterable
        return tuple(to_device(v, device) for v in obj)
    return obj


def all_to_all_objects(
    outgoing: List[Any],
    group=None,
    *,
    problem: Optional[str] = None,
    what: str = "all_to_all_objects",
    peer_problem: str = "could not send their objects",
    to_cpu: Callable[[Any], Any] = lambda obj: to_device(obj, torch.device("cpu")),
) -> List[Any]:
    """Collective: outgoing[d] (None: nothing) to rank d of `group`; returns what each rank sent
    this one (None where it sent nothing). A rank with a `problem` (a message) sends -1 as every
    count instead, so every rank raises InvalidArgument (that rank its message, the others
    "<what>: rank(s) [...] <peer_problem>") rather than some waiting for bytes that never come.
    `to_cpu` readies an object for torch.save (default: its tensors to the CPU)."""
    device = collective_device(group)
    payloads = []
    for obj in outgoing:
        if obj is None or problem is not None:
            payloads.append(b"")
            continue
        buffer = io.BytesIO()
        torch.save(to_cpu(obj), buffer)
        payloads.append(buffer.getvalue())
    counts = [-1 if problem is not None else len(p) for p in payloads]
    send_counts = torch.tensor(counts, dtype=torch.int64, device=device)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    received_counts = [int(n) for n in recv_counts.tolist()]
    if problem is not None:
        raise InvalidArgument(problem)
    failed = [s for s, n in enumerate(received_counts) if n < 0]
    if failed:
        raise InvalidArgument(
            f"{what}: rank(s) {failed} {peer_problem} (their own error names it); nothing was "
            "moved"
        )
    joined = b"".join(payloads)
    send = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else None
    send = (send if send is not None else torch.empty(0, dtype=torch.uint8)).to(device)
    recv = torch.empty(sum(received_counts), dtype=torch.uint8, device=device)
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=received_counts,
        input_split_sizes=[len(p) for p in payloads],
        group=group,
    )
    data, start, received = recv.cpu().numpy().tobytes(), 0, []
    for size in received_counts:
        chunk = data[start : start + size]
        start += size
        received.append(torch.load(io.BytesIO(chunk), weights_only=False) if size else None)
    return received
