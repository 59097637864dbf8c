"""Telling a batch-shape tie from an error where a greedy output parts from plain decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from speculative.backend import ContextConfig, LlamaContext, LlamaModel
from speculative.divergence import AS_PLAIN, explain, first_difference
from speculative.drafting import TreeBudget
from speculative.engine import Engine
from speculative.kvtree import COMMIT
from speculative.oracle import OracleDrafter
from speculative.penalties import Penalizer
from speculative.policies import Mode, SpecConfig
from speculative.sampling import SamplingParams
from tests.fakes import FakeContext, logit_table, plain_greedy, table_logits

V = 12
TABLE = logit_table(V, seed=3)


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_identical_outputs_need_no_explanation() -> None:
    prompt = [1, 2]
    ref = plain_greedy(TABLE, prompt, 10)
    assert explain(FakeContext(TABLE), prompt, ref, ref) is None
    assert explain(FakeContext(TABLE), prompt, ref, ref[:6]) is None  # a prefix: cut short


def test_a_token_the_target_never_prefers_is_an_error() -> None:
    """The fake's logits do not depend on batch shape: any other token is an error, and the
    margin is the table's own (a > b by exactly that much, under every shape)."""
    prompt = [4, 7]
    ref = plain_greedy(TABLE, prompt, 12)
    row = table_logits(TABLE, [*prompt, *ref[:5]])
    wrong = int(np.argsort(row)[-2])  # the runner-up: as close as the fake gets to a tie
    other = [*ref[:5], wrong, *ref[6:]]
    d = explain(FakeContext(TABLE), prompt, ref, other)
    assert d is not None and (d.index, d.a, d.b) == (5, ref[5], wrong)
    assert not d.tie and d.spread == pytest.approx(0.0, abs=1e-4)
    assert d.margins[AS_PLAIN] == pytest.approx(row[ref[5]] - row[wrong], abs=1e-4)
    assert "NOT a tie" in d.describe()


def test_with_penalties_the_margins_are_the_penalised_logits() -> None:
    """A run with repetition control compared the penalised logits: so does the explanation
    (a gap the penalties closed is a tie of the logits the run saw, not of the raw ones)."""
    prompt = [4, 7, 4, 7, 4]
    ref = plain_greedy(TABLE, prompt, 8)
    row = table_logits(TABLE, [*prompt, *ref[:3]])
    wrong = int(np.argsort(row)[-2])
    other = [*ref[:3], wrong, *ref[4:]]
    params = SamplingParams(repeat_penalty=1.5, dry_multiplier=2.0, dry_allowed_length=1)
    penalizer = Penalizer(params, n_vocab=V)
    d = explain(FakeContext(TABLE), prompt, ref, other, penalizer)
    penalised = penalizer.step([*prompt, *ref[:3]]).apply(row, ())
    assert d is not None and d.index == 3
    assert d.margins[AS_PLAIN] == pytest.approx(penalised[ref[3]] - penalised[wrong], abs=1e-4)
    assert d.margins[AS_PLAIN] != pytest.approx(row[ref[3]] - row[wrong], abs=1e-3)


@pytest.fixture(scope="module")
def target(tiny_models: dict[str, Path]):
    with LlamaModel(tiny_models["q8_0-target"]) as model, \
            LlamaContext(model, ContextConfig(n_ctx=256, n_batch=64, n_threads=1)) as ctx:
        yield ctx


def test_on_llama_cpp_the_plain_shape_reproduces_plain_decoding(target: LlamaContext) -> None:
    """Replayed as plain ran it, the target prefers plain's token at every point; a token it
    ranks low (an error a broken rule would make) is never a tie."""
    prompt = target.model.vocab.tokenize("def add(a, b):\n    return")
    engine = Engine(target, config=SpecConfig(mode=Mode.PLAIN))
    ref = [t for step in engine.generate(prompt, 24) for t in step.tokens]
    for i in (0, 7, 23):
        other = [*ref[:i], (ref[i] + 1) % target.n_vocab]
        d = explain(target, prompt, ref, other)
        assert d is not None and d.index == i
        assert d.margins[AS_PLAIN] > 0 and all(m > 0 for m in d.margins.values())
        assert not d.tie, d.describe()


def _rows(ctx: LlamaContext, text: list[int], chunk: int) -> np.ndarray:
    """Every row's logits for ``text`` decoded from an empty cache in batches of ``chunk``."""
    ctx.clear()
    rows = []
    for i in range(0, len(text), chunk):
        part = text[i:i + chunk]
        rows.append(np.array(ctx.decode(part, list(range(i, i + len(part))),
                                        [[0]] * len(part), True)))
    return np.concatenate(rows)


