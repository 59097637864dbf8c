"""Why two greedy outputs of the same target differ: an algorithm error, or a batch-shape tie.

Two things make llama.cpp's logits for the same text differ slightly between runs:

- the batch's size, with flash attention off: the attention's matrix products take another code
  path for a batch of one token than for several (llamafile's tinyBLAS runs only when
  ``n >= 2``, ggml's own dot products otherwise), and they round differently. Flash
  attention's CPU kernel computes each query row on its own, and with it on the logits of the
  same cache are the same whatever the batch (the README gives the check);
- the layout of the KV cells a row attends to, with or without flash attention: the attention
  sums over cells in cell order, a tree's accepted nodes sit in the cells the tree gave them,
  with the cells of rejected siblings freed between them, and llama.cpp later fills freed
  cells with new tokens, before tokens they follow. The engine lays each tree out likeliest
  path first (``Engine._verify``): an accepted likeliest path leaves no freed cell between
  its tokens.

Plain decoding runs one token per pass in cells that follow the text, verification runs
batches over a cache the trees have laid out, so where the target's two best tokens are that
close, plain and a speculative mode may each take a different one, and from there on they
write different (equally valid) text. The algorithm is not at fault: each step took the argmax
of the logits llama.cpp gave it.

``explain`` tells the two cases apart for one pair of outputs. At the first token where they
differ, it decodes the shared text again under several batch shapes (as plain decoding ran it:
the prompt in batches, then a token per pass; the whole history in batches, then the last token
alone or in a 2-token batch as a verification would; every generated token behind a sibling,
in a later KV cell, as a tree's second branch is; every other token in the cell its sibling
freed, before the token it follows; every token alone) and reads the margin
``logit(a) - logit(b)`` of the two candidates, ``a`` the reference's token and ``b`` the
other's, under each:

- the target itself prefers ``b`` under some batch shape and ``a`` under another: a *tie*;
- or the smallest margin is within twice (``SLACK``) how much the margin moved between the
  shapes: a *tie*. The shapes tried are a sample of those a run meets (a chat turn reuses a
  cache filled by earlier turns in other modes), so a run's own margin can lie beyond the
  sampled range: seen in the soak, margins of +0.005 to +0.019 where the run took ``b``;
- otherwise ``b`` was never the target's choice: an *error* (a broken rule, a stale KV cell).

Measured on the bench and eval prompts (built-in pair, 160 tokens, every mode): 2 of 20
prompts part from plain, every speculative mode at the same token, with margins of 0.003-0.016
that flip sign between shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from .kvtree import COMMIT, KVTree
from .penalties import Penalizer
from .protocols import Context


@dataclasses.dataclass(frozen=True, slots=True)
class Divergence:
    """Where two outputs part, and whether the target's own logits explain it."""

    index: int                  # the first output token that differs
    a: int                      # the reference's token there
    b: int                      # the other output's token there
    margins: dict[str, float]   # logit(a) - logit(b), by batch shape
    tie: bool

    @property
    def spread(self) -> float:
        """How far the margin moved between batch shapes."""
        values = list(self.margins.values())
        return max(values) - min(values)

    def describe(self) -> str:
        shapes = ", ".join(f"{k} {v:+.3f}" for k, v in self.margins.items())
        kind = "a batch-shape tie" if self.tie else "NOT a tie"
        return (f"token {self.index}: {self.a} vs {self.b}, logit margin {shapes} "
                f"(spread {self.spread:.3f}): {kind}")


AS_PLAIN = "as plain ran"  # the prompt in batches, then one token per pass
SLACK = 2.0  # the shapes tried are a sample of a run's: its margin may lie this far beyond


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def explain(ctx: Context, prompt: Sequence[int], reference: Sequence[int],
            other: Sequence[int], penalizer: Penalizer | None = None) -> Divergence | None:
    """Compare ``other`` with ``reference`` (both continuations of ``prompt``, greedy, by the
    model of ``ctx``); None when they agree up to the shorter one's end. ``penalizer``: the
    repetition control both ran with (the margins are read off the penalised logits, which
    are what each run compared). Clears ``ctx``."""
    i = first_difference(reference, other)
    if i is None or i >= len(reference) or i >= len(other):
        return None
    a, b = reference[i], other[i]
    text = [*prompt, *reference[:i]]
    penalties = penalizer.step(text) if penalizer is not None else None
    margins = {}
    for name, rows in _shapes(ctx, len(prompt), text, (a, b)):
        if penalties is not None:
            rows = penalties.apply(rows, ())
        margins[name] = float(rows[a] - rows[b])
    values = list(margins.values())
    flips = min(values) <= 0 <= max(values)
    spread = max(values) - min(values)
    tie = flips or min(abs(v) for v in values) <= SLACK * spread
    return Divergence(i, a, b, margins, tie)


def _shapes(ctx: Context, n_prompt: int, text: list[int], candidates: tuple[int, int]
            ) -> Iterator[tuple[str, np.ndarray]]:
    """The logits after ``text`` under several batch shapes: (name, row)."""
    kv = KVTree(ctx)
    # as plain decoding ran: the prompt in batches of n_batch, every later token alone
    kv.reset()
    pending = kv.prepare(text[:n_prompt], max_pending=1)
    for token in [*pending, *text[n_prompt:]]:
        _, rows = kv.decode([token], [COMMIT], [True])
    yield AS_PLAIN, rows[0]
    # the history in batches of n_batch, the last token alone
    kv.reset()
    pending = kv.prepare(text, max_pending=1)
    _, rows = kv.decode(pending, [COMMIT], [True])
    yield "history batched, last alone", rows[0]
    # verification's shape: the last token with a drafted child, in one batch
    for child in candidates:
        pending = kv.prepare(text, max_pending=1)
        _, rows = kv.decode([*pending, child], [COMMIT, 0], [True, False])
        yield f"history batched, last with {child}", rows[0]
    # a tree's history: every token since the prompt decoded behind a sibling (as a tree's
    # second branch is), and kept in that later cell
    # and out of cell order: every other token fills the cell its rejected sibling freed,
    # before the token it follows (the attention then sums in another order)
    for name, alternate in (("history behind siblings", False),
                            ("history out of cell order", True)):
        row = _beside_siblings(kv, n_prompt, text, candidates[0], alternate)
        if row is not None:
            yield name, row
    # every token alone
    kv.reset()
    for token in text:
        _, rows = kv.decode([token], [COMMIT], [True])
    yield "every token alone", rows[0]
    kv.reset()


def _beside_siblings(kv: KVTree, n_prompt: int, text: list[int], sibling: int,
                     alternate: bool) -> np.ndarray | None:
    """The logits after ``text`` with every token since the prompt decoded beside ``sibling``
    (rejected, its cell freed): behind it, or with ``alternate`` every other token ahead of it,
    in the cell the previous sibling freed. None when nothing is cached to decode beside."""
    kv.reset()
    pending = kv.prepare(text[:n_prompt], max_pending=1)
    tokens = [*pending, *text[n_prompt:]]
    for i, token in enumerate(tokens):
        tip = kv.tip()
        if tip is None:
            return None
        last = i == len(tokens) - 1
        mine = 0 if alternate and i % 2 else 1
        pair = [token, sibling] if mine == 0 else [sibling, token]
        slots, rows = kv.decode(pair, [tip, tip], [mine == 0 and last, mine == 1 and last])
        if last:
            return rows[0]
        kv.commit(slots[mine], [token])
    return None
