"""A token tree: the root is the last committed token, every other node a drafted continuation.

Nodes are numbered so that parents come before children (the order a ``llama_batch`` needs).
Each non-root node has a ``score``: the estimated chance that the target accepts its whole path
(the product, along the path, of each node's estimated acceptance given its parent's: see
``costmodel.Acceptance``), used to choose the tree best-first; a ``prob``: the proposer's own
probability of the node given its parent, which that estimate was made from; and a ``rank``:
its position among its siblings, which is the order in which verification tries them.
"""

from __future__ import annotations

import dataclasses
import heapq


@dataclasses.dataclass(slots=True)
class TokenTree:
    tokens: list[int]
    parents: list[int]          # parents[0] == -1 (root)
    depths: list[int]
    scores: list[float]         # root: 1.0
    probs: list[float]          # the proposer's probability given the parent; root: 1.0
    ranks: list[int]            # index among siblings, 0 = tried first
    origins: list[str]          # who proposed the node: "root", "draft" or "ngram"
    children: list[list[int]]   # node ids in rank order

    @classmethod
    def rooted(cls, token: int) -> TokenTree:
        return cls([token], [-1], [0], [1.0], [1.0], [0], ["root"], [[]])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float, origin: str,
            prob: float | None = None) -> int:
        """A node below ``parent``; ``prob``: its proposer's probability of it given the
        parent (None: the ratio of its score to the parent's)."""
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        if prob is None:
            above = self.scores[parent]
            prob = score / above if above > 0 else 0.0
        self.probs.append(prob)
        self.ranks.append(len(self.children[parent]))
        self.origins.append(origin)
        self.children.append([])
        self.children[parent].append(node)
        return node

    def path(self, node: int) -> tuple[int, ...]:
        """Tokens from just below the root down to ``node`` (empty for the root)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return tuple(reversed(out))

    def child_with_token(self, node: int, token: int) -> int | None:
        for c in self.children[node]:
            if self.tokens[c] == token:
                return c
        return None

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def top_nodes(self, n: int) -> set[int]:
        """The ``n`` best non-root nodes by score (ties: shallower, then older, first).

        A child's score never exceeds its parent's and ties prefer the shallower node, so the
        chosen set always contains every chosen node's ancestors: it is itself a tree.
        """
        best = heapq.nsmallest(n, range(1, len(self.tokens)),
                               key=lambda i: (-self.scores[i], self.depths[i], i))
        return set(best)

    def pruned(self, keep: set[int]) -> TokenTree:
        """A new tree of the root and ``keep``, renumbered breadth-first (parents first)."""
        out = TokenTree.rooted(self.tokens[0])
        queue = [(0, 0)]  # (old id, new id)
        while queue:
            nxt = []
            for old, new in queue:
                for c in self.children[old]:
                    if c in keep:
                        nxt.append((c, out.add(new, self.tokens[c], self.scores[c],
                                               self.origins[c], self.probs[c])))
            queue = nxt
        return out

    def likeliest_first(self) -> list[int]:
        """Node ids depth first, each node's children by descending score (ties: by rank): the
        likeliest path comes first, right after the root, and every subtree is contiguous."""
        order, stack = [], [0]
        while stack:
            u = stack.pop()
            order.append(u)
            stack.extend(sorted(self.children[u], key=lambda c: (self.scores[c], -self.ranks[c])))
        return order

    def leaves(self) -> list[int]:
        return [i for i, ch in enumerate(self.children) if not ch]
