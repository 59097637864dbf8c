"""Property tests (hypothesis) of the tree and the verification core: random trees, scores,
logits and draft distributions. Exactness in distribution is test_sampling_exact.py's job; these
check what must hold on every single draw."""

from __future__ import annotations

import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from speculative.drafting import ModelDrafter, TreeBudget, grow_tree
from speculative.kvtree import KVTree
from speculative.sampling import SamplingParams, argmax, distribution, top_k
from speculative.tree import TokenTree
from speculative.verify import verify_greedy, verify_sampling
from tests.fakes import FakeContext, logit_table, noisy, table_logits

V = 10
MAX_NODES = 24
FAST = settings(max_examples=300, deadline=None, database=None)


@st.composite
def trees(draw: st.DrawFn, logits: np.ndarray | None = None,
          support: list[np.ndarray] | None = None) -> TokenTree:
    """A random tree: each node under a random earlier node, siblings distinct, scores falling
    along every path. With ``logits``, a child is often its parent's argmax (so greedy
    verification goes deep); with ``support``, children come from ``support[parent]``."""
    tree = TokenTree.rooted(draw(st.integers(0, V - 1)))
    for _ in range(draw(st.integers(0, MAX_NODES))):
        parent = draw(st.integers(0, len(tree) - 1))
        taken = {tree.tokens[c] for c in tree.children[parent]}
        allowed = [t for t in (support[parent] if support is not None else range(V))
                   if t not in taken]
        if not allowed:
            continue
        token = draw(st.sampled_from(allowed))
        if logits is not None and draw(st.booleans()):
            best = argmax(logits[parent])
            token = best if best in allowed else token
        factor = draw(st.floats(0.0, 1.0, exclude_min=True))
        tree.add(parent, int(token), tree.scores[parent] * factor, "draft")
    return tree


def _logits(seed: int, scale: float) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, scale, (MAX_NODES + 1, V)).astype(np.float32)


def _assert_root_path(tree: TokenTree, accepted: list[int]) -> None:
    parent = 0
    for node in accepted:
        assert tree.parents[node] == parent, "accepted nodes are not one root path"
        parent = node
    assert len(accepted) <= tree.max_depth  # with the next token: at most depth + 1 per pass


seeds = st.integers(0, 2**32 - 1)
scales = st.floats(0.1, 6.0)


@FAST
@given(st.data(), seeds, scales)
def test_greedy_verification_follows_the_argmax_path(data, seed, scale) -> None:
    logits = _logits(seed, scale)
    tree = data.draw(trees(logits=logits))
    verdict = verify_greedy(tree, logits)
    _assert_root_path(tree, verdict.accepted)
    # every emitted token is the target's argmax after the tokens before it...
    node = 0
    for child in verdict.accepted:
        assert tree.tokens[child] == argmax(logits[node])
        node = child
    assert verdict.next_token == argmax(logits[node])
    # ...and the path stops only where the tree has no such child
    assert tree.child_with_token(node, verdict.next_token) is None
    assert verdict.offered == len(verdict.accepted) + (1 if tree.children[node] else 0)


sampling_params = st.builds(
    SamplingParams, temperature=st.floats(0.05, 3.0), top_k=st.integers(0, V),
    top_p=st.floats(0.05, 1.0), seed=st.none())


@FAST
@given(st.data(), seeds, scales, sampling_params)
def test_sampling_verification_emits_a_root_path_and_a_token_the_target_allows(
        data, seed, scale, params) -> None:
    logits = _logits(seed, scale)
    rng = np.random.default_rng([seed, 1])  # a draft unlike the target (another stream)
    q_rows = [distribution(rng.normal(0.0, scale, V), params) for _ in range(MAX_NODES + 1)]
    support = [np.flatnonzero(q) for q in q_rows]
    tree = data.draw(trees(support=support))
    q = {u: q_rows[u] for u in range(len(tree)) if tree.children[u]}
    verdict = verify_sampling(tree, logits, q, params, np.random.default_rng([seed, 2]))
    _assert_root_path(tree, verdict.accepted)
    last = verdict.accepted[-1] if verdict.accepted else 0
    event(f"rejected every child of the last node: {bool(tree.children[last])}")
    # the next token is one the processed target distribution allows (top-k, top-p respected)
    assert distribution(logits[last], params)[verdict.next_token] > 0.0
    # a rejected child leaves no mass behind: the next token is never one the target refused
    assert tree.child_with_token(last, verdict.next_token) is None


@FAST
@given(st.data(), seeds, scales, sampling_params)
def test_a_draft_equal_to_the_target_is_always_accepted(data, seed, scale, params) -> None:
    """With q = p at every node, min(1, p/q) = 1: the first child is accepted at every node,
    down to a leaf."""
    logits = _logits(seed, scale)
    p_rows = [distribution(row, params) for row in logits]
    tree = data.draw(trees(support=[np.flatnonzero(p) for p in p_rows]))
    q = {u: p_rows[u] for u in range(len(tree)) if tree.children[u]}
    verdict = verify_sampling(tree, logits, q, params, np.random.default_rng(seed))
    node, expect = 0, []
    while tree.children[node]:
        node = tree.children[node][0]
        expect.append(node)
    assert verdict.accepted == expect


@FAST
@given(st.data(), st.integers(1, MAX_NODES + 2))
def test_top_nodes_form_a_tree_and_pruning_keeps_every_path(data, n) -> None:
    tree = data.draw(trees())
    keep = tree.top_nodes(n)
    assert len(keep) == min(n, len(tree) - 1)
    assert all(tree.parents[v] == 0 or tree.parents[v] in keep for v in keep)
    pruned = tree.pruned(keep)
    assert sorted(pruned.path(v) for v in range(1, len(pruned))) == \
        sorted(tree.path(v) for v in keep)
    assert all(pruned.parents[v] < v for v in range(1, len(pruned)))  # parents first (batch)
    for v in range(1, len(pruned)):  # siblings keep their order (verification tries them so)
        old = next(u for u in keep if tree.path(u) == pruned.path(v))
        assert pruned.scores[v] == tree.scores[old]


TARGET = logit_table(V, seed=21)
DRAFT = noisy(TARGET, seed=22, noise=1.0)


@settings(max_examples=60, deadline=None, database=None)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=6),
       budget=st.builds(TreeBudget, max_nodes=st.integers(1, 20), max_depth=st.integers(1, 8),
                        max_children=st.integers(1, 5)),
       n_seq_max=st.integers(2, 40))
def test_greedy_draft_trees_respect_the_budget_and_rank_the_drafts_best(prompt, budget,
                                                                        n_seq_max) -> None:
    """Every node's children are its draft's most likely tokens, best first (a prefix of its
    top-k: pruning may drop the worst), within the node, depth and children budgets."""
    kv = KVTree(FakeContext(DRAFT, n_ctx=64, n_batch=64, n_seq_max=n_seq_max))
    draft = grow_tree(ModelDrafter(kv), prompt, budget, SamplingParams(),
                      np.random.default_rng(0))
    tree = draft.tree
    assert len(tree) - 1 <= budget.max_nodes
    assert tree.max_depth <= budget.max_depth
    for u in range(len(tree)):
        kids = [tree.tokens[c] for c in tree.children[u]]
        assert len(kids) <= budget.max_children
        best = top_k(table_logits(DRAFT, [*prompt, *tree.path(u)]).astype(np.float32),
                     budget.max_children)
        assert kids == [int(t) for t in best[:len(kids)]]
        assert all(tree.scores[c] <= tree.scores[u] for c in tree.children[u])
