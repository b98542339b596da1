"""Training data for `odc train`: sample lengths or token ids, plans, packed microbatches.

A sample is a 1-D int64 array of token ids. A microbatch packs several samples into one sequence:
positions restart at 0 for each document, document ids tell attention which tokens may see each
other, and the label of a document's last token is -100 (no next token inside the document), so
packed samples neither attend to nor predict each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from ..errors import InvalidArgument
from ..planner import plan_consecutive

IGNORE_INDEX = -100


INT64_MAX = 2**63 - 1


def load_token_ids(path: str, vocab_size: Optional[int] = None) -> List[np.ndarray]:
    """JSONL: each line a list of token ids or an object with "input_ids". Every id is an integer
    from 0 to vocab_size - 1 (to int64's largest without a vocabulary); a bad line raises
    ValueError naming the file, the line and the problem."""
    samples = []
    largest = INT64_MAX if vocab_size is None else vocab_size - 1
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"'{path}' line {number}"
        try:
            record = json.loads(line)
        except RecursionError:  # the decoder recurses once per level of nesting
            raise InvalidArgument(f"{where}: not a list of token ids (nested too deeply)") from None
        except ValueError as error:  # JSONDecodeError, or an integer of over 4,300 digits
            message = getattr(error, "msg", None) or str(error)
            raise InvalidArgument(f"{where}: not JSON ({message})") from None
        ids = record.get("input_ids") if isinstance(record, dict) else record
        if (
            not isinstance(ids, list)
            or len(ids) < 2
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise InvalidArgument(
                f"{where}: expected at least 2 non-negative integer "
                'token ids (a list, or an object with "input_ids")'
            )
        beyond = max(ids)
        if beyond > largest:
            limit = (
                f"the vocabulary of {vocab_size}"
                if vocab_size is not None
                else f"the largest int64, {INT64_MAX}"
            )
            raise InvalidArgument(f"{where}: token id {beyond} is beyond {limit}")
        samples.append(np.asarray(ids, dtype=np.int64))
    if not samples:
        raise InvalidArgument(f"'{path}': no samples")
    return samples


def synthetic_tokens(lengths: Sequence[int], vocab_size: int, seed: int = 0) -> List[np.ndarray]:
    """Random token ids with the given lengths (fixed seed: the same data on every rank)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=int(n), dtype=np.int64) for n in lengths]


def schedule(
    lengths: Sequence[int],
    ranks: int,
    samples_per_minibatch: int,
    max_tokens: int,
    policy: str,
    cost=(1.0, 0.0, 0.0),
    split: str = "off",
    microbatch_memory: str = "lb-micro",
) -> dict:
    """The planner's plan for consecutive minibatches of `samples_per_minibatch` (GRPO's are
    prompts x group / K samples, not always a multiple of the ranks: odc.plan's samples_per_rank
    cannot say it)."""
    return plan_consecutive(
        list(lengths),
        ranks=ranks,
        max_tokens=max_tokens,
        policy=policy,
        samples_per_minibatch=samples_per_minibatch,
        cost=cost,
        split=split,
        microbatch_memory=microbatch_memory,
    )


@dataclass
class PackedMicrobatch:
    input_ids: np.ndarray  # [T] int64
    position_ids: np.ndarray  # [T] int64, restarting at 0 per document
    document_ids: np.ndarray  # [T] int64, 0..num_documents-1
    labels: np.ndarray  # [T] int64, next token within the document, else IGNORE_INDEX
    num_documents: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def boundaries(self) -> np.ndarray:
        """int32 [documents + 1]: where each document starts, then the total (varlen attention's
        cu_seqlens). A padding microbatch is one 1-token document."""
        counts = np.bincount(self.document_ids)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)

    @property
    def longest(self) -> int:
        """Tokens of the longest document."""
        return int(np.bincount(self.document_ids).max())

    @property
    def num_predicted(self) -> int:
        """Tokens that carry a loss term (each document's tokens but its last)."""
        return int(np.count_nonzero(self.labels != IGNORE_INDEX))


def pack(samples: Sequence[np.ndarray]) -> PackedMicrobatch:
    """Concatenates documents into one sequence with positions, document ids and labels.
    An empty list (an LB-Micro padding microbatch) gives a 1-token microbatch with no labels."""
    if not samples:
        zero = np.zeros(1, dtype=np.int64)
        return PackedMicrobatch(zero, zero, zero, np.full(1, IGNORE_INDEX, np.int64), 0)
    input_ids = np.concatenate(samples).astype(np.int64)
    position_ids = np.concatenate([np.arange(len(s), dtype=np.int64) for s in samples])
    document_ids = np.concatenate(
        [np.full(len(s), i, dtype=np.int64) for i, s in enumerate(samples)]
    )
    labels = np.concatenate([np.append(s[1:], IGNORE_INDEX).astype(np.int64) for s in samples])
    return PackedMicrobatch(input_ids, position_ids, document_ids, labels, len(samples))


def pack_chunk(sample: np.ndarray, pieces: Sequence[Sequence[int]]) -> PackedMicrobatch:
    """One rank's chunk of a split sample (the planner's "splits" entry): the tokens of `pieces`
    ([begin, end) ranges, ascending) concatenated, with the sample's global positions (RoPE) and
    labels (the next token of the whole sample, so a piece's last token predicts the first token
    of the next piece; only the sample's last token has none). As one document for the model's
    bookkeeping; attention itself takes the global causal mask from the split."""
    labels_all = np.append(sample[1:], IGNORE_INDEX).astype(np.int64)
    ranges = [(int(b), int(e)) for b, e in pieces]
    if not ranges or any(not 0 <= b < e <= len(sample) for b, e in ranges):
        raise InvalidArgument(f"bad chunk {ranges} of a {len(sample)}-token sample")
    input_ids = np.concatenate([sample[b:e] for b, e in ranges]).astype(np.int64)
    positions = np.concatenate([np.arange(b, e, dtype=np.int64) for b, e in ranges])
    labels = np.concatenate([labels_all[b:e] for b, e in ranges])
    return PackedMicrobatch(input_ids, positions, np.zeros_like(input_ids), labels, 1)
