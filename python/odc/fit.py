"""`python -m odc.fit`: the planner's cost model, max(F, C + sum(A*L + B*L^2)) per microbatch
(docs/planner.md, "Cost model"), fitted to one's own model on one device, printed as the
`--cost A,B,C,F` that `odc plan`, `odc compare` and `odc simulate` take.

The model is built with random weights from a Hugging Face config (nothing is downloaded), with
odc.train's packed attention unless --attn-implementation names another, or given as an object
(fit_cost). Forward + backward is timed on odc.train's ladder: single-sample microbatches, packed
ones (the two longest lengths as 4 and 16 documents: they separate a from b) where the model's
attention keeps documents apart, and the floor's short microbatch; the fit itself is
odc._cost_fit's, the one `odc train` applies to its own model. One device, no sharding:
the times are compute and the host's launches, without FSDP2's communication.

  python -m odc.fit data/configs/qwen2_1_5b.json --max-tokens 32768
  python -m odc.fit Qwen/Qwen2-1.5B --max-tokens 32768 --gradient-checkpointing  # cached config

Usage errors exit with status 2 and one line, like `odc` and `python -m odc.train`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .errors import InvalidArgument
from ._cost_fit import (
    MIN_FIT_TOKENS,
    fit_cost_with_floor,
    fitted_rungs,
    floor_length,
    ladder,
    packed_ladder,
)
from ._numbers import option_type, whole_number

PROG = "python -m odc.fit"
USAGE_ERROR = 2
MIN_RUNGS = 3  # a, b and c need three lengths
NOISY_SPREAD = 0.1  # (max - min) / median of the repeats above this: say the times are noisy
LOSS_CHUNK_TOKENS = 4096  # logits of this many tokens at a time (as odc.train's model)
# transformers attention implementations that take packed documents' boundaries (cu_seq_lens_q,
# as flash attention's varlen kernels): packed rungs are timed only for these. "odc_packed" is
# odc.train's (odc.train.model.ATTENTION_NAME), the default for a model built here.
PACKED_ATTENTION = ("odc_packed", "flash_attention_2", "flash_attention_3")
_COUNT = option_type(whole_number)  # the integer options: plain digits 0-9, as odc.train's


class FitError(InvalidArgument):
    """Input the fit cannot use (config, device, lengths) or a ladder too short to fit; the
    message is one line, meant for the user. An odc.InvalidArgument, so a ValueError."""


@dataclass
class Rung:
    """One timed microbatch: every repeat's seconds, their median and spread ((max - min) /
    median); `documents` the lengths of a packed one's documents (None: one sample)."""

    tokens: int
    times: List[float]
    documents: Optional[List[int]] = None

    @property
    def lengths(self) -> List[int]:
        return self.documents if self.documents else [self.tokens]

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        return (max(self.times) - min(self.times)) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class CostFit:
    """The fitted cost model and what it was fitted on. `rungs` is the ladder as measured (it
    ends early when a length ran out of memory: `stopped` says where); `fitted` marks the rungs
    a, b, c were fitted on (the others are close to the floor: host time, odc._cost_fit)."""

    a: float
    b: float
    c: float
    floor: float
    floor_rung: Rung
    rungs: List[Rung]
    fitted: List[bool]
    stopped: Optional[str] = None
    description: str = ""
    settings: dict = field(default_factory=dict)

    @property
    def cost(self) -> Tuple[float, float, float, float]:
        """(a, b, c, floor), as odc.plan's `cost` takes it."""
        return (self.a, self.b, self.c, self.floor)

    @property
    def flag(self) -> str:
        return "--cost " + ",".join(f"{v:.4g}" for v in self.cost)

    def predict(self, tokens) -> float:
        """The fitted time of a microbatch: one sample of `tokens` tokens, or documents of the
        lengths `tokens` lists packed together."""
        lengths = [tokens] if isinstance(tokens, int) else list(tokens)
        return max(self.floor, self.c + sum(self.a * n + self.b * n * n for n in lengths))

    def to_json(self) -> dict:
        def row(rung: Rung, fitted: Optional[bool]) -> dict:
            entry = {"tokens": rung.tokens, "seconds": rung.seconds, "times": rung.times}
            if rung.documents:
                entry["documents"] = rung.documents
            entry["predicted"] = self.predict(rung.lengths)
            if fitted is not None:
                entry["fitted"] = fitted
            return entry

        return {
            "cost": {"a": self.a, "b": self.b, "c": self.c, "floor": self.floor},
            "flag": self.flag,
            "model": self.description,
            "settings": self.settings,
            "floor_microbatch": row(self.floor_rung, None),
            "ladder": [row(r, f) for r, f in zip(self.rungs, self.fitted)],
            "stopped": self.stopped,
        }


