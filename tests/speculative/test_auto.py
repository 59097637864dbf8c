"""``auto`` on fake contexts: what it drafts on each cost curve, its measured rates and regret
budget, probes, the merged tree, and the ``Learned`` hand-on; every reply exact."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np
import pytest

from speculative.auto import (
    EXPLORE_EVERY,
    EXPLORE_FLOOR,
    EXPLORE_SHARE,
    FULL_SHARE_LEAD,
    HOLD_STEPS,
    MAX_BACKOFF,
    RECALL_STEPS,
    START_STEPS,
    SWITCH_DOUBTS,
    SWITCH_MARGIN,
    TRIAL_STEPS,
    AutoPolicy,
    Guessed,
    Margin,
    Missed,
    Planner,
    catching_up,
)
from speculative.costmodel import Calibration, Running, VerifyCost
from speculative.drafting import (
    DraftCounters,
    DraftTree,
    NgramDrafter,
    TreeBudget,
    grow_tree,
    sparse_top,
)
from speculative.engine import Engine
from speculative.ngram import KatzTrigram
from speculative.plan import Scorer, StepKind
from speculative.policies import Mode, SpecConfig
from speculative.sampling import SamplingParams
from speculative.sizing import Sizer
from speculative.stats import RunStats
from speculative.tree import TokenTree
from tests.fakes import FakeContext, noisy
from tests.speculative.test_engine import (
    CHEAP_DRAFT,
    DRAFT,
    FLAT,
    PROMPTS,
    STEEP,
    TARGET,
    V,
    _engine,
    _generate,
    _plain,
)


def _auto(target_cost: tuple, draft_cost: tuple, draft: np.ndarray = DRAFT) -> Engine:
    engine = _engine(Mode.AUTO, TreeBudget(24, 8, 3), draft=draft)
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), target_cost)
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), draft_cost)
    return engine


def _plant(engine: Engine, planted: type[Planner],
           rates: list[tuple[StepKind, int, float]]) -> Planner:
    """``engine``'s costs measured and its planner a ``planted`` one (a subclass that keeps
    its rates: the fakes' own steps take microseconds of Python), given five steps of each of
    ``rates`` (kind, tokens, seconds) through ``Planner.observe_step``."""
    engine.measure_cost()
    planner = engine.planner = planted(engine.res.sizer)
    for _ in range(5):
        for kind, tokens, seconds in rates:
            Planner.observe_step(planner, kind, tokens, seconds)
    return planner




def test_ngram_trees_grow_only_nodes_that_could_pay() -> None:
    """Where a batch token costs a good share of a pass, an n-gram node whose calibrated
    score is below that share is never expanded (its children score less still): fewer
    n-gram queries, the same exact output. Where batches are free, the tree grows whole."""
    assert Sizer(VerifyCost((1, 2, 4, 8, 16, 32), STEEP), None).least_worth() \
        == pytest.approx((5.3 - 3.5) / 8)  # the cheapest extra token: between 8 and 16
    assert Sizer(VerifyCost((1, 2, 4, 8, 16, 32), FLAT), None).least_worth() < 0.02
    grown = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        engine = _auto(curve, CHEAP_DRAFT)
        engine.measure_cost()
        params = SamplingParams()
        budget = TreeBudget(24, 8, 3)
        sizes = []
        for prompt in PROMPTS[:8]:
            ngram = NgramDrafter(engine.ngram, sparse_top(params, budget.max_children))
            tree = grow_tree(ngram, prompt, budget, params, np.random.default_rng(0),
                             engine.res.worth_growing()).tree
            least = engine.res.sizer.least_worth()
            parents = {tree.parents[v] for v in range(1, len(tree))}
            assert all(tree.scores[u] >= least for u in parents)  # only worthy nodes grew
            sizes.append(len(tree))
        grown[name] = sum(sizes)
    assert grown["flat"] > grown["steep"]
    for mode in (Mode.AUTO, Mode.NGRAM):
        engine = _engine(mode)
        engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), STEEP)
        for prompt in PROMPTS[:6]:
            assert _generate(engine, prompt, 24) == _plain(prompt, 24)


def test_ngram_trees_stop_growing_far_below_what_the_cut_keeps() -> None:
    """On a curve with a free slot (a 4th batch token costs nothing more than a 3rd, as where
    llama.cpp's kernels work on tiles) no node is too cheap to pay, yet the n-gram's tree grows
    only nodes near those the cut keeps: far fewer expansions than growing the whole budget,
    and the same cut in nearly every step."""
    tiled = VerifyCost((1, 2, 3, 4, 8, 16, 32), (1.0, 1.2, 1.4, 1.4, 2.2, 3.0, 5.0))
    corpus = [_plain(prompt, 40) for prompt in PROMPTS[10:14]]  # the n-gram knows some text
    engine = _engine(Mode.NGRAM, TreeBudget(16, 6, 4), corpus=corpus)
    engine.verify_cost = tiled
    engine.measure_cost()
    res = engine.res
    assert res.sizer.least_worth() == 0.0
    params, budget = SamplingParams(), TreeBudget(16, 6, 4)
    factor = res.calibrations.factor(Scorer.NGRAM)
    class Counting(NgramDrafter):
        asked = 0

        def logits(self, paths):
            Counting.asked += len(paths)
            return super().logits(paths)

    expansions = []
    same = 0
    prompts = [p + _plain(p, 8)[:k] for p in PROMPTS[10:14] for k in (2, 5)]
    for expand in (res.worth_growing(), None):
        Counting.asked = 0
        for prompt in prompts:
            ngram = Counting(engine.ngram, sparse_top(params, budget.max_children))
            grow_tree(ngram, prompt, budget, params, np.random.default_rng(0), expand)
        expansions.append(Counting.asked)
    for prompt in prompts:
        trees = [grow_tree(NgramDrafter(engine.ngram, sparse_top(params, budget.max_children)),
                           prompt, budget, params, np.random.default_rng(0), expand)
                 for expand in (res.worth_growing(), None)]
        cuts = [res.cut(t, t.scores(), 0.0, factor).tree for t in trees]
        paths = [{c.path(v) for v in range(1, len(c))} for c in cuts]
        same += paths[0] == paths[1]
    assert expansions[0] < 0.5 * expansions[1]
    assert same >= len(prompts) - 1


def test_auto_drafts_what_the_cost_curve_pays_for_and_stays_exact() -> None:
    drafted = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        engine = _auto(curve, CHEAP_DRAFT)
        run = RunStats()
        for prompt in PROMPTS[:8]:
            assert _generate(engine, prompt, 24, run=run) == _plain(prompt, 24), name
        drafted[name] = run.mean_drafted
    assert drafted["flat"] > 2 * drafted["steep"] > 0


def test_auto_stops_drafting_when_the_draft_is_useless() -> None:
    useless = noisy(TARGET, seed=11, noise=50.0)  # its guesses are nearly never the target's
    engine = _auto(STEEP, (0.5, 0.8, 1.1, 1.8, 3.0, 5.5), draft=useless)
    run = RunStats()
    for prompt in PROMPTS[:10]:
        assert _generate(engine, prompt, 24, run=run) == _plain(prompt, 24)
    late = run.steps[len(run.steps) // 2:]
    assert sum(s.draft_calls for s in late) <= 0.2 * len(late)  # learned: mostly plain now


def test_auto_takes_the_kind_of_step_measured_fastest() -> None:
    """Without a draft model, steps of the n-gram's tree measured faster than the target alone
    run; with one, greedy, the n-gram's tree is no kind of its own (the draft's kind verifies
    it alone where that pays more, step by step): the target alone, measured faster than the
    draft's kind, runs, however fast the n-gram's steps once measured; when the draft's steps
    measure faster, the draft runs. (The rates are planted: the fakes' own steps take
    microseconds of Python.)"""

    class Planted(Planner):  # the rates stay as planted; the waits go on
        taken: list[StepKind] = []  # noqa: RUF012 (the test's record)

        def observe_step(self, kind: StepKind, tokens: int, seconds: float,
                         switch: float = 0.0, alternatives=()) -> None:
            self.taken.append(kind)
            for k in StepKind:
                self.idle[k] = 0 if k is kind else self.idle[k] + 1

    rates = [(StepKind.ROOT, 1, 0.01),      # 100 tokens/s alone
             (StepKind.DRAFT, 2, 0.04),     # 50 with the draft
             (StepKind.GUESSES, 3, 0.02)]   # 150 with the n-gram's
    ngram = KatzTrigram.build([list(np.random.default_rng(9).integers(0, V, 200))], V)
    alone = Engine(FakeContext(TARGET), None, ngram,  # no draft model loaded
                   SpecConfig(mode=Mode.AUTO, tree=TreeBudget(24, 8, 3)))
    alone.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), FLAT)
    planner = _plant(alone, Planted, rates)
    run = RunStats()
    assert _generate(alone, PROMPTS[4], 12, run=run) == _plain(PROMPTS[4], 12)
    assert set(planner.taken) == {StepKind.GUESSES}
    assert all(s.draft_calls == 0 for s in run.steps) and run.mean_drafted > 0

    engine = _auto(FLAT, CHEAP_DRAFT)
    planner = _plant(engine, Planted, rates)
    planner.taken.clear()
    run = RunStats()
    assert _generate(engine, PROMPTS[4], 12, run=run) == _plain(PROMPTS[4], 12)
    assert set(planner.taken) == {StepKind.ROOT}
    assert run.mean_drafted == 0
    for _ in range(40):
        Planner.observe_step(planner, StepKind.DRAFT, 8, 0.02)     # now 400 with the draft
    planner.taken.clear()
    assert _generate(engine, PROMPTS[5], 12) == _plain(PROMPTS[5], 12)
    # the draft's steps, but for the explorations that were due (the waits went on above)
    assert planner.taken.count(StepKind.DRAFT) >= len(planner.taken) - 2


def test_a_draft_step_that_paid_for_the_draft_verifies_its_best_node() -> None:
    """On a curve where no drafted node pays, the draft's kind, held as the fastest, still
    verifies at least its best node at every step where the draft model decoded (the fixed
    modes do the same): a paid draft with nothing verified yields nothing for its price."""

    class Planted(Planner):  # the draft's kind stays the fastest
        def observe_step(self, kind: StepKind, tokens: int, seconds: float,
                         switch: float = 0.0, alternatives=()) -> None:
            pass

    engine = _auto((1.0, 2.4, 3.2, 4.0, 7.0, 13.0), CHEAP_DRAFT)
    _plant(engine, Planted, [(StepKind.ROOT, 1, 0.04), (StepKind.GUESSES, 1, 0.04),
                             (StepKind.DRAFT, 3, 0.02)])
    run = RunStats()
    for prompt in PROMPTS[4:8]:
        assert _generate(engine, prompt, 16, run=run) == _plain(prompt, 16)
    paid = [s for s in run.steps if s.draft_calls > 0]
    assert paid and all(s.drafted >= 1 for s in paid)


class _Held(Missed):
    """A measured miss that stays as planted (the fakes' steps take microseconds of
    Python): ``tokens`` and ``seconds`` beyond the estimate on average."""

    def __init__(self, tokens: float = 0.0, seconds: float = 0.0) -> None:
        super().__init__(10 * tokens, 10 * seconds, 10.0)

    def add(self, tokens: float, seconds: float) -> None:
        pass


class _Alone(Running):
    """A target-alone step's time that stays as planted (the fakes' passes are priced in
    the curve's seconds, but take microseconds)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds, 1.0)

    def add(self, value: float, weight: float = 1.0) -> None:
        pass


def _margins(engine: Engine, tokens: float, seconds: float) -> AutoPolicy:
    """``engine``'s ``auto`` policy with steps that run the draft measured to emit ``tokens``
    more, in ``seconds`` more, than the n-gram tree's estimate, and that tree as estimated,
    in every bin; the target alone as its curve prices it."""
    policy = engine._policy(Mode.AUTO)
    assert isinstance(policy, AutoPolicy)
    margins = policy.planner.margins
    margins[:] = [Margin(_Held(tokens, seconds), _Held()) for _ in margins]
    assert engine.verify_cost is not None
    policy.planner.alone = _Alone(engine.verify_cost.curve(1))
    return policy


NOTHING = (0.0, 0.5)  # running the draft adds no token, and half a (fake) second
EVERYTHING = (1e3, 0.0)  # ... a thousand tokens, for nothing


