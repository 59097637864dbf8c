"""Property tests (hypothesis) of the KV-cache bookkeeping and the loop, on fake contexts that
enforce llama.cpp's rules (positions, sequences, batch size, the unified cache's cells) and
compute each token's logits from what the cache holds for it: random trees, random
accept/reject/abandon sequences, edited histories, windows and budgets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from speculative.drafting import TreeBudget
from speculative.engine import Engine
from speculative.errors import ContextOverflow
from speculative.kvtree import COMMIT, KVTree, Parent
from speculative.ngram import KatzTrigram
from speculative.policies import Mode, SpecConfig
from speculative.sampling import SamplingParams
from speculative.tree import TokenTree
from tests.fakes import FakeContext, logit_table, noisy, plain_greedy, table_logits

V = 9
TARGET = logit_table(V, seed=31)
DRAFT = noisy(TARGET, seed=32, noise=0.8)
tokens = st.integers(0, V - 1)


@st.composite
def shaped_trees(draw: st.DrawFn, root: int, max_nodes: int, max_leaves: int) -> TokenTree:
    """A random tree of at most ``max_nodes`` nodes below ``root`` and ``max_leaves`` leaves."""
    tree = TokenTree.rooted(root)
    for _ in range(draw(st.integers(0, max_nodes))):
        parent = draw(st.integers(0, len(tree) - 1))
        taken = {tree.tokens[c] for c in tree.children[parent]}
        allowed = [t for t in range(V) if t not in taken]
        new_leaf = parent == 0 or bool(tree.children[parent])
        if not allowed or (new_leaf and len(tree.leaves()) >= max_leaves):
            continue
        tree.add(parent, draw(st.sampled_from(allowed)), 1.0, "draft")
    return tree


def _decode_tree(kv: KVTree, committed: list[int], tree: TokenTree):
    """The engine's verification batch: pending committed tokens, then the tree's nodes."""
    pending = kv.prepare(committed, max_pending=kv.ctx.n_batch - len(tree) + 1)
    k = len(pending) - 1
    parents: list[Parent] = [COMMIT] * len(pending)
    parents += [k + tree.parents[i] for i in range(1, len(tree))]
    slots, logits = kv.decode(pending + tree.tokens[1:], parents,
                              [False] * k + [True] * len(tree))
    return slots[k:], logits


def _assert_cache_is_the_committed_text(kv: KVTree, committed: list[int]) -> None:
    ctx = kv.ctx
    assert kv.tokens == committed[:len(kv.tokens)]
    assert ctx.held(0) == kv.tokens
    assert sorted(c.pos for c in ctx.cells) == list(range(len(kv.tokens)))  # no stray cell
    assert all(c.seqs == {0} for c in ctx.cells)  # no tree sequence left behind
    assert kv.cells_free == ctx.n_ctx - len(kv.tokens)


class _CountingContext(FakeContext):
    """Counts ``seq_keep`` calls: in llama.cpp each is a pass over every cell of the cache."""

    keeps = 0

    def seq_keep(self, seq: int) -> None:
        self.keeps += 1
        super().seq_keep(seq)


def test_the_target_alone_makes_no_pass_over_the_cells_once_the_cache_is_clean() -> None:
    """After a commit only sequence 0 is in the cache, and a step that decodes committed
    tokens alone leaves it so: nothing to roll back or keep. A tree's step still cleans up
    after itself, and the next step finds the cache clean again."""
    ctx = _CountingContext(TARGET, n_ctx=64, n_batch=16, n_seq_max=8)
    kv = KVTree(ctx)
    committed = [1, 2, 3]
    for token in (4, 5, 6, 7):  # the target alone
        slots, _ = _decode_tree(kv, committed, TokenTree.rooted(committed[-1]))
        kv.commit(slots[0], [])
        committed.append(token)
    assert ctx.keeps == 1  # the first step's, on a cache of unknown content
    tree = TokenTree.rooted(committed[-1])
    child = tree.add(0, 1, 1.0, "draft")
    tree.add(0, 2, 1.0, "draft")
    slots, _ = _decode_tree(kv, committed, tree)
    kv.commit(slots[child], [1])
    committed += [1, 3]
    assert ctx.keeps == 2
    _assert_cache_is_the_committed_text(kv, committed)
    slots, _ = _decode_tree(kv, committed, TokenTree.rooted(committed[-1]))
    kv.commit(slots[0], [])
    assert ctx.keeps == 2
    _assert_cache_is_the_committed_text(kv, [*committed, 0])


@settings(max_examples=300, deadline=None, database=None)
@given(st.data(), st.integers(6, 40), st.integers(3, 16), st.integers(2, 10))
def test_cache_equals_a_from_scratch_decode_after_any_accept_reject_sequence(
        data, n_ctx, n_batch, n_seq_max) -> None:
    ctx = FakeContext(TARGET, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max)
    kv = KVTree(ctx)
    committed = data.draw(st.lists(tokens, min_size=1, max_size=n_ctx))
    for _ in range(data.draw(st.integers(1, 10))):
        action = data.draw(st.sampled_from(["accept", "accept", "abandon", "edit", "overflow"]))
        if action == "edit":  # a new turn that keeps only part of the history
            keep = data.draw(st.integers(1, len(committed)))
            committed = committed[:keep] + data.draw(st.lists(tokens, max_size=n_ctx - keep))
            continue
        room = min(n_ctx - len(committed), n_batch - 1)
        if action == "overflow":
            # siblings: one position, but one cell each; one more than the cells left is
            # refused before llama.cpp would fail to find them, and the cache is unchanged
            wide = n_ctx - len(committed) + 1
            if wide > min(V, n_batch - 1, n_seq_max - 1):
                continue
            event("overflow tried")
            tree = TokenTree.rooted(committed[-1])
            for token in range(wide):
                tree.add(0, token, 1.0, "draft")
            with pytest.raises(ContextOverflow, match="KV cells"):
                _decode_tree(kv, committed, tree)
            kv.rollback()
            _assert_cache_is_the_committed_text(kv, committed)
            continue
        tree = data.draw(shaped_trees(committed[-1], room, n_seq_max - 1))
        slots, logits = _decode_tree(kv, committed, tree)
        for node in range(len(tree)):  # each node sees exactly its own path
            want = table_logits(TARGET, [*committed, *tree.path(node)])
            assert np.array_equal(logits[node], want.astype(np.float32))
        if action == "abandon":  # a cancelled step
            kv.rollback()
        else:
            node = data.draw(st.integers(0, len(tree) - 1))
            path = list(tree.path(node))
            kv.commit(slots[node], path)
            committed = committed + path
            if len(committed) < n_ctx:
                committed.append(data.draw(tokens))  # the target's own next token
        _assert_cache_is_the_committed_text(kv, committed)
        if len(committed) >= n_ctx:
            break
    # and the next decode continues exactly as a fresh context decoding the whole text would
    pending = kv.prepare(committed, max_pending=n_batch)
    _, logits = kv.decode(pending, [COMMIT] * len(pending))
    assert np.array_equal(logits[-1], table_logits(TARGET, committed).astype(np.float32))


class _Recording(FakeContext):
    """Remembers the distinct sequence ids of each decoded batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.distinct: list[int] = []

    def decode(self, tokens, positions, seq_ids, logits=True):
        self.distinct.append(len({s for ids in seq_ids for s in ids}))
        return super().decode(tokens, positions, seq_ids, logits)


