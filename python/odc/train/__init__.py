"""odc.train: building blocks of the end-to-end SFT benchmark (`odc train`, in progress).

Ready: data (JSONL token ids, synthetic tokens, per-minibatch plans, packing into
microbatches with per-document positions and labels) and measured metrics (busy/idle per rank,
the measured bubble beside the planner's prediction, throughput). The model presets, the training
loop and the command line come next.
"""

from .data import PackedMicrobatch, load_token_ids, pack, schedule, synthetic_tokens
from .metrics import MinibatchTiming, summarize

__all__ = [
    "MinibatchTiming",
    "PackedMicrobatch",
    "load_token_ids",
    "pack",
    "schedule",
    "summarize",
    "synthetic_tokens",
]
