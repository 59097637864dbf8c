"""``auto`` on fake contexts: what it drafts on each cost curve, its measured rates and regret
budget, probes, the merged tree, and the ``Learned`` hand-on; every reply exact."""

from __future__ import annotations

import math

import numpy as np
import pytest

from speculative.auto import EXPLORE_EVERY, EXPLORE_SHARE, EXPLORE_START, PROBE, Planner
from speculative.costmodel import Calibration, VerifyCost
from speculative.drafting import (
    DraftCounters,
    DraftTree,
    ModelDrafter,
    NgramDrafter,
    TreeBudget,
    grow_tree,
    sparse_top,
)
from speculative.engine import Engine
from speculative.ngram import KatzTrigram
from speculative.plan import Scorer, StepKind
from speculative.policies import Mode, SpecConfig, StepInput
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


def test_no_probe_of_the_draft_where_the_ngram_tree_pays() -> None:
    """A probe is due (drafting measured a loss, EXPLORE_EVERY steps passed), but at a step
    where the n-gram's own tree already pays (a baseline rate) a short chain could not beat
    it: the draft does not run. Where the n-gram offers nothing, the probe runs."""
    engine = _auto(STEEP, CHEAP_DRAFT)
    engine.measure_cost()
    planner = engine.planner
    for _ in range(10):
        planner.observe_step(StepKind.ROOT, 10, 0.1)
        planner.observe_step(StepKind.DRAFT, 1, 0.1)
    planner.regret = -100.0  # budget to spare: only the rule can stop the probe
    assert planner.measured_loss(StepKind.DRAFT)
    prompt, params = PROMPTS[4], SamplingParams()
    budget = TreeBudget(24, 8, 3)
    runs = []
    for baseline in (50.0, 0.0):
        planner.idle = EXPLORE_EVERY
        drafter = ModelDrafter(engine.draft, None, 0)
        step = StepInput(prompt, engine.config, budget, params, np.random.default_rng(0))
        tree = engine._policy(Mode.AUTO).maybe_draft(drafter, step,
                                                     engine.res.expander(budget), baseline)
        engine.draft.rollback()
        runs.append((len(tree.tree) - 1, drafter.counters.calls))
    assert runs[0] == (0, 0)  # the n-gram pays: no draft call
    assert runs[1][1] > 0 and 1 <= runs[1][0] <= 3  # nothing else pays: a probe of <= 3


def test_auto_probes_with_a_short_chain_while_drafting_measures_a_loss() -> None:
    """The cost model says drafting pays (a flat curve), the measured step rates say it loses:
    auto runs the target alone, and explores with a chain of at most ``PROBE`` tokens, never
    a full tree (verified at the steep end of a real curve, one costs several passes)."""
    class Measured(Planner):  # the rates stay as planted: drafting measured 10x slower
        def observe_step(self, kind: StepKind, tokens: int, seconds: float) -> None:
            pass

    engine = _auto(FLAT, CHEAP_DRAFT)
    engine.measure_cost()
    planner = engine.planner = Measured(engine.res.sizer)
    for _ in range(10):
        Planner.observe_step(planner, StepKind.ROOT, 10, 0.1)
        Planner.observe_step(planner, StepKind.DRAFT, 1, 0.1)
    assert planner.measured_loss(StepKind.DRAFT)
    for prompt in PROMPTS[:5]:  # greedy: exact (the probes get n-gram guesses hung below)
        assert _generate(engine, prompt, 24) == _plain(prompt, 24)
    run = RunStats()
    for i, prompt in enumerate(PROMPTS[:10]):  # sampled: the tree is the draft's alone
        _generate(engine, prompt, 24, params=SamplingParams(1.0, 0, 1.0, i), run=run)
    probes = [s for s in run.steps if s.draft_calls]
    # one at each reply's start (Planner.new_text), then one per EXPLORE_EVERY steps at most
    assert 1 <= len(probes) <= 10 + len(run.steps) // EXPLORE_EVERY
    assert all(s.drafted <= PROBE for s in probes)


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


