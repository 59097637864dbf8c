"""The acceptance map: how often the target accepts a node, its parent accepted, by the
proposer's probability of it; what drafted trees are scored and sized by."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from speculative.costmodel import ACCEPTANCE_EDGES, Acceptance, VerifyCost
from speculative.drafting import DraftTree, TreeBudget
from speculative.plan import Calibrations, Scorer, StepKind, StepPlan
from speculative.policies import Mode
from speculative.stats import RunStats
from speculative.tree import TokenTree
from tests.speculative.test_engine import FLAT, TARGET, _engine, _generate, _plain

CENTRES = [(a + b) / 2 for a, b in itertools.pairwise(ACCEPTANCE_EDGES)]


def test_before_any_verdict_a_node_is_accepted_as_often_as_its_probability_says() -> None:
    a = Acceptance()
    assert a(0.0) == 0.0
    for p in CENTRES:
        assert a(p) == pytest.approx(p) and a(p, first=False) == pytest.approx(p)


def test_first_children_and_their_siblings_are_learned_apart() -> None:
    """A first child of 0.3 leads a flat distribution and the target mostly takes it; a
    second child of 0.3 trails a likelier sibling and the target mostly does not."""
    a = Acceptance()
    for step in range(200):
        a.add([0.3, 0.3], [True, False], [step % 10 != 0, step % 10 == 0])
    assert a(0.35) == pytest.approx(0.9, abs=0.05)
    assert a(0.35, first=False) == pytest.approx(0.1, abs=0.05)
    assert a(0.95) >= a(0.35)  # where nothing was seen: the prior, kept above what was


def test_the_map_never_falls_as_the_probability_rises() -> None:
    """A likelier node is accepted at least as often: where nothing was seen beside a
    well-measured bin, the bins that would break the order take its rate, not their
    prior's."""
    a = Acceptance()
    for _ in range(100):
        a.add([0.15, 0.25], [True, False], [True, False])
    for first in (True, False):
        rates = a.rates(first)
        assert rates == sorted(rates)
    assert a(0.15) > 0.9 and a(0.55) >= a(0.15)
    assert a(0.15, first=False) <= a(0.25, first=False) < 0.1  # not lifted by 0.15's prior
    assert a(0.55, first=False) == pytest.approx(0.55)  # above it: the prior


def test_old_verdicts_fade() -> None:
    a = Acceptance()
    for _ in range(200):
        a.add([0.45], [True], [True])
    high = a(0.45)
    for _ in range(200):
        a.add([0.45], [True], [False])
    assert high > 0.9 and a(0.45) < 0.1


def test_a_remembered_map_is_read_back_and_weighs_what_it_is_told() -> None:
    a = Acceptance()
    for _ in range(100):
        a.add([0.45, 0.25], [True, False], [True, False])
    again = Acceptance().recalled(a.memory(), 1e9)
    assert again.rates() == pytest.approx(a.rates())
    assert again.rates(False) == pytest.approx(a.rates(False))
    light = Acceptance().recalled(a.memory(), 1.0)  # one trial per bin at most
    assert 0.45 < light(0.45) < a(0.45)
    for bad in ([[1.0], [2.0]], [[-1.0] * 24, [1.0] * 24], [[2.0] * 24, [1.0] * 24], "x"):
        with pytest.raises(ValueError):
            Acceptance().recalled(bad, 3.0)


def test_calibrations_learn_from_the_children_of_accepted_nodes_only() -> None:
    """A node whose parent the target rejected was never put to the test: it teaches
    nothing. The root's children and the accepted nodes' children do, first children apart
    from their siblings."""
    tree = TokenTree.rooted(7)
    a = tree.add(0, 1, 0.6, "draft", 0.6)
    b = tree.add(0, 2, 0.3, "draft", 0.3)
    c = tree.add(a, 3, 0.3, "draft", 0.5)
    tree.add(b, 4, 0.27, "draft", 0.9)  # below a rejected node
    plan = StepPlan.scored_by(DraftTree(tree, {}), None, StepKind.DRAFT, Scorer.DRAFT)
    calibrations = Calibrations()
    calibrations.observe(plan, [a, c])
    learned = calibrations.acceptance[Scorer.DRAFT]
    assert learned.trials[0].sum() == 2 and learned.hits[0].sum() == 2  # a and c
    assert learned.trials[1].sum() == 1 and learned.hits[1].sum() == 0  # b
    assert calibrations.acceptance[Scorer.NGRAM].trials.sum() == 0