@settings(max_examples=100, deadline=None, database=None)
@given(st.data(), st.integers(1, 8))
def test_trees_of_one_size_carry_as_many_sequence_ids_whatever_their_shape(data, size) -> None:
    """llama.cpp reuses its compute graph only for a batch of the same shape, distinct
    sequence ids included: a chain and a bush of ``size`` nodes must both carry ``size + 1``
    (spare ids are topped up), see exactly their own paths, and leave nothing behind."""
    committed = data.draw(st.lists(tokens, min_size=1, max_size=10))
    ctx = _Recording(TARGET, n_ctx=40, n_batch=16, n_seq_max=16)
    kv = KVTree(ctx)
    for _ in range(3):
        tree = TokenTree.rooted(committed[-1])
        while len(tree) - 1 < size:  # any shape, exactly `size` nodes
            parent = data.draw(st.integers(0, len(tree) - 1))
            taken = {tree.tokens[c] for c in tree.children[parent]}
            token = data.draw(st.sampled_from([t for t in range(V) if t not in taken] or [-1]))
            if token >= 0:
                tree.add(parent, token, 1.0, "draft")
        slots, logits = _decode_tree(kv, committed, tree)
        assert ctx.distinct[-1] == size + 1
        for node in range(len(tree)):
            want = table_logits(TARGET, [*committed, *tree.path(node)])
            assert np.array_equal(logits[node], want.astype(np.float32))
        node = data.draw(st.integers(0, len(tree) - 1))
        kv.commit(slots[node], list(tree.path(node)))
        committed = [*committed, *tree.path(node)]
        _assert_cache_is_the_committed_text(kv, committed)
    # a plain step (one committed token, no tree) stays on sequence 0 alone
    pending = kv.prepare([*committed, 1], max_pending=1)
    kv.decode(pending, [COMMIT] * len(pending))
    assert ctx.distinct[-1] == 1