def test_without_the_draft_a_step_verifies_the_ngram_tree_where_it_pays_else_the_root(
        ) -> None:
    """The draft adding nothing, each step of its kind verifies what pays most without it:
    where a second batch token costs more than a whole pass (a steep CPU curve) the
    n-gram's lone nodes mostly do not, and the target alone runs; on a flat curve, the
    n-gram's trees. The output is plain decoding's either way."""

    class Planted(Planner):  # the draft's kind stays the fastest
        ran: list[StepKind] = []  # noqa: RUF012 (the test's record)

        def observe_step(self, kind: StepKind, tokens: int, seconds: float,
                         switch: float = 0.0, alternatives=()) -> None:
            self.ran.append(kind)

    steeper = (1.0, 2.4, 3.2, 4.0, 7.0, 13.0)
    drafted = {}
    for name, curve in (("steeper", steeper), ("flat", FLAT)):
        engine = _auto(curve, CHEAP_DRAFT)
        planner = _plant(engine, Planted, [(StepKind.ROOT, 1, 0.04), (StepKind.DRAFT, 3, 0.02)])
        _margins(engine, *NOTHING)
        planner.ran.clear()
        run = RunStats()
        for prompt in PROMPTS[4:8]:
            assert _generate(engine, prompt, 16, run=run) == _plain(prompt, 16), name
        assert set(planner.ran) == {StepKind.DRAFT}, name
        left_out = [s.drafted for s in run.steps if s.draft_calls == 0]
        assert len(left_out) >= len(run.steps) - 2, name  # but the draft's refreshes
        drafted[name] = left_out
    assert 0 in drafted["steeper"] and 0 not in drafted["flat"]
    assert sum(drafted["flat"]) > 2 * sum(drafted["steeper"])


def test_the_draft_runs_where_it_adds_more_than_the_ngram_tree_alone_yields() -> None:
    """Greedy, the draft's kind held: where running the draft is measured to add tokens
    faster than the n-gram's tree alone yields them, every step runs it; where it is measured
    to add none, the n-gram's tree is verified alone (on a flat curve its nodes pay) at every
    step but the draft's refreshes; the output is plain decoding's either way."""
    corpus = [_plain(prompt, 40) for prompt in PROMPTS[10:12]]
    calls = {}
    for added in (EVERYTHING, NOTHING):
        engine = _engine(Mode.AUTO, TreeBudget(24, 8, 3), corpus=corpus)
        engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), FLAT)
        engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), CHEAP_DRAFT)

        class Planted(Planner):  # the draft's kind stays the fastest
            def observe_step(self, kind: StepKind, tokens: int, seconds: float,
                             switch: float = 0.0, alternatives=()) -> None:
                assert kind is StepKind.DRAFT

        _plant(engine, Planted, [(StepKind.ROOT, 1, 0.04), (StepKind.DRAFT, 3, 0.02)])
        policy = _margins(engine, *added)
        decide = policy.without_draft
        ran: list[bool] = []

        def record(cut: DraftTree, t0: float, decide=decide, ran=ran) -> DraftTree | None:
            left = decide(cut, t0)
            ran.append(left is None)
            return left

        policy.without_draft = record
        run = RunStats()
        for prompt in PROMPTS[10:12]:
            assert _generate(engine, prompt, 24, run=run) == _plain(prompt, 24), added
        calls[added] = (ran, [(s.draft_calls, s.drafted) for s in run.steps])
    ran, _ = calls[EVERYTHING]
    assert all(ran) and len(ran) > 4  # the draft ran at every step
    ran, steps = calls[NOTHING]
    assert ran.count(True) <= 2  # but for its refreshes, left out
    left_out = [drafted for n, drafted in steps if n == 0]
    assert sum(left_out) > 2 * len(left_out)  # the n-gram's trees, several nodes each


def _one_node_choice(tokens: float, seconds: float) -> tuple[AutoPolicy, DraftTree, float]:
    """An ``auto`` policy on a steep curve with a cheap draft, its costs measured and its
    margins planted (``_margins``), and an n-gram cut of one nearly sure node with the time
    its step began: what ``without_draft`` is asked about."""
    engine = _auto(STEEP, CHEAP_DRAFT)
    engine.measure_cost()
    policy = _margins(engine, tokens, seconds)
    tree = TokenTree.rooted(1)
    tree.add(0, 2, 0.95, "ngram")
    return policy, DraftTree(tree, {}), time.perf_counter()


def test_the_draft_left_out_runs_again_after_a_wait_that_doubles_while_it_adds_nothing(
        ) -> None:
    """After ``EXPLORE_EVERY`` steps in a row without the draft, the next runs it (its margin
    is measured only on steps that run it); while it keeps adding nothing, the wait doubles,
    up to ``MAX_BACKOFF`` times; a step that runs it for what it adds starts the wait
    over. Each step's bin is the n-gram tree's expected tokens."""
    policy, cut, t0 = _one_node_choice(*NOTHING)
    gaps, run = [], 0
    for _ in range(EXPLORE_EVERY * 16):
        if policy.without_draft(cut, t0) is not None:
            run += 1
        else:
            gaps.append(run)
            run = 0
    assert gaps[:4] == [EXPLORE_EVERY, 2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY,
                        8 * EXPLORE_EVERY]
    assert policy.refresh == EXPLORE_EVERY * min(16, MAX_BACKOFF)
    assert policy.bin == 1  # one node nearly sure: about 2 tokens expected
    policy.planner.margins[1] = Margin(_Held(1e3), _Held())
    assert policy.without_draft(cut, t0) is None
    assert policy.refresh == EXPLORE_EVERY
    root = policy.without_draft(DraftTree(TokenTree.rooted(1), {}), t0)
    assert root is not None and len(root.tree) == 1
    assert policy.bin == 0  # nothing to verify: the target's token only


def test_each_choice_is_priced_from_the_ngram_trees_estimate_as_its_steps_measured() -> None:
    """Without the draft and with it, a step is priced from the n-gram tree's estimate,
    corrected by how far such steps measured from theirs (``Margin``), and the target alone
    as such steps take now (``Planner.alone``): each choice measured slower than the next
    is passed over for it."""
    policy, cut, t0 = _one_node_choice(1.0, 0.0)
    assert policy.without_draft(cut, t0) is None  # a token more for nothing: the draft runs
    assert policy.chose is StepKind.DRAFT and policy.estimate is not None
    margins = policy.planner.margins
    margins[policy.bin] = Margin(_Held(1.0, 10.0), _Held())  # ... in ten passes' time
    left = policy.without_draft(cut, t0)
    assert left is not None and len(left.tree) == 2 and policy.chose is StepKind.GUESSES
    margins[policy.bin] = Margin(_Held(1.0, 10.0), _Held(0.0, 10.0))
    root = policy.without_draft(cut, t0)
    assert root is not None and len(root.tree) == 1 and policy.chose is StepKind.ROOT
    policy.planner.alone = _Alone(100.0)  # the target alone now takes a hundred passes
    assert policy.without_draft(cut, t0) is None  # ... the slowest: the draft runs
    assert policy.chose is StepKind.DRAFT


def test_the_draft_is_left_out_only_where_its_steps_are_surely_slower() -> None:
    """The draft's steps are measured only where it runs: measured a little slower than the
    n-gram's tree alone, steadily, it is left out; as slow on average but spread out (steps
    of one token and of several), it runs, and is measured further."""
    policy, cut, t0 = _one_node_choice(0.0, 0.0)
    policy.without_draft(cut, t0)
    steady, spread = Missed(decay=1.0), Missed(decay=1.0)
    for i in range(10):
        steady.add(-0.2, 0.0)
        spread.add(-1.2 if i % 2 else 0.8, 0.0)
    assert spread.mean() == pytest.approx(steady.mean())
    assert steady.doubt() < 1e-6 and spread.doubt() > 0.3
    policy.planner.margins[policy.bin] = Margin(steady, _Held())
    left = policy.without_draft(cut, t0)
    assert left is not None and policy.chose is StepKind.GUESSES
    policy.planner.margins[policy.bin] = Margin(spread, _Held())
    assert policy.without_draft(cut, t0) is None and policy.chose is StepKind.DRAFT


def _steep_sampled(mode: Mode) -> Engine:
    """An engine of ``mode`` on a steep curve with a cheap draft, its costs measured."""
    engine = _engine(mode, TreeBudget(24, 8, 3))
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), STEEP)
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), CHEAP_DRAFT)
    engine.measure_cost()
    return engine


def test_a_first_sampled_step_verifies_what_the_curve_pays_for_not_the_whole_budget() -> None:
    """A sampled tree is sized before its nodes are drawn, from the last step's candidates;
    the first step of a kind has none, and keeps only nodes that would pay for their batch
    in a tree of nodes as good (``Sizer.uniform_worth``): on a steep curve far fewer than
    the budget."""
    params = SamplingParams(temperature=1.0, top_k=5, seed=3)
    engine = _steep_sampled(Mode.NGRAM)
    res = engine.res
    floor = res.floor(Scorer.NGRAM, params)
    assert floor == res.sizer.uniform_worth() / res.calibrations.factor(Scorer.NGRAM) > 0.0
    assert res.floor(Scorer.NGRAM, SamplingParams()) == 0.0  # greedy trees are cut instead
    budget = TreeBudget(24, 8, 3)
    sizes = []
    for prompt in PROMPTS[:4]:
        ngram = NgramDrafter(engine.ngram, sparse_top(params, budget.max_children))
        tree = grow_tree(ngram, prompt, budget, params, np.random.default_rng(0),
                         floor=floor, at_least=1).tree
        assert all(tree.scores[v] >= floor for v in range(1, len(tree))
                   if v != tree.children[0][0])  # the root's first child: verified anyway
        whole = grow_tree(ngram, prompt, budget, params, np.random.default_rng(0)).tree
        sizes.append((len(tree), len(whole)))
    assert sum(a for a, _ in sizes) < sum(b for _, b in sizes)
    run = RunStats()
    _generate(engine, PROMPTS[0], 1, params=params, run=run)
    assert run.steps[0].drafted < budget.max_nodes


def test_a_tiled_curves_free_slot_does_not_open_a_sampled_tree_to_the_whole_budget() -> None:
    """Where a batch of 4 tokens costs less than one of 3 (llama.cpp's kernels work on tiles;
    measured so on a 2-core AVX2 host), the cheapest batch token is free and ``least_worth``
    is 0, but a tree still pays for its batch: a sampled step sized as a first one keeps
    only nodes that a tree of nodes as good would pay for, and the n-gram's sampled steps
    verify a few nodes, not the budget."""
    tiled = VerifyCost((1, 2, 3, 4, 8, 16, 32), (1.0, 1.56, 2.38, 2.23, 3.66, 6.22, 12.5))
    engine = _engine(Mode.NGRAM, TreeBudget(16, 6, 4))
    engine.verify_cost = tiled
    engine.measure_cost()
    res = engine.res
    assert res.sizer.least_worth() == 0.0
    # (cost(16) - cost(1)) / 15: the cheapest share of a pass a node of a uniform tree pays
    assert res.sizer.uniform_worth() == pytest.approx(5.22 / 15)
    params = SamplingParams(temperature=1.0, top_k=5, seed=3)
    assert res.floor(Scorer.NGRAM, params) > 0.3 / res.calibrations.factor(Scorer.NGRAM)
    res.previous[Scorer.NGRAM] = ([0.3, 0.1, 0.05], 0.0)  # nothing paid in the last step
    assert res.floor(Scorer.NGRAM, params) > 0.3 / res.calibrations.factor(Scorer.NGRAM)
    run = RunStats()
    for prompt in PROMPTS[:4]:
        _generate(engine, prompt, 12, params=params, run=run)
    assert run.mean_drafted < 4


def test_a_sampled_step_after_one_where_nothing_paid_is_sized_as_a_first_step() -> None:
    """Floored where nothing in the last step's candidates paid, a tree would keep the root's
    first child alone (verified anyway), whose siblings would be the next step's only
    candidates, paying nothing either: every later step would stay that stunted. Such a
    step is sized as a first one (``Sizer.uniform_worth``); after a step whose nodes paid, by
    what one more node needed to pay there."""
    from speculative.costmodel import paying_floor

    params = SamplingParams(temperature=1.0, top_k=5, seed=3)
    res = _steep_sampled(Mode.TREE).res
    first = res.floor(Scorer.DRAFT, params)
    factor = res.calibrations.factor(Scorer.DRAFT)
    stunted = [0.3, 0.1, 0.05]  # the root's slots, beside its one child
    assert paying_floor(stunted, res.sizer.priced, 0.05, factor) == math.inf
    res.previous[Scorer.DRAFT] = (stunted, 0.05)
    assert res.floor(Scorer.DRAFT, params) == first < math.inf
    paid = [0.95, 0.9, 0.85, 0.8, 0.3, 0.1]
    res.previous[Scorer.DRAFT] = (paid, 0.05)
    floor = res.floor(Scorer.DRAFT, params)
    assert floor == paying_floor(paid, res.sizer.priced, 0.05, factor) != first