def load_config(source):
    """A transformers config from a config.json path, a folder holding one, or a model name
    already in the local Hugging Face cache (no download: the GPU machines have no network)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise FitError(
            "building a model from a config needs transformers: pip install 'odc[train]'"
        ) from None
    text = str(source)
    path = Path(text).expanduser()
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise FitError(f"cannot read '{text}' as a JSON config: {error}") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise FitError(f"'{text}' has no \"model_type\": not a Hugging Face config.json")
        model_type = data.pop("model_type")
        try:
            return AutoConfig.for_model(model_type, **data)
        except Exception as error:  # noqa: BLE001 - transformers' validators raise many types
            # (ValueError, KeyError, huggingface_hub's StrictDataclass*ValidationError, ...):
            # every one means this file is not a config transformers takes.
            raise FitError(f"'{text}': {_one_line(error)}") from None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FitError(f"the folder '{text}' has no config.json")
        return load_config(path / "config.json")
    if text.endswith(".json") or text.startswith(("/", "./", "../", "~")):
        raise FitError(f"no such config file or folder: '{text}'")
    try:
        return AutoConfig.from_pretrained(text, local_files_only=True)
    except (OSError, ValueError):
        raise FitError(
            f"'{text}' is neither a config.json path nor a model in the local Hugging Face "
            "cache (nothing is downloaded: give the path of its config.json)"
        ) from None


def _one_line(error: BaseException, limit: int = 240) -> str:
    """The error's message as one line: its lines joined (transformers' validators and torch put
    the reason on the second line), cut at `limit` characters."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    text = text or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _resolve_device(device):
    import torch

    name = str(device)
    if not (name == "cpu" or name == "cuda" or name.startswith("cuda:")):
        raise FitError(f"device must be cuda or cpu, got '{name}'")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise FitError(f"--device {name}, but torch sees no GPU (on the CPU: --device cpu)")
    return torch.device(name)


def _resolve_dtype(dtype):
    import torch

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    if isinstance(dtype, torch.dtype) and dtype in dtypes.values():
        return dtype
    if dtype not in dtypes:
        raise FitError(f"dtype must be bfloat16 or float32, got '{dtype}'")
    return dtypes[dtype]


def build_model(config, device, dtype, attn_implementation: Optional[str] = None, seed: int = 0):
    """transformers' causal LM for `config`, randomly initialized (seeded) on `device` in
    `dtype`, in training mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if attn_implementation == PACKED_ATTENTION[0]:
        from ._packed_attention import register_packed_attention

        register_packed_attention()
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialize in dtype: no fp32 copy of a large model
    try:
        with device:  # and on the device: a 7B model initialized on the CPU takes minutes
            model = AutoModelForCausalLM.from_config(config, **extra)
        return model.to(device=device, dtype=dtype).train()
    except Exception as error:  # noqa: BLE001 - a config transformers took may still fail here
        # (a head count of 0, a negative size: ZeroDivisionError, RuntimeError, ...), or its
        # weights may not fit the device: one line either way, not a traceback.
        if _is_out_of_memory(error):
            tried = re.search(r"[Tt]ried to allocate (\d[^.(]*?)(?:\.|\(|$)", str(error))
            size = f" (it tried to allocate {tried.group(1).strip()})" if tried else ""
            raise FitError(
                f"out of memory building the model on {device}{size}: a smaller config, --dtype "
                "bfloat16 or a larger device"
            ) from None
        # A KeyError's text is the bare key: a name the config gives that transformers lacks.
        reason = f"unknown name {error}" if isinstance(error, KeyError) else _one_line(error)
        raise FitError(f"cannot build a causal LM from this config: {reason}") from None
    finally:
        torch.set_default_dtype(default)


def _head_loss_sum(hidden, weight, bias, labels):
    import torch.nn.functional as F

    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, reduction="sum")


@functools.lru_cache(maxsize=4)
def _packed_inputs(documents: tuple, device) -> dict:
    """The position ids and document boundaries of `documents` packed, on `device`: made once
    per rung, not in every timed repeat (each would copy them to the device)."""
    import torch

    boundaries = torch.tensor([0, *itertools.accumulate(documents)], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in documents]).view(1, -1)
    return dict(
        position_ids=positions.to(device),
        cu_seq_lens_q=boundaries.to(device),
        cu_seq_lens_k=boundaries.to(device),
        max_length_q=max(documents),
        max_length_k=max(documents),
    )


def causal_lm_loss(model, input_ids, documents: Optional[Sequence[int]] = None):
    """Next-token loss of a transformers causal LM on `input_ids` [1, L], its LM head applied
    LOSS_CHUNK_TOKENS tokens at a time (recomputed in backward) as odc.train does, so that a 32K
    microbatch never holds all its logits; a model without a separable Linear head uses its own
    loss (labels=input_ids). `documents`: the input is these documents packed (their lengths sum
    to L): positions restart at each and the attention gets their boundaries (cu_seq_lens_q, as
    the PACKED_ATTENTION implementations take them)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(base, torch.nn.Module) or not isinstance(head, torch.nn.Linear):
        return model(input_ids=input_ids, labels=input_ids).loss
    extra = {} if documents is None else _packed_inputs(tuple(documents), input_ids.device)
    hidden = base(input_ids=input_ids, **extra).last_hidden_state[0, :-1]
    labels = input_ids[0, 1:]
    total = hidden.new_zeros((), dtype=torch.float32)
    for begin in range(0, hidden.shape[0], LOSS_CHUNK_TOKENS):
        end = begin + LOSS_CHUNK_TOKENS
        total = total + checkpoint(
            _head_loss_sum,
            hidden[begin:end],
            head.weight,
            head.bias,
            labels[begin:end],
            use_reentrant=False,
        )
    return total


