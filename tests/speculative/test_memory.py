"""What an engine learned, kept for the next run on the same models (``ModelPair.remember`` and
``ModelPair.recall``), on real llama.cpp contexts of the tiny models."""

from __future__ import annotations

import json

import numpy as np
import pytest

from speculative.backend import ContextConfig
from speculative.costmodel import (
    PASS_FACTOR_RANGE,
    PASS_HORIZON,
    PASS_MIN,
    PassLoads,
    VerifyCost,
)
from speculative.drafting import TreeBudget
from speculative.engine import CHECK_PASSES
from speculative.loading import open_pair
from speculative.plan import StepKind
from speculative.policies import Mode, SpecConfig

SPEC = SpecConfig(mode=Mode.AUTO, tree=TreeBudget(12, 6, 3), lookahead=3)
PROMPTS = ["def parse(text):\n    ", "import os\n\n\ndef main():\n", "class Stack:\n    def "]


def _config(threads: int = 1) -> ContextConfig:
    return ContextConfig(n_threads=threads, n_ctx=256, n_batch=64, n_seq_max=256)


def _generate(engine, prompt: list[int], n: int = 24) -> list[int]:
    return [t for step in engine.generate(prompt, n) for t in step.tokens]


def test_the_next_run_on_the_same_models_starts_from_what_the_last_one_learned(
        tiny_models, tmp_path) -> None:
    memory = tmp_path / "learned.json"
    target, draft = tiny_models["q8_0-target"], tiny_models["q8_0-draft"]
    with open_pair(target, draft, _config()) as pair:
        pair.measure_costs(SPEC)
        vocab = pair.target.vocab
        first = pair.engine(SPEC)
        assert not pair.recall(first, memory)  # nothing kept yet
        for text in PROMPTS[:2]:
            _generate(first, vocab.tokenize(text))
        assert first.planner is not None and first.planner.held is not None
        pair.remember(first, memory)
        kept = json.loads(memory.read_text())
        assert list(kept) == [pair.memory_key()]

        second = pair.engine(SPEC)
        assert pair.recall(second, memory)
        planner = second.planner
        assert planner is not None and planner.elapsed == 0  # nothing of its own yet
        assert set(planner.stashed) == {"greedy"}  # taken up by the first greedy reply
        planner.new_text(greedy=True)
        assert planner.held is first.planner.held
        for kind in StepKind:
            if first.planner.rates[kind].measured:
                assert planner.rates[kind].measured
                assert planner.speed(kind) == pytest.approx(first.planner.speed(kind))
        assert second.res.calibrations.memory() != pair.engine(SPEC).res.calibrations.memory()

        # the recalled engine still writes the target's own text
        plain = pair.engine(SpecConfig(mode=Mode.PLAIN))
        prompt = vocab.tokenize(PROMPTS[2])
        assert _generate(second, prompt) == _generate(plain, prompt)

    # other settings (threads) are another machine's measurement: not recalled
    with open_pair(target, draft, _config(threads=2)) as other:
        other.measure_costs(SPEC)
        assert other.memory_key() != pair.memory_key()
        assert not other.recall(other.engine(SPEC), memory)


def test_a_memory_file_that_cannot_be_read_is_let_be_and_written_anew(tiny_models,
                                                                        tmp_path) -> None:
    memory = tmp_path / "learned.json"
    with open_pair(tiny_models["q8_0-target"], tiny_models["q8_0-draft"], _config()) as pair:
        pair.measure_costs(SPEC)
        engine = pair.engine(SPEC)
        for broken in ("{not json", json.dumps([1, 2]),
                       json.dumps({pair.memory_key(): {"memory": {"planner": 3}}}),
                       json.dumps({pair.memory_key(): {"memory": {
                           "planner": None, "calibrations": {"by_scorer": {"nobody": [1, 2]}},
                           "confidence": None}}})):
            memory.write_text(broken)
            assert not pair.recall(engine, memory)
        assert engine.planner is not None and engine.planner.stashed == {}
        _generate(engine, pair.target.vocab.tokenize(PROMPTS[0]))
        pair.remember(engine, memory)
        assert pair.recall(pair.engine(SPEC), memory)


def _scaled(cost: VerifyCost, factor: float) -> VerifyCost:
    return VerifyCost(cost.sizes, tuple(factor * t for t in cost.seconds), cost.switch,
                      context=cost.context, per_context=cost.per_context)


