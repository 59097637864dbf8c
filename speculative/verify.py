"""The target's verdict on a draft tree, from the logits of one forward pass over the tree.

Greedy: follow the children whose token is the target's argmax; the target's argmax after the
last accepted node is the next token. The output is the target's greedy output, by construction.

Sampling (multi-draft speculative sampling, without replacement): at node u with target
distribution p and draft distribution q, the children x_1, x_2, ... were drawn one after another
from q without replacement. Try them in that order:
    accept x_i with probability min(1, p(x_i) / q_i(x_i));
    on rejection p <- norm(max(p - q_i, 0)) and q_{i+1} <- q_i without x_i, renormalised.
With penalties (``speculative.penalties``), p at node u is the target's distribution after
penalising u's logits with the history along u's own path; the rule is unchanged, so each
emitted token follows the penalised target's distribution.

Each try is ordinary speculative sampling of a proposal drawn from q_i against target p, whose
output is distributed exactly as p (accepted token, or a draw from the residual); a rejected
try hands that residual on as the next target. When every child is rejected, the next token is
drawn from what remains of p. So each emitted token is distributed exactly as the target's.

Beside the draws, a sampled verdict reports the accepted path's expected length given the tree
as drawn and the target's distributions over it: each node's chance of being reached, from the
same odds the draws use. It has the drawn length's mean without the spread of the rule's own
draws (a step's accepted length is one draw of it), so that what a kind of step yields, and
how often the target accepts a drafter's nodes, are learned from fewer steps
(``speculative.auto``, ``plan.Calibrations``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .penalties import StepPenalties
from .sampling import SamplingParams, argmax, distribution, sample
from .tree import TokenTree


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    accepted: list[int]  # tree nodes of the accepted path, root excluded, root-most first
    next_token: int      # the target's own token after the accepted path
    offered: int         # depths at which the target was offered at least one candidate
    changed: int = 0     # positions where penalties changed the target's most likely token
    # sampled: each node's chance of being reached by the rule (the root's 1), by node id;
    # greedy: empty (a node is reached or not)
    reached: tuple[float, ...] = ()
    # sampled: the expected accepted length of each tree verified beside this one in thought
    # (``verify_sampling``'s ``beside``), in its order
    beside: tuple[float, ...] = ()

    @property
    def expected(self) -> float:
        """The accepted path's length averaged over the acceptance rule's draws, given the
        tree and the target's distributions over it; greedy, where the rule draws nothing,
        the length itself."""
        return sum(self.reached[1:]) if self.reached else float(len(self.accepted))


def _row(tree: TokenTree, logits: np.ndarray, u: int, penalties: StepPenalties | None
         ) -> tuple[np.ndarray, bool]:
    """The target's logits after node u, penalised along u's path; whether the penalties
    changed which token is the most likely."""
    if penalties is None:
        return logits[u], False
    before = argmax(logits[u])
    # each node's row is read once, and the pass's logits are the verifier's own: no copy
    row = penalties.apply(logits[u], tree.path(u), copy=logits.dtype != np.float32)
    return row, argmax(row) != before


def verify_greedy(tree: TokenTree, logits: np.ndarray,
                  penalties: StepPenalties | None = None) -> Verdict:
    """``logits[i]`` are the target's logits after tree node ``i``."""
    path: list[int] = []
    u, changed = 0, 0
    while True:
        row, moved = _row(tree, logits, u, penalties)
        changed += moved
        token = argmax(row)
        child = tree.child_with_token(u, token)
        if child is None:
            offered = len(path) + (1 if tree.children[u] else 0)
            return Verdict(path, token, offered, changed)
        path.append(child)
        u = child


def verify_sampling(tree: TokenTree, logits: np.ndarray, q: dict[int, np.ndarray],
                    params: SamplingParams, rng: np.random.Generator,
                    penalties: StepPenalties | None = None,
                    beside: Sequence[tuple[TokenTree, Mapping[int, np.ndarray]]] = ()
                    ) -> Verdict:
    """``q[u]`` is the draft distribution u's children were drawn from (see ``grow_tree``).
    The verdict's ``reached`` gives every node's chance of being reached under the rule,
    given the tree as drawn and the target's distributions over it (``_reached``), and
    ``expected`` their sum: the accepted path's length averaged over the rule's own
    draws. ``beside``: other sampled trees (each with its q) drawn for the same root and not
    verified; the verdict's ``beside`` gives each one's expected accepted length as this
    pass can tell it (``_beside``)."""
    found: dict[int, tuple[list[tuple[int, float]], np.ndarray, bool]] = {}
    dists: dict[int, tuple[np.ndarray, bool]] = {}

    def dist(u: int) -> tuple[np.ndarray, bool]:
        # the target's distribution after u; whether the penalties changed its most likely
        # token there
        if u not in dists:
            row, moved = _row(tree, logits, u, penalties)
            dists[u] = (distribution(row, params), moved)
        return dists[u]

    def tries(u: int) -> tuple[list[tuple[int, float]], np.ndarray, bool]:
        # u's children in the order they are tried, each with its chance of acceptance once
        # the ones before it were rejected; the residual after all; whether the penalties
        # changed the target's most likely token at u
        if u not in found:
            p, moved = dist(u)
            kids = tree.children[u]
            found[u] = (*_tries(tree, kids, p, q[u] if kids else None), moved)
        return found[u]

    path: list[int] = []
    u, changed = 0, 0
    while True:
        odds, residual, moved = tries(u)
        changed += moved
        child = next((c for c, accept in odds if rng.random() < accept), None)
        if child is not None:
            path.append(child)
            u = child
            continue
        offered = len(path) + (1 if tree.children[u] else 0)
        return Verdict(path, sample(residual, rng), offered, changed,
                       tuple(_reached(tree, tries)),
                       tuple(_beside(tree, lambda v: dist(v)[0], *other) for other in beside))


