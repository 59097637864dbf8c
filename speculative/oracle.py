"""The ceiling: a drafter that knows the target's greedy continuation and costs nothing.

Given the tokens plain greedy decoding wrote after the prompt, it proposes exactly those, with
probability 1, and takes no time. Verified like any draft (the engine still runs the target over
the tree and keeps what the target agrees with), it measures the best speed any drafter could
reach on this machine's verification cost curve: every drafted token is accepted, and the
adaptive size picks the n that maximises (n + 1) / cost(n + 1). Greedy only: a sampled run's
tokens are not known in advance.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .drafting import DraftCounters

Path = tuple[int, ...]
_SURE = 1e4  # a logit gap whose softmax is exactly 1.0 in float64: slot probability 1


class OracleDrafter:
    """Proposes ``continuation`` (what follows ``prompt_len`` tokens) as a chain."""

    def __init__(self, continuation: Sequence[int], prompt_len: int, n_vocab: int) -> None:
        self.continuation = list(continuation)
        self.prompt_len = prompt_len
        self.n_vocab = n_vocab
        self.counters = DraftCounters()
        self._done = 0  # continuation tokens already committed

    def _logits(self, path: Path) -> np.ndarray:
        i = self._done + len(path)
        out = np.zeros(self.n_vocab, dtype=np.float32)
        if i < len(self.continuation):
            out[self.continuation[i]] = _SURE
        return out  # past the known text: a flat row, whose slots score 1 / n_vocab

    def begin(self, committed: Sequence[int]) -> np.ndarray:
        self.counters = DraftCounters()
        self._done = len(committed) - self.prompt_len
        return self._logits(())

    def logits(self, paths: Sequence[Path]) -> list[np.ndarray]:
        return [self._logits(p) for p in paths]

    def origin(self, path: Path) -> str:
        return "draft"

    def commit(self, accepted: Path, bonus: int) -> None:
        """Nothing to keep: the next ``begin`` reads the position from the committed tokens."""
