"""odc.torch's refusals that were plain RuntimeErrors before they had odc classes: each is its odc
class (docs/errors.md) and still a RuntimeError, so code written `except RuntimeError` keeps
catching them."""

from __future__ import annotations

from ..errors import InternalError, InvalidArgument


class MismatchError(InvalidArgument, RuntimeError):
    """A communicator, process group or parameter layout that does not fit the FSDP2 model (other
    ranks, other hosts, not the HSDP shard dimension, uneven shards): odc.InvalidArgument."""


class UnexplainedStateError(InternalError, RuntimeError):
    """An FSDP2 state odc.torch cannot explain: odc.InternalError (please report it)."""