def test_a_staged_drafters_calls_are_priced_by_all_of_them() -> None:
    """The sizer prices a staged draft call by the guesses a call carries and the levels it
    yields, averaged over every call, those that carried no guess included: where guesses
    rarely pay (sampled trees), a call is as narrow as the tree drafter's."""
    from speculative.drafting import DraftTree as _Tree
    from speculative.plan import Calibrations, StepPlan

    class Staged:
        lookahead = object()  # a drafter with stage-2 guesses
        counters = DraftCounters()

    calibrations = Calibrations()
    tree = TokenTree.rooted(7)
    node = 0
    for token in (1, 2, 3):  # three levels: three batches, one level at a time
        node = tree.add(node, token, 0.6 ** token, "draft", 0.6)
    guessing, plain = Staged(), Staged()
    guessing.counters = DraftCounters(calls=1, stage2_proposed=4, stage2_used=3)
    plain.counters = DraftCounters(calls=3)
    for drafter in (guessing, plain):
        plan = StepPlan.scored_by(_Tree(tree, {}), drafter, StepKind.DRAFT, Scorer.DRAFT)
        calibrations.observe(plan, [1])
    assert calibrations.stage2_width.value == pytest.approx(4 / 4, rel=0.05)
    # the guessing step saved two of its three batches, the other none
    assert calibrations.stage2_saved_per_call.value == pytest.approx(2 / 4, rel=0.05)


def test_guesses_are_credited_with_the_batches_they_saved_not_the_nodes_they_answered() -> None:
    """A guess the draft agreed with answers its node for free, but saves a batch only where
    the verified tree has a level no batch drafted: levels that other nodes' batch drafted
    anyway, and guessed nodes whose children the cut dropped, save nothing; the n-gram's own
    branches (``auto``'s merged trees) never needed the draft at all."""
    from speculative.drafting import DraftTree as _Tree
    from speculative.plan import StepPlan, saved_calls

    class Staged:
        lookahead = object()
        counters = DraftCounters()

    def plan(tree: TokenTree, calls: int, ngram: frozenset[int] = frozenset()) -> StepPlan:
        drafter = Staged()
        drafter.counters = DraftCounters(calls=calls, stage2_proposed=4, stage2_used=2)
        return StepPlan.scored_by(_Tree(tree, {}), drafter, StepKind.DRAFT, Scorer.DRAFT,
                                  skip=ngram)

    spine = TokenTree.rooted(7)
    a = spine.add(0, 1, 0.9, "draft", 0.9)
    b = spine.add(a, 2, 0.8, "ngram", 0.9)  # a guess the draft agreed with
    spine.add(b, 3, 0.7, "ngram", 0.9)      # ... and the next
    assert saved_calls(plan(spine, 1)) == 2  # three levels from the root's batch alone
    assert saved_calls(plan(spine, 3)) == 0  # a batch per level: nothing saved
    cut = TokenTree.rooted(7)
    cut.add(cut.add(0, 1, 0.9, "draft", 0.9), 2, 0.8, "ngram", 0.9)
    assert saved_calls(plan(cut, 1)) == 1  # the third level was cut: no batch would pay it
    wide = TokenTree.rooted(7)
    a = wide.add(0, 1, 0.9, "draft", 0.9)
    side = wide.add(0, 4, 0.05, "draft", 0.05)
    wide.add(a, 2, 0.8, "draft", 0.9)  # answered by a guess...
    wide.add(side, 5, 0.04, "draft", 0.8)  # ... but its level took a batch for this one
    assert saved_calls(plan(wide, 2)) == 0
    merged = TokenTree.rooted(7)
    merged.add(merged.add(0, 1, 0.9, "ngram", 0.9), 2, 0.8, "ngram", 0.9)
    assert saved_calls(plan(merged, 0, ngram=frozenset({1, 2}))) == 0


def test_merged_tree_holds_both_trees_scored_by_their_calibrations() -> None:
    engine = _auto(FLAT, CHEAP_DRAFT)
    engine.measure_cost()
    calibrations = engine.res.calibrations.by_scorer
    calibrations[Scorer.DRAFT] = Calibration(3, 4.0, prior=0.0)     # the draft: 0.75
    calibrations[Scorer.BRANCHES] = Calibration(1, 4.0, prior=0.0)  # n-gram branches: 0.25
    draft = TokenTree.rooted(7)
    a = draft.add(0, 1, 0.8, "draft")
    draft.add(a, 2, 0.6, "draft")
    draft.add(0, 3, 0.1, "draft")
    ngram = TokenTree.rooted(7)
    b = ngram.add(0, 1, 0.5, "ngram")   # the draft's path too: keeps the draft's estimate
    ngram.add(b, 4, 0.4, "ngram")       # a branch beside the draft's 2
    ngram.add(0, 5, 0.3, "ngram")       # a branch beside the draft's 1 and 3

    class Counted:
        counters = DraftCounters()

    auto = engine._policy(Mode.AUTO)
    plan = auto.merge(DraftTree(draft, {}), DraftTree(ngram, {}), Counted(),
                      NgramDrafter(engine.ngram), TreeBudget(24, 8, 3))
    merged = plan.tree.tree
    assert plan.kind is StepKind.DRAFT
    assert plan.scored[(1, 4)] == (Scorer.BRANCHES, 0.4)
    assert plan.scored[(1,)] == (Scorer.DRAFT, 0.8)
    estimates = {merged.path(v): merged.scores[v] for v in range(1, len(merged))}
    assert estimates == pytest.approx({(1,): 0.6, (1, 2): 0.45, (3,): 0.075,
                                       (1, 4): 0.1, (5,): 0.075})
    assert {merged.origins[v] for v in range(1, len(merged))
            if merged.path(v) in ((1, 4), (5,))} == {"ngram"}
    capped = auto.merge(DraftTree(draft, {}), DraftTree(ngram, {}), Counted(),
                        NgramDrafter(engine.ngram), TreeBudget(2, 8, 3)).tree.tree
    assert len(capped) - 1 == 2  # never more nodes than the target's batch was sized for


def test_merged_tree_keeps_each_nodes_own_probability_for_the_acceptance_maps() -> None:
    """The merged tree's scores are estimates times factors; what the acceptance maps learn
    from is each drafter's own probability of the node, which the merge must carry over."""
    engine = _auto(FLAT, CHEAP_DRAFT)
    engine.measure_cost()
    draft = TokenTree.rooted(7)
    a = draft.add(0, 1, 0.8, "draft", 0.35)
    draft.add(a, 2, 0.6, "draft", 0.3)
    ngram = TokenTree.rooted(7)
    b = ngram.add(0, 1, 0.5, "ngram", 0.5)
    ngram.add(b, 4, 0.4, "ngram", 0.2)

    class Counted:
        counters = DraftCounters()

    merged = engine._policy(Mode.AUTO).merge(
        DraftTree(draft, {}), DraftTree(ngram, {}), Counted(), NgramDrafter(engine.ngram),
        TreeBudget(24, 8, 3)).tree.tree
    probs = {merged.path(v): merged.probs[v] for v in range(1, len(merged))}
    assert probs == {(1,): 0.35, (1, 2): 0.3, (1, 4): 0.2}


def test_auto_greedy_verifies_ngram_branches_beside_the_draft_and_stays_exact() -> None:
    """A flat cost curve (a GPU), a noisy draft and an n-gram model that knows the target's
    text: the merged trees' n-gram branches are verified, some accepted, every reply exact.
    (The fakes' step rates are not measured: their Python overhead would make every kind of
    drafting lose to the target alone, see Planner.measured_loss.)"""
    class Unmeasured(Planner):
        def observe_step(self, kind: StepKind, tokens: int, seconds: float,
                         switch: float = 0.0, alternatives=()) -> None:
            pass

    corpus = [_plain(prompt, 40) for prompt in PROMPTS[10:12]]  # knows some of the text
    engine = _engine(Mode.AUTO, TreeBudget(24, 8, 3), corpus=corpus)
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), FLAT)
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), CHEAP_DRAFT)
    engine.measure_cost()
    engine.planner = Unmeasured(engine.res.sizer)
    for prompt in PROMPTS[:10]:
        assert _generate(engine, prompt, 24) == _plain(prompt, 24)
    branches = engine.res.calibrations.by_scorer[Scorer.BRANCHES]
    assert branches.predicted > 0 and branches.accepted > 0


def test_auto_without_a_draft_model_uses_the_ngram_model() -> None:
    ngram = KatzTrigram.build([list(np.random.default_rng(9).integers(0, V, 200))], V)
    engine = Engine(FakeContext(TARGET), None, ngram, SpecConfig(mode=Mode.AUTO))
    for prompt in PROMPTS[:5]:
        assert _generate(engine, prompt, 16) == _plain(prompt, 16)




def test_a_new_engine_carries_on_from_what_another_learned() -> None:
    """The bench makes an engine per reply and hands on ``Learned``, as the app keeps its
    engine: the planner (rates, budget, what running the draft gains over the n-gram's tree)
    and the calibrations continue, and output stays exact."""
    first = _auto(STEEP, CHEAP_DRAFT)
    for prompt in PROMPTS[:3]:
        _generate(first, prompt, 24)
    learned = first.learned()
    assert learned.planner is not None and learned.planner.elapsed > 0
    assert sum(m.drafted.steps for m in learned.planner.margins) > 0  # the draft's steps
    assert sum(m.ngram.steps for m in learned.planner.margins) > 0  # ... the n-gram's beside
    second = _auto(STEEP, CHEAP_DRAFT)
    second.adopt(learned)
    assert second.planner is learned.planner
    assert second.res.calibrations is learned.calibrations
    elapsed = learned.planner.elapsed
    assert _generate(second, PROMPTS[3], 24) == _plain(PROMPTS[3], 24)
    assert second.planner.elapsed > elapsed  # the same planner went on measuring
    policy = second._policy(Mode.AUTO)
    assert isinstance(policy, AutoPolicy) and policy.planner.margins is learned.planner.margins


def _planner() -> Planner:
    curve = VerifyCost((1, 2, 4, 8, 16), (1.0, 1.1, 1.2, 1.4, 2.0))
    return Planner(Sizer(curve, VerifyCost((1, 2, 4), (0.5, 0.6, 0.8))))


KINDS = [StepKind.DRAFT, StepKind.GUESSES, StepKind.ROOT]


def _take(planner: Planner, seconds: dict[StepKind, float], n: int) -> list[StepKind]:
    """``n`` steps as auto takes them, each kind's step giving one token in its seconds."""
    taken = []
    for _ in range(n):
        kind = planner.choose(KINDS)
        planner.observe_step(kind, 1, seconds[kind])
        taken.append(kind)
    return taken


def _runs(taken: list[StepKind], kind: StepKind) -> list[tuple[int, int]]:
    """(first step, length) of each run of ``kind``'s steps in a row in ``taken``."""
    runs, i = [], 0
    for k, group in itertools.groupby(taken):
        n = len(list(group))
        if k is kind:
            runs.append((i, n))
        i += n
    return runs


def test_each_kind_is_measured_then_the_fastest_runs() -> None:
    """A fresh planner tries each kind in turn (the draft first) until measured, then keeps to
    the fastest; the others are explored again after EXPLORE_EVERY steps, for TRIAL_STEPS steps in
    a row, and a kind that keeps losing waits twice as long each time."""
    planner = _planner()
    planner.regret = -1e9  # budget to spare: only the waits decide
    seconds = {StepKind.DRAFT: 2.0, StepKind.GUESSES: 0.5, StepKind.ROOT: 1.0}
    taken = _take(planner, seconds, 12 * EXPLORE_EVERY)
    first = taken[:12]  # (decayed, 4 steps make MIN_STEPS)
    assert first == [StepKind.DRAFT] * 4 + [StepKind.GUESSES] * 4 + [StepKind.ROOT] * 4
    rest = taken[12:]
    assert rest.count(StepKind.GUESSES) > 0.9 * len(rest)
    # each exploration a trial of TRIAL_STEPS steps in a row (one more where the kind's old
    # measurement has aged away over the wait: a kind not measured is measured first)
    runs = _runs(rest, StepKind.DRAFT)
    assert len(runs) >= 3
    assert all(TRIAL_STEPS <= n <= TRIAL_STEPS + 1 for _, n in runs)
    # steps from the end of one trial to the start of the next: doubled while losing
    waits = [b - (a + n) + 1 for (a, n), (b, _) in itertools.pairwise(runs)]
    assert waits[0] == 2 * EXPLORE_EVERY and waits[1] == 2 * waits[0]


