"""Keeping a context's KV cache in step with a token tree.

Sequence 0 holds the committed tokens. Each batch of new tree nodes gives every *batch leaf*
(a new node with no new child) a fresh sequence id, copied from its nearest ancestor already in
the cache; every new node carries the ids of all batch leaves below it. That is the layout
llama.cpp accepts for a tree in one ``llama_batch``: each sequence then sees exactly its own
root-to-leaf path at consecutive positions. Committing a path keeps that path's sequence and
makes it sequence 0 again.

The cache is llama.cpp's *unified* one: ``n_ctx`` cells shared by every sequence. Each committed
token and each decoded tree node holds one cell (a node on several sequences still holds one),
so a step's batches must fit the cells left, not just the positions left: ``cells_free``.

llama.cpp reuses the compute graph of the previous batch when the next one has the same shape:
as many tokens, outputs and distinct sequence ids (building a graph costs about a tenth of a
pass: ``costmodel``). Distinct ids follow the tree's leaf count, so two trees of equal size
but different shapes would each build a graph; every batch with n tree nodes therefore
carries the same number of ids, topped up with spare ids on its first token. A spare id is a
copy of that token's own sequence, so nothing attends differently (llama.cpp masks each token
by its first id), and committing a path drops it with the other sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .errors import ContextOverflow, PromptTooLong, TooManySequences
from .protocols import Context


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """Where a decoded node lives: its position, and a sequence holding it and its ancestors."""

    pos: int
    seq: int


COMMIT = None
"""Parent marker for a token that extends sequence 0 directly (it is already committed)."""

Parent = Slot | int | None  # a cached node, an earlier node of the same batch, or COMMIT


class KVTree:
    """One context's cache: committed tokens on sequence 0 plus this step's tree nodes."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.tokens: list[int] = []  # what sequence 0 holds, position by position
        self._next_seq = 1
        self._nodes = 0  # cells held by this step's uncommitted nodes
        # whether the cells are known to hold sequence 0's committed tokens and nothing else
        # (after a rollback or a commit, until tree nodes are decoded): then there is nothing
        # to roll back, and llama.cpp's ``seq_keep``, a pass over every cell of the cache, is
        # skipped where the target alone or a chain of committed tokens was decoded
        self._clean = False
        self.last_batch = 0  # tokens in the last decoded batch (the graph llama.cpp holds)
        # the logits after the last committed token when they were decoded with it (a draft's
        # answer for the next step's root, see ``commit``); None once the text changes
        self.tip_logits: np.ndarray | None = None

    @property
    def room(self) -> int:
        """Positions still free in the context window."""
        return self.ctx.n_ctx - len(self.tokens)

    @property
    def cells_free(self) -> int:
        """KV cells still free: the window less the committed tokens and this step's nodes."""
        return self.ctx.n_ctx - len(self.tokens) - self._nodes

    @property
    def seqs_free(self) -> int:
        """Sequence ids this step can still hand out (one per batch leaf)."""
        return self.ctx.n_seq_max - self._next_seq

    def behind(self, committed: Sequence[int]) -> int:
        """Tokens of ``committed`` that ``prepare`` would have to decode (all but the last)."""
        return max(len(committed) - 1 - _common_prefix(self.tokens, committed), 0)

    def tip(self) -> Slot | None:
        return Slot(len(self.tokens) - 1, 0) if self.tokens else None

    def rollback(self) -> None:
        """Forget every uncommitted node (after a finished or abandoned step)."""
        self.ctx.seq_keep(0)
        self.ctx.seq_rm(0, len(self.tokens), -1)
        self._next_seq = 1
        self._nodes = 0
        self._clean = True

    def keep(self, text: Sequence[int]) -> None:
        """Keep what the cache shares with ``text`` and forget the rest, every other sequence's
        cells included: after another cache on this context (another engine's) decoded
        ``text`` from position 0 in sequence 0 and went on past it, its first positions hold
        the same tokens as this one's, the rest is the other's."""
        del self.tokens[_common_prefix(self.tokens, text):]
        self.tip_logits = None
        self.rollback()  # every cell past the shared text, of any sequence

    def reset(self) -> None:
        """Empty the cache (after someone else, e.g. a cost measurement, used the context)."""
        self.ctx.clear()
        self.tokens.clear()
        self.tip_logits = None
        self._next_seq = 1
        self._nodes = 0
        self._clean = True

    def prepare(self, committed: Sequence[int], max_pending: int) -> list[int]:
        """Cache all but the last few ``committed`` tokens; return those (at least the last).

        What the cache shares with ``committed`` is kept (a new chat turn re-decodes only what
        is new); a long gap is decoded here in chunks of ``n_batch``, so that at most
        ``max_pending`` tokens are left to decode with the caller's next batch.
        """
        if not committed:
            raise ValueError("nothing to decode")
        if len(committed) > self.ctx.n_ctx:
            raise PromptTooLong(len(committed), self.ctx.n_ctx)
        if not self._clean:
            self.rollback()
        self.tip_logits = None  # the last token is decoded again: its logits come back
        start = min(_common_prefix(self.tokens, committed), len(committed) - 1)
        self.ctx.seq_rm(0, start, -1)
        del self.tokens[start:]
        if len(committed) - start > max(max_pending, 1):
            rest = list(committed[start:-1])
            for i in range(0, len(rest), self.ctx.n_batch):
                chunk = rest[i:i + self.ctx.n_batch]
                self.decode(chunk, [COMMIT] * len(chunk), [False] * len(chunk))
            start = len(committed) - 1
        return list(committed[start:])

    def decode(self, tokens: Sequence[int], parents: Sequence[Parent],
               want_logits: Sequence[bool] | None = None) -> tuple[list[Slot], np.ndarray]:
        """Decode new nodes in one batch; returns their slots and the requested logits.

        ``parents[i]`` is ``COMMIT`` (the token extends sequence 0: such tokens come first and
        become committed), an earlier index in this batch, or the ``Slot`` of a cached node.
        """
        n = len(tokens)
        if n > self.cells_free:  # llama.cpp would fail with "failed to find a memory slot"
            raise ContextOverflow(f"a batch of {n} tokens needs {n} KV cells, but only "
                                  f"{self.cells_free} of {self.ctx.n_ctx} are free")
        pos, anchor = self._positions(parents)
        if any(p is not COMMIT for p in parents):
            self._clean = False  # (before any cell changes: a failed decode is rolled back)
        is_parent = [False] * n
        for p in parents:
            if isinstance(p, int):
                is_parent[p] = True
        seqs: list[list[int]] = [[0] if parents[i] is COMMIT else [] for i in range(n)]
        leaves = [i for i in range(n) if parents[i] is not COMMIT and not is_parent[i]]
        for i in leaves:
            s = self._new_seq()
            self._copy_prefix(anchor[i], s)
            j: int | None = i
            while j is not None:  # the leaf's id goes on every new node of its path
                seqs[j].append(s)
                p = parents[j]
                if p is COMMIT:  # COMMIT tokens are a chain: the previous one is the parent
                    j = j - 1 if j > 0 else None
                else:
                    j = p if isinstance(p, int) else None
        self._pad_seqs(seqs, parents, anchor)
        logits = self.ctx.decode(tokens, pos, seqs,
                                 True if want_logits is None else list(want_logits))
        for i in range(n):
            if parents[i] is COMMIT:
                self.tokens.append(tokens[i])
                self.tip_logits = None
            else:
                self._nodes += 1
        self.last_batch = n
        # a slot names one sequence holding the node: 0 for committed tokens, else the first
        # leaf below it
        slots = [Slot(pos[i], seqs[i][0]) for i in range(n)]
        return slots, logits

    def _positions(self, parents: Sequence[Parent]) -> tuple[list[int], list[Slot | None]]:
        """Each node's position, and its nearest ancestor already in the cache (or None)."""
        base = self.tip()
        pos: list[int] = []
        anchor: list[Slot | None] = []
        n_commit = 0
        for i, p in enumerate(parents):
            if p is COMMIT:
                if i != n_commit:
                    raise ValueError("COMMIT tokens must come first in a batch")
                n_commit += 1
                pos.append(len(self.tokens) + i)
                anchor.append(base)
            elif isinstance(p, Slot):
                pos.append(p.pos + 1)
                anchor.append(p)
            else:
                if not 0 <= p < i:
                    raise ValueError(f"node {i}: parent {p} must be an earlier node of the batch")
                pos.append(pos[p] + 1)
                anchor.append(anchor[p])
        return pos, anchor

    def _copy_prefix(self, origin: Slot | None, seq: int) -> None:
        """Give ``seq`` the cached path up to ``origin`` (nothing if the batch starts afresh)."""
        if origin is not None:
            self.ctx.seq_cp(origin.seq, seq, -1, origin.pos + 1)

    def _pad_seqs(self, seqs: list[list[int]], parents: Sequence[Parent],
                  anchor: list[Slot | None]) -> None:
        """Top the batch's distinct sequence ids up to one per tree node (plus sequence 0 if
        committed tokens come first), so that equal-sized trees share llama.cpp's graph (see
        the module docstring). Skipped when the spare ids are not free."""
        nodes = sum(p is not COMMIT for p in parents)
        if nodes == 0:
            return
        want = nodes + (parents[0] is COMMIT)
        have = len({s for ids in seqs for s in ids})
        if want <= have or want - have > self.seqs_free:
            return
        for _ in range(want - have):
            s = self._new_seq()
            self._copy_prefix(anchor[0], s)
            seqs[0].append(s)

    def _new_seq(self) -> int:
        s = self._next_seq
        if s >= self.ctx.n_seq_max:
            raise TooManySequences(f"tree needs sequence id {s}, n_seq_max is "
                                   f"{self.ctx.n_seq_max}")
        self._next_seq += 1
        return s

    def commit(self, slot: Slot, tokens: Sequence[int],
               tip_logits: np.ndarray | None = None) -> None:
        """Keep the path ending at ``slot`` (whose tokens beyond sequence 0 are ``tokens``);
        ``tip_logits``: the logits decoded after its last token, if the caller kept them."""
        if len(self.tokens) + len(tokens) != slot.pos + 1:
            raise ValueError(f"path of {len(tokens)} tokens does not end at position {slot.pos}")
        if not self._clean:  # (clean: sequence 0 is the only one)
            self.ctx.seq_keep(slot.seq)
        self.ctx.seq_rm(slot.seq, slot.pos + 1, -1)
        if slot.seq != 0:
            self.ctx.seq_cp(slot.seq, 0, -1, -1)
            self.ctx.seq_rm(slot.seq, -1, -1)
        self.tokens.extend(tokens)
        self.tip_logits = tip_logits
        self._next_seq = 1
        self._nodes = 0
        self._clean = True


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens ``a`` and ``b`` share. Mostly one holds all of the other (the
    cache and the text it caches, a step apart): that is one comparison of the two slices;
    otherwise token by token."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        i += 1
    return i
