"""Progress of the long phases of `python -m odc.train` (the cost fit, the training steps) on rank
0's stderr: a tqdm bar where tqdm is installed and stderr is a terminal, else one plain line per
update, so a log shows progress too. Nothing here is needed for correctness."""

from __future__ import annotations

import sys
import time

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # tqdm is optional (pip install 'odc[train]' brings it)
    _tqdm = None


class Progress:
    """`with Progress(total, "label") as bar: ... bar.update(note="loss 2.31")`; silent when
    enabled is False (ranks other than 0)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled
        self.done = 0
        self._start = time.perf_counter()
        self._bar = None
        if enabled and _tqdm is not None and sys.stderr.isatty():
            self._bar = _tqdm(total=total, desc=label, file=sys.stderr, leave=True)

    def start(self) -> "Progress":
        if self.enabled and self._bar is None:
            print(f"{self.label}: 0/{self.total}", file=sys.stderr, flush=True)
        return self

    __enter__ = start

    def update(self, note: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(1)
            return
        elapsed = time.perf_counter() - self._start
        suffix = f" {note}" if note else ""
        print(
            f"{self.label}: {self.done}/{self.total} ({elapsed:.1f} s){suffix}",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __exit__(self, *exc) -> None:
        self.close()
