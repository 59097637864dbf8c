"""Token trees and best-first growth."""

from __future__ import annotations

import numpy as np

from speculative.drafting import DraftCounters, TreeBudget, grow_tree
from speculative.sampling import SamplingParams, softmax
from speculative.tree import TokenTree


def test_top_nodes_is_closed_under_ancestors_and_pruning_keeps_rank_order() -> None:
    tree = TokenTree.rooted(7)
    a = tree.add(0, 1, 0.6, "draft")
    b = tree.add(0, 2, 0.3, "draft")
    aa = tree.add(a, 3, 0.6, "draft")  # equal to its parent: the tie must favour the parent
    tree.add(a, 4, 0.1, "draft")
    tree.add(b, 5, 0.25, "draft")
    keep = tree.top_nodes(3)
    assert keep == {a, aa, b}
    pruned = tree.pruned(keep)
    assert pruned.tokens == [7, 1, 2, 3]
    assert pruned.parents == [-1, 0, 0, 1]
    assert pruned.children[0] == [1, 2] and [pruned.ranks[i] for i in (1, 2)] == [0, 1]
    assert pruned.path(3) == (1, 3)


def test_likeliest_first_puts_the_best_path_right_after_the_root_and_keeps_subtrees_whole(
        ) -> None:
    tree = TokenTree.rooted(7)
    b = tree.add(0, 2, 0.3, "draft")
    a = tree.add(0, 1, 0.6, "ngram")  # added later, likelier: first
    ab = tree.add(a, 4, 0.1, "draft")
    aa = tree.add(a, 3, 0.5, "draft")
    ba = tree.add(b, 5, 0.25, "draft")
    c = tree.add(0, 6, 0.3, "draft")  # as likely as b, ranked after it: after b's subtree
    order = tree.likeliest_first()
    assert order == [0, a, aa, ab, b, ba, c]
    assert all(order.index(tree.parents[v]) < order.index(v) for v in order[1:])


class ChainDrafter:
    """Draft logits from a fixed function of the path; counts how often it is asked."""

    def __init__(self, n_vocab: int, seed: int) -> None:
        self.rng_seed = seed
        self.n_vocab = n_vocab
        self.counters = DraftCounters()
        self.asked: list[int] = []

    def _logits(self, path) -> np.ndarray:
        rng = np.random.default_rng(hash((self.rng_seed, *path)) % 2**32)
        return rng.normal(0, 2.0, self.n_vocab)

    def begin(self, committed):
        return self._logits(())

    def logits(self, paths):
        self.asked.append(len(paths))
        return [self._logits(p) for p in paths]

    def origin(self, path):
        return "draft"

    def commit(self, accepted):
        pass


def brute_force_best(drafter: ChainDrafter, budget: TreeBudget) -> set[tuple[int, ...]]:
    """The best max_nodes paths of the full tree (every node max_children slots, max_depth)."""
    scored = []
    frontier = [((), 1.0)]
    for _ in range(budget.max_depth):
        nxt = []
        for path, score in frontier:
            p = softmax(drafter._logits(path))
            for t in np.argsort(-p, kind="stable")[: budget.max_children]:
                nxt.append(((*path, int(t)), score * float(p[t])))
        scored += nxt
        frontier = nxt
    scored.sort(key=lambda x: (-x[1], len(x[0])))
    return {p for p, _ in scored[: budget.max_nodes]}


def test_level_by_level_growth_finds_the_best_first_tree() -> None:
    for seed in range(10):
        budget = TreeBudget(max_nodes=10, max_depth=4, max_children=3)
        drafter = ChainDrafter(30, seed)
        tree = grow_tree(drafter, [1], budget, SamplingParams(), np.random.default_rng(0)).tree
        got = {tree.path(i) for i in range(1, len(tree))}
        assert got == brute_force_best(drafter, budget)
        assert len(drafter.asked) <= budget.max_depth - 1  # one draft batch per level


def test_ngram_trees_from_best_children_equal_those_from_full_distributions() -> None:
    """``NgramDrafter(top=...)`` names each node's best children instead of its full row: the
    greedy tree is the same tree, and a sampled node's distribution q is the same q."""
    from speculative.drafting import NgramDrafter, sparse_top
    from speculative.ngram import KatzTrigram

    rng = np.random.default_rng(3)
    corpus = [list(rng.integers(0, 30, 300)), [1, 2, 3, 4, 5] * 20]
    model = KatzTrigram.build(corpus, 40)  # 10 tokens never seen: the unigram tail matters
    budget = TreeBudget(max_nodes=12, max_depth=4, max_children=3)
    for committed in ([1, 2], [7], [3, 4, 5], [39, 38]):
        dense = grow_tree(NgramDrafter(model), committed, budget, SamplingParams(),
                          np.random.default_rng(0)).tree
        sparse = grow_tree(NgramDrafter(model, sparse_top(SamplingParams(), 3)), committed,
                           budget, SamplingParams(), np.random.default_rng(0)).tree
        assert [sparse.path(i) for i in range(len(sparse))] == [
            dense.path(i) for i in range(len(dense))]
        assert np.allclose(sparse.scores, dense.scores, rtol=1e-6)  # the dense path is fp32
        for params in (SamplingParams(0.8, 5, 1.0), SamplingParams(1.3, 8, 0.9)):
            full = grow_tree(NgramDrafter(model), committed, budget, params,
                             np.random.default_rng(1))
            best = grow_tree(NgramDrafter(model, sparse_top(params, 3)), committed, budget,
                             params, np.random.default_rng(1))
            assert np.allclose(best.q[0], full.q[0], rtol=1e-9, atol=1e-15)  # the root's q
            assert np.isclose(best.q[0].sum(), 1.0)
            for tree in (full.tree, best.tree):  # children: distinct tokens q gives mass to
                for u in range(len(tree)):
                    kids = [tree.tokens[c] for c in tree.children[u]]
                    assert len(set(kids)) == len(kids)
            assert all(best.q[0][best.tree.tokens[c]] > 0 for c in best.tree.children[0])
    try:
        grow_tree(NgramDrafter(model, 3), [1, 2], budget, SamplingParams(1.0, 0, 1.0),
                  np.random.default_rng(0))
    except ValueError as exc:
        assert "full distribution" in str(exc)
    else:
        raise AssertionError("sampling without top-k from best children must refuse")