def test_a_sampled_verdict_teaches_each_nodes_chance_not_its_draw() -> None:
    """Sampled, the verdict gives each node's chance of being reached by the acceptance rule:
    a node counts as tried as often as its parent is reached, and as accepted as often as it
    is reached itself, whichever path the rule drew (here the first child's)."""
    tree = TokenTree.rooted(7)
    a = tree.add(0, 1, 0.6, "draft", 0.6)
    tree.add(0, 2, 0.3, "draft", 0.3)  # b
    tree.add(a, 3, 0.3, "draft", 0.5)  # c
    plan = StepPlan.scored_by(DraftTree(tree, {}), None, StepKind.DRAFT, Scorer.DRAFT)
    reached = [1.0, 0.5, 0.3, 0.4]  # by node: the root, a, b, c
    drawn, expected = Calibrations(), Calibrations()
    drawn.observe(plan, [a])
    expected.observe(plan, [a], reached)
    learned = expected.acceptance[Scorer.DRAFT]
    assert learned.trials[0].sum() == pytest.approx(1.0 + 0.5)  # a, and c as often as a
    assert learned.hits[0].sum() == pytest.approx(0.5 + 0.4)
    assert learned.trials[1].sum() == 1.0 and learned.hits[1].sum() == pytest.approx(0.3)
    assert drawn.acceptance[Scorer.DRAFT].hits[1].sum() == 0  # b, drawn: rejected
    assert expected.by_scorer[Scorer.DRAFT].accepted == pytest.approx(0.5 + 0.3 + 0.4)
    assert drawn.by_scorer[Scorer.DRAFT].accepted == 1  # a alone
    assert expected.by_scorer[Scorer.DRAFT].predicted == drawn.by_scorer[Scorer.DRAFT].predicted


def test_an_old_memory_without_acceptance_maps_is_still_recalled() -> None:
    calibrations = Calibrations()
    memory = calibrations.memory()
    del memory["acceptance"]
    recalled = calibrations.recalled(memory, 3.0)
    assert recalled.acceptance[Scorer.DRAFT].trials.sum() == 0


def test_an_accurate_draft_that_doubts_itself_learns_to_grow_deep_trees() -> None:
    """The target's own table, flattened: the draft names the target's token every time but
    gives it little probability (about 0.25 of 12 tokens), so a path of four of its nodes has
    a probability near 0.004 and, scored by that, no tree would go past a level or two. The
    target accepts every first child: the map learns it, and on a flat curve the trees grow
    deep. The output is the target's."""
    engine = _engine(Mode.TREE, TreeBudget(16, 8, 2), draft=TARGET * 0.25)
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), FLAT)
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), (0.05, 0.06, 0.07, 0.09, 0.12, 0.2))
    runs = []
    for prompt in [list(np.random.default_rng(s).integers(0, 12, size=3)) for s in range(8)]:
        run = RunStats()
        assert _generate(engine, prompt, 40, run=run) == _plain(prompt, 40)
        runs.append(run)
    learned = engine.res.calibrations.acceptance[Scorer.DRAFT]
    probs = [p for p in CENTRES if learned.trials[0][CENTRES.index(p)] > 5]
    assert probs and all(learned(p) > 0.8 for p in probs if p < 0.5)
    late = [s.accepted for run in runs[4:] for s in run.steps]
    assert np.mean(late) >= 6  # levels accepted per pass, once learned (by the
    # draft's probabilities alone: 1)
