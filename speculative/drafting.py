"""Stage 1: growing the draft tree; stage 2: speeding up the draft model with an n-gram model.

A drafter answers "what are the draft's logits after this path?" for tree paths (token tuples
below the root). ``grow_tree`` asks for one tree level at a time, so a draft *model* answers each
level with one batched decode. With a ``lookahead`` n-gram (stage 2), each draft batch also
decodes the n-gram's guess of how the best path continues, and ``grow_staged`` expands every
node whose logits are known: a guessed spine the draft agrees with grows several levels, with
their side branches, from one draft call. Every node's children are still the draft's (its
best tokens, or draws from its distribution): the n-gram changes which nodes are decoded when,
never what a node's children are drawn from.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from .kvtree import COMMIT, KVTree, Parent, Slot
from .ngram import KatzTrigram
from .penalties import StepPenalties
from .sampling import (
    SamplingParams,
    distribution,
    greedy_children,
    sample_without_replacement,
    top_k,
    top_k_support,
)
from .tree import TokenTree

Path = tuple[int, ...]
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class TreeBudget:
    max_nodes: int = 16    # drafted nodes the target verifies per pass (its batch is 1 + this)
    max_depth: int = 6     # longest drafted path
    max_children: int = 4  # candidates tried per position; 1 makes a chain

    def __post_init__(self) -> None:
        if self.max_nodes < 1 or self.max_depth < 1 or self.max_children < 1:
            raise ValueError(f"tree budget values must be >= 1: {self}")
        if self.max_nodes > 255:
            raise ValueError("max_nodes over 255: llama.cpp allows at most 256 sequences")


@dataclasses.dataclass(slots=True)
class DraftCounters:
    """What drafting cost in one step (see ``speculative.stats`` for the definitions)."""

    calls: int = 0             # draft-model decodes (batches)
    stage2_proposed: int = 0   # n-gram lookahead tokens decoded by the draft
    stage2_used: int = 0       # ... of which the tree later needed
    t_draft: float = 0.0       # seconds in draft decodes and tree growth
    t_stage2: float = 0.0      # seconds in the n-gram model
    caught_up: int = 0         # committed tokens the draft decoded first (it had not run)
    t_begin: float = 0.0       # seconds of the step's first draft decodes (catching up in them)
    begin_tokens: int = 0      # tokens its first batch holds besides the catching up


@dataclasses.dataclass(frozen=True, slots=True)
class Children:
    """A node's most likely next tokens, best first, with their probabilities: what a greedy
    tree needs of a node, from a drafter that can name them without a full distribution."""

    tokens: np.ndarray
    probs: np.ndarray
    n_vocab: int


Next = np.ndarray | Children  # a drafter's answer for one node: its logits, or its children


def sparse_top(params: SamplingParams, width: int) -> int | None:
    """How many best children a drafter that can name them must give each node (``Children``)
    for trees of ``width`` children under ``params``; None: the full distribution is needed
    (sampling without top-k)."""
    if params.greedy:
        return width
    return params.top_k if params.top_k > 0 else None


class DraftExhausted(Exception):
    """The drafter cannot decode more nodes this step (out of sequence ids): stop growing."""


class Drafter(Protocol):
    counters: DraftCounters
    # the estimated chance the target accepts a node, its parent accepted, from the drafter's
    # probability of it and whether it is the parent's first child (``costmodel.Acceptance``);
    # a drafter without one (None, or no such attribute) scores nodes by its probabilities
    acceptance: Callable[[float, bool], float] | None

    def begin(self, committed: Sequence[int]) -> Next:
        """Start a step whose root is ``committed[-1]``; returns the root's logits (or, greedy
        only, its ``Children``)."""
        ...

    def logits(self, paths: Sequence[Path]) -> list[Next]:
        """Logits (or children) after each path (all of whose prefixes were asked for before)."""
        ...

    def origin(self, path: Path) -> str:
        """Who proposed the path's last token: "draft" or "ngram"."""
        ...

    def commit(self, accepted: Path, bonus: int) -> None:
        """The target accepted ``accepted`` below the root, then wrote ``bonus`` itself."""
        ...