def _is_causal_lm(model) -> bool:
    return hasattr(model, "get_output_embeddings") and hasattr(model, "base_model_prefix")


def packs_documents(model) -> bool:
    """Whether fit_cost can time packed microbatches on `model`: a transformers causal LM whose
    attention is one of PACKED_ATTENTION (others, SDPA or eager, attend across documents)."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return _is_causal_lm(model) and attention in PACKED_ATTENTION


def _default_loss(model, input_ids, documents=None):
    """causal_lm_loss for transformers models; for another module, its output's `.loss`, or
    the sum of the tensor it returns."""
    if _is_causal_lm(model):
        return causal_lm_loss(model, input_ids, documents)
    output = model(input_ids)
    loss = getattr(output, "loss", None)
    if loss is None:
        loss = output if not isinstance(output, (tuple, list)) else output[0]
    return loss.float().sum()


def _enable_checkpointing(model) -> None:
    """transformers' activation checkpointing (non-reentrant); named
    activation_checkpointing_enable from transformers 5.x on, gradient_checkpointing_enable
    before (deprecated after)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise FitError(
            "gradient checkpointing needs a transformers model (or checkpoint it yourself)"
        )


def _is_out_of_memory(error: BaseException) -> bool:
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text  # the CPU allocator's words
    )


