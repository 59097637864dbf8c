"""What the algorithm needs from a model: a context it can decode token batches into.

``speculative.backend.LlamaContext`` is the real implementation; pure-algorithm tests use fakes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Context(Protocol):
    n_vocab: int
    n_ctx: int
    n_batch: int
    n_seq_max: int

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               seq_ids: Sequence[Sequence[int]], logits: Sequence[bool] | bool = True,
               ) -> np.ndarray:
        """Logits ``(n_requested, n_vocab)`` of the rows whose ``logits`` flag is set."""
        ...

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...

    def seq_keep(self, seq: int) -> None: ...

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None: ...

    def clear(self) -> None: ...
