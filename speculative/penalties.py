"""Repetition control: logit penalties that depend on the text so far.

The repetition penalty, the presence and frequency penalties and DRY (see ``SamplingParams``)
change a node's logits according to the history *along its own path*: the committed text, then
the tree's tokens from the root down to the node. Verification applies them to the target's
logits at every node it walks, and drafting to the draft's logits at every node it expands, so
that greedy output is the penalised target's argmax token for token and sampled output follows
the penalised target's distribution exactly (``speculative.verify``).

Each penalty touches only tokens that occur in the history (a window of it), so a node costs
a few small numpy operations over that window, never a pass over the vocabulary in Python:
``Penalties.edits`` finds the tokens and their new logits, ``apply`` writes them into a copy
of the row. One step's nodes share the committed text: ``Penalizer.step`` prepares it once
and each node adds its path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from .sampling import SamplingParams

# DRY's exponent stops growing here: the penalty is already far beyond any logit gap, and a
# loop of one token would otherwise make the match search as long as the loop
_DRY_MAX_EXTRA = 24

Path = tuple[int, ...]


class Penalizer:
    """The penalties of one ``SamplingParams`` over one vocabulary."""

    def __init__(self, params: SamplingParams, breakers: frozenset[int] = frozenset(),
                 n_vocab: int = 0) -> None:
        self.params = params
        self.tokens_on = params.token_penalties
        self.dry_on = params.dry_multiplier > 0.0
        size = max(n_vocab, max(breakers, default=-1) + 1)
        self.breaker = np.zeros(size, dtype=bool)  # token id -> ends every DRY match
        self.breaker[list(breakers)] = True

    @property
    def window(self) -> int | None:
        """How much of the committed text the penalties read (None: all of it)."""
        p = self.params
        dry = (p.dry_last_n or None) if self.dry_on else 0
        if dry is None:
            return None
        return max(p.repeat_last_n if self.tokens_on else 0, dry)

    def step(self, committed: Sequence[int]) -> StepPenalties:
        """The penalties for the nodes of one step, below ``committed``."""
        window = self.window
        tail = committed if window is None else committed[-window:] if window else ()
        return StepPenalties(self, np.asarray(tail, dtype=np.int64))


class StepPenalties:
    """``Penalizer`` for the nodes below one committed text; caches each path's edits (the
    draft and the target ask for the same nodes)."""

    def __init__(self, penalizer: Penalizer, tail: np.ndarray) -> None:
        self.penalizer = penalizer
        self.tail = tail
        self._edits: dict[Path, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self.seconds = 0.0  # spent penalising this step's nodes (inside drafting and verifying)

    def apply(self, logits: np.ndarray, path: Path, copy: bool = True) -> np.ndarray:
        """One row of ``logits`` after ``path`` below the root, penalised: a copy, or (``copy``
        False, for a float32 row its caller owns and reads no more) the row itself."""
        t0 = time.perf_counter()
        rep_tokens, rep_counts, dry_tokens, dry_amount = self._path_edits(path)
        out = np.array(logits, dtype=np.float32) if copy else logits
        if rep_tokens.size:
            out[rep_tokens] = self._repeat(out[rep_tokens], rep_counts)
        if dry_tokens.size:
            out[dry_tokens] -= dry_amount
        self.seconds += time.perf_counter() - t0
        return out

    def apply_sparse(self, tokens: np.ndarray, logits: np.ndarray, path: Path) -> np.ndarray:
        """``apply`` for the entries ``logits`` of ``tokens`` only (a drafter's best tokens)."""
        t0 = time.perf_counter()
        rep_tokens, rep_counts, dry_tokens, dry_amount = self._path_edits(path)
        out = np.array(logits, dtype=np.float64)
        if rep_tokens.size:
            hit, where = _lookup(tokens, rep_tokens)
            out[hit] = self._repeat(out[hit], rep_counts[where])
        if dry_tokens.size:
            hit, where = _lookup(tokens, dry_tokens)
            out[hit] -= dry_amount[where]
        self.seconds += time.perf_counter() - t0
        return out

    def _repeat(self, values: np.ndarray, counts: np.ndarray) -> np.ndarray:
        p = self.penalizer.params
        if p.repeat_penalty != 1.0:
            values = np.where(values > 0, values / p.repeat_penalty, values * p.repeat_penalty)
        return values - (counts * p.frequency_penalty + p.presence_penalty)

    def _path_edits(self, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        hit = self._edits.get(path)
        if hit is None:
            seq = (np.concatenate([self.tail, np.asarray(path, dtype=np.int64)]) if path
                   else self.tail)
            hit = self._edits[path] = (*self._token_edits(seq), *self._dry_edits(seq))
        return hit

    def _token_edits(self, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pen = self.penalizer
        if not pen.tokens_on or seq.size == 0:
            return _EMPTY_I, _EMPTY_I
        tokens, counts = np.unique(seq[-pen.params.repeat_last_n:], return_counts=True)
        return tokens, counts

    def _dry_edits(self, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """DRY: for each earlier occurrence of the last token, how many tokens before it match
        the text's end (not across a breaker); the token that followed that occurrence would
        repeat a sequence that long. Returns the tokens and what their logits lose."""
        pen = self.penalizer
        if not pen.dry_on:
            return _EMPTY_I, _EMPTY_F
        p = pen.params
        if p.dry_last_n:
            seq = seq[-p.dry_last_n:]
        n = seq.size
        if n < 2:
            return _EMPTY_I, _EMPTY_F
        breaks = pen.breaker[seq] if pen.breaker.size else np.zeros(n, dtype=bool)
        if breaks[-1]:
            return _EMPTY_I, _EMPTY_F
        after = np.flatnonzero(breaks)
        room = n - 1 - (int(after[-1]) if after.size else -1)  # tokens since the last breaker
        # longest useful match: the penalty's exponent stops at _DRY_MAX_EXTRA
        room = min(room, p.dry_allowed_length + _DRY_MAX_EXTRA)
        ends = np.flatnonzero(seq[:-1] == seq[-1])  # earlier occurrences of the last token
        if ends.size == 0:
            return _EMPTY_I, _EMPTY_F
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.arange(ends.size)
        for k in range(1, room):
            j = ends[alive] - k
            ok = j >= 0
            ok[ok] = seq[j[ok]] == seq[n - 1 - k]
            alive = alive[ok]
            if alive.size == 0:
                break
            length[alive] += 1
        follows = seq[ends + 1]
        keep = (length >= p.dry_allowed_length) & ~(pen.breaker[follows] if pen.breaker.size
                                                    else False)
        if not keep.any():
            return _EMPTY_I, _EMPTY_F
        follows, length = follows[keep], length[keep]
        order = np.argsort(-length, kind="stable")  # longest first: np.unique keeps the first
        tokens, first = np.unique(follows[order], return_index=True)
        longest = length[order][first]
        amount = p.dry_multiplier * p.dry_base ** (longest - p.dry_allowed_length)
        return tokens, amount.astype(np.float64)


_EMPTY_I = np.zeros(0, dtype=np.int64)
_EMPTY_F = np.zeros(0, dtype=np.float64)


def _lookup(tokens: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions in ``tokens`` that occur in the sorted ``table``, and where in it."""
    where = np.searchsorted(table, tokens)
    where = np.minimum(where, table.size - 1)
    hit = table[where] == tokens
    return np.flatnonzero(hit), where[hit]


def penalizer_for(params: SamplingParams, n_vocab: int,
                  breakers_of: Callable[[Sequence[str]], frozenset[int]] | None = None
                  ) -> Penalizer | None:
    """The params' penalties over a vocabulary of ``n_vocab`` tokens, None when none is on;
    ``breakers_of``: the tokens containing given strings (``Vocabulary.tokens_containing``)."""
    if not params.penalized:
        return None
    breakers: frozenset[int] = frozenset()
    if params.dry_multiplier > 0 and breakers_of is not None:
        breakers = breakers_of(params.dry_breakers)
    return Penalizer(params, breakers, n_vocab)


def breaker_tokens(breakers: Sequence[str], n_vocab: int,
                   piece: Callable[[int], bytes]) -> frozenset[int]:
    """Tokens whose text contains one of the ``breakers`` (DRY's sequence breakers)."""
    if not breakers:
        return frozenset()
    found = set()
    for t in range(n_vocab):
        text = piece(t).decode("utf-8", errors="ignore")
        if any(b in text for b in breakers):
            found.add(t)
    return frozenset(found)
