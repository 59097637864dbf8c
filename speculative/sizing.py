"""How much to draft at a step: each draft batch, and each node, only where it pays.

A step's goal is the most tokens per second. Its cost is what drafting takes plus one target
pass over the root and the drafted nodes, ``cost_t(n + 1)``, plus the loop's own overhead; its
yield is the expected number of tokens, 1 + the summed acceptance probabilities of the verified
nodes (a node's probability is estimated as ``min(1, c * score)``: its score, the estimated
chance that the target accepts its path, from how often it accepted nodes of the proposer's
probability so far, corrected by ``c``, the ratio of accepted tokens to predicted ones:
``plan.Calibrations``).

To maximise a ratio yield / time, a step takes an extra piece of work only if the piece's own
ratio beats the ratio reached so far. A draft batch expanding the ``m`` best frontier nodes
costs ``cost_d(m)`` now (a draft forward pass) and more target work later; its expected gain is
each expanded node's score times the typical estimated acceptance of a best child, ``p``, once
per level below (``s * p ** level``, corrected like any node's score), over the next levels.
Because the target's cost curve is concave (the 2nd token of a batch costs more than the
8th), one level alone can look unprofitable while a run of confident levels
pays, so the test looks ahead a few levels (``LOOKAHEAD``) and takes the batch if any horizon
pays. On a GPU or an AMX CPU, where 16 tokens cost little more than one, this drafts deep and
wide; where a second batch token costs most of a pass, only where the draft is confident.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .costmodel import Running, VerifyCost, accepted_estimate

LOOKAHEAD = 8  # levels a draft batch's payoff is looked ahead over


@dataclasses.dataclass(slots=True)
class Sizer:
    """The two cost curves and running estimates of the draft's confidence and the loop's
    overhead: what the adaptive modes size their draft batches and trees by."""

    # the curves as measured; ``locate`` moves them to each step's context
    measured_target: VerifyCost
    measured_draft: VerifyCost | None
    # seconds per step outside the target and the draft (Python bookkeeping), running
    steps_overhead: Running = dataclasses.field(default_factory=lambda: Running(prior=0.0))
    # the estimated acceptance of an expanded node's best child, given the node's (its score
    # over its parent's)
    confidence: Running = dataclasses.field(default_factory=lambda: Running(prior=0.6))
    # where the coming step is priced (``locate``): its context, the last batch's size and
    # the drafted passes' factor (or what gives it); the step's curves are worked out from
    # them when first asked for (a step of the target alone asks for none of the draft's,
    # nor for the factor)
    located: tuple[int, int | None, float | Callable[[], float]] = dataclasses.field(
        init=False)
    _curves: dict[str, VerifyCost | None] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.locate(0, None)

    def locate(self, context: int, last: int | None,
               drafted: float | Callable[[], float] = 1.0) -> None:
        """Price the coming step: after ``context`` tokens of context and, for the target, a
        batch of ``last`` tokens (None: shapes unpriced), its drafted passes ``drafted``
        times as dear against a single token as the measured curve says (what they have
        recently cost in decoding: ``VerifyCost.drafted``; a function giving the factor is
        called when the step first prices a drafted pass)."""
        self.located = (context, last, drafted)
        self._curves = {}

    def _located(self, name: str, make: Callable[[], VerifyCost | None]) -> VerifyCost | None:
        """The step's curve ``name``, made by ``make`` the first time it is asked for."""
        if name not in self._curves:
            self._curves[name] = make()
        return self._curves[name]

    @property
    def curve(self) -> VerifyCost:
        """The target's curve at the step's context, as measured."""
        curve = self._located("curve", lambda: self.measured_target.at(self.located[0]))
        assert curve is not None
        return curve

    @property
    def priced(self) -> VerifyCost:
        """``curve`` as the target's passes cost in decoding (drafted passes against single
        tokens, see ``locate``)."""
        drafted = self.located[2]
        curve = self._located("priced", lambda: self.curve.drafted(
            drafted() if callable(drafted) else drafted))
        assert curve is not None
        return curve

    @property
    def target(self) -> VerifyCost:
        """``priced`` after the last batch's shape: what the step's batch of n tokens costs."""
        curve = self._located("target", lambda: self.priced.after(self.located[1]))
        assert curve is not None
        return curve

    @property
    def draft(self) -> VerifyCost | None:
        """The draft's curve at the step's context (None without a draft)."""
        measured = self.measured_draft
        return self._located("draft", lambda: measured.at(self.located[0])
                             if measured is not None else None)

    @property
    def overhead(self) -> float:
        return self.steps_overhead.value

    def observe(self, best_child_probs: list[float]) -> None:
        for p in best_child_probs:
            self.confidence.add(p)

    def expand(self, frontier: list[float], scores: list[float], t_spent: float,
               calibration: float, levels_left: int, baseline: float = 0.0,
               levels_per_call: float = 1.0, guess_width: float = 0.0,
               floor: float = 0.0) -> int:
        """How many of the best ``frontier`` nodes (scores, best first) to expand with one
        draft batch; 0 stops drafting. ``scores`` are all drafted nodes' scores so far, and
        drafting has taken ``t_spent`` seconds. A batch must yield more tokens per second
        than the step does so far, than the target alone does, and than ``baseline`` (what
        another tree offers). With
        stage 2, a draft batch also decodes ``guess_width`` guessed tokens and yields
        ``levels_per_call`` levels on average (its own, and the guesses the draft agreed
        with), so a level costs that fraction of a wider batch. A sampled tree keeps only
        nodes scoring at least ``floor`` (``drafting.grow_tree``): a node whose best child
        would likely fall under it is not expanded, and levels under it gain nothing."""
        if floor > 0.0:
            frontier = [s for s in frontier if s * self.confidence.value >= floor]
        if self.draft is None or not frontier or levels_left < 1:
            return 0
        n, now = self.best_cut(scores, t_spent, calibration)
        # a batch's extra tokens per extra second must also beat the target alone: the
        # step's own rate, lowered by what drafting has spent so far, is too low a bar
        alone = 1.0 / (self.target(1) + self.overhead)
        best_m, best_ratio = 0, max(now, baseline, alone)
        horizon = min(LOOKAHEAD, levels_left)
        # a frontier node of score s has, ``level`` levels below, a best descendant scoring
        # about s * confidence ** level, accepted with its calibrated estimate
        falls = [self.confidence.value ** level for level in range(horizon + 1)]
        by_level = [0.0] * (horizon + 1)  # the expanded nodes' estimates, level by level
        for m in range(1, len(frontier) + 1):
            for level in range(1, horizon + 1):
                score = frontier[m - 1] * falls[level]
                if score >= floor:
                    by_level[level] += accepted_estimate(score, calibration)
            gain, nodes = 0.0, n
            call = self.draft(m + round(guess_width)) / max(levels_per_call, 1.0)
            for level in range(1, horizon + 1):
                gain += by_level[level]
                nodes += m
                cost = level * call + self.target(nodes + 1) - self.target(n + 1)
                if cost > 0 and gain / cost > best_ratio:
                    best_m, best_ratio = m, gain / cost
        return best_m

    def best_cut(self, scores: list[float], t_spent: float, calibration: float,
                 ) -> tuple[int, float]:
        """(n, tokens per second) of verifying the ``n`` best of ``scores``, the best n."""
        ordered = sorted(scores, reverse=True)
        best_n, best_rate, total = 0, 1.0 / (t_spent + self.target(1) + self.overhead), 0.0
        for n, s in enumerate(ordered, start=1):
            total += accepted_estimate(s, calibration)
            rate = (1.0 + total) / (t_spent + self.target(n + 1) + self.overhead)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n, best_rate

    def least_worth(self) -> float:
        """The acceptance probability a drafted node needs at the very least to pay for its
        place in the batch: the cheapest extra batch token (up to 32) in single-token
        passes. A step runs at no less than the target alone's rate, 1 / cost(1) tokens per
        second, and a node adds its acceptance probability in tokens for the cost of one more
        batch token, so below this no node pays; where batches are nearly free, almost any
        node does."""
        curve = self.priced.curve
        cheapest = min(curve(n + 1) - curve(n) for n in range(1, 32))
        return max(cheapest, 0.0) / curve(1)

    def uniform_worth(self) -> float:
        """The acceptance probability below which no tree pays unless better nodes carry it:
        a tree of n nodes each accepted with probability a beats the target alone when
        1 + n * a > cost(n + 1) / cost(1), so the least such a over trees of up to 31 nodes.
        ``least_worth`` prices one batch token where it is cheapest, which is nothing
        where llama.cpp's kernels work on tiles (a batch one token larger than another can
        cost no more): a fine bound for the node that fills such a slot, no bound for a
        whole tree. Counted from the root, a tile's free slot is shared by every node below
        it. 0 where a second batch token is free."""
        curve = self.priced.curve
        one = curve(1)
        cheapest = min((curve(n + 1) - one) / n for n in range(1, 32))
        return max(cheapest, 0.0) / one