def _tries(tree: TokenTree, kids: list[int], p: np.ndarray, q: np.ndarray | None
           ) -> tuple[list[tuple[int, float]], np.ndarray]:
    """Each child in the order it is tried, with its chance of acceptance given that the
    ones before it were rejected, and the residual distribution left when every child is
    rejected (what the next token is then drawn from)."""
    odds: list[tuple[int, float]] = []
    if not kids or q is None:
        return odds, p
    q = q.copy()
    for c in kids:
        x = tree.tokens[c]
        # accept x with prob min(1, p(x)/q(x)); q(x) > 0, x was drawn from q
        odds.append((c, min(1.0, p[x] / q[x]) if q[x] > 0.0 else 0.0))
        # rejected: p <- norm(max(p - q, 0)); q <- q without x, renormalised
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        if total > 0.0:  # total == 0 needs p == q, where rejection has probability 0
            p = residual / total
        q[x] = 0.0
        q_total = q.sum()
        if q_total <= 0.0:
            break
        q /= q_total
    return odds, p


def _reached(tree: TokenTree, tries: Callable[[int], tuple[list[tuple[int, float]],
                                                             np.ndarray, bool]]) -> list[float]:
    """Each node's chance of being reached under the acceptance rule, given the tree as
    drawn: its parent's, times the chance that its earlier siblings are rejected and it is
    accepted (the root's: 1). Nodes that cannot be reached are not priced."""
    reach = [0.0] * len(tree)
    reach[0] = 1.0
    todo = [0]
    while todo:
        u = todo.pop()
        if not tree.children[u]:
            continue
        rest = reach[u]
        for child, accept in tries(u)[0]:
            reach[child] = rest * accept
            rest -= reach[child]
            if reach[child] > 0.0:
                todo.append(child)
    return reach


def _beside(tree: TokenTree, dist: Callable[[int], np.ndarray], other: TokenTree,
            other_q: Mapping[int, np.ndarray]) -> float:
    """The expected accepted length of ``other``, a sampled tree drawn for the same root as
    ``tree`` (``other_q`` the distributions its children were drawn from), had it been
    verified instead: each node's chance of being reached under the rule (``_reached``),
    from the target's distribution ``dist(v)`` after the node ``v`` of ``tree`` with the
    same path. This pass has the target's distribution only where ``tree`` has the path (the
    root always); below a node of ``other`` it does not have, the children's chances are
    estimated by ``other``'s own scores (its drafter's acceptance map, as sizing estimates
    them: a child's score over its parent's), their sum at most the parent's chance.
    Exact where ``other``'s paths are ``tree``'s; the target's own rows are those of the same
    text, so a tree compared with this one on the same step needs no draws of its own."""
    same: dict[int, int] = {0: 0}  # a node of other -> the node of tree with its path
    for u in range(1, len(other)):  # parents before children (``TokenTree.add``)
        v = same.get(other.parents[u])
        w = tree.child_with_token(v, other.tokens[u]) if v is not None else None
        if w is not None:
            same[u] = w

    def tries(u: int) -> tuple[list[tuple[int, float]], np.ndarray, bool]:
        kids = other.children[u]
        v = same.get(u)
        if v is not None:
            return (*_tries(other, kids, dist(v), other_q.get(u)), False)
        # each child's chance given u's is its score over u's, taken in turn from what the
        # children before it left
        odds, left, parent = [], 1.0, other.scores[u]
        for child in kids:
            share = other.scores[child] / parent if parent > 0.0 else 0.0
            accept = min(share / left, 1.0) if left > 0.0 else 0.0
            odds.append((child, accept))
            left -= left * accept
        return odds, np.empty(0), False

    return sum(_reached(other, tries)[1:])