def test_the_wait_keeps_doubling_once_a_kind_sits_out_long_enough_to_age_away() -> None:
    """Over a long wait a losing kind's measurement ages away, and TRIAL_STEPS steps do not
    measure it again: its exploration runs a step longer, until they do, and then doubles the
    wait as before, up to MAX_BACKOFF times EXPLORE_EVERY (ended unmeasured, it left the wait
    at 4 times EXPLORE_EVERY, and a kind that kept losing was explored every hundred steps)."""
    planner = _planner()
    planner.regret = -1e9  # budget to spare: only the waits decide
    seconds = {StepKind.DRAFT: 2.0, StepKind.GUESSES: 0.5, StepKind.ROOT: 1.0}
    runs = _runs(_take(planner, seconds, 60 * EXPLORE_EVERY)[12:], StepKind.DRAFT)
    waits = [b - (a + n) + 1 for (a, n), (b, _) in itertools.pairwise(runs)]
    doubling = [EXPLORE_EVERY * 2 ** k for k in range(1, MAX_BACKOFF.bit_length())]
    assert waits[:len(doubling)] == doubling
    assert all(w == EXPLORE_EVERY * MAX_BACKOFF for w in waits[len(doubling):])
    assert len(waits) > len(doubling)  # the cap held over later explorations too
    assert all(TRIAL_STEPS <= n <= TRIAL_STEPS + 1 for _, n in runs)
    assert planner.every[StepKind.DRAFT] == EXPLORE_EVERY * MAX_BACKOFF


def test_a_kind_about_as_fast_as_the_fastest_is_explored_at_the_usual_wait() -> None:
    """Only an exploration that surely lost (by more than SWITCH_MARGIN) lengthens the wait:
    one that came out about even, however it read, is tried again after EXPLORE_EVERY steps
    (about as fast, it costs about nothing, and more of its steps are what can tell)."""
    planner = _planner()
    planner.regret = -1e9  # budget to spare: only the waits decide
    seconds = {StepKind.DRAFT: 1.0, StepKind.GUESSES: 1.02, StepKind.ROOT: 3.0}
    taken = _take(planner, seconds, 12 * EXPLORE_EVERY)[12:]
    assert planner.fastest(KINDS) is StepKind.DRAFT
    assert planner.every[StepKind.GUESSES] == EXPLORE_EVERY
    trials = [kind for kind, _ in itertools.groupby(taken)].count(StepKind.GUESSES)
    assert trials >= len(taken) // (EXPLORE_EVERY + TRIAL_STEPS) - 1


def test_auto_explores_only_while_its_losses_fit_the_budget() -> None:
    """A kind other than the fastest may run only while the time lost so far (regret) is under
    what the time spent earned (plus a fresh start's allowance): each second EXPLORE_FLOOR of
    itself while the target alone is the fastest; time spent without losing refills the
    budget, and what was earned stays earned."""
    planner = _planner()
    start = START_STEPS  # plain steps' time a fresh planner may lose (a step is 1 s here)
    assert planner.within_budget()
    for _ in range(10):
        planner.observe_step(StepKind.ROOT, 1, 1.0)  # the target alone: 1 token per second
    planner.observe_step(StepKind.DRAFT, 1, 1.0 + 1.2 * start)  # a try that lost more
    assert planner.regret == pytest.approx(1.2 * start)
    assert not planner.within_budget()
    planner.idle[StepKind.DRAFT] = planner.idle[StepKind.GUESSES] = 10 * EXPLORE_EVERY
    assert planner.choose(KINDS) is StepKind.ROOT  # due, but not affordable
    waited = 0
    while not planner.within_budget():
        planner.observe_step(StepKind.ROOT, 1, 1.0)
        waited += 1
    # until the steps since earn the loss beyond the start allowance and what the steps before
    # earned: EXPLORE_SHARE of each second while nothing was measured (the target alone's first
    # 4 steps), EXPLORE_FLOOR since (the target alone the fastest)
    assert planner.explore_share() == EXPLORE_FLOOR
    before = 4 * EXPLORE_SHARE + (6 + 1 + 1.2 * start) * EXPLORE_FLOOR
    assert waited == math.ceil((0.2 * start - before) / EXPLORE_FLOOR)
    assert planner.choose(KINDS) is not StepKind.ROOT  # affordable again: explore
    # unless switching to it costs more than is left (the draft catching up on a long text)
    pair = [StepKind.DRAFT, StepKind.ROOT]
    assert planner.choose(pair) is StepKind.DRAFT
    assert planner.choose(pair, {StepKind.DRAFT: 10.0}) is StepKind.ROOT
    for _ in range(5):  # n-gram trees at 3 tokens per second: the fastest
        planner.observe_step(StepKind.GUESSES, 3, 1.0)
    assert planner.fastest(KINDS) is StepKind.GUESSES
    # the regret is counted against the fastest kind: the fastest running at its own rate
    # neither spends nor earns budget, and a step at the target alone's rate loses what the
    # fastest would have saved (its lead over plain is not budget to lose)
    before = planner.regret
    planner.observe_step(StepKind.GUESSES, 3, 1.0)
    assert planner.regret == pytest.approx(before)
    planner.observe_step(StepKind.DRAFT, 3, 3.0)
    assert planner.regret == pytest.approx(before + 2.0)


def test_the_exploring_share_follows_what_the_fastest_kind_gains() -> None:
    """Where nothing beats the target alone, exploring may cost EXPLORE_FLOOR of the time (on a
    steep curve every exploration is a loss unless the text changes); the share grows with the
    fastest kind's lead over the target alone, to EXPLORE_SHARE at a lead of FULL_SHARE_LEAD."""
    planner = _planner()
    assert planner.explore_share() == EXPLORE_SHARE  # nothing measured: find out first
    for _ in range(10):
        planner.observe_step(StepKind.ROOT, 1, 1.0)
    for _ in range(4):
        planner.observe_step(StepKind.GUESSES, 1, 1.25)  # slower than the target alone
    assert planner.fastest(KINDS) is StepKind.ROOT
    assert planner.explore_share() == EXPLORE_FLOOR
    # the n-gram's trees, paired with the target alone on the same steps, half the lead
    for _ in range(40):
        planner.observe_step(StepKind.GUESSES, 1, 1.0 / (1 + FULL_SHARE_LEAD / 2),
                             alternatives=[(StepKind.ROOT, 1, 1.0)])
    assert planner.fastest(KINDS) is StepKind.GUESSES
    assert planner.explore_share() == pytest.approx((EXPLORE_FLOOR + EXPLORE_SHARE) / 2)
    for _ in range(40):
        planner.observe_step(StepKind.GUESSES, 3, 1.0, alternatives=[(StepKind.ROOT, 1, 1.0)])
    assert planner.explore_share() == EXPLORE_SHARE
    # the budget follows: a second spent with the lead earns EXPLORE_SHARE of itself
    earned = planner.earned
    planner.observe_step(StepKind.GUESSES, 3, 1.0, alternatives=[(StepKind.ROOT, 1, 1.0)])
    assert planner.earned - earned == pytest.approx(EXPLORE_SHARE)
    earned = planner.earned
    for _ in range(300):  # the lead gone: the n-gram's trees no faster than the target alone
        planner.observe_step(StepKind.GUESSES, 1, 1.0, alternatives=[(StepKind.ROOT, 1, 1.0)])
    assert planner.explore_share() == pytest.approx(EXPLORE_FLOOR, abs=1e-4)
    assert planner.earned > earned + 300 * EXPLORE_FLOOR  # what was earned stays earned
    earned = planner.earned
    planner.observe_step(StepKind.GUESSES, 1, 1.0, alternatives=[(StepKind.ROOT, 1, 1.0)])
    assert planner.earned - earned == pytest.approx(EXPLORE_FLOOR, abs=1e-4)


def test_a_kind_that_must_catch_up_takes_over_only_where_the_switch_pays() -> None:
    """The draft, 5% faster than the n-gram's trees that have been running, but 2 s behind
    the text: catching up costs more than 5% gains over the steps until the next exploration,
    so the n-gram's trees stay the fastest (and running them is no regret); a short catching
    up, none, or a much faster draft, and the draft takes over. A draft faster by less than
    SWITCH_MARGIN does not take over even with nothing to catch up (the measured speeds'
    noise would make the two alternate)."""
    def planted(draft_seconds: float) -> Planner:
        planner = _planner()
        for kind, seconds in ((StepKind.ROOT, 1.0), (StepKind.DRAFT, draft_seconds),
                              (StepKind.GUESSES, 0.5)):
            for _ in range(4):
                planner.observe_step(kind, 1, seconds)
        planner.held = StepKind.GUESSES  # (what ran last)
        planner.regret = 1e9  # no budget: no exploration, only the fastest runs
        return planner

    def choose(planner: Planner, catch_up: float) -> StepKind | None:
        planner.observe_catch_up({StepKind.DRAFT: catch_up})
        return planner.fastest(KINDS)  # (whether to explore it is ``worth_exploring``'s)

    assert 0.5 / 0.49 < 1 + SWITCH_MARGIN < 0.5 / 0.475
    assert choose(planted(0.49), 0.0) is StepKind.GUESSES
    planner = planted(0.475)
    assert choose(planner, 2.0) is StepKind.GUESSES
    before = planner.regret
    planner.observe_step(StepKind.GUESSES, 1, 0.5)
    assert planner.regret == before and planner.held is StepKind.GUESSES
    assert choose(planner, 0.1) is StepKind.DRAFT
    assert choose(planner, 0.0) is StepKind.DRAFT
    for _ in range(8):
        planner.observe_step(StepKind.DRAFT, 2, 0.475)  # now twice as fast
    planner.held = StepKind.GUESSES
    assert choose(planner, 2.0) is StepKind.DRAFT


def _stale_draft(draft: tuple[float, float], catch_up: float, steps: int = 3000
                 ) -> tuple[list[int], Planner]:
    """A planner whose draft's kind was measured over four scattered steps at 0.75 times the
    target alone (a fresh start on text the draft did not know yet), the target alone
    running since, no budget left; then ``steps`` steps as ``choose`` takes them, a draft
    step emitting ``draft`` (tokens, seconds) beside a target alone at 1 token a second, and
    catching up ``catch_up`` seconds for each step the draft sat out. Returns the steps
    at which the draft ran, and the planner."""
    planner = _planner()
    _beside_root(planner, StepKind.DRAFT, [(1, 1.6), (2, 2.4), (1, 1.2), (1, 1.5)])
    planner.held = StepKind.ROOT
    ran = []
    for i in range(steps):
        planner.regret = 1e9  # no budget left
        behind = catch_up * planner.idle[StepKind.DRAFT]
        planner.observe_catch_up({StepKind.DRAFT: behind})
        kind = planner.choose([StepKind.DRAFT, StepKind.ROOT], {StepKind.DRAFT: behind})
        if kind is StepKind.DRAFT:
            ran.append(i)
            tokens, seconds = draft
            planner.observe_step(kind, tokens, seconds + behind, behind,
                                 alternatives=[(StepKind.ROOT, 1, 1.0)])
        else:
            planner.observe_step(kind, 1, 1.0)
    return ran, planner


@pytest.mark.parametrize("catch_up", [0.01, 0.05])
def test_a_kind_starved_by_the_budget_is_explored_again_once_its_measurement_has_aged(
        catch_up: float) -> None:
    """The budget alone never again pays for the draft's kind here: what its catching up
    costs grows with every step it sits out, faster than the budget is earned. Its poor
    measurement ages with the text (its doubt grows), and once it may well lead, exploring
    it is worth its catching up: measured 1.2 times the target alone, it takes over; as
    slow as it was measured, it is explored once, for a step, and costs a fraction of a
    percent of the time."""
    ran, planner = _stale_draft((6, 5.0), catch_up)
    assert 0 < ran[0] < 4 * EXPLORE_EVERY
    assert planner.held is StepKind.DRAFT and len(ran) > 2900
    ran, planner = _stale_draft((7, 10.0), catch_up)
    lost = sum(3.0 + catch_up * i for i in ran)  # 7 tokens in 10 s where 7 took 7 s
    assert 0 < len(ran) <= 3 and planner.held is StepKind.ROOT
    assert lost < 0.005 * 3000
    planner = _stale_draft((7, 10.0), catch_up, steps=0)[1]
    planner.regret = 1e9  # nor is it explored while its measurement is fresh
    assert planner.choose([StepKind.DRAFT, StepKind.ROOT]) is StepKind.ROOT