class ModelDrafter:
    """A draft model on its own context, optionally sped up by an n-gram ``lookahead``."""

    def __init__(self, kv: KVTree, lookahead: KatzTrigram | None = None,
                 lookahead_len: int = 4,
                 guess_budget: Callable[[int, int], int] | None = None,
                 acceptance: Callable[[float, bool], float] | None = None) -> None:
        self.kv = kv
        self.acceptance = acceptance
        self.lookahead = lookahead
        self.lookahead_len = lookahead_len if lookahead is not None else 0
        # (tokens in the batch, most guess tokens) -> guess tokens worth their cost; None: all
        self.guess_budget = guess_budget
        self.counters = DraftCounters()
        self._committed: list[int] = []
        self._cache: dict[Path, tuple[Slot, np.ndarray]] = {}  # decoded nodes of this step
        self._guessed: set[Path] = set()  # nodes first decoded as n-gram guesses
        self._used: set[Path] = set()  # ... of which the tree needed these
        self._t_guess = 0.0  # seconds of the last guess (kept out of the draft's time)

    def begin(self, committed: Sequence[int]) -> np.ndarray:
        self.counters = DraftCounters()
        self._committed = list(committed)
        self._cache.clear()
        self._guessed.clear()
        self._used.clear()
        t0 = time.perf_counter()
        tip = self.kv.tip_logits
        if tip is not None and self.kv.tokens == self._committed:
            # the last step decoded this root already (see ``commit``): no batch needed
            self.kv.rollback()
            self._cache[()] = (self.kv.tip(), tip)
            self.counters.t_draft += time.perf_counter() - t0
            return tip
        # the tokens the draft has not seen yet (the target's bonus token, perhaps an accepted
        # leaf) end with the root; they share one batch with the n-gram's guess after the root
        room = self.kv.ctx.n_batch - self.lookahead_len
        self.counters.caught_up = self.kv.behind(committed)
        pending = self.kv.prepare(committed, max_pending=room)
        guess = self._guess((), room=self._room(len(pending)) if self.kv.seqs_free > 0 else 0,
                            batch=len(pending))
        tokens = pending + guess
        parents: list[Parent] = [COMMIT] * len(pending)
        parents += [len(pending) - 1 + i for i in range(len(guess))]
        want = [False] * (len(pending) - 1) + [True] * (1 + len(guess))
        slots, out = self.kv.decode(tokens, parents, want)
        self.counters.calls += 1
        self._cache[()] = (slots[len(pending) - 1], out[0])
        self._remember_guess((), guess, slots[len(pending):], out[1:])
        elapsed = time.perf_counter() - t0 - self._t_guess
        self.counters.t_draft += elapsed
        self.counters.t_begin, self.counters.begin_tokens = elapsed, 1 + len(guess)
        return out[0]

    def logits(self, paths: Sequence[Path]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        self._t_guess = 0.0
        missing = [p for p in paths if p not in self._cache]
        self._count_used(paths)
        if missing:
            if len(missing) > self.kv.seqs_free:
                raise DraftExhausted(f"{len(missing)} nodes, {self.kv.seqs_free} sequences left")
            # near the end of the window: the tree's nodes and the guesses of earlier batches
            # may have taken the KV cells that are left
            if len(missing) > self.kv.cells_free:
                raise DraftExhausted(f"{len(missing)} nodes, {self.kv.cells_free} KV cells left")
            # paths arrive best-first: the n-gram guesses how the best missing one continues
            room = self._room(len(missing))
            guess = self._guess(missing[0], room if self.kv.seqs_free > len(missing) else 0,
                                batch=len(missing))
            tokens = [p[-1] for p in missing] + guess
            parents: list[Parent] = [self._cache[p[:-1]][0] for p in missing]
            parents += [0 if i == 0 else len(missing) + i - 1 for i in range(len(guess))]
            slots, out = self.kv.decode(tokens, parents)
            self.counters.calls += 1
            for k, p in enumerate(missing):
                self._cache[p] = (slots[k], out[k])
            self._remember_guess(missing[0], guess, slots[len(missing):], out[len(missing):])
        self.counters.t_draft += time.perf_counter() - t0 - self._t_guess
        return [self._cache[p][1] for p in paths]

    def known(self, path: Path) -> np.ndarray | None:
        """The draft's logits after ``path`` if a batch of this step already decoded it (a
        stage-2 guess), without decoding anything; None otherwise."""
        hit = self._cache.get(path)
        if hit is None:
            return None
        self._count_used([path])
        return hit[1]

    def _count_used(self, paths: Sequence[Path]) -> None:
        """Stage-2 guesses the tree needed, each counted once."""
        used = [p for p in paths if p in self._guessed and p not in self._used]
        self._used.update(used)
        self.counters.stage2_used += len(used)

    def _room(self, batch: int) -> int:
        """Guess tokens that fit beside a batch of ``batch`` tokens: in the batch, and in the
        KV cells left (each guess token takes a cell of its own until the step ends)."""
        return min(self.kv.ctx.n_batch, self.kv.cells_free) - batch

    def _guess(self, after: Path, room: int, batch: int) -> list[int]:
        """The n-gram's greedy continuation of ``after``, to decode speculatively (stage 2)
        in a draft batch of ``batch`` other tokens."""
        self._t_guess = 0.0
        # guesses sit right after ``after``, whose last token is at len(committed)-1+len(after)
        window = self.kv.ctx.n_ctx - len(self._committed) - len(after)
        n = min(self.lookahead_len, room, window)
        if self.guess_budget is not None and n > 0:
            n = self.guess_budget(batch, n)
        if self.lookahead is None or n <= 0:
            return []
        t0 = time.perf_counter()
        guess = self.lookahead.greedy([*self._committed, *after][-2:], n)
        self._t_guess = time.perf_counter() - t0
        self.counters.t_stage2 += self._t_guess
        return guess

    def _remember_guess(self, after: Path, guess: list[int], slots: Sequence[Slot],
                        rows: np.ndarray) -> None:
        path = after
        for tok, slot, row in zip(guess, slots, rows, strict=True):
            path = (*path, tok)
            self._cache[path] = (slot, row)
            self._guessed.add(path)
        self.counters.stage2_proposed += len(guess)

    def origin(self, path: Path) -> str:
        return "ngram" if path in self._guessed else "draft"

    def commit(self, accepted: Path, bonus: int) -> None:
        """Keep the deepest decoded node of the text the target wrote: when this step already
        decoded the target's own token after the accepted path (a stage-2 guess that turned
        out right), the draft's answer for it is the next step's root answer, and that step
        begins without a draft batch (``KVTree.tip_logits``)."""
        if not self._cache:
            return  # not asked this step (``auto`` skipped drafting): nothing new to keep
        written = (*accepted, bonus)
        if written in self._cache:
            slot, logits = self._cache[written]
            self.kv.commit(slot, list(written), tip_logits=logits)
        else:
            depth = len(accepted)
            while accepted[:depth] not in self._cache:
                depth -= 1  # the deepest accepted node the draft has decoded (the root at worst)
            self.kv.commit(self._cache[accepted[:depth]][0], list(accepted[:depth]))
        self._cache.clear()


class NgramDrafter:
    """The n-gram model drafting for the target directly (no draft model). With ``top`` (greedy
    trees: their width; sampled with top-k: k), each node's answer is its ``top`` best
    children (``KatzTrigram.top``, from a per-history cache), not the log of its full
    distribution (a pass over the whole vocabulary)."""

    def __init__(self, model: KatzTrigram, top: int | None = None,
                 acceptance: Callable[[float, bool], float] | None = None) -> None:
        self.model = model
        self.top = top
        self.acceptance = acceptance
        self.counters = DraftCounters()
        self._committed: list[int] = []

    def _logits(self, path: Path) -> Next:
        context = [*self._committed, *path][-2:]
        if self.top is not None:
            return Children(*self.model.top(context, self.top), self.model.n_vocab)
        with np.errstate(divide="ignore"):
            return np.log(self.model.probs(context))

    def begin(self, committed: Sequence[int]) -> Next:
        self.counters = DraftCounters()
        self._committed = list(committed)
        t0 = time.perf_counter()
        out = self._logits(())
        self.counters.t_stage2 += time.perf_counter() - t0
        return out

    def logits(self, paths: Sequence[Path]) -> list[Next]:
        t0 = time.perf_counter()
        out = [self._logits(p) for p in paths]
        self.counters.t_stage2 += time.perf_counter() - t0
        return out

    def origin(self, path: Path) -> str:
        return "ngram"

    def commit(self, accepted: Path, bonus: int) -> None:
        """Nothing to do: the engine feeds committed tokens to the n-gram model."""


@dataclasses.dataclass(slots=True)
class DraftTree:
    tree: TokenTree
    q: dict[int, np.ndarray]  # node -> the draft distribution its children were drawn from
    # a sampled tree's candidates: the score of every child slot of every expanded node, kept
    # or not (``grow_tree``); None for a tree whose nodes are its candidates
    candidates: list[float] | None = None

    def scores(self) -> list[float]:
        """Node scores (draft path probabilities), best first, root excluded."""
        return sorted(self.tree.scores[1:], reverse=True)

    def basis(self) -> list[float]:
        """What a later step's size is chosen from: the candidates' scores (or the nodes'),
        best first."""
        if self.candidates is None:
            return self.scores()
        return sorted(self.candidates, reverse=True)

    def best(self, n: int) -> DraftTree:
        """The tree cut down to its ``n`` best nodes (still a tree: see ``top_nodes``)."""
        if n >= len(self.tree) - 1:
            return self
        return _prune(self.tree, self.q, self.tree.top_nodes(n))


Expand = Callable[[TokenTree, list[int], int], int]
"""``expand(tree, frontier, depth)``: how many of the best-first ``frontier`` nodes to expand
with the next draft batch (0 stops growing). ``auto`` mode decides it from the cost curves."""


def grow_tree(drafter: Drafter, committed: Sequence[int], budget: TreeBudget,
              params: SamplingParams, rng: np.random.Generator,
              expand: Expand | None = None, penalties: StepPenalties | None = None,
              floor: float = 0.0, at_least: int = 0) -> DraftTree:
    """Grow the draft tree best-first, one draft batch per level.

    Every expanded node offers ``max_children`` slots. Slot i of node u scores
    ``score(u) * a(q_u[i-th largest], i == 1)``, ``a`` the drafter's ``acceptance`` (the
    probability itself without one): the estimated chance that the target accepts the path,
    from the draft's probability of each node on it (greedy) or of the i-th most likely token
    (sampling). Each level expands the nodes at its depth among the ``max_nodes`` best (as
    scores only fall with depth, a node outside the best set can never enter it), as many of
    them as ``expand`` says.

    Greedy fills slot i with the i-th most likely token, and the tree is the ``max_nodes``
    best slots overall. Sampling fills the slots with draws *without replacement* from q_u,
    and the tree only grows: how many children a node gets is fixed before they are drawn and
    never revised (its leading slots scoring at least ``floor``, the root's first whatever its
    score when ``at_least``; a level's slots best first while the ``max_nodes`` budget has
    room). Which of a node's siblings are verified then never depends on the sibling's own
    draw or on what grew below it, which is what keeps tree speculative sampling exact
    (``speculative.verify``); a tree cut to its best nodes after growing would keep a later
    sibling more often when an earlier one's subtree grew less, and so by what was drawn.
    ``candidates`` keeps every slot's score, kept or not, for sizing the next step. With
    ``penalties``, each node's draft logits are penalised along its path as the target's
    will be.
    """
    root = drafter.begin(committed)
    tree = TokenTree.rooted(committed[-1])
    q: dict[int, np.ndarray] = {}
    candidates: list[float] = []
    frontier, dists = [0], [root]
    for depth in range(1, budget.max_depth + 1):
        level = [_slots(tree, u, logits, budget.max_children, params, drafter, q, penalties)
                 for u, logits in zip(frontier, dists, strict=True)]
        _place(tree, level, drafter, params, rng, budget, floor, at_least, candidates)
        best = tree.top_nodes(budget.max_nodes)
        frontier = [v for v in _by_score(tree, best) if tree.depths[v] == depth]
        if expand is not None and frontier and depth < budget.max_depth:
            frontier = frontier[:expand(tree, frontier, depth)]
        if depth == budget.max_depth or not frontier:
            break
        try:
            dists = drafter.logits([tree.path(v) for v in frontier])
        except DraftExhausted as exc:
            log.debug("tree growth stopped at depth %d: %s", depth, exc)
            break
    if not params.greedy:  # every node kept when it was added
        return DraftTree(tree, q, candidates)
    return _prune(tree, q, tree.top_nodes(budget.max_nodes))


def _place(tree: TokenTree, level: Sequence[_Slots], drafter: Drafter, params: SamplingParams,
           rng: np.random.Generator, budget: TreeBudget, floor: float, at_least: int,
           candidates: list[float]) -> None:
    """Give the nodes of ``level`` their children: greedy, every slot (the tree is cut once
    grown); sampled, as many as ``_counts`` decides before any is drawn, every slot's score
    kept in ``candidates``."""
    if params.greedy:
        counts = [len(slots.scores) for slots in level]
    else:
        candidates += [c for slots in level for c in slots.scores]
        counts = _counts(level, floor, at_least, budget.max_nodes - (len(tree) - 1))
    for slots, n in zip(level, counts, strict=True):
        slots.place(tree, drafter, n, rng)


def _counts(level: Sequence[_Slots], floor: float, at_least: int, room: int) -> list[int]:
    """How many of each node's slots in a sampled tree's new ``level`` become children,
    decided from their scores alone (before any is drawn): the level's slots best first,
    each scoring at least ``floor`` (the root's first whatever its score when
    ``at_least``) and following its node's slot before it, while there is ``room``."""
    counts = [0] * len(level)
    order = sorted(((a, i) for a, slots in enumerate(level) for i in range(len(slots.scores))),
                   key=lambda ai: (-level[ai[0]].scores[ai[1]], ai))
    for a, i in order:
        if room <= 0:
            break
        forced = level[a].node == 0 and i < at_least
        if counts[a] == i and (level[a].scores[i] >= floor or forced):
            counts[a] += 1
            room -= 1
    return counts


def grow_staged(drafter: ModelDrafter, committed: Sequence[int], budget: TreeBudget,
                params: SamplingParams, rng: np.random.Generator,
                expand: Expand | None = None, penalties: StepPenalties | None = None,
                floor: float = 0.0, at_least: int = 0) -> DraftTree:
    """Grow a draft tree best-first, expanding every node whose answer is known.

    A node is expanded (given its child slots, as in ``grow_tree``) as soon as the draft's
    answer for it is known, whatever its depth: its answer came from a draft batch that decoded
    it, or, with stage 2, from a batch that decoded the n-gram's guess of how its parent
    continues. A guessed spine the draft agrees with therefore yields its levels, with their
    side branches, from the one batch that checked it. Only nodes with no known answer cost a
    draft batch (``expand`` says how many of the best unexpanded ones take the next one).

    Greedy: every slot of an expanded node among the ``max_nodes`` best becomes a child, and
    the tree is cut to its best nodes at the end. Sampled: as in ``grow_tree``, how many
    children a node gets is decided from its slots' scores (``floor``, ``at_least``, the room
    left) when it is expanded, before they are drawn, and never revised. Which nodes expand
    when then depends on other nodes' draws (a guessed child is known, a sibling is not), never
    on the draws below the node itself, which is what exact tree verification needs
    (``speculative.verify``).
    """
    tree = TokenTree.rooted(committed[-1])
    grower = _Grower(tree, {0: drafter.begin(committed)}, set(), budget, drafter, params, rng,
                     {}, [], penalties, floor, at_least)
    while True:
        grower.expand_known()
        best = tree.top_nodes(budget.max_nodes) if params.greedy else range(1, len(tree))
        frontier = [v for v in _by_score(tree, set(best))
                    if v not in grower.expanded and tree.depths[v] < budget.max_depth]
        if not frontier:
            break
        take = len(frontier)
        if expand is not None:
            take = expand(tree, frontier, min(tree.depths[v] for v in frontier))
        if take <= 0:
            break
        try:
            out = drafter.logits([tree.path(v) for v in frontier[:take]])
        except DraftExhausted as exc:
            log.debug("tree growth stopped: %s", exc)
            break
        grower.answers.update(zip(frontier[:take], out, strict=True))
    if not params.greedy:  # every node kept when it was added
        return DraftTree(tree, grower.q, grower.candidates)
    return _prune(tree, grower.q, tree.top_nodes(budget.max_nodes))


@dataclasses.dataclass(slots=True)
class _Grower:
    """``grow_staged``'s tree and what it knows of it: the draft's answers for nodes not yet
    expanded, the nodes expanded, and (sampled) each expanded node's q and every child slot's
    score (``DraftTree.q``, ``DraftTree.candidates``)."""

    tree: TokenTree
    answers: dict[int, Next]
    expanded: set[int]
    budget: TreeBudget
    drafter: ModelDrafter
    params: SamplingParams
    rng: np.random.Generator
    q: dict[int, np.ndarray]
    candidates: list[float]
    penalties: StepPenalties | None
    floor: float
    at_least: int

    def expand_known(self) -> None:
        """Expand the root and every node (greedy: among the best) whose answer is known,
        until none is left; children whose answers the drafter already holds (stage-2
        guesses) join them. Sampled, each round's nodes share the room left best slot
        first, as a level of ``grow_tree`` does."""
        tree, budget = self.tree, self.budget
        while True:
            among = tree.top_nodes(budget.max_nodes) | {0} if self.params.greedy else None
            ready = [u for u in self.answers if u not in self.expanded
                     and tree.depths[u] < budget.max_depth and (among is None or u in among)]
            if not ready:
                return
            level = [_slots(tree, u, self.answers.pop(u), budget.max_children, self.params,
                            self.drafter, self.q, self.penalties) for u in sorted(ready)]
            _place(tree, level, self.drafter, self.params, self.rng, budget, self.floor,
                   self.at_least, self.candidates)
            for slots in level:
                self.expanded.add(slots.node)
                for c in tree.children[slots.node]:
                    known = self.drafter.known(tree.path(c))
                    if known is not None:
                        self.answers[c] = known


@dataclasses.dataclass(slots=True)
class _Slots:
    """Node ``node``'s child slots, best first: their draft probabilities and scores; greedy,
    their tokens; sampled, the distribution ``q`` they are drawn from (over ``support`` when
    the drafter named its best tokens only)."""

    node: int
    probs: list[float]
    scores: list[float]
    tokens: np.ndarray | None = None
    q: np.ndarray | None = None
    support: np.ndarray | None = None

    def place(self, tree: TokenTree, drafter: Drafter, n: int,
              rng: np.random.Generator | None) -> None:
        """Add the ``n`` best slots as the node's children: greedy, its best tokens;
        sampled, ``n`` draws without replacement from ``q``."""
        tokens = self.tokens
        if tokens is None:
            assert self.q is not None and rng is not None
            if self.support is not None:
                tokens = self.support[sample_without_replacement(self.q[self.support], n, rng)]
            else:
                tokens = np.array(sample_without_replacement(self.q, n, rng), dtype=np.int64)
        base = tree.path(self.node)
        for tok, sq, score in zip(tokens.tolist()[:n], self.probs, self.scores, strict=False):
            tree.add(self.node, tok, score, drafter.origin((*base, tok)), sq)


def _slots(tree: TokenTree, u: int, logits: Next, k: int, params: SamplingParams,
           drafter: Drafter, q: dict[int, np.ndarray],
           penalties: StepPenalties | None = None) -> _Slots:
    """Node u's ``k`` child slots (see ``grow_tree``); keeps q_u when sampling."""
    # sampled children from a drafter's best tokens: did they cover every token with any
    # probability (read before the penalties change the probabilities)
    complete = (isinstance(logits, Children) and not params.greedy
                and logits.probs.sum() >= 1.0 - 1e-9)
    if penalties is not None:
        logits = _penalised(logits, penalties, tree.path(u))
    tokens = support = None
    if isinstance(logits, Children) and params.greedy:
        tokens, slot_q = logits.tokens[:k], logits.probs[:k]
    elif isinstance(logits, Children):
        # top-k sampling reads only the k best tokens (all there: ``sparse_top``), or every
        # token with any probability (``complete``)
        if params.top_k <= 0 or (logits.tokens.size < params.top_k and not complete):
            raise ValueError("a sampled node needs its full distribution or its top-k tokens")
        best = slice(0, params.top_k)
        support, dist = top_k_support(logits.tokens[best], np.log(logits.probs[best]), params)
        q[u] = np.zeros(logits.n_vocab, dtype=np.float64)
        q[u][support] = dist
        slot_q = dist[:k]  # best first, as top_k(q[u], k) would read them
    elif params.greedy:
        tokens, slot_q = greedy_children(logits, k)
    else:
        q[u] = distribution(logits, params)
        slot_q = q[u][top_k(q[u], k)]
    probs = [p for p in slot_q.tolist() if p > 0.0]
    accept = getattr(drafter, "acceptance", None)
    # each slot's estimated acceptance given u's; at most one of the siblings is accepted
    chances = probs if accept is None else [accept(p, i == 0) for i, p in enumerate(probs)]
    total = sum(chances)
    if total > 1.0:
        chances = [c / total for c in chances]
    return _Slots(u, probs, [tree.scores[u] * c for c in chances], tokens, q.get(u), support)


def _penalised(logits: Next, penalties: StepPenalties, path: Path) -> Next:
    """A node's draft answer with the penalties along its path applied. A drafter's best
    tokens are penalised among themselves and re-ranked: a token outside them that the
    penalties would have made one of the best is missed, which costs acceptance, never
    exactness (a sampled node's q is what its children were drawn from, whatever it is)."""
    if not isinstance(logits, Children):
        return penalties.apply(logits, path)
    with np.errstate(divide="ignore"):
        z = penalties.apply_sparse(logits.tokens, np.log(logits.probs), path)
    order = np.lexsort((logits.tokens, -z))  # most likely first, ties to the smaller id
    return Children(logits.tokens[order], np.exp(z[order]), logits.n_vocab)


def _by_score(tree: TokenTree, nodes: set[int]) -> list[int]:
    return sorted(nodes, key=lambda i: (-tree.scores[i], tree.depths[i], i))


def _prune(tree: TokenTree, q: dict[int, np.ndarray], keep: set[int]) -> DraftTree:
    pruned = tree.pruned(keep)
    # map q (needed for verification of sampled children) to the new numbering
    old_of_new = {0: 0}
    for new in range(1, len(pruned)):
        parent_old = old_of_new[pruned.parents[new]]
        old_of_new[new] = next(c for c in tree.children[parent_old]
                               if tree.tokens[c] == pruned.tokens[new])
    return DraftTree(pruned, {new: q[old] for new, old in old_of_new.items() if old in q})
