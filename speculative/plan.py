"""What one step will verify, and what the engine learns from its verdict.

A mode's policy (``speculative.policies``, ``speculative.auto``) turns the committed text into a
``StepPlan``: the token tree to verify, the drafter that decoded it (told what was accepted, so
its cache follows), the kind of step, and who scored each node. The engine verifies the plan's
tree in one target pass and hands the verdict back to the policy; nothing about a step travels
between methods outside its plan.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .costmodel import Acceptance, Calibration, Running
from .drafting import DraftCounters, Drafter, DraftTree
from .tree import TokenTree

Path = tuple[int, ...]


class StepKind(enum.Enum):
    """What a step tried (whatever the final cut then kept), for ``auto``'s measured rates."""

    ROOT = "root"        # the target alone
    GUESSES = "guesses"  # the n-gram model's tree, no draft model
    DRAFT = "draft"      # the draft model ran


class Scorer(enum.Enum):
    """Whose probabilities a node's score is; each has its own calibration (``Calibrations``)."""

    DRAFT = "draft"        # a draft model's path probability (the oracle's count as these)
    NGRAM = "ngram"        # the n-gram model's, in a tree of its own
    BRANCHES = "branches"  # the n-gram model's, on a branch merged beside a draft tree


@dataclasses.dataclass(frozen=True, slots=True)
class Alternative:
    """A step another kind would have verified instead, on the same text: its tree and what
    planning it took. ``auto`` times the step taken against these counterfactuals, so kinds
    are compared on the same text rather than on rates measured at other moments."""

    kind: StepKind
    tree: TokenTree   # a lone root for the target alone
    t_plan: float = 0.0
    # a sampled tree's draft distributions (its nodes' children were drawn from them, as
    # ``DraftTree.q``): the engine prices what it would have yielded from the target's pass
    # over the step's own tree (``verify.verify_sampling``'s ``beside``); None: not priced
    q: Mapping[int, np.ndarray] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's tree and what to learn from its verdict. Immutable once made."""

    tree: DraftTree            # what the target verifies (a lone root: the target alone)
    drafter: Drafter | None    # told the accepted path (its KV cache follows the text)
    kind: StepKind
    # the calibrations this step updates, and each calibrated node's (scorer, score as its
    # drafter gave it, before the scorer's factor) by path below the root; a calibration with
    # no node here still learns that nothing was predicted (it decays)
    calibrates: frozenset[Scorer] = frozenset()
    scored: Mapping[Path, tuple[Scorer, float]] = dataclasses.field(default_factory=dict)
    # auto's n-gram chain hung below a drafted path: (that path, the chain's tokens)
    guesses: tuple[Path, Path] | None = None
    alternatives: tuple[Alternative, ...] = ()  # auto: what other kinds would have verified
    # seconds of planning spent on alternatives alone (a target-alone step's n-gram tree):
    # not part of the step's own kind, nor of the loop around plain decoding's passes
    t_aside: float = 0.0

    @property
    def counters(self) -> DraftCounters:
        """What drafting cost (the drafter's; none for the target alone)."""
        return self.drafter.counters if self.drafter is not None else DraftCounters()

    @classmethod
    def alone(cls, root: int, drafter: Drafter | None = None,
              calibrates: frozenset[Scorer] = frozenset()) -> StepPlan:
        """The target alone: a lone root. (A drafter that was begun still hears the verdict.)"""
        return cls(DraftTree(TokenTree.rooted(root), {}), drafter, StepKind.ROOT, calibrates)

    @classmethod
    def scored_by(cls, tree: DraftTree, drafter: Drafter, kind: StepKind, scorer: Scorer,
                  skip: frozenset[int] = frozenset(), guesses: tuple[Path, Path] | None = None,
                  alternatives: tuple[Alternative, ...] = ()) -> StepPlan:
        """A tree whose nodes ``scorer`` scored, all but the node ids in ``skip``."""
        t = tree.tree
        scored = {t.path(v): (scorer, t.scores[v]) for v in range(1, len(t)) if v not in skip}
        return cls(tree, drafter, kind, frozenset({scorer}), scored, guesses, alternatives)


