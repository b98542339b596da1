"""Qwen2-architecture causal LMs from explicit configurations (no download), run on packed
microbatches: documents concatenated into one sequence, attention kept inside each document, and
the LM-head loss computed in chunks so that 64K-token microbatches never hold all their logits.

The model class is transformers' Qwen2ForCausalLM, so transformers must be installed; without it
`build_model` raises a RuntimeError saying so. Weights are random (seeded): the benchmark measures
speed, memory and equality of results, not quality.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import InvalidArgument
from .._packed_attention import (  # noqa: F401 - re-exported: odc.train's model API
    ATTENTION_NAME,
    packed_attention,
    register_packed_attention,
    varlen_available,
)
from ..torch import split as split_execution
from .data import IGNORE_INDEX

# Shapes of the public Qwen2 checkpoints of these sizes (config.json of Qwen2-0.5B/1.5B/7B);
# `tiny` is for CPU runs.
PRESETS = {
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}

LOSS_CHUNK_TOKENS = 4096  # logits of this many tokens at a time: 4096 x 152K fp32 = 2.5 GB


def build_model(preset: str, seed: int = 0) -> "PackedCausalLM":
    """A randomly initialized Qwen2 model of `preset` (fp32, on the current default device),
    wrapped for packed microbatches."""
    if preset not in PRESETS:
        raise InvalidArgument(f"unknown preset '{preset}': expected one of {', '.join(PRESETS)}")
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError:
        raise RuntimeError(
            "odc train builds its models with transformers' Qwen2 classes: "
            "pip install 'transformers>=5'"
        ) from None
    register_packed_attention()
    config = Qwen2Config(**PRESETS[preset], max_position_embeddings=131072, rope_theta=1_000_000.0)
    torch.manual_seed(seed)
    return PackedCausalLM(Qwen2ForCausalLM._from_config(config, attn_implementation=ATTENTION_NAME))


# Compiled variants of one block's code that a process may need: every block of every model
# shares them (one code object), and grad mode, requires_grad changes and inductor's size
# thresholds each add some. torch's default of 8 was reached on an H200 by a probe that built
# several models in one process, after which torch ran the blocks eagerly and said so only in a
# log line. Set for the whole process (torch's config is global).
RECOMPILE_LIMIT = 64


def compile_blocks(model: "PackedCausalLM", *, backend: str = "inductor") -> bool:
    """Compiles each decoder block's forward with torch.compile (inductor; the token dimension
    dynamic), as production stacks do (torchtitan compiles each block): eager PyTorch launches a few
    dozen kernels per block from Python, so a short microbatch of the 1.5b preset cost ~270 ms of
    host time while its GPU work took a few ms (docs/benchmarks.md, "5. The host floor"). Only the
    block's forward is compiled, after activation checkpointing wrapped it (the recomputation is
    compiled with it) and after fully_shard (which changes each block's class); the module's hooks,
    FSDP2's and odc.torch's, stay outside and run as before. The blocks share their compiled code
    (the same function); torch compiles again where its guards ask (on an H200: at two size
    thresholds of inductor's fusion heuristics, ~3.4K and 4K tokens for 1.5b), and keeps compiled
    code on disk (inductor's cache). Raises torch's recompile limit to RECOMPILE_LIMIT and makes
    reaching it an error (torch's default is to fall back to eager silently, and a run reported as
    compiled would not be). Not with split samples (odc.train refuses --compile with --split: their
    K/V exchange inside a compiled block has not run on a GPU). Only on CUDA with flash attention:
    elsewhere the plain path. Another `backend` (tests: "aot_eager", which traces and partitions as
    inductor does but runs the aten ops) compiles on any device. Returns whether it compiled."""
    first = next(model.parameters(), None)
    if first is None or (backend == "inductor" and not varlen_available(first.device)):
        return False
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.fail_on_recompile_limit_hit = True
    for layer in model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, backend=backend)
    return True


# compile_sizes: dense up to here (inductor's size heuristics switch at small token counts: seen
# at 3.4K and 4K tokens for the 1.5b preset, 1.5K and 4K expected for 7b), doubling above.
DENSE_COMPILE_TOKENS = 8192
COMPILE_STEP = 1.1


def compile_sizes(smallest: int, largest: int) -> list:
    """Token counts whose forward + backward make torch compile every variant that microbatches
    of smallest..largest tokens would need, so that none compiles inside a measured minibatch.
    torch compiles a block again where inductor's heuristics guard on the token count (which
    reduction to split, which block size to use: ranges such as 3,414-4,095 tokens, 1.2x wide);
    a ladder 10% apart up to DENSE_COMPILE_TOKENS meets each such range, and above it the
    heuristics no longer change (measured up to 64K tokens: dev/gpu/compile_variants.py)."""
    if smallest < 1 or largest < smallest:
        raise InvalidArgument(
            f"compile_sizes: need 1 <= smallest <= largest, got {smallest}, {largest}"
        )
    sizes, tokens = [], float(smallest)
    while tokens < largest:
        sizes.append(int(tokens))
        tokens = tokens * COMPILE_STEP if tokens < DENSE_COMPILE_TOKENS else tokens * 2
    sizes.append(largest)
    return sorted(set(sizes))


def compile_warm_up_microbatches(smallest: int, largest: int, vocab_size: int, seed: int = 0):
    """Packed microbatches (data.Packed) whose forward + backward compile every variant of the
    blocks that microbatches of smallest..largest tokens need: each of compile_sizes as one
    document and as two. Two, because torch gives equal sizes one symbol when it compiles (a
    one-document microbatch's longest document is its token count) and may guard on that
    equality, so a packed microbatch of a size class compiled from one document alone could
    compile again."""
    from .data import pack, synthetic_tokens

    sizes = compile_sizes(smallest, largest)
    packed = []
    for document in synthetic_tokens(sizes, vocab_size, seed=seed):
        packed.append(pack([document]))
        if len(document) >= 3:  # two documents, the longest shorter than the microbatch
            cut = len(document) - len(document) // 3
            packed.append(pack([document[:cut], document[cut:]]))
    return packed


def shard_blocks(model: "PackedCausalLM", *, compile: bool, backend: str = "inductor", **options):
    """fully_shard each decoder block, then the root (`options`: fully_shard's, e.g. mesh,
    mp_policy, reshard_after_forward (the blocks only: the root never reshards after forward
    anyway)), then with `compile` compile_blocks. The order is the point: compiled before
    fully_shard, a block kept the pre-FSDP class's forward, and transformers 5.24's activation
    checkpointing (on the class's forward, active only where it is the outermost one) stopped
    recomputing without a word (tests/python/test_train_model.py measures the saved activations).
    FSDP2's hooks, and odc.torch's, are module hooks: outside the compiled forward. Returns whether
    the blocks were compiled (CUDA without flash attention runs them eagerly)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, **options)
    options.pop("reshard_after_forward", None)
    fully_shard(model, **options)
    return compile and compile_blocks(model, backend=backend)


def _lm_head_objective(hidden, weight, labels, objective, begin: int):
    """One chunk's logits (fp32) and their objective: the summed token cross entropy, or
    `objective(logits, labels, begin)` (begin: the chunk's first token in the microbatch)."""
    logits = F.linear(hidden, weight).float()
    if objective is None:
        return F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
    return objective(logits, labels, begin)


class PackedCausalLM(torch.nn.Module):
    """Qwen2ForCausalLM (`.lm`) whose forward takes one packed microbatch and returns the summed
    token loss. Shard it like the plain model: `fully_shard` each of `.layers`, then this module."""

    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm

    @property
    def config(self):
        return self.lm.config

    @property
    def layers(self):
        return self.lm.model.layers

    def gradient_checkpointing_enable(self) -> None:
        self.lm.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )

    def hidden_states(self, input_ids, position_ids, boundaries, longest, split=None):
        """[T, hidden] of one packed microbatch (or split chunk, see forward)."""
        extra = {} if split is None else {"odc_split": split}
        return self.lm.model(
            input_ids=input_ids.view(1, -1),
            position_ids=position_ids.view(1, -1),
            cu_seq_lens_q=boundaries,
            cu_seq_lens_k=boundaries,
            max_length_q=longest,
            max_length_k=longest,
            **extra,
        ).last_hidden_state[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        boundaries: torch.Tensor,
        longest: int,
        split: Optional[split_execution.SplitChunk] = None,
        objective=None,
    ) -> torch.Tensor:
        """input_ids, position_ids, labels: [T]; boundaries: int32 [documents + 1] cumulative
        document lengths; longest: the longest document. Returns the loss summed over tokens:
        cross entropy, or `objective(logits, labels, begin)` summed over chunks of
        LOSS_CHUNK_TOKENS tokens (logits fp32 [chunk, vocab]; begin: the chunk's first token;
        e.g. GRPO's clipped objective, odc.train.grpo). With `split`, the inputs are this rank's
        chunk of a split sample (data.pack_chunk, global positions and labels) and every member
        of its group must run it at the same time."""
        hidden = self.hidden_states(input_ids, position_ids, boundaries, longest, split)
        weight = self.lm.lm_head.weight
        total = hidden.new_zeros((), dtype=torch.float32)
        for begin in range(0, hidden.shape[0], LOSS_CHUNK_TOKENS):
            end = begin + LOSS_CHUNK_TOKENS
            # Recomputed in backward: only one chunk's logits exist at a time.
            total = total + checkpoint(
                _lm_head_objective, hidden[begin:end], weight, labels[begin:end], objective,
                begin, use_reentrant=False,
            )  # fmt: skip
        return total

    @torch.no_grad()
    def token_logprobs(self, input_ids, position_ids, labels, boundaries, longest):
        """(log-probability of each label, entropy of each position), fp32 [T], 0 where the
        label is ignored; forward only, LOSS_CHUNK_TOKENS logits at a time."""
        from .grpo import token_logprobs

        hidden = self.hidden_states(input_ids, position_ids, boundaries, longest)
        weight = self.lm.lm_head.weight
        parts = [
            token_logprobs(
                F.linear(hidden[b : b + LOSS_CHUNK_TOKENS], weight),
                labels[b : b + LOSS_CHUNK_TOKENS],
            )
            for b in range(0, hidden.shape[0], LOSS_CHUNK_TOKENS)
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
