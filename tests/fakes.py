"""A fake ``Context`` over a small vocabulary: fixed logit tables, llama.cpp's KV-cache rules.

The fake enforces what llama.cpp enforces (each sequence's batch tokens continue right after its
last cached position; a token's sequences must all see the same history; batch and sequence
limits; the unified KV cache's ``n_ctx`` cells, shared by all sequences) and computes each
token's logits from the tokens its sequences hold, so the tree layout of ``speculative.kvtree``
is checked by these tests as well as by llama.cpp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from speculative.errors import LlamaError


def logit_table(n_vocab: int, seed: int, sharpness: float = 2.0) -> np.ndarray:
    """``table[a, b]``: logits of the next token after tokens ``a, b`` (a trigram model)."""
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, sharpness, (n_vocab, n_vocab, n_vocab))


def noisy(table: np.ndarray, seed: int, noise: float) -> np.ndarray:
    """A draft table: the target's plus noise (a poor draft for large ``noise``)."""
    rng = np.random.default_rng(seed)
    return table + rng.normal(0.0, noise, table.shape)


def table_logits(table: np.ndarray, history: Sequence[int]) -> np.ndarray:
    """Logits after ``history`` (padded on the left with token 0)."""
    a, b = ([0, 0, *history])[-2:]
    return table[a, b]


def plain_greedy(table: np.ndarray, prompt: Sequence[int], n: int) -> list[int]:
    """The target's own greedy continuation, one token at a time: what every mode must emit."""
    out, text = [], list(prompt)
    for _ in range(n):
        text.append(int(np.argmax(table_logits(table, text).astype(np.float32))))
        out.append(text[-1])
    return out


@dataclasses.dataclass(slots=True)
class _Cell:
    pos: int
    token: int
    seqs: set[int]


class FakeContext:
    def __init__(self, table: np.ndarray, n_ctx: int = 64, n_batch: int = 32,
                 n_seq_max: int = 64) -> None:
        self.table = table
        self.n_vocab = table.shape[-1]
        self.n_ctx, self.n_batch, self.n_seq_max = n_ctx, n_batch, n_seq_max
        self.cells: list[_Cell] = []
        self.decodes = 0
        self.decoded_tokens = 0

    def _history(self, seq: int, below: int, batch: list[_Cell]) -> list[int]:
        held = {c.pos: c.token for c in self.cells + batch if seq in c.seqs and c.pos < below}
        if sorted(held) != list(range(below)):
            raise AssertionError(f"sequence {seq} does not hold positions 0..{below - 1}")
        return [held[p] for p in range(below)]

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               seq_ids: Sequence[Sequence[int]], logits: Sequence[bool] | bool = True,
               ) -> np.ndarray:
        n = len(tokens)
        assert 0 < n <= self.n_batch, "batch size"
        # llama.cpp's unified cache: n_ctx cells for all sequences together; every batch token
        # takes a free cell, and a cell held by several sequences is still one cell
        if len(self.cells) + n > self.n_ctx:
            raise LlamaError(f"llama_decode failed (1): decode: failed to find a memory slot "
                             f"for batch of size {n}")
        want = [logits] * n if isinstance(logits, bool) else list(logits)
        last = {}
        for c in self.cells:
            for s in c.seqs:
                last[s] = max(last.get(s, -1), c.pos)
        expect = dict(last)
        for pos, seqs in zip(positions, seq_ids, strict=True):
            assert 0 <= pos < self.n_ctx, "context overflow"
            for s in seqs:
                assert 0 <= s < self.n_seq_max, "sequence id"
                if pos != expect.get(s, -1) + 1:
                    raise AssertionError(f"inconsistent sequence positions for seq {s}")
                expect[s] = pos
        batch = [_Cell(p, t, set(s)) for t, p, s in zip(tokens, positions, seq_ids, strict=True)]
        rows = []
        for i, cell in enumerate(batch):
            histories = {tuple(self._history(s, cell.pos, batch[:i])) for s in cell.seqs}
            assert len(histories) == 1, "a token's sequences disagree on its history"
            if want[i]:
                rows.append(table_logits(self.table, [*histories.pop(), cell.token]))
        self.cells += batch
        self.decodes += 1
        self.decoded_tokens += n
        return np.array(rows, dtype=np.float32).reshape(len(rows), self.n_vocab)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        hi = p1 if p1 >= 0 else 1 << 30
        for c in self.cells:
            if src in c.seqs and max(p0, 0) <= c.pos < hi:
                c.seqs.add(dst)

    def seq_keep(self, seq: int) -> None:
        self.cells = [c for c in self.cells if seq in c.seqs]
        for c in self.cells:
            c.seqs = {seq}

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        hi = p1 if p1 >= 0 else 1 << 30
        for c in self.cells:
            if seq in c.seqs and max(p0, 0) <= c.pos < hi:
                c.seqs.discard(seq)
        self.cells = [c for c in self.cells if c.seqs]

    def clear(self) -> None:
        self.cells = []

    def held(self, seq: int = 0) -> list[int]:
        cells = sorted((c for c in self.cells if seq in c.seqs), key=lambda c: c.pos)
        return [c.token for c in cells]