def test_with_flash_attention_a_rows_logits_do_not_depend_on_its_batch(
        tiny_models: dict[str, Path]) -> None:
    """Flash attention's kernel computes each row on its own: the same cache gives the same
    logits, bit for bit, whether the text is decoded a token at a time or in batches."""
    config = ContextConfig(n_ctx=256, n_batch=64, n_threads=1, flash_attn=True)
    with LlamaModel(tiny_models["q8_0-target"]) as model, LlamaContext(model, config) as ctx:
        text = model.vocab.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n"
                                    "    return fibonacci(n - 1) + fibonacci(n - 2)\n")
        alone = _rows(ctx, text, 1)
        for chunk in (2, 3, 16, len(text)):
            assert np.array_equal(_rows(ctx, text, chunk), alone), chunk


def test_the_cell_order_shape_moves_the_margin(tiny_models: dict[str, Path]) -> None:
    """With flash attention on, the batch shapes that keep the cells in text order all give
    the same margin; a history whose cells are out of order (as a tree leaves them) moves it,
    so that a tie from cell order can be told from an error."""
    config = ContextConfig(n_ctx=256, n_batch=64, n_threads=1, flash_attn=True)
    with LlamaModel(tiny_models["q8_0-target"]) as model, LlamaContext(model, config) as ctx:
        prompt = model.vocab.tokenize("def add(a, b):\n    return")
        engine = Engine(ctx, config=SpecConfig(mode=Mode.PLAIN))
        ref = [t for step in engine.generate(prompt, 24) for t in step.tokens]
        moved = 0
        for i in (8, 15, 23):
            d = explain(ctx, prompt, ref, [*ref[:i], (ref[i] + 1) % ctx.n_vocab])
            assert d is not None
            in_order = {v for k, v in d.margins.items() if k != "history out of cell order"}
            assert len(in_order) == 1, d.describe()
            moved += d.margins["history out of cell order"] not in in_order
        assert moved >= 1


class _NearOracle(OracleDrafter):
    """Knows the target's text and proposes it beside a wrong token at every node, first
    (``right_first``: the likeliest path is always the accepted one) or second."""

    right_first = True

    def _logits(self, path: tuple[int, ...]) -> np.ndarray:
        i = self._done + len(path)
        out = np.full(self.n_vocab, -1e4, dtype=np.float32)
        if i < len(self.continuation):
            right = self.continuation[i]
            first, second = (1.0, 0.9) if self.right_first else (0.9, 1.0)
            out[right], out[(right + 1) % self.n_vocab] = first, second
        return out


class _OracleTrees(SpecConfig):
    """The oracle mode with the tree budget itself (the mode's own is a chain)."""

    def budget(self) -> TreeBudget | None:
        return self.tree


@pytest.mark.parametrize("right_first", [True, False], ids=["likeliest", "second"])
def test_a_tree_leaves_the_cache_as_plain_decoding_does(tiny_models: dict[str, Path],
                                                        right_first: bool) -> None:
    """The engine lays a tree out likeliest path first, and keeps in the target's cache only
    the accepted nodes that sit right after the root in the batch (the rest of the path is
    decoded again with the next batch): with flash attention on (rows that do not depend on
    their batch), the cache then gives plain decoding's logits bit for bit, after steps that
    each rejected a sibling at every level, whether the target took the likeliest path or
    always the second child."""
    config = ContextConfig(n_ctx=256, n_batch=64, n_threads=1, flash_attn=True)
    with LlamaModel(tiny_models["q8_0-target"]) as model, LlamaContext(model, config) as ctx:
        prompt = model.vocab.tokenize("def add(a, b):\n    return")
        plain = Engine(ctx, config=SpecConfig(mode=Mode.PLAIN))
        answer = [t for step in plain.generate(prompt, 40) for t in step.tokens]
        budget = TreeBudget(max_nodes=8, max_depth=4, max_children=2)
        engine = Engine(ctx, config=_OracleTrees(mode=Mode.ORACLE, tree=budget, adaptive=False))
        engine.oracle = _NearOracle(answer, len(prompt), ctx.n_vocab)
        engine.oracle.right_first = right_first
        steps = list(engine.generate(prompt, 40))
        assert [t for s in steps for t in s.tokens] == answer
        assert sum(s.stats.drafted - s.stats.accepted for s in steps) > len(steps)  # siblings
        text = [*prompt, *answer]
        kv = engine.target
        pending = kv.prepare(text, max_pending=1)
        mine = np.array(kv.decode(pending, [COMMIT] * len(pending))[1][-1])
        assert np.array_equal(mine, _rows(ctx, text, 1)[-1])