budgets = st.builds(TreeBudget, max_nodes=st.integers(1, 12), max_depth=st.integers(1, 8),
                    max_children=st.integers(1, 4))
NGRAM_TEXT = [list(np.random.default_rng(33).integers(0, V, 200))]


def _engine(mode: Mode, budget: TreeBudget, n_ctx: int, draft_ctx: int, chain: int,
            lookahead: int) -> Engine:
    ngram = KatzTrigram.build(NGRAM_TEXT, V)  # fresh: the engine teaches it the conversation
    return Engine(FakeContext(TARGET, n_ctx=n_ctx), FakeContext(DRAFT, n_ctx=draft_ctx), ngram,
                  SpecConfig(mode=mode, tree=budget, chain_length=chain, lookahead=lookahead,
                             adaptive=False))


def _per_pass_limit(mode: Mode, budget: TreeBudget, chain: int) -> int:
    """Tokens one target pass can emit: the deepest drafted path, plus the target's own."""
    depth = {Mode.PLAIN: 0, Mode.CHAIN: chain}.get(mode, budget.max_depth)
    return depth + 1


@settings(max_examples=250, deadline=None, database=None)
@given(mode=st.sampled_from(Mode.selectable()), budget=budgets, n_ctx=st.integers(4, 40),
       draft_shorter=st.integers(0, 6), chain=st.integers(1, 6), lookahead=st.integers(0, 4),
       prompt=st.lists(tokens, min_size=1, max_size=40), n=st.integers(1, 60))
def test_greedy_generation_equals_plain_decoding_up_to_the_window(
        mode, budget, n_ctx, draft_shorter, chain, lookahead, prompt, n) -> None:
    draft_ctx = max(n_ctx - draft_shorter, 2)
    uses_draft = mode.needs_draft or mode is Mode.AUTO  # auto drafts when it has a draft
    window = min(n_ctx, draft_ctx) if uses_draft else n_ctx
    prompt = prompt[:window]
    engine = _engine(mode, budget, n_ctx, draft_ctx, chain, lookahead)
    steps = list(engine.generate(prompt, n))
    out = [t for s in steps for t in s.tokens]
    assert out == plain_greedy(TARGET, prompt, len(out))
    limit = _per_pass_limit(mode, budget, chain)
    assert all(len(s.tokens) <= limit and s.stats.accepted <= s.stats.drafted for s in steps)
    assert all(s.finish is None for s in steps[:-1])
    if steps[-1].finish == "context":
        assert len(out) == window - len(prompt) + 1
    else:
        assert steps[-1].finish == "length" and len(out) == n


@settings(max_examples=150, deadline=None, database=None)
@given(mode=st.sampled_from([Mode.CHAIN, Mode.TREE, Mode.STAGED, Mode.NGRAM, Mode.AUTO]),
       budget=budgets,
       n_ctx=st.integers(4, 30), lookahead=st.integers(0, 4),
       prompt=st.lists(tokens, min_size=1, max_size=30),
       temperature=st.floats(0.1, 2.0), top_k=st.integers(0, V), top_p=st.floats(0.1, 1.0),
       seed=st.integers(0, 2**16))
def test_sampled_generation_runs_to_the_window_within_every_limit(
        mode, budget, n_ctx, lookahead, prompt, temperature, top_k, top_p, seed) -> None:
    params = SamplingParams(temperature, top_k, top_p, seed)
    prompt = prompt[:n_ctx]
    engine = _engine(mode, budget, n_ctx, n_ctx, 4, lookahead)
    steps = list(engine.generate(prompt, 10_000, params))
    out = [t for s in steps for t in s.tokens]
    assert steps[-1].finish == "context" and len(out) == n_ctx - len(prompt) + 1
    limit = _per_pass_limit(mode, budget, 4)
    assert all(len(s.tokens) <= limit for s in steps)
    kv = engine.target
    _assert_cache_is_the_committed_text(kv, [*prompt, *out])