@dataclasses.dataclass(slots=True)
class Calibrations:
    """What the cost model estimates acceptance by, learned from each verdict: by scorer, how
    often the target accepts a node given its parent, by the proposer's probability of it
    (``acceptance``: what a drafter scores its nodes with), and accepted tokens over the
    scores that predicted them (``by_scorer``: what is left to correct, a factor near 1 once
    the acceptance maps have learned); stage 2's draft calls saved over guess tokens decoded
    (``saved_calls``)."""

    by_scorer: dict[Scorer, Calibration] = dataclasses.field(
        default_factory=lambda: {s: Calibration() for s in Scorer})
    acceptance: dict[Scorer, Acceptance] = dataclasses.field(
        default_factory=lambda: {s: Acceptance() for s in Scorer})
    stage2: Calibration = dataclasses.field(default_factory=Calibration)
    # per draft call of a staged drafter: draft calls its guesses saved (levels the call gave
    # beyond its own), and guess tokens it decoded
    stage2_saved_per_call: Running = dataclasses.field(
        default_factory=lambda: Running(prior=0.0))
    stage2_width: Running = dataclasses.field(default_factory=lambda: Running(prior=0.0))

    def factor(self, scorer: Scorer) -> float:
        return self.by_scorer[scorer].factor

    def memory(self) -> dict[str, Any]:
        """JSON-able sums, for a later run on the same models (``recalled``)."""
        return {"by_scorer": {s.value: c.memory() for s, c in self.by_scorer.items()},
                "acceptance": {s.value: a.memory() for s, a in self.acceptance.items()},
                "stage2_saved": self.stage2.memory(),
                "stage2_saved_per_call": self.stage2_saved_per_call.memory(),
                "stage2_width": self.stage2_width.memory()}

    def recalled(self, memory: Mapping[str, Any], weight: float) -> Calibrations:
        """These calibrations carried on from ``memory()`` of an earlier run, each worth
        ``weight`` predicted tokens (or draft calls) at most; ValueError for a memory it
        cannot read. Stage 2's measurements of an older version (guesses used, not calls
        saved: they overstate what guesses save) start afresh."""
        try:
            by_scorer = {**self.by_scorer, **{
                Scorer(s): self.by_scorer[Scorer(s)].recalled(m, weight)
                for s, m in memory["by_scorer"].items()}}
            # (a memory from before the acceptance maps has none: they start afresh)
            acceptance = {**self.acceptance, **{
                Scorer(s): self.acceptance[Scorer(s)].recalled(m, weight)
                for s, m in memory.get("acceptance", {}).items()}}
            if "stage2_saved" not in memory:
                return Calibrations(by_scorer, acceptance)
            return Calibrations(
                by_scorer, acceptance, self.stage2.recalled(memory["stage2_saved"], weight),
                self.stage2_saved_per_call.recalled(memory["stage2_saved_per_call"], weight),
                self.stage2_width.recalled(memory["stage2_width"], weight))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not calibrations: {exc!r}") from exc

    def observe(self, plan: StepPlan, accepted_nodes: list[int],
                reached: Sequence[float] = ()) -> None:
        """Each calibration the plan names learns its nodes' hits and summed scores, and its
        acceptance map the nodes whose parent the target accepted (the root's children
        included): their probabilities and which of them it accepted. With ``reached``
        (sampled: each node's chance of being reached by the acceptance rule, by node id,
        ``Verdict.reached``), a node's hit is its chance, and a node counts as tried as
        often as its parent is reached: the same sums on average as the drawn verdict's,
        without the spread of the rule's own draws."""
        tree = plan.tree.tree
        kept = set(accepted_nodes)
        if reached:
            hit, tried_as = list(reached), [reached[p] for p in tree.parents[1:]]
        else:
            hit = [float(v in kept) for v in range(len(tree))]
            tried_as = [float(p == 0 or p in kept) for p in tree.parents[1:]]
        totals = {s: [0.0, 0.0] for s in plan.calibrates}
        tried: dict[Scorer, tuple[list[float], list[bool], list[float], list[float]]] = {
            s: ([], [], [], []) for s in plan.calibrates}
        for v in range(1, len(tree)):
            entry = plan.scored.get(tree.path(v))
            if entry is not None and entry[0] in totals:
                totals[entry[0]][0] += hit[v]
                totals[entry[0]][1] += entry[1]
                if tried_as[v - 1] > 0.0:
                    probs, first, hits, weights = tried[entry[0]]
                    probs.append(tree.probs[v])
                    first.append(tree.ranks[v] == 0)
                    hits.append(hit[v])
                    weights.append(tried_as[v - 1])
        for scorer, (hits, predicted) in totals.items():
            self.by_scorer[scorer].add(hits, predicted)
        for scorer, (probs, first, accepted, weights) in tried.items():
            self.acceptance[scorer].add(probs, first, accepted, weights)
        counters = plan.counters
        if getattr(plan.drafter, "lookahead", None) is None:
            return
        saved = saved_calls(plan)
        if counters.stage2_proposed or saved:
            self.stage2.add(saved, counters.stage2_proposed)
        if counters.calls:
            # per call of a staged drafter, the calls that carried no guess included: the
            # sizer prices every call by these, and where guesses rarely pay (sampled trees,
            # whose draws seldom follow the n-gram's greedy guess) a mean over the calls
            # that carried some would price every call as wide as those few
            self.stage2_saved_per_call.add(saved / counters.calls, counters.calls)
            self.stage2_width.add(counters.stage2_proposed / counters.calls, counters.calls)


def saved_calls(plan: StepPlan) -> int:
    """Draft calls a staged step's guesses saved: the draft batches drafting the verified
    tree one level per batch would have taken (a batch for each depth at which a node has
    children the draft model proposed, the root's included), less the batches it took.

    Not the guesses the tree used: a guess the draft agreed with expands its node for free,
    but a level that no batch would have paid for is not a batch saved, and a level whose
    other nodes took a batch anyway saved none; counted as used, guesses looked worth
    several times what they saved, and where a wide draft batch costs much more than a
    narrow one they made drafting slower. The verified tree is the one that paid; batches
    that grew nodes it cut are counted as taken (a saving is never overstated)."""
    tree = plan.tree.tree
    depths = {tree.depths[tree.parents[v]] for v in range(1, len(tree))
              if plan.scored.get(tree.path(v), (None,))[0] is Scorer.DRAFT}
    return max(len(depths) - plan.counters.calls, 0)
