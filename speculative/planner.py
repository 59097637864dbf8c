"""``auto`` mode: decide each step how much drafting pays on this machine.

The step's goal is the most tokens per second. Its cost is what drafting takes plus one target
pass over the root and the drafted nodes, ``cost_t(n + 1)``; its yield is the expected number
of tokens, 1 + the summed acceptance probabilities of the verified nodes (a node's probability
is estimated as ``c * score``: its draft path probability, calibrated by ``c``, the ratio of
accepted tokens to predicted ones so far).

To maximise a ratio yield / time, a step takes an extra piece of work only if the piece's own
ratio beats the ratio reached so far. Two kinds of pieces:

- a draft batch: expanding the ``m`` best frontier nodes costs ``cost_d(m)`` now (a draft
  forward pass) and more target work later; expected gain: each expanded node's score times
  the draft's typical confidence in its best child, ``p``, over the next levels. Because the
  target's cost curve is concave (the 2nd token of a batch costs more than the 8th), one level
  alone can look unprofitable while a run of confident levels pays, so the test looks ahead a
  few levels (``LOOKAHEAD``) and takes the batch if any horizon pays;
- free n-gram guesses appended below the best drafted leaf (greedy only): they cost only their
  share of the target pass, and the final cut (``costmodel.best_size``) keeps those that pay.

On a GPU or an AMX CPU, where 16 tokens cost little more than one, this drafts deep and wide;
on a CPU whose second batch token costs 0.75 of the first, it drafts only when the draft is
confident, and lets plain decoding run otherwise. Every choice depends on the draft's
distributions and past steps, never on this step's sampled tokens, so ``auto`` is as exact
as the tree modes it is made of.
"""

from __future__ import annotations

import dataclasses

from .costmodel import VerifyCost

LOOKAHEAD = 8  # levels a draft batch's payoff is looked ahead over
EXPLORE_EVERY = 24  # steps without drafting after which the draft is tried once more


@dataclasses.dataclass(slots=True)
class Running:
    """A decayed running mean (recent steps weigh more: the text's difficulty drifts)."""

    total: float = 0.0
    weight: float = 0.0
    decay: float = 0.95
    prior: float = 0.5

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total = self.decay * self.total + value * weight
        self.weight = self.decay * self.weight + weight

    @property
    def value(self) -> float:
        return self.total / self.weight if self.weight > 0 else self.prior


@dataclasses.dataclass(slots=True)
class Planner:
    """What ``auto`` knows: the two cost curves and running estimates of the draft's quality."""

    target: VerifyCost
    draft: VerifyCost | None
    # seconds per step outside the target and the draft (Python bookkeeping), running
    steps_overhead: Running = dataclasses.field(default_factory=lambda: Running(prior=0.0))
    # the draft's probability of its best child at an expanded node (its confidence)
    confidence: Running = dataclasses.field(default_factory=lambda: Running(prior=0.6))
    # P(an n-gram guess is accepted | its parent was): the chain's per-level hit rate
    ngram_hits: Running = dataclasses.field(default_factory=lambda: Running(prior=0.3))
    idle: int = 0  # steps since the draft last ran

    def explore(self) -> bool:
        """Draft this step although the estimates say it does not pay: they were made when the
        text was different, and are only updated by steps that draft. (Decided by a counter,
        never by this step's draws.)"""
        self.idle += 1
        return self.draft is not None and self.idle >= EXPLORE_EVERY

    def drafted(self) -> None:
        self.idle = 0

    def expand(self, frontier: list[float], scores: list[float], t_spent: float,
               calibration: float, levels_left: int) -> int:
        """How many of the best ``frontier`` nodes (scores, best first) to expand with one
        draft batch; 0 stops drafting. ``scores`` are all drafted nodes' scores so far, and
        drafting has taken ``t_spent`` seconds."""
        if self.draft is None or not frontier or levels_left < 1:
            return 0
        n, now = self.best_cut(scores, t_spent, calibration)
        p = self.confidence.value * calibration
        best_m, best_ratio = 0, now
        reach = 0.0
        for m in range(1, len(frontier) + 1):
            reach += frontier[m - 1]
            gain, nodes = 0.0, n
            for level in range(1, min(LOOKAHEAD, levels_left) + 1):
                gain += calibration * reach * p ** level
                nodes += m
                cost = level * self.draft(m) + self.target(nodes + 1) - self.target(n + 1)
                if cost > 0 and gain / cost > best_ratio:
                    best_m, best_ratio = m, gain / cost
        return best_m

    @property
    def overhead(self) -> float:
        return self.steps_overhead.value

    def best_cut(self, scores: list[float], t_spent: float, calibration: float,
                 ) -> tuple[int, float]:
        """(n, tokens per second) of verifying the ``n`` best of ``scores``, the best n."""
        ordered = sorted(scores, reverse=True)
        best_n, best_rate, total = 0, 1.0 / (t_spent + self.target(1) + self.overhead), 0.0
        for n, s in enumerate(ordered, start=1):
            total += s
            rate = (1.0 + calibration * total) / (t_spent + self.target(n + 1) + self.overhead)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n, best_rate

    def ngram_scores(self, leaf_score: float, n: int) -> list[float]:
        """Scores to give ``n`` chained n-gram guesses below a leaf (their expected
        acceptance, before calibration)."""
        h = self.ngram_hits.value
        return [leaf_score * h ** (i + 1) for i in range(n)]

    def observe(self, best_child_probs: list[float]) -> None:
        for p in best_child_probs:
            self.confidence.add(p)

    def observe_ngram(self, offered: int, accepted: int) -> None:
        """A chain of ``offered`` n-gram guesses of which the first ``accepted`` were kept."""
        for i in range(offered):
            self.ngram_hits.add(1.0 if i < accepted else 0.0)
            if i >= accepted:
                break
