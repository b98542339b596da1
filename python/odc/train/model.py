"""Qwen2-architecture causal LMs from explicit configurations (no download), and the attention
mask that keeps packed documents apart.

The model class is transformers' Qwen2ForCausalLM, so transformers must be installed; without it
`build_model` raises a RuntimeError saying so. Weights are random (seeded): the benchmark measures
speed, memory and equality of results, not quality.
"""

from __future__ import annotations

import torch

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


def build_model(preset: str, seed: int = 0):
    """A randomly initialized Qwen2ForCausalLM of `preset` (on the CPU, fp32), SDPA attention."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}': expected one of {', '.join(PRESETS)}")
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError:
        raise RuntimeError(
            "odc train builds its models with transformers' Qwen2 classes: "
            "pip install 'transformers>=5'"
        ) from None
    config = Qwen2Config(**PRESETS[preset], max_position_embeddings=131072, rope_theta=1_000_000.0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] boolean mask: a token attends to earlier tokens of its own document only."""
    same = document_ids.view(-1, 1) == document_ids.view(1, -1)
    causal = torch.ones_like(same).tril()
    return (same & causal).view(1, 1, *same.shape)
