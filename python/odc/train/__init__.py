"""odc.train: the end-to-end SFT benchmark, `python -m odc.train` (docs/train.md).

data: JSONL token ids, synthetic tokens, per-minibatch plans, packing into microbatches with
per-document positions and labels. metrics: busy/idle per rank, the measured bubble beside the
planner's prediction, throughput. model: Qwen2 presets on packed microbatches (varlen attention,
chunked loss; a split sample's chunk through odc.torch.split); the planner's cost model is fitted
to measured times by odc._cost_fit, which odc.fit shares. run: one rank of a run (Run: setup, plan, steps, collect). summary: a
run's results from every rank's records. matrix: the runs one command makes. arms: the FSDP2
baselines (deferred sync, unsharded) and the plans they run. __main__: the CLI.
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