def test_a_kind_measured_slower_over_many_steps_is_not_explored_beyond_the_budget() -> None:
    """The draft's kind measured at 0.7 times the target alone over many steady steps, and
    catching up costing a twentieth of a target pass for each step it sat out: its doubt
    stays small as it ages, and nothing is worth exploring beyond the budget."""
    planner = _planner()
    _beside_root(planner, StepKind.DRAFT, [(7, 10.0), (5, 7.0)] * 40)
    planner.held = StepKind.ROOT
    for _ in range(2000):
        planner.regret = 1e9
        behind = 0.05 * planner.idle[StepKind.DRAFT]
        assert planner.choose([StepKind.DRAFT, StepKind.ROOT],
                              {StepKind.DRAFT: behind}) is StepKind.ROOT
        planner.observe_step(StepKind.ROOT, 1, 1.0)


def test_the_draft_reads_the_prompt_with_the_target_when_its_steps_come_next() -> None:
    """Like the draft's own modes, auto decodes a new prompt into the draft before the first
    step when the draft's kind will run first (not measured yet, or the fastest); while
    another kind is the fastest, the draft is left behind (it catches up if it runs)."""
    engine = _auto(FLAT, CHEAP_DRAFT)
    engine.measure_cost()
    rng = np.random.default_rng(4)
    first, second = (list(rng.integers(0, V, 20)) for _ in range(2))
    list(engine.generate(first, 0))  # the prompt alone (no step)
    assert engine.draft.behind(first) == 0  # the draft's kind is measured first
    planner = engine.planner
    planner.rates[StepKind.DRAFT].steps = 5.0  # measured, and the n-gram's trees fastest
    planner.held = StepKind.GUESSES
    list(engine.generate(second, 0))
    assert engine.draft.behind(second) > 0
    planner.held = StepKind.DRAFT
    list(engine.generate(second, 0))
    assert engine.draft.behind(second) == 0


def test_the_draft_catching_up_is_not_counted_against_drafting() -> None:
    """...in its rate measured apart nor on the same steps (a kind explored one step at a time
    would pay it at every step and never look as fast as it runs; switching is priced where
    it is decided); the budget counts the whole step."""
    planner = _planner()
    planner.observe_step(StepKind.DRAFT, 4, 1.0, switch=0.5,
                         alternatives=[(StepKind.ROOT, 1, 0.25)])
    assert planner.rates[StepKind.DRAFT].value == pytest.approx(8.0)  # 4 tokens in 0.5 s
    assert planner.elapsed == 1.0  # the whole step counts for the budget
    assert planner.pairs[(StepKind.DRAFT, StepKind.ROOT)].seconds == pytest.approx(0.5)


def test_the_drafts_catching_up_is_what_its_first_decodes_took_beyond_a_caught_up_batch(
        ) -> None:
    """The draft skipped 40 tokens; its first decodes of the step (the 40, the root and a
    guess, in one batch) took 60 ms, where the root and the guess alone cost 20 ms on its
    curve: catching up took 40 ms. Read off the curve for 40 tokens (far beyond the sizes it
    was timed at, its slope extended) it would be 180 ms, more than the step's whole
    drafting, and the kind's own time would come out negative. Later catching up is priced
    at the measured 1 ms a token, not by the curve."""
    draft = VerifyCost((1, 2, 4, 8), (0.01, 0.02, 0.036, 0.052))
    counters = DraftCounters(calls=2, t_draft=0.08, caught_up=40, t_begin=0.06,
                             begin_tokens=2)
    assert draft.curve(40) > counters.t_draft
    assert catching_up(counters, draft) == pytest.approx(0.04)
    assert catching_up(dataclasses.replace(counters, t_begin=0.015), draft) == 0.0
    planner = Planner(Sizer(VerifyCost((1, 2, 4), (1.0, 1.1, 1.2)), draft))
    assert planner.catching_up(24) == pytest.approx(draft.curve(24))  # nothing measured yet
    planner.observe_caught_up(40, catching_up(counters, draft))
    assert planner.catching_up(24) == pytest.approx(0.024)
    assert planner.returning(StepKind.DRAFT) == pytest.approx(0.001 * HOLD_STEPS)
    assert planner.returning(StepKind.GUESSES) == planner.returning(StepKind.ROOT) == 0.0


def test_rates_measured_under_the_other_sampling_start_over() -> None:
    """Each sampling has its own measurements: a sampled reply starts without the greedy
    ones, and the next greedy reply takes them up again."""
    planner = _planner()
    planner.new_text(greedy=True)
    for _ in range(4):
        planner.observe_step(StepKind.DRAFT, 3, 1.0)
    planner.new_text(greedy=True)
    assert planner.rates[StepKind.DRAFT].measured
    greedy = planner.speed(StepKind.DRAFT)
    planner.new_text(greedy=False)
    assert not planner.rates[StepKind.DRAFT].measured
    for _ in range(4):
        planner.observe_step(StepKind.DRAFT, 1, 1.0)
    planner.new_text(greedy=True)
    assert planner.rates[StepKind.DRAFT].measured
    assert planner.speed(StepKind.DRAFT) == pytest.approx(greedy)
    planner.new_text(greedy=False)
    assert planner.rates[StepKind.DRAFT].value == pytest.approx(1.0)


def _measured(seconds: dict[StepKind, float], greedy: bool = True) -> Planner:
    """A planner that has measured every kind, each step giving one token in its seconds."""
    planner = _planner()
    planner.new_text(greedy)
    planner.regret = -1e9  # budget to spare
    _take(planner, seconds, 4 * EXPLORE_EVERY)
    return planner


def test_a_new_run_starts_from_what_the_last_one_measured() -> None:
    """``memory`` survives JSON; a fresh planner that recalls it runs the kind the last run
    found fastest from its first step, without measuring the others again first, and the
    recalled measurements weigh only ``RECALL_STEPS`` steps: when this run's text makes
    another kind faster, its own steps soon decide."""
    import json

    seconds = {StepKind.DRAFT: 2.0, StepKind.GUESSES: 0.5, StepKind.ROOT: 1.0}
    old = _measured(seconds)
    assert old.held is StepKind.GUESSES
    memory = json.loads(json.dumps(old.memory()))

    fresh = _planner()
    fresh.new_text(greedy=True)
    assert _take(fresh, seconds, 3)[0] is StepKind.DRAFT  # without memory: measures first

    new = _planner()
    new.recall(memory)
    new.new_text(greedy=True)
    assert new.held is StepKind.GUESSES and not new.runs_first(StepKind.DRAFT)
    assert new.speed(StepKind.GUESSES) == pytest.approx(old.speed(StepKind.GUESSES))
    assert all(r.steps <= RECALL_STEPS for r in new.rates.values())
    assert _take(new, seconds, EXPLORE_EVERY - 1) == [StepKind.GUESSES] * (EXPLORE_EVERY - 1)
    # the text changes: the n-gram now loses to the target alone, and the run's own steps
    # take over within a few
    worse = {**seconds, StepKind.GUESSES: 3.0}
    taken = _take(new, worse, 12)
    assert taken[-4:] == [StepKind.ROOT] * 4


def test_a_memory_is_taken_up_by_its_own_sampling_only() -> None:
    """A memory holds each sampling's measurements apart: recalled before a sampled reply, it
    gives the sampled ones; a planner that has measured in this run keeps its own."""
    greedy = _measured({StepKind.DRAFT: 0.5, StepKind.GUESSES: 2.0, StepKind.ROOT: 1.0})
    greedy.new_text(False)
    for _ in range(4):
        greedy.observe_step(StepKind.ROOT, 1, 1.0)
    memory = greedy.memory()
    assert set(memory["sampling"]) == {"greedy", "sampled"}

    sampled = _planner()
    sampled.recall(memory)
    sampled.new_text(greedy=False)
    assert sampled.rates[StepKind.ROOT].measured
    assert not sampled.rates[StepKind.DRAFT].measured
    sampled.new_text(greedy=True)
    assert sampled.held is StepKind.DRAFT

    busy = _planner()
    busy.new_text(greedy=True)
    busy.observe_step(StepKind.ROOT, 1, 1.0)
    busy.recall(memory)
    assert busy.held is None and not busy.rates[StepKind.DRAFT].measured


@pytest.mark.parametrize("memory", [
    {}, {"sampling": {}}, {"sampling": [], "ngram_hits": [1, 2]},
    {"sampling": {}, "ngram_hits": [1.0, float("nan")]}, {"sampling": {}, "ngram_hits": [1]},
    {"sampling": {}, "ngram_hits": [-1.0, 2.0]}, {"sampling": {}, "ngram_hits": "no"},
    {"sampling": {}, "ngram_hits": [1, 2], "margins": [[[0, 0, 1, 0], [0, 0, 1, 0]]]},
    {"sampling": {}, "ngram_hits": [1, 2], "margins": [[[0, 0, -1, 0], [0, 0, 1, 0]]] * 3},
    {"sampling": {}, "ngram_hits": [1, 2], "margins": [[[0, 0, 1, 0]]] * 3},
    {"sampling": {}, "ngram_hits": [1, 2], "alone": [float("inf"), 1]},
])
def test_a_memory_that_cannot_be_read_changes_nothing(memory) -> None:
    planner = _planner()
    before = planner.memory()
    with pytest.raises(ValueError):
        planner.recall(memory)
    assert planner.memory() == before


def test_a_new_run_keeps_how_far_each_greedy_choice_measured_from_its_estimate() -> None:
    """Greedy with a draft model, each step of the draft's kind prices its choices from the
    n-gram tree's estimate corrected by how far such steps measured (``Margin``), and the
    target alone by what its steps take (``Planner.alone``). Both survive a restart through
    ``memory`` (JSON), weighing ``RECALL_STEPS`` steps at most with their means kept, so a
    new run prices its first steps as the last run measured instead of running the draft
    until each bin is measured again; a memory from before they were kept leaves them to
    be measured afresh."""
    import json

    old = _planner()
    for k, margin in enumerate(old.margins):
        for i in range(12):
            margin.drafted.add(0.5 + k + (-1) ** i, 0.01 * k)
            margin.ngram.add(-0.25 * k + 0.5 * (-1) ** i, 0.002)
    for _ in range(8):
        old.alone.add(0.06)
    memory = json.loads(json.dumps(old.memory()))

    new = _planner()
    new.recall(memory)
    for was, now in zip(old.margins, new.margins, strict=True):
        for a, b in ((was.drafted, now.drafted), (was.ngram, now.ngram)):
            assert b.measured and b.steps == pytest.approx(RECALL_STEPS) and a.steps > b.steps
            assert b.mean() == pytest.approx(a.mean())
            assert b.doubt() > a.doubt() > 0.0  # as sure as RECALL_STEPS steps
    assert new.alone.value == pytest.approx(0.06)
    assert new.alone.weight == pytest.approx(RECALL_STEPS)

    older = _planner()
    older.recall({k: v for k, v in memory.items() if k not in ("margins", "alone")})
    assert not any(m.drafted.measured or m.ngram.measured for m in older.margins)
    assert older.alone.weight == 0.0


def test_broken_measurements_in_a_memory_are_measured_again() -> None:
    """A sampling's entry that cannot be read (a file edited by hand, another version's) is
    let be when its reply begins: the kinds are measured as on a fresh start."""
    memory = {"sampling": {"greedy": {"rates": {"draft": [1, 2]}, "pairs": [], "every": {},
                                      "held": "nothing"}},
              "ngram_hits": [0.3, 1.0]}
    planner = _planner()
    planner.recall(memory)
    planner.new_text(greedy=True)
    assert planner.held is None and not planner.rates[StepKind.DRAFT].measured


def test_the_planners_questions_change_nothing() -> None:
    """Asking which kind to take, which is fastest or whether the budget holds leaves the
    planner as it was; only what happened moves it."""
    import copy

    planner = _planner()
    for _ in range(5):
        planner.observe_step(StepKind.ROOT, 1, 0.01)
        planner.observe_step(StepKind.GUESSES, 1, 0.05)
    before = copy.deepcopy(planner)
    for _ in range(3):
        planner.choose(KINDS), planner.fastest(KINDS), planner.within_budget()
        planner.plain_seconds(), planner.ngram_scores(0.5, 3)
    assert planner == before


