"""Telling a batch-shape tie from an error where a greedy output parts from plain decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from speculative.backend import ContextConfig, LlamaContext, LlamaModel
from speculative.divergence import AS_PLAIN, explain, first_difference
from speculative.engine import Engine
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