def test_a_curve_that_prices_single_tokens_dearer_than_decoding_does_is_measured_again(
        tiny_models, tmp_path, monkeypatch) -> None:
    """A curve timed in a slow moment (here: the measured one, made three times dearer) and
    cached would size every later run; the replies' own single-token passes show it, and
    between replies it is measured again, for this engine and the pair's later ones, keeping
    what the engine learned, and only once per pair."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = SpecConfig(mode=Mode.AUTO, tree=TreeBudget(8, 4, 2))
    with open_pair(tiny_models["q8_0-target"], None, _config()) as pair:
        measured, _ = pair.measure_costs(spec)
        vocab = pair.target.vocab

        def replies(engine) -> None:  # until the check has its passes (the target alone)
            for text in PROMPTS * 4:
                if len(engine._one_seen) >= CHECK_PASSES:
                    return
                _generate(engine, vocab.tokenize(text * 12), 24)  # past the curve's context

        pair.costs = (_scaled(measured, 3.0), None)
        engine = pair.engine(spec)
        replies(engine)
        assert engine.curve_too_dear() and pair.curve_due(engine)
        calibrations = engine.res.calibrations
        assert pair.check_curve(engine)
        again = pair.costs[0]
        assert again.seconds[0] < 2.0 * measured.seconds[0]
        assert engine.verify_cost is again and engine.res.sizer.measured_target is again
        assert engine.res.calibrations is calibrations  # what it learned stays
        assert not engine.curve_too_dear()  # its passes are counted afresh
        assert not pair.passes.single and not pair.passes.drafted  # priced by the old curve

        fresh = pair.engine(spec)
        assert fresh.verify_cost is again
        replies(fresh)
        # the curve measured again prices single tokens as decoding does, within what a
        # tiny model's sub-millisecond passes let two timings agree (the dear one read 1/3)
        assert len(fresh._one_seen) >= CHECK_PASSES
        assert float(np.median(fresh._one_seen)) > 0.5
        pair.costs = (_scaled(again, 3.0), None)  # once per pair: never again
        dear = pair.engine(spec)
        replies(dear)
        assert dear.curve_too_dear() and not pair.curve_due(dear)
        assert not pair.check_curve(dear)


def test_drafted_passes_that_cost_more_than_the_curve_says_correct_the_meter(
        tiny_models, tmp_path, monkeypatch) -> None:
    """The pair's engines share what the target's passes took against the curve: plain
    decoding's single tokens and a tree mode's drafted passes both land in it; where drafted
    passes have recently cost a quarter more than the curve's ratio to single tokens, a
    drafted pass's counterfactual plain time is a quarter less than the curve alone says."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = SpecConfig(mode=Mode.STAGED, tree=TreeBudget(8, 4, 2))
    with open_pair(tiny_models["q8_0-target"], tiny_models["q8_0-draft"], _config(),
                   ngram_optional=True) as pair:
        pair.measure_costs(spec)
        vocab = pair.target.vocab
        prompt = vocab.tokenize(PROMPTS[0] * 12)  # past the curve's context
        _generate(pair.engine(SpecConfig(mode=Mode.PLAIN)), prompt)
        staged = pair.engine(spec)
        _generate(staged, prompt)
        assert staged.passes is pair.passes
        assert len(pair.passes.single) >= 8 and len(pair.passes.drafted) >= 1

        pair.passes.clear()
        single = staged._single_pass(4, 4, t_verify=0.010)
        for _ in range(PASS_MIN):
            pair.passes.add(1, 1.0)
            pair.passes.add(4, 1.25)
        assert staged._single_pass(4, 4, 0.010) == pytest.approx(single / 1.25)
        assert staged._plain_per_token(4, single / 1.25, t_rest=0.0) == pytest.approx(
            single / 1.25 + staged._overhead.value)


def test_pass_loads_compare_recent_passes_of_each_kind_within_bounds() -> None:
    loads = PassLoads()
    for i in range(PASS_MIN - 1):
        loads.add(1, 1.0, now=float(i))
        loads.add(5, 1.3, now=float(i))
    assert loads.drafted_factor(now=10.0) == 1.0  # too few yet
    loads.add(1, 1.0, now=10.0)
    loads.add(3, 1.3, now=10.0)
    assert loads.drafted_factor(now=10.0) == pytest.approx(1.3)
    # all too old: the last factor measured (a ratio of passes timed in the same minutes)
    assert loads.drafted_factor(now=10.0 + PASS_HORIZON + 1) == pytest.approx(1.3)
    for _ in range(PASS_MIN):
        loads.add(2, 9.0, now=20.0)
    assert loads.drafted_factor(now=20.0) == PASS_FACTOR_RANGE[1]  # a disturbed moment
    loads.add(1, float("nan"))
    loads.add(1, 0.0)
    assert len(loads.single) == PASS_MIN  # neither counts
    loads.clear()  # a new curve: the factor was a ratio over the old one
    assert loads.drafted_factor(now=20.0) == 1.0


def test_the_drafted_passes_factor_carries_over_to_the_next_run(tiny_models, tmp_path,
                                                                monkeypatch) -> None:
    """A first reply that drafts every step times no single tokens to compare its passes
    with: the factor the last run measured stands in (and one out of range is not taken)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = SpecConfig(mode=Mode.AUTO)
    with open_pair(tiny_models["q8_0-target"], tiny_models["q8_0-draft"], _config(),
                   ngram_optional=True) as pair:
        pair.measure_costs(spec)
        engine = pair.engine(spec)
        for _ in range(PASS_MIN):
            pair.passes.add(1, 1.0)
            pair.passes.add(4, 1.4)
        assert pair.passes.drafted_factor() == pytest.approx(1.4)
        pair.remember(engine)
    with open_pair(tiny_models["q8_0-target"], tiny_models["q8_0-draft"], _config(),
                   ngram_optional=True) as pair:
        pair.measure_costs(spec)
        engine = pair.engine(spec)
        assert engine.passes.drafted_factor() == 1.0
        assert pair.recall(engine)
        assert not pair.passes.single and engine.passes.drafted_factor() == pytest.approx(1.4)
        assert engine._single_pass(4, 4, 0.010) == pytest.approx(
            0.010 * engine.res.sizer.curve.curve(1) / engine.res.sizer.curve.curve(4) / 1.4)
        memory = engine.memory()
        engine.passes.clear()
        engine.recall({**memory, "drafted_factor": 50.0})
        assert engine.passes.drafted_factor() == 1.0