def test_the_target_alone_is_measured_even_when_the_budget_is_spent() -> None:
    """Where drafting loses to the target alone (a tiny target whose pass costs less than the
    loop's own bookkeeping), the first kind tried is the only one measured and it spends the
    budget; the target alone, the baseline, is still measured, and then runs."""
    planner = _planner()
    seconds = {StepKind.DRAFT: 5.0, StepKind.GUESSES: 4.0, StepKind.ROOT: 1.0}
    taken = _take(planner, seconds, 40)
    assert taken[:4] == [StepKind.DRAFT] * 4 and not planner.within_budget()
    assert StepKind.ROOT in taken[4:12]
    assert taken[-20:] == [StepKind.ROOT] * 20


def test_the_target_alone_is_timed_in_a_drafted_steps_place_by_the_engines_single_pass(
        ) -> None:
    """A drafted step's counterfactuals: the target alone costs the step's time outside
    planning and the pass, plus the engine's estimate of a single-token pass at this moment
    (a pass's fixed costs do not shrink with the curve, so scaling the drafted pass down by
    the curve would read fast); another tree costs that plus its planning, its pass scaled
    from this one by the curve. Without the engine's estimate the root's pass is scaled too.
    Once the target alone's steps have been timed, its counterfactual is the engine's."""
    from types import SimpleNamespace

    from speculative.plan import Alternative, StepPlan
    from speculative.policies import Outcome

    planner = _planner()
    planner.greedy = True
    policy = AutoPolicy(SimpleNamespace(planner=planner))
    drafted = TokenTree.rooted(7)
    a = drafted.add(0, 1, 0.9, "draft")
    drafted.add(a, 2, 0.8, "draft")
    drafted.add(0, 3, 0.1, "draft")  # 4 nodes: a batch of 4, the root included
    guesses = TokenTree.rooted(7)
    guesses.add(0, 1, 0.5, "ngram")  # 2 nodes: a batch of 2
    plan = StepPlan(DraftTree(drafted, {}), None, StepKind.DRAFT, alternatives=(
        Alternative(StepKind.GUESSES, guesses, 0.01), Alternative(StepKind.ROOT,
                                                                 TokenTree.rooted(7))))
    outcome = Outcome([a], (1,), 2, seconds=0.30, t_plan=0.08, t_verify=0.20, batch=4,
                      next_token=5, t_single=0.18)
    rest, curve = 0.02, planner.sizer.target.curve
    (gu, gu_tree, gu_s, gu_tokens), (root, root_tree, root_s, root_tokens) = (
        policy.counterfactuals(plan, outcome))
    assert (gu, gu_tree, root, len(root_tree)) == (StepKind.GUESSES, guesses, StepKind.ROOT, 1)
    assert (gu_tokens, root_tokens) == (None, 1.0)  # the text decides the tree, later
    assert gu_s == pytest.approx(rest + 0.01 + 0.20 * curve(2) / curve(4))
    assert root_s == pytest.approx(rest + 0.18)
    assert root_s > rest + 0.20 * curve(1) / curve(4)  # what the curve alone says
    unknown = dataclasses.replace(outcome, t_single=0.0)
    assert policy.counterfactuals(plan, unknown)[1][2] == pytest.approx(
        rest + 0.20 * curve(1) / curve(4))
    # once steps with the target alone have been timed, its step at this moment is the
    # engine's: its pass and the loop's time around such a pass, measured on those steps
    # (less than around this tree's pass), not this step's time outside its pass
    alone = dataclasses.replace(outcome, t_alone=0.185)
    assert policy.counterfactuals(plan, alone)[1][2] == pytest.approx(0.185)
    assert policy.counterfactuals(plan, alone)[0][2] == pytest.approx(gu_s)


def test_the_target_alones_counterfactual_is_the_meters_plain_token() -> None:
    """The engine tells ``auto`` what a step with the target alone costs at this moment: on
    such a step, the step itself outside drafting; on a drafted one, before any such step,
    nothing (0), and after, the drafted pass's single-token estimate plus the loop's time
    around the target alone's passes (the plain token the meter counts). A step of the
    target alone whose pass also decoded a token still pending is priced like a drafted
    one: its pass was not one token's."""
    from speculative.policies import Outcome

    engine = _auto(FLAT, CHEAP_DRAFT)
    seen: list[tuple[StepKind, Outcome]] = []
    observe = engine._policy(Mode.AUTO).observe

    def spy(plan, outcome) -> None:
        seen.append((plan.kind, outcome))
        observe(plan, outcome)

    engine._policy(Mode.AUTO).observe = spy
    run = RunStats()
    for prompt in PROMPTS[:4]:
        assert _generate(engine, prompt, 16, run=run) == _plain(prompt, 16)
    # the first pass over the root alone (a step of the target alone, or of the draft's kind
    # that left the draft out and verified nothing): the loop around such a pass is timed
    first_alone = [o.batch for _, o in seen].index(1)
    assert all(o.t_alone == 0.0 for k, o in seen[:first_alone] if o.batch > 1)
    assert all(o.t_alone > 0.0 for _, o in seen[first_alone:])
    assert any(k is StepKind.ROOT and o.batch == 1 for k, o in seen)
    for _, o in seen[first_alone:]:
        if o.batch == 1:  # the target alone over the root: its own step
            assert o.t_alone <= o.seconds
        else:  # the loop's time around a pass with the target alone is added to its pass
            assert o.t_alone > o.t_single > 0


@pytest.mark.parametrize("greedy", [False, True])
def test_a_sampled_step_counts_what_its_tree_yields_on_average(greedy: bool) -> None:
    """Sampled, a drafted step is measured by the tokens its tree yields on average over the
    acceptance rule's draws (``Outcome.expected``), not by the ones it drew; greedy, the rule
    draws nothing and the two are the same."""
    from types import SimpleNamespace

    from speculative.plan import StepPlan
    from speculative.policies import Outcome

    planner = _planner()
    planner.greedy = greedy
    policy = AutoPolicy(SimpleNamespace(planner=planner))
    drafted = TokenTree.rooted(7)
    drafted.add(drafted.add(0, 1, 0.9, "draft"), 2, 0.8, "draft")
    plan = StepPlan(DraftTree(drafted, {}), None, StepKind.DRAFT)
    for _ in range(6):  # drew 1 token each time, where 2.5 come on average
        policy.observe(plan, Outcome([], (), 1, seconds=1.0, next_token=5, expected=2.5))
    rate = planner.rates[StepKind.DRAFT].value
    assert rate == pytest.approx(1.0 if greedy else 2.5)
    unknown = _planner()
    unknown.greedy = greedy
    policy = AutoPolicy(SimpleNamespace(planner=unknown))
    policy.observe(plan, Outcome([], (), 1, seconds=1.0, next_token=5))  # no expectation
    assert unknown.rates[StepKind.DRAFT].value == pytest.approx(1.0)


@pytest.mark.parametrize("steady", [False, True])
def test_a_kind_takes_over_only_when_its_lead_is_beyond_the_steps_noise(steady: bool) -> None:
    """The n-gram's kind has been running; then the draft's runs four steps with the n-gram's
    tree as its alternative, 1.4 times as fast pooled. Where each step says about the same
    (steady) the draft takes over; where one step emits 6 tokens and the next 1 (the n-gram's
    alternative 3 and 2), four steps cannot tell a 1.4 lead from chance: the n-gram's kind
    stays. Either way the pair keeps what the steps said: it does not age while its kinds sit
    idle, so later explorations add to it."""
    planner = _planner()
    for _ in range(10):
        planner.observe_step(StepKind.GUESSES, 2, 1.0, alternatives=[(StepKind.ROOT, 1, 0.8)])
    assert planner.held is StepKind.GUESSES
    steps = ([(7, 2.0, 5, 2.0)] * 4 if steady
             else [(6, 1.0, 3, 1.0), (1, 1.0, 2, 1.0)] * 2)
    for tokens, seconds, alt_tokens, alt_seconds in steps:
        planner.observe_step(StepKind.DRAFT, tokens, seconds, alternatives=[
            (StepKind.GUESSES, alt_tokens, alt_seconds), (StepKind.ROOT, 1, 0.8 * seconds)])
    pair = planner.pairs[(StepKind.DRAFT, StepKind.GUESSES)]
    assert pair.measured and pair.advantage == pytest.approx(1.4, rel=0.05)
    assert planner.speed(StepKind.DRAFT) > planner.speed(StepKind.GUESSES)
    assert planner.held is (StepKind.DRAFT if steady else StepKind.GUESSES)
    assert (pair.doubt < 0.01) is steady
    before = pair.steps
    for _ in range(EXPLORE_EVERY):
        planner.observe_step(StepKind.GUESSES, 2, 1.0, alternatives=[(StepKind.ROOT, 1, 0.8)])
    assert pair.steps == before


def _beside_root(planner: Planner, kind: StepKind, steps: list[tuple[float, float]]) -> None:
    """Steps of ``kind``, each (tokens, seconds), the target alone timed in each one's place
    at 1 token a second (itself measured first, at that speed)."""
    while not planner.rates[StepKind.ROOT].measured:
        planner.observe_step(StepKind.ROOT, 1, 1.0)
    for tokens, seconds in steps:
        planner.observe_step(kind, tokens, seconds, alternatives=[(StepKind.ROOT, 1, 1.0)])


def test_a_short_exploration_that_read_far_ahead_by_chance_does_not_take_over() -> None:
    """The draft's kind has been running at 1.5 times the target alone; the n-gram's is
    explored for four steps that emit 7, 1, 5 and 1 tokens: 3.5 times the target alone on them,
    beyond the draft's lead by more than the steps' standard error, but four scattered steps
    are mostly chance: weighed against how far apart kinds usually are, the draft stays. The
    n-gram's kind, measured ahead, is explored again at once (not after EXPLORE_EVERY steps),
    until its own steps, at the target alone's speed, show it is not."""
    planner = _planner()
    _beside_root(planner, StepKind.DRAFT, [(4, 2.0), (2, 2.0)] * 15)
    assert planner.held is StepKind.DRAFT
    _beside_root(planner, StepKind.GUESSES, [(7, 1.0), (1, 1.0), (5, 1.0), (1, 1.0)])
    raw = math.log(planner.relative(StepKind.GUESSES, StepKind.DRAFT))
    doubt = planner.doubt(StepKind.GUESSES, StepKind.DRAFT)
    assert raw > math.log1p(SWITCH_MARGIN) + SWITCH_DOUBTS * doubt  # read alone, a switch
    assert planner.held is StepKind.DRAFT
    lead, sure = planner.lead(StepKind.GUESSES, StepKind.DRAFT)
    assert 0 < lead < raw / 2 and sure < doubt
    taken = []
    for _ in range(EXPLORE_EVERY):
        kind = planner.choose(KINDS)
        taken.append(kind)
        if kind is StepKind.GUESSES:
            _beside_root(planner, kind, [(1, 1.0)])
        else:
            _beside_root(planner, kind, [(3, 2.0)])
        assert planner.held is StepKind.DRAFT
    explored = len(list(itertools.takewhile(lambda k: k is StepKind.GUESSES, taken)))
    assert explored > TRIAL_STEPS  # explored on while measured ahead
    assert StepKind.GUESSES not in taken[explored:]  # and no more once it was not
    assert planner.speed(StepKind.GUESSES) < planner.speed(StepKind.DRAFT) * (1 + SWITCH_MARGIN)


