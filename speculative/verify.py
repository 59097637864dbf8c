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
"""

from __future__ import annotations

import dataclasses

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
                    penalties: StepPenalties | None = None) -> Verdict:
    """``q[u]`` is the draft distribution u's children were drawn from (see ``grow_tree``)."""
    path: list[int] = []
    u, changed = 0, 0
    while True:
        row, moved = _row(tree, logits, u, penalties)
        changed += moved
        p = distribution(row, params)
        kids = tree.children[u]
        result = _try_children(tree, kids, p, q[u] if kids else None, rng)
        if not isinstance(result, np.ndarray):
            path.append(result)
            u = result
            continue
        offered = len(path) + (1 if kids else 0)
        return Verdict(path, sample(result, rng), offered, changed)


def _try_children(tree: TokenTree, kids: list[int], p: np.ndarray, q: np.ndarray | None,
                  rng: np.random.Generator) -> int | np.ndarray:
    """The accepted child, or the residual distribution when every child is rejected."""
    if not kids or q is None:
        return p
    q = q.copy()
    for c in kids:
        x = tree.tokens[c]
        # accept x with prob min(1, p(x)/q(x))
        if rng.random() * q[x] < p[x]:
            return c
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
    return p