def test_auto_greedy_verifies_ngram_branches_beside_the_draft_and_stays_exact() -> None:
    """A flat cost curve (a GPU), a noisy draft and an n-gram model that knows the target's
    text: the merged trees' n-gram branches are verified, some accepted, every reply exact.
    (The fakes' step rates are not measured: their Python overhead would make every kind of
    drafting lose to the target alone, see Planner.measured_loss.)"""
    class Unmeasured(Planner):
        def observe_step(self, kind: StepKind, tokens: int, seconds: float) -> None:
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
    engine: the planner (rates, budget) and the calibrations continue, and output stays exact."""
    first = _auto(STEEP, CHEAP_DRAFT)
    for prompt in PROMPTS[:3]:
        _generate(first, prompt, 24)
    learned = first.learned()
    assert learned.planner is not None and learned.planner.elapsed > 0
    second = _auto(STEEP, CHEAP_DRAFT)
    second.adopt(learned)
    assert second.planner is learned.planner
    assert second.res.calibrations is learned.calibrations
    elapsed = learned.planner.elapsed
    assert _generate(second, PROMPTS[3], 24) == _plain(PROMPTS[3], 24)
    assert second.planner.elapsed > elapsed  # the same planner went on measuring


def test_auto_explores_only_while_its_losses_fit_the_budget() -> None:
    """Steps of a kind not yet measured faster than the target alone may run only while the
    time lost so far (regret) is under EXPLORE_SHARE of the time spent; a proven kind runs
    regardless, and its gains fund later explorations."""
    curve = VerifyCost((1, 2, 4, 8, 16), (1.0, 1.1, 1.2, 1.4, 2.0))
    planner = Planner(Sizer(curve, VerifyCost((1, 2, 4), (0.5, 0.6, 0.8))))
    start = EXPLORE_SHARE * EXPLORE_START  # plain steps' time a fresh planner may lose
    assert planner.within_budget(0.9 * start) and not planner.within_budget(1.1 * start)
    for _ in range(10):
        planner.observe_step(StepKind.ROOT, 1, 1.0)  # the target alone: 1 token per second
    planner.observe_step(StepKind.DRAFT, 1, 1.0 + 1.2 * start)  # a probe that lost more than that
    assert planner.regret == pytest.approx(1.2 * start)
    assert not planner.may_try(StepKind.DRAFT) and not planner.may_try(StepKind.GUESSES)
    planner.idle = EXPLORE_EVERY
    assert not planner.exploration_due()  # due, but not affordable
    waited = 0
    while not planner.within_budget():  # time spent without losing refills the budget
        planner.observe_step(StepKind.ROOT, 1, 1.0)
        waited += 1
    # until the loss beyond the start allowance, 0.2 * start, is EXPLORE_SHARE of the time
    # spent, of which 11 s + 1.2 * start had passed before
    assert waited == math.ceil(0.2 * start / EXPLORE_SHARE - (11 + 1.2 * start))
    # a probe's risk counts: the draft catching up on 100 tokens costs more than is left
    assert planner.probe_risk(100, 3) > planner.probe_risk(0, 3) > 0
    assert not planner.exploration_due(planner.probe_risk(100, 3))
    for _ in range(5):  # n-gram trees measured at 3 tokens per second: proven, they run
        planner.observe_step(StepKind.GUESSES, 3, 1.0)
    assert planner.may_try(StepKind.GUESSES) and planner.regret < 0  # and their gain is budget


def test_a_kind_of_step_measured_slower_than_the_target_alone_is_not_taken() -> None:
    curve = VerifyCost((1, 2, 4, 8, 16), (1.0, 1.1, 1.2, 1.4, 2.0))
    planner = Planner(Sizer(curve, curve))
    assert not planner.measured_loss(StepKind.DRAFT)  # nothing measured: the model decides
    assert not planner.wants_root()
    for _ in range(4):  # decayed: 1 + 0.95 + 0.95**2 + 0.95**3 >= MIN_STEPS
        planner.observe_step(StepKind.DRAFT, 2, 0.04)
    assert planner.wants_root()  # drafting measured, the target alone not yet
    for _ in range(5):
        planner.observe_step(StepKind.ROOT, 1, 0.01)      # 100 tokens/s alone
        planner.observe_step(StepKind.DRAFT, 2, 0.04)     # 50 tokens/s with the draft
        planner.observe_step(StepKind.GUESSES, 3, 0.02)   # 150 tokens/s with n-gram guesses
    assert planner.measured_loss(StepKind.DRAFT) and not planner.measured_loss(StepKind.GUESSES)
    for _ in range(5):
        planner.observe_step(StepKind.GUESSES, 1, 0.05)
    assert planner.measured_loss(StepKind.GUESSES)
    # explored, not abandoned; each exploration that still loses doubles the wait
    allowed = [_guess(planner) for _ in range(7 * EXPLORE_EVERY)]
    explored = [i + 1 for i, a in enumerate(allowed) if a]
    assert explored == [EXPLORE_EVERY, 3 * EXPLORE_EVERY, 7 * EXPLORE_EVERY]
    for _ in range(20):  # the n-gram wins again: the next exploration resets the wait
        planner.observe_step(StepKind.GUESSES, 4, 0.02)
    allowed = [_guess(planner) for _ in range(2 * EXPLORE_EVERY)]
    assert all(allowed)
    # the draft model backs off the same way while it loses
    planner.idle, waits, last = 0, [], 0
    for step in range(1, 16 * EXPLORE_EVERY):
        if not planner.exploration_due():
            planner.waited()
            continue
        planner.explored()
        planner.drafted()
        waits.append(step - last)
        last = step
    assert waits[:4] == [EXPLORE_EVERY, 2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY, 8 * EXPLORE_EVERY]


def _guess(planner: Planner) -> bool:
    """One step's decision about n-gram guesses, as ``AutoPolicy.plan`` makes it."""
    due = planner.guesses_due()
    planner.guessed(due)
    return due


def test_the_planners_questions_change_nothing() -> None:
    """Asking whether to explore or guess leaves the planner as it was; only the calls that
    say what happened move its counters."""
    import copy

    curve = VerifyCost((1, 2, 4, 8, 16), (1.0, 1.1, 1.2, 1.4, 2.0))
    planner = Planner(Sizer(curve, curve))
    for _ in range(5):
        planner.observe_step(StepKind.ROOT, 1, 0.01)
        planner.observe_step(StepKind.GUESSES, 1, 0.05)
    planner.idle = planner.guess_idle = EXPLORE_EVERY
    before = copy.deepcopy(planner)
    for _ in range(3):
        planner.exploration_due(), planner.guesses_due(), planner.wants_root()
        planner.within_budget(), planner.probe_risk(10, 3), planner.plain_seconds()
    assert planner == before
    planner.waited()
    assert planner.idle == before.idle + 1