def test_the_target_alone_takes_over_from_a_slower_kind_once_it_leads_by_the_margin() -> None:
    """The n-gram's kind has been running at 1.5 times the target alone; then the text
    changes and its steps emit 3 tokens or 1 in 2.5 and 2.05 seconds where the target alone
    makes a token a second: 0.88 times its speed, measured in every step's place. Steps this
    scattered leave the lead within a standard error of the margin (a drafted kind, measured
    so, would not take over), but the target alone needs no catching up and is measured on
    every step: it takes over within the steps the n-gram's measurement needs to follow the
    text, and ``auto`` does not run a kind slower than plain decoding for hundreds of steps."""
    planner = _planner()
    _beside_root(planner, StepKind.GUESSES, [(4, 2.0), (2, 2.0)] * 15)
    assert planner.held is StepKind.GUESSES
    taken = 0
    while planner.held is StepKind.GUESSES and taken < 200:
        _beside_root(planner, StepKind.GUESSES, [(3, 2.5), (1, 2.05)][taken % 2:][:1])
        taken += 1
    assert planner.held is StepKind.ROOT and taken < 2 * EXPLORE_EVERY
    lead, doubt = planner.lead(StepKind.ROOT, StepKind.GUESSES)
    assert math.log1p(SWITCH_MARGIN) < lead < math.log1p(SWITCH_MARGIN) + SWITCH_DOUBTS * doubt
    for _ in range(40):  # and it would not be sure on these steps however many ran
        _beside_root(planner, StepKind.GUESSES, [(3, 2.5), (1, 2.05)])
    assert planner.relative(StepKind.ROOT, StepKind.GUESSES) == pytest.approx(1 / 0.88, rel=0.02)
    lead, doubt = planner.lead(StepKind.ROOT, StepKind.GUESSES)
    assert lead < math.log1p(SWITCH_MARGIN) + SWITCH_DOUBTS * doubt


def test_a_kind_that_cannot_take_over_does_not_keep_a_slower_one_running() -> None:
    """The n-gram's kind took over where the draft's steps, with the n-gram's tree priced
    beside them, read slower than it; then its own steps run at 0.85 times the target alone.
    The draft's kind reads the fastest against the target alone but not against the n-gram's
    on the same steps, so it cannot take over; the target alone, which leads the running kind
    surely, does, and from it the draft's kind, which leads the target alone surely: ``auto``
    does not run a kind slower than plain decoding because a third kind's measurements
    disagree."""
    planner = _planner()
    _beside_root(planner, StepKind.DRAFT, [(1.4, 1.0)] * 10)
    _beside_root(planner, StepKind.GUESSES, [(1.0, 1.0)] * 4)  # explored
    for _ in range(10):
        planner.observe_step(StepKind.DRAFT, 1.4, 1.0, alternatives=[
            (StepKind.GUESSES, 1.65, 1.0), (StepKind.ROOT, 1, 1.0)])
    planner.held = StepKind.GUESSES  # (it took over)
    _beside_root(planner, StepKind.GUESSES, [(0.85, 1.0)] * 40)
    assert planner.speed(StepKind.DRAFT) > 1.0 > planner.speed(StepKind.GUESSES)
    assert planner.relative(StepKind.DRAFT, StepKind.GUESSES) < 1.0
    assert planner.held is StepKind.DRAFT


@pytest.mark.parametrize("draft_curve", [None, VerifyCost((1, 2, 4), (0.5, 0.6, 0.8))])
def test_leaving_the_drafts_kind_must_repay_catching_up_on_return(
        draft_curve: VerifyCost | None) -> None:
    """The target alone leads the draft's kind that has been running by 6%, steadily (sure,
    beyond the margin). Over the steps it would run that gains about 1.4 target passes; if
    coming back to the draft after them costs more (the draft reading 24 tokens at once
    takes 2.8 passes here), the draft's kind keeps running; with nothing to catch up,
    the target alone takes over."""
    planner = Planner(Sizer(VerifyCost((1, 2, 4, 8, 16), (1.0, 1.1, 1.2, 1.4, 2.0)),
                            draft_curve))
    _beside_root(planner, StepKind.DRAFT, [(1, 1.06)] * 40)
    planner.held = StepKind.DRAFT  # (what has been running)
    lead, doubt = planner.lead(StepKind.ROOT, StepKind.DRAFT)
    assert lead > math.log1p(SWITCH_MARGIN) + SWITCH_DOUBTS * doubt
    gain = (1 - math.exp(-lead)) * HOLD_STEPS
    if draft_curve is None:
        assert planner.returning(StepKind.DRAFT) == 0.0
        assert planner.fastest(KINDS) is StepKind.ROOT
    else:
        assert planner.returning(StepKind.DRAFT) > gain
        assert planner.fastest(KINDS) is StepKind.DRAFT


def test_a_kind_measured_ahead_of_the_running_one_runs_until_its_lead_is_sure() -> None:
    """The n-gram's kind has been running at 1.2 times the target alone; the draft's, explored,
    reads 1.6 times over four scattered steps: not sure enough to take over, but explored
    again at every step while it reads ahead, until it is sure and takes over, with no step of
    the n-gram's kind in between."""
    planner = _planner()
    _beside_root(planner, StepKind.GUESSES, [(1.6, 1.0), (0.8, 1.0)] * 15)
    assert planner.held is StepKind.GUESSES
    _beside_root(planner, StepKind.DRAFT, [(2.4, 1.0), (0.8, 1.0), (1.6, 1.0), (1.6, 1.0)])
    assert planner.held is StepKind.GUESSES
    assert planner.ahead(StepKind.DRAFT, StepKind.GUESSES)
    taken = []
    while planner.held is StepKind.GUESSES and len(taken) < 5 * EXPLORE_EVERY:
        kind = planner.choose(KINDS)
        taken.append(kind)
        _beside_root(planner, kind, [(2.0, 1.0), (1.2, 1.0)][len(taken) % 2:][:1])
    assert planner.held is StepKind.DRAFT
    assert set(taken) == {StepKind.DRAFT} and len(taken) < EXPLORE_EVERY


def test_kinds_are_compared_on_the_same_steps() -> None:
    """The n-gram's trees ran on easy text (3 tokens per second) and the draft's on hard text
    (2 per second): apart, the n-gram's look faster. On the draft's own steps the n-gram's
    tree would have emitted 1 token where the draft's emitted 2, in nearly the same time:
    compared on the same text, the draft is the faster kind, whatever order it is asked in."""
    planner = _planner()
    for _ in range(6):
        planner.observe_step(StepKind.ROOT, 1, 1.0)
        planner.observe_step(StepKind.GUESSES, 3, 1.0, alternatives=[(StepKind.ROOT, 1, 0.5)])
        planner.observe_step(StepKind.DRAFT, 2, 1.0, alternatives=[
            (StepKind.GUESSES, 1, 0.8), (StepKind.ROOT, 1, 1.0)])
    assert planner.rates[StepKind.GUESSES].value > planner.rates[StepKind.DRAFT].value
    assert planner.speed(StepKind.DRAFT) == pytest.approx(2.0)
    # pooled from the n-gram's own steps and the draft's alternatives
    assert 1.0 < planner.speed(StepKind.GUESSES) < planner.speed(StepKind.DRAFT)
    for kinds in itertools.permutations(KINDS):
        assert planner.fastest(list(kinds)) is StepKind.DRAFT
    # the alternatives were compared with each other too
    assert planner.pairs[(StepKind.GUESSES, StepKind.ROOT)].steps > 0


def test_only_explorations_count_as_regret() -> None:
    """Steps before any kind is measured, and steps of the fastest kind, are not regret; a
    step of another kind is, by what it lost against the fastest."""
    planner = _planner()
    for _ in range(3):
        planner.observe_step(StepKind.GUESSES, 1, 5.0, alternatives=[(StepKind.ROOT, 1, 1.0)])
    assert planner.regret == 0.0  # measuring: no kind known to be faster yet
    planner.observe_step(StepKind.GUESSES, 1, 5.0, alternatives=[(StepKind.ROOT, 1, 1.0)])
    for _ in range(4):
        planner.observe_step(StepKind.ROOT, 1, 1.0)
    assert planner.fastest(KINDS) is StepKind.ROOT
    regret = planner.regret
    planner.observe_step(StepKind.ROOT, 1, 1.0)
    assert planner.regret == regret
    planner.observe_step(StepKind.GUESSES, 1, 3.0, alternatives=[(StepKind.ROOT, 1, 1.0)])
    assert planner.regret == pytest.approx(regret + 2.0)


def test_an_exploration_on_a_busy_machine_is_charged_its_loss_not_the_load() -> None:
    """An exploration's regret is what it lost against the fastest kind at the same moment:
    the target alone's time timed in its place (over the fastest kind's lead), so that a
    step slowed three times by another program is charged the second it lost, not the load;
    a step without that counterpart is priced by the fastest kind's measured rate."""
    planner = _planner()
    for _ in range(5):
        planner.observe_step(StepKind.ROOT, 1, 1.0)
    for _ in range(4):
        planner.observe_step(StepKind.GUESSES, 1, 1.2, alternatives=[(StepKind.ROOT, 1, 1.0)])
    assert planner.fastest(KINDS) is StepKind.ROOT
    before = planner.regret
    # busy: the target alone would have taken 3 s where this step took 3.6 s for its token
    planner.observe_step(StepKind.GUESSES, 1, 3.6, alternatives=[(StepKind.ROOT, 1, 3.0)])
    assert planner.regret == pytest.approx(before + 0.6)
    before = planner.regret
    planner.observe_step(StepKind.GUESSES, 1, 3.6)  # no counterpart: the measured rate
    assert planner.regret == pytest.approx(before + 2.6)


def test_auto_times_each_step_against_what_other_kinds_would_have_done() -> None:
    """On fake models, every greedy drafted step is paired with the n-gram's tree and the
    target alone in its place, and output stays exact."""
    corpus = [_plain(prompt, 40) for prompt in PROMPTS[10:12]]
    engine = _engine(Mode.AUTO, TreeBudget(24, 8, 3), corpus=corpus)
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), FLAT)
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), CHEAP_DRAFT)
    for prompt in PROMPTS[:6]:
        assert _generate(engine, prompt, 24) == _plain(prompt, 24)
    pairs = engine.planner.pairs
    assert (StepKind.DRAFT, StepKind.GUESSES) in pairs
    assert (StepKind.DRAFT, StepKind.ROOT) in pairs
    for pair in pairs.values():
        assert pair.alt_tokens > 0 and pair.alt_seconds > 0


def test_paired_timings_are_recalled_with_their_spread_and_from_older_memories() -> None:
    """A pair's memory keeps the steps' log ratios (its doubt comes back with it, shrunk to the
    steps recalled); a memory written before they were kept is recalled as sure as it is
    many; anything else is not a pair's memory."""
    from speculative.auto import Paired

    pair = Paired()
    for tokens in (6, 1, 6, 1, 6, 1):
        pair.add(tokens, 1.0, 3, 1.0)
    again = Paired.recalled(pair.memory(), pair.steps)
    assert again.advantage == pytest.approx(pair.advantage)
    assert again.doubt == pytest.approx(pair.doubt) and pair.doubt > 0.3
    older = Paired.recalled(pair.memory()[:5], RECALL_STEPS)
    assert older.advantage == pytest.approx(pair.advantage) and older.doubt == 0.0
    for bad in ([1.0, 2.0], [*pair.memory()[:5], math.nan, 1.0], [*pair.memory()[:5], 0.0, -1.0]):
        with pytest.raises(ValueError):
            Paired.recalled(bad, RECALL_STEPS)