def _sizes_for(config, max_tokens: int, vocab_size: Optional[int]) -> int:
    """The vocabulary size (`vocab_size`, else the config's); refuses a max_tokens beyond the
    config's positions (learned position embeddings would index past their table)."""
    vocab = vocab_size or getattr(config, "vocab_size", None)
    if vocab is None:
        raise FitError("the model has no config.vocab_size: pass vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise FitError(f"the vocabulary size must be a positive integer, got {vocab!r}")
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    if positions and max_tokens > positions:
        raise FitError(
            f"max_tokens {max_tokens} is beyond the model's {positions} positions "
            "(max_position_embeddings)"
        )
    return int(vocab)


def fit_cost(
    model_or_config: Any,
    max_tokens: int,
    *,
    device=None,
    dtype="bfloat16",
    repeats: int = 3,
    warmup: int = 1,
    gradient_checkpointing: bool = False,
    attn_implementation: Optional[str] = None,
    loss_fn: Optional[Callable] = None,
    vocab_size: Optional[int] = None,
    seed: int = 0,
    progress: Optional[Callable[[str], None]] = None,
) -> CostFit:
    """Fits the planner's cost model to `model_or_config` by timing forward + backward of
    one-sample microbatches of _cost_fit.ladder(max_tokens) tokens, then the packed ones of
    _cost_fit.packed_ladder(max_tokens) where the model packs documents (packs_documents), then
    of _cost_fit.floor_length(max_tokens) tokens for the floor: for each, `warmup` untimed runs,
    then the median of `repeats`, each run between two device synchronizations.

    model_or_config: a config.json path, a folder holding one, a model name in the local Hugging
        Face cache, or a transformers config: built with random weights on `device` (default
        cuda) in `dtype` ("bfloat16" or "float32"), with `attn_implementation` (default
        odc.train's packed attention, "odc_packed": flash attention's varlen kernel on CUDA). Or a torch module, used as it is (its
        device, which `device` may only repeat, and dtype): a transformers causal LM, or any module that `loss_fn(model,
        input_ids)` (default: the module's `.loss`, or the sum of its output) turns into a
        scalar; `vocab_size` when it has no config.vocab_size.
    gradient_checkpointing: recompute activations in backward (transformers' activation
        checkpointing); it raises a and b and lets longer microbatches fit.

    A length that runs out of memory ends the ladder there (`stopped` says so); with fewer than
    three lengths measured that raises FitError. Weights are never updated (no optimizer):
    gradients accumulate across the runs and are dropped at the end.
    """
    import torch  # noqa: F401 - without torch, ImportError before any argument is checked

    if not isinstance(max_tokens, int) or max_tokens < MIN_FIT_TOKENS:
        raise FitError(f"max_tokens must be at least {MIN_FIT_TOKENS}, got {max_tokens}")
    if repeats < 1 or warmup < 0:
        raise FitError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if not 0 <= seed < 2**64:  # torch's generators take 64 bits
        raise FitError(f"seed must be 0 to 2^64 - 1, got {seed}")
    say = progress or (lambda text: None)
    model, device, vocab, description = _take_model(
        model_or_config, max_tokens, device, dtype, attn_implementation, vocab_size, seed, say
    )
    if gradient_checkpointing:
        _enable_checkpointing(model)
    if hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = False  # training: no KV cache
    model.train()
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    description += _describe(model, device, dtypes, gradient_checkpointing)
    packs = loss_fn is None and packs_documents(model)
    bench = _Bench(model, loss_fn or _default_loss, device, vocab, warmup, repeats, seed, say)
    bench.packs = packs
    rungs, floor_rung, stopped = _measure_ladder(bench, max_tokens, gradient_checkpointing, say)
    seconds = [r.seconds for r in rungs]
    a, b, c, floor = fit_cost_with_floor([r.lengths for r in rungs], seconds, floor_rung.seconds)
    chosen = set(fitted_rungs(seconds, floor_rung.seconds))
    settings = {
        "max_tokens": max_tokens,
        "device": str(device),
        "repeats": repeats,
        "warmup": warmup,
        "gradient_checkpointing": gradient_checkpointing,
        "dtype": "/".join(dtypes),
        "packed_rungs": packs,
    }
    return CostFit(
        a,
        b,
        c,
        floor,
        floor_rung,
        rungs,
        [i in chosen for i in range(len(rungs))],
        stopped,
        description,
        settings,
    )


def _take_model(
    model_or_config, max_tokens, device, dtype, attn_implementation, vocab_size, seed, say
):
    """(model, device, vocabulary size, description) for fit_cost: a torch module as it is (on
    its own device, which `device` may only repeat), else a model built from the config."""
    import torch

    if isinstance(model_or_config, torch.nn.Module):
        model = model_or_config
        first = next(model.parameters(), None)
        own = first.device if first is not None else torch.device("cpu")
        if device is not None and torch.device(device) != own:
            raise FitError(f"the model is on {own}, not {device}: move it there first")
        device = _resolve_device(own)
        vocab = _sizes_for(getattr(model, "config", None), max_tokens, vocab_size)
        return model, device, vocab, type(model).__name__
    config = model_or_config
    source = "config"
    if not hasattr(config, "to_dict"):  # a path or a name
        source = str(config)
        config = load_config(config)
    device = _resolve_device(device or "cuda")
    dtype = _resolve_dtype(dtype)
    vocab = _sizes_for(config, max_tokens, vocab_size)
    attn_implementation = attn_implementation or PACKED_ATTENTION[0]
    say(f"building {getattr(config, 'model_type', '?')} from {source} on {device}")
    model = build_model(config, device, dtype, attn_implementation, seed)
    return model, device, vocab, f"{type(model).__name__} from {source}"


def _describe(model, device, dtypes: List[str], gradient_checkpointing: bool) -> str:
    """What the description adds after the model's name: size, dtypes, device, checkpointing."""
    import torch

    parameters = sum(p.numel() for p in model.parameters())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    size = f"{parameters / 1e9:.3g}B" if parameters >= 1e9 else f"{parameters / 1e6:.3g}M"
    return (
        f", {size} parameters, {'/'.join(dtypes)} on {where}"
        f", gradient checkpointing {'on' if gradient_checkpointing else 'off'}"
    )


class _Bench:
    """Times forward + backward of a model's microbatches (fit_cost's rungs): one sample, or
    packed documents where `packs` (the loss then gets every microbatch's document lengths)."""

    packs = False

    def __init__(self, model, loss_fn, device, vocab: int, warmup: int, repeats: int, seed, say):
        import torch

        self.model, self.loss_fn, self.device, self.vocab = model, loss_fn, device, vocab
        self.warmup, self.repeats, self.say = warmup, repeats, say
        self.on_gpu = device.type == "cuda"
        self.generator = torch.Generator().manual_seed(seed)

    def sync(self) -> None:
        import torch

        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def once(self, input_ids, documents=None) -> float:
        self.sync()
        begin = time.perf_counter()
        extra = (documents,) if self.packs else ()
        self.loss_fn(self.model, input_ids, *extra).backward()
        self.sync()  # backward's kernels run after the host returns
        return time.perf_counter() - begin

    def measure(self, tokens: int, documents: Optional[List[int]] = None) -> Rung:
        """One rung: `tokens` tokens, one sample or the `documents` lengths packed."""
        import torch

        lengths = documents or [tokens]
        input_ids = torch.randint(0, self.vocab, (1, tokens), generator=self.generator)
        input_ids = input_ids.to(self.device)
        for _ in range(self.warmup):  # allocator growth, kernel autotuning, lazy initialization
            self.once(input_ids, lengths)
        times = [self.once(input_ids, lengths) for _ in range(self.repeats)]
        rung = Rung(tokens, times, list(documents) if documents else None)
        shape = f"{tokens} tokens" + (f" in {len(documents)} documents" if documents else "")
        self.say(f"{shape}: {rung.seconds:.4g} s (spread {100 * rung.spread:.1f}%)")
        return rung

    def released(self) -> None:
        import torch

        self.model.zero_grad(set_to_none=True)
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()

    def attempt(self, tokens: int, documents: Optional[List[int]] = None) -> Optional[Rung]:
        """measure(tokens, documents), or None when it ran out of memory. Any other failure of
        forward + backward (a config transformers built but cannot run, e.g. heads that do not
        divide the hidden size) is a FitError naming the length, chained to the error."""
        try:
            return self.measure(tokens, documents)
        except Exception as error:  # noqa: BLE001 - the model's own errors, whatever their type
            if not _is_out_of_memory(error):
                shape = f"{tokens} tokens" + (
                    f" in {len(documents)} documents" if documents else ""
                )
                raise FitError(
                    f"forward + backward of {shape} failed: {_one_line(error)}"
                ) from error
        # Out of the except block: the error and its traceback, which holds the failed
        # microbatch's activations, are gone; their memory goes back to the device.
        self.released()
        return None


def _measure_ladder(
    bench: _Bench, max_tokens: int, gradient_checkpointing: bool, say
) -> Tuple[List[Rung], Rung, Optional[str]]:
    """(rungs, floor rung, why the ladder stopped early or None): the ladder up to the first
    length that runs out of memory, then its packed rungs (bench.packs) whose length was
    measured, then the floor; gradients dropped at the end."""
    rungs: List[Rung] = []
    stopped = None
    try:
        for tokens in ladder(max_tokens):
            rung = bench.attempt(tokens)
            if rung is None:  # longer rungs would not fit either
                stopped = f"out of memory at {tokens} tokens: the ladder stops there"
                say(stopped)
                break
            rungs.append(rung)
        if len(rungs) < MIN_RUNGS:
            fix = "" if gradient_checkpointing else "--gradient-checkpointing, "
            raise FitError(
                f"{stopped}, after {len(rungs)} measured lengths; the fit needs {MIN_RUNGS}: "
                f"try {fix}a smaller --max-tokens or a larger device"
            )
        measured = {r.tokens for r in rungs}
        for documents in packed_ladder(max_tokens) if bench.packs else []:
            # No more memory than the single sample of the same tokens, which fitted.
            if sum(documents) in measured:
                rung = bench.attempt(sum(documents), documents)
                if rung is not None:
                    rungs.append(rung)
        # The floor last, every kernel warm by now: its time is the host's pace, not first calls.
        floor_rung = bench.attempt(floor_length(max_tokens))
        if floor_rung is None:
            raise FitError(f"out of memory at {floor_length(max_tokens)} tokens (the floor's)")
    finally:
        bench.released()
    return rungs, floor_rung, stopped


def format_table(fit: CostFit) -> str:
    """The measured and fitted times, one row per length, the floor's first."""
    lines = [f"{'tokens':>8} {'measured s':>11} {'spread':>7} {'fitted s':>10} {'error':>7}"]

    def row(rung: Rung, note: str) -> str:
        predicted = fit.predict(rung.lengths)
        if rung.documents:
            note = f"  packed: {len(rung.documents)} documents" + note
        error = (predicted - rung.seconds) / rung.seconds if rung.seconds > 0 else 0.0
        return (
            f"{rung.tokens:8d} {rung.seconds:11.4g} {100 * rung.spread:6.1f}% "
            f"{predicted:10.4g} {100 * error:+6.1f}%{note}"
        )

    lines.append(row(fit.floor_rung, "  floor"))
    for rung, fitted in zip(fit.rungs, fit.fitted):
        lines.append(row(rung, "" if fitted else "  near the floor: not in a, b, c"))
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints the whole usage block first
        raise FitError(f"{message} (see --help)")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = _Parser(
        prog=PROG,
        description="Fit the planner's cost model (--cost A,B,C,F) to a model on one device: "
        "forward + backward of one-sample microbatches and of the longest lengths packed as 4 and "
        "16 documents, random weights from a Hugging Face config.",
    )
    parser.add_argument(
        "model",
        help="a config.json, a folder holding one, or a model name in the local Hugging Face "
        "cache (nothing is downloaded)",
    )
    parser.add_argument(
        "--max-tokens", type=_COUNT, required=True, help="the longest microbatch, in tokens"
    )
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    parser.add_argument("--device", default="cuda", help="cuda (default, one GPU) or cpu")
    parser.add_argument(
        "--repeats", type=_COUNT, default=3, help="timed runs per length (median; default 3)"
    )
    parser.add_argument(
        "--warmup", type=_COUNT, default=1, help="untimed runs per length first (default 1)"
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="recompute activations in backward (as odc train does on GPUs; raises B)",
    )
    parser.add_argument(
        "--attn-implementation",
        help="transformers' attention (default odc_packed: odc.train's, flash attention's varlen "
        "kernel on CUDA); packed rungs are timed with odc_packed, flash_attention_2 or "
        "flash_attention_3 only",
    )
    parser.add_argument("--seed", type=_COUNT, default=0, help="weights and tokens (default 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the fit and its table here")
    return parser.parse_args(argv)


def check_output_path(path: str) -> Optional[str]:
    """Why `--json PATH` cannot be written, or None: checked before the fit, which takes minutes,
    so that a typo fails at once (its parent must be a writable directory; PATH not one)."""
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        return f"cannot write --json '{path}': a directory"
    if not parent.is_dir():
        return f"cannot write --json '{path}': no directory '{parent}'"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot write --json '{path}': directory '{parent}' is not writable"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse_args(argv)
    except FitError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    if args.json is not None:
        problem = check_output_path(args.json)
        if problem:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
            return USAGE_ERROR
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"{PROG}: error: needs PyTorch: pip install 'odc[train]'", file=sys.stderr)
        return USAGE_ERROR
    say = lambda text: print(f"{PROG}: {text}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        fit = fit_cost(
            args.model,
            args.max_tokens,
            device=args.device,
            dtype=args.dtype,
            repeats=args.repeats,
            warmup=args.warmup,
            gradient_checkpointing=args.gradient_checkpointing,
            attn_implementation=args.attn_implementation,
            seed=args.seed,
            progress=say,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(fit.to_json(), indent=2) + "\n")
    except (FitError, OSError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    print(f"{fit.description}; median of {args.repeats} after {args.warmup} warmup")
    print(format_table(fit))
    if fit.stopped:
        print(f"{fit.stopped}; fitted on the {len(fit.rungs)} lengths measured")
    if not fit.settings.get("packed_rungs"):
        print(
            "no packed rungs (the attention does not keep packed documents apart): a and b "
            "come from single samples only and may trade one for the other"
        )
    noisy = [r.tokens for r in [fit.floor_rung, *fit.rungs] if r.spread > NOISY_SPREAD]
    if noisy:
        print(
            f"repeats spread over {100 * NOISY_SPREAD:.0f}% at {len(noisy)} lengths: is the "
            "device shared? rerun with more --repeats"
        )
    text = f"{fit.c:.4g} s + {fit.a:.4g} s x L + {fit.b:.4g} s x L^2"
    print(f"cost per microbatch: max({fit.floor:.4g} s, {text})")
    print(fit.flag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