def test_a_kind_read_ahead_long_ago_is_not_explored_at_every_step_while_it_runs_slower() -> None:
    """On the draft's steps the n-gram's tree, timed in their place, would have been faster:
    read on those steps alone it stays ahead whatever its own steps show (they do not change
    that comparison). Explored, the n-gram's kind runs at the target alone's speed, below the
    draft's: once its own speed reads below the draft's it is no longer explored at every
    step, and the draft runs until the next exploration is due."""
    planner = _planner()
    while not planner.rates[StepKind.ROOT].measured:
        planner.observe_step(StepKind.ROOT, 1, 1.0)
    for _ in range(4):
        planner.observe_step(StepKind.DRAFT, 1.5, 1.0, alternatives=[
            (StepKind.GUESSES, 2.0, 1.0), (StepKind.ROOT, 1, 1.0)])
    assert planner.relative(StepKind.GUESSES, StepKind.DRAFT) > 1.0 + SWITCH_MARGIN
    taken = []
    for _ in range(EXPLORE_EVERY):
        kind = planner.choose(KINDS)
        taken.append(kind)
        if kind is StepKind.DRAFT:
            planner.observe_step(kind, 1.5, 1.0, alternatives=[
                (StepKind.GUESSES, 1.5, 1.0), (StepKind.ROOT, 1, 1.0)])
        else:
            _beside_root(planner, kind, [(1.0, 1.0)])
    guessed = taken.count(StepKind.GUESSES)
    assert TRIAL_STEPS <= guessed <= TRIAL_STEPS + 3, taken
    assert taken[-EXPLORE_EVERY // 2:] == [StepKind.DRAFT] * (EXPLORE_EVERY // 2)


def test_an_alternative_tree_is_decided_by_the_text_written_after_it() -> None:
    """A tree another kind would have verified in a step's place follows the text written
    since, step by step, until the text leaves it (the tokens along it and the target's
    own) or reaches a leaf (its depth and the target's next, whatever that is)."""
    tree = TokenTree.rooted(1)
    a = tree.add(0, 5, 0.9, "ngram")
    b = tree.add(a, 6, 0.8, "ngram")
    tree.add(b, 7, 0.7, "ngram")
    tree.add(0, 9, 0.1, "ngram")
    def fresh() -> Guessed:
        return Guessed(tree, StepKind.GUESSES, 1.0, ())

    assert fresh().follow([4]) == 1  # not in the tree: the target's own
    assert fresh().follow([9]) == 2  # a leaf: it and the target's next
    guessed = fresh()
    assert guessed.follow([5]) is None  # undecided while the text follows it
    assert guessed.follow([6]) is None
    assert guessed.follow([8, 3]) == 3  # left at the third level
    assert fresh().follow([5, 6, 7]) == 4


@pytest.mark.parametrize("beside", ["decided", "priced", None])
def test_the_ngram_kind_timed_beside_the_target_alone_takes_over_without_being_explored(
        beside: str | None) -> None:
    """The target alone has been running: the n-gram's kind measured at half its speed, its
    explorations so surely lost that its wait is at the longest, and no budget left. The
    text turns repetitive: the n-gram's trees planned beside the target alone's steps show it
    1.5 times as fast, greedy decided by the text written after them (``observe_aside``),
    sampled priced by the step's own pass (an alternative of the step). It takes over within
    a few dozen steps, none of its own run to find out; without those timings it would not
    run again for hundreds of steps."""
    planner = _planner()
    _beside_root(planner, StepKind.GUESSES, [(1, 2.0)] * 6)
    kinds = [StepKind.GUESSES, StepKind.ROOT]
    while planner.held is not StepKind.ROOT:
        planner.observe_step(StepKind.ROOT, 1, 1.0)
    planner.every[StepKind.GUESSES] = EXPLORE_EVERY * MAX_BACKOFF
    planner.regret = 1e9  # no budget: nothing explored for its own sake
    taken = []
    for _ in range(2 * EXPLORE_EVERY):
        kind = planner.choose(kinds)
        taken.append(kind)
        if kind is StepKind.GUESSES:
            planner.observe_step(kind, 3, 2.0, alternatives=[(StepKind.ROOT, 1, 1.0)])
            continue
        if beside == "priced":
            planner.observe_step(kind, 1, 1.0, alternatives=[(StepKind.GUESSES, 3, 2.0)])
            continue
        planner.observe_step(kind, 1, 1.0)
        if beside == "decided":
            planner.observe_aside(StepKind.GUESSES, 3, 2.0, [(StepKind.ROOT, 1, 1.0)])
    if beside:
        first = taken.index(StepKind.GUESSES)
        assert planner.held is StepKind.GUESSES and first < EXPLORE_EVERY
        assert taken[first:] == [StepKind.GUESSES] * (len(taken) - first)
        assert planner.speed(StepKind.GUESSES) == pytest.approx(1.5, rel=0.05)
    else:
        assert taken == [StepKind.ROOT] * len(taken)


def test_greedy_target_alone_steps_time_the_ngram_tree_beside_them_and_stay_exact() -> None:
    """On fake models without a draft, the target alone measured fastest, every greedy step
    is the target alone; beside each, the n-gram's tree is planned and, once the text has
    decided it, timed against the step; its planning is not counted in the target alone's
    time. (With a draft model, the n-gram's tree is no kind of its own, greedy: nothing to
    time beside.)"""

    class Planted(Planner):  # the rates stay as planted; what is timed beside is recorded
        ran: list[float] = []  # noqa: RUF012 (the test's record)
        asides: list[tuple[float, float, float]] = []  # noqa: RUF012

        def observe_step(self, kind: StepKind, tokens: float, seconds: float,
                         switch: float = 0.0, alternatives=()) -> None:
            assert kind is StepKind.ROOT and not alternatives
            self.ran.append(seconds)

        def observe_aside(self, kind: StepKind, tokens: float, seconds: float, against
                          ) -> None:
            assert kind is StepKind.GUESSES
            [(ran, one, alone)] = against  # the target alone, as it ran
            assert (ran, one) == (StepKind.ROOT, 1)
            self.asides.append((tokens, seconds, alone))

    corpus = [_plain(prompt, 40) for prompt in PROMPTS[10:12]]
    ngram = KatzTrigram.build(corpus, V)
    engine = Engine(FakeContext(TARGET), None, ngram,  # the n-gram's tree: a kind to choose
                    SpecConfig(mode=Mode.AUTO, tree=TreeBudget(24, 8, 3)))
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), STEEP)
    planner = _plant(engine, Planted, [(StepKind.ROOT, 1, 1.0),     # a token a second
                                       (StepKind.GUESSES, 1, 4.0)])
    planner.greedy = True
    for prompt in PROMPTS[10:12]:
        planner.ran.clear()
        planner.asides.clear()
        assert _generate(engine, prompt, 24) == _plain(prompt, 24)
        # the text repeats what the n-gram model learned: its trees follow it for several
        # tokens, and all but the last few are decided before the reply ends
        assert len(planner.asides) >= len(planner.ran) - 8
        assert max(tokens for tokens, _, _ in planner.asides) > 2
        assert all(seconds > alone > 0 for _, seconds, alone in planner.asides)
    # the target alone's own steps: as long as the steps, less the n-gram's planning
    assert planner.asides[-1][2] in planner.ran


def test_a_deep_ngram_tree_beside_a_draft_step_is_credited_with_what_it_would_have_emitted(
        ) -> None:
    """Beside a draft step that emitted 2 tokens, the n-gram's chain of three held both and
    goes deeper: the next step's text decides it (all three, and the target's next: 4
    tokens), and only then is it paired with the draft's step and the target alone timed
    in that step's place; the bin's margin learns how far the draft's step, and the
    chain's, measured from the estimate the chain was planned with."""
    from types import SimpleNamespace

    from speculative.plan import Alternative, StepPlan
    from speculative.policies import Outcome

    planner = _planner()
    planner.greedy = True
    policy = AutoPolicy(SimpleNamespace(planner=planner))
    drafted = TokenTree.rooted(7)
    drafted.add(0, 1, 0.9, "draft")
    chain = TokenTree.rooted(7)
    node = 0
    for token in (1, 2, 3):
        node = chain.add(node, token, 0.5, "ngram")
    plan = StepPlan(DraftTree(drafted, {}), None, StepKind.DRAFT, alternatives=(
        Alternative(StepKind.GUESSES, chain, 0.01), Alternative(StepKind.ROOT,
                                                               TokenTree.rooted(7))))
    outcome = Outcome([1], (1,), 2, seconds=0.30, t_plan=0.08, t_verify=0.20, batch=2,
                      next_token=2, t_single=0.18, t_alone=0.2)
    # as ``without_draft`` priced the chain's step, choosing to run the draft
    policy.estimate, policy.chose = (1.5, 0.1), StepKind.DRAFT
    policy.observe(plan, outcome)
    assert (StepKind.DRAFT, StepKind.GUESSES) not in planner.pairs  # not decided yet
    assert planner.pairs[(StepKind.DRAFT, StepKind.ROOT)].alt_tokens == 1
    later = StepPlan.alone(2)
    policy.observe(later, Outcome([], (), 1, seconds=0.2, t_verify=0.18, batch=1,
                                  next_token=3))
    pair = planner.pairs[(StepKind.DRAFT, StepKind.GUESSES)]
    assert (pair.tokens, pair.alt_tokens) == (2, 4)
    assert pair.seconds == pytest.approx(0.30)
    # how far the step that ran the draft (2 tokens in 0.30 s), and the n-gram's chain as the
    # text decided it, measured from the chain's estimate, in the bin of the step
    margin = policy.planner.margins[policy.bin]
    assert margin.drafted.steps == margin.ngram.steps == 1
    assert margin.drafted.mean() == pytest.approx((2 - 1.5, 0.30 - 0.1))
    assert margin.ngram.mean() == pytest.approx((4 - 1.5, pair.alt_seconds - 0.1))
    assert sum(m.drafted.steps + m.ngram.steps for m in policy.planner.margins) == 2
    guesses = planner.pairs[(StepKind.GUESSES, StepKind.ROOT)]
    assert (guesses.tokens, guesses.alt_tokens, guesses.alt_seconds) == (4, 1, 0.2)


class _Seen(Planner):
    """A planner whose rates stay as planted; each step's kind, seconds and alternatives (kind,
    tokens, seconds) are recorded."""

    seen: list[tuple[StepKind, float, list]]

    def observe_step(self, kind: StepKind, tokens: float, seconds: float,
                     switch: float = 0.0, alternatives=()) -> None:
        self.seen.append((kind, seconds, list(alternatives)))


def _spied_plans(engine: Engine) -> list:
    """The plans ``engine``'s ``auto`` policy makes from now on, in order."""
    plans: list = []
    policy = engine._policy(Mode.AUTO)
    plan_step = policy.plan

    def spy(step):
        plans.append(plan_step(step))
        return plans[-1]

    policy.plan = spy
    return plans


def test_sampled_with_a_draft_model_each_step_is_the_draft_tree_or_the_target_alone() -> None:
    """Sampled with a draft model, the n-gram's tree is no kind of ``auto``'s: even where its
    steps were measured the fastest, each step runs the draft's tree (the n-gram's guesses its
    stage 2) with the target alone timed in its place, and no n-gram tree is planned beside."""
    engine = _auto(FLAT, CHEAP_DRAFT)
    planner = _plant(engine, _Seen, [(StepKind.ROOT, 1, 1.0),  # a token a second
                                     (StepKind.GUESSES, 3, 0.5), (StepKind.DRAFT, 3, 1.0)])
    planner.seen = []
    planner.greedy = False
    plans = _spied_plans(engine)
    params = SamplingParams(temperature=1.0, seed=3)
    steps = [step for prompt in PROMPTS[:4] for step in engine.generate(prompt, 16, params)]
    assert {kind for kind, _, _ in planner.seen} == {StepKind.DRAFT}
    assert sum(step.stats.stage2_proposed for step in steps) > 0  # the n-gram's guesses drafted
    for plan, (_, _, alternatives) in zip(plans, planner.seen, strict=True):
        assert [kind for kind, _, _ in alternatives] == [StepKind.ROOT]
        assert [alt.kind for alt in plan.alternatives] == [StepKind.ROOT]
        assert plan.t_aside == 0.0


def test_sampled_target_alone_steps_time_the_ngram_tree_beside_them_from_their_own_pass(
        ) -> None:
    """Sampled without a draft model, a tree's acceptance is a draw that the text does not
    decide; a step of the target alone plans the n-gram's tree beside it, and the engine
    prices it from the step's target pass (``Outcome.beside``): the n-gram's kind is timed
    against the target alone on the same steps, without running it, and its planning is not
    the target alone's time."""
    corpus = [_plain(prompt, 40) for prompt in PROMPTS[10:12]]
    engine = Engine(FakeContext(TARGET), None, KatzTrigram.build(corpus, V),
                    SpecConfig(mode=Mode.AUTO, tree=TreeBudget(24, 8, 3)))
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), STEEP)
    planner = _plant(engine, _Seen, [(StepKind.ROOT, 1, 1.0),  # a token a second
                                     (StepKind.GUESSES, 1, 4.0)])
    planner.seen = []
    planner.greedy = False
    plans = _spied_plans(engine)
    params = SamplingParams(temperature=1.0, seed=3)
    for prompt in PROMPTS[10:12]:
        list(engine.generate(prompt, 16, params))
    assert {kind for kind, _, _ in planner.seen} == {StepKind.ROOT}
    priced = 0
    for plan, (_, seconds, alternatives) in zip(plans, planner.seen, strict=True):
        if not alternatives:
            continue
        [(kind, tokens, alt_seconds)] = alternatives
        # its tree drawn with the n-gram's distributions, its planning outside the step's time
        [guesses] = plan.alternatives
        assert kind is StepKind.GUESSES and guesses.q is not None
        assert 0.0 < plan.t_aside < guesses.t_plan
        assert 1.0 <= tokens <= 1.0 + guesses.tree.max_depth
        assert alt_seconds > 0.0 and seconds > 0.0
        priced += 1
    assert priced >= len(plans) // 2
