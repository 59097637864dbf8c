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
  share of the target pass, and the final cut (``costmodel.best_size``) keeps those that pay;
  likewise greedy, the n-gram's own tree is merged into the draft's (``Engine._merge``), its
  branches beside the draft's choices scored by their own measured acceptance.

A step without the draft model verifies the n-gram model's own tree instead (greedy or
sampled, as ``ngram`` mode grows it), cut to the size that pays. Greedy, that tree is grown
first, and the draft runs only if its first batch promises more tokens per second than the
n-gram's tree (scored by the n-gram's probabilities, calibrated on its own steps): on
repetitive text the free n-gram out-guesses the draft, and this is judged at every step.

The model's predictions are checked against what steps really yield: the tokens per second of
steps where the draft ran, of steps with the n-gram's tree only ("guesses"), and of the target
alone, as decayed running rates. A kind of step measured slower than the target alone is not
taken, whatever the model predicts (costs it does not see: the draft's sampling, cache
bookkeeping), and is explored again after ``EXPLORE_EVERY`` steps, since the text's difficulty
drifts (the wait doubles while explorations keep losing, up to ``MAX_BACKOFF`` times; the
n-gram's wait starts over with each reply).

Exploring is paid for from a budget, so that ``auto`` is never much slower than the target
alone: the *regret*, the time steps took beyond what the target alone would have taken for
their tokens (at its measured rate), may reach ``EXPLORE_SHARE`` of the time spent (plus an
allowance of ``EXPLORE_START`` plain steps' time for a fresh start). A kind of step not yet
measured faster than the target alone, by the model's word or as an exploration, runs only
while regret is under budget; a kind measured faster runs regardless, and what it gains
(negative regret) is budget for later explorations. On a machine and a text where nothing
pays, auto then loses at most about that share; where drafting pays, it explores freely.

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
MAX_BACKOFF = 16    # at most this many times longer while explorations keep losing
EXPLORE_SHARE = 0.01  # time auto may lose to unproven kinds of step, as a share of its time
EXPLORE_START = 200   # plain steps' time a fresh planner counts as spent (2 steps to lose)


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
class Rate:
    """Decayed running tokens per second of one kind of step (what a step really yielded): the
    steps' rates averaged with their seconds as weights, i.e. decayed tokens over seconds."""

    mean: Running = dataclasses.field(default_factory=lambda: Running(prior=0.0))
    steps: float = 0.0  # decayed count of the steps seen

    def add(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self.mean.add(tokens / seconds, seconds)
        self.steps = self.mean.decay * self.steps + 1.0

    @property
    def value(self) -> float:
        return self.mean.value


MIN_STEPS = 3.0  # decayed steps of both kinds before measured rates overrule the model


@dataclasses.dataclass(slots=True)
class Planner:
    """What ``auto`` knows: the two cost curves and running estimates of the draft's quality."""

    target: VerifyCost  # priced after the last batch's shape: the engine sets it at each step
    draft: VerifyCost | None
    # seconds per step outside the target and the draft (Python bookkeeping), running
    steps_overhead: Running = dataclasses.field(default_factory=lambda: Running(prior=0.0))
    # the draft's probability of its best child at an expanded node (its confidence)
    confidence: Running = dataclasses.field(default_factory=lambda: Running(prior=0.6))
    # P(an n-gram guess is accepted | its parent was): the chain's per-level hit rate
    ngram_hits: Running = dataclasses.field(default_factory=lambda: Running(prior=0.3))
    idle: int = 0  # steps since the draft last ran
    explore_every: int = EXPLORE_EVERY  # steps between explorations (backs off, see explore)
    # what steps really yielded, by kind: "root" (the target alone), "guesses" (n-gram guesses
    # only), "draft" (the draft model ran). The cost model above predicts; these check it: a
    # kind measured slower than the target alone is not taken (but explored now and then).
    rates: dict[str, Rate] = dataclasses.field(
        default_factory=lambda: {"root": Rate(), "guesses": Rate(), "draft": Rate()})
    guess_idle: int = 0  # steps since n-gram guesses were last verified
    guess_every: int = EXPLORE_EVERY  # steps between n-gram explorations while they lose
    elapsed: float = 0.0  # seconds of all steps observed
    regret: float = 0.0   # their seconds beyond the target alone's for their tokens
    least: float | None = None  # least_worth, once computed

    def explore(self, risk: float = 0.0) -> bool:
        """Draft this step although the estimates say it does not pay: they were made when the
        text was different, and are only updated by steps that draft. (Decided by a counter
        and past steps, never by this step's draws.) Each exploration that finds drafting
        still at a measured loss doubles the wait before the next, up to ``MAX_BACKOFF``
        times; none starts unless the budget holds its ``risk`` (``probe_risk``)."""
        self.idle += 1
        if (self.draft is None or self.idle < self.explore_every
                or not self.within_budget(risk)):
            return False
        lost = self.measured_loss("draft")
        self.explore_every = (min(self.explore_every * 2, EXPLORE_EVERY * MAX_BACKOFF) if lost
                              else EXPLORE_EVERY)
        return True

    def new_text(self, greedy: bool) -> None:
        """A new reply begins: its text may suit the n-gram's trees better than the last
        reply's end did, so their backoff starts over, and greedy (where the tree costs a few
        ms and is sized by the step's own scores) they are explored at the reply's first step.
        Sampled, an exploration is a probe that mostly loses, and the draft model's probe
        costs its catching up on the text since it last ran: probing either at every reply
        cost sampled replies of 48 tokens about 5%."""
        self.guess_every = EXPLORE_EVERY
        if greedy:
            self.guess_idle = EXPLORE_EVERY - 1

    def drafted(self) -> None:
        self.idle = 0

    def observe_step(self, kind: str, tokens: int, seconds: float) -> None:
        """A finished step of ``kind`` ("root", "guesses" or "draft") emitted ``tokens``."""
        self.regret += seconds - tokens * self.plain_seconds()
        self.elapsed += seconds
        self.rates[kind].add(tokens, seconds)

    def plain_seconds(self) -> float:
        """Seconds per token of the target alone: measured, or before any such step, the cost
        model's single-token pass (without the steps' overhead, which the n-gram's trees and
        the draft's catching up inflate: a baseline too slow would book losses as gains)."""
        root = self.rates["root"]
        if root.steps > 0 and root.value > 0:
            return 1.0 / root.value
        return self.target.curve(1)

    def within_budget(self, risk: float = 0.0) -> bool:
        """Whether the regret so far leaves room for a step that may lose up to ``risk``
        seconds (see the module docstring)."""
        allowance = EXPLORE_SHARE * (self.elapsed + EXPLORE_START * self.plain_seconds())
        return self.regret + risk < allowance

    def probe_risk(self, behind: int, length: int) -> float:
        """What a probe may lose: the draft catching up on ``behind`` tokens (it last ran
        that long ago), drafting a chain of ``length`` tokens one by one, and verifying them,
        against one token of the target alone."""
        if self.draft is None:
            return 0.0
        catch_up = self.draft.curve(behind) if behind > 0 else 0.0
        return (catch_up + length * self.draft.curve(1) + self.target(length + 1)
                - self.plain_seconds())

    def proven(self, kind: str) -> bool:
        """Steps of ``kind`` have really been at least as fast as the target alone."""
        mine, root = self.rates[kind], self.rates["root"]
        return (mine.steps >= MIN_STEPS and root.steps >= MIN_STEPS
                and mine.value >= root.value)

    def may_try(self, kind: str) -> bool:
        """A step of ``kind`` may run: proven, or an affordable try (``within_budget``)."""
        return self.proven(kind) or self.within_budget()

    def measured_loss(self, kind: str) -> bool:
        """Steps of ``kind`` have really been slower than the target alone, over enough recent
        steps of both: the cost model's prediction was wrong on this machine (costs it does
        not see: the draft's sampling, cache bookkeeping, a tree's attention mask). (Not
        against each other: greedy, the n-gram's trees win exactly where they were chosen.)"""
        mine, root = self.rates[kind], self.rates["root"]
        return (mine.steps >= MIN_STEPS and root.steps >= MIN_STEPS
                and mine.value < root.value)

    def wants_root(self) -> bool:
        """Take a step with the target alone, to measure it: the other kinds have been
        measured and it has not (the model may have predicted that drafting always pays)."""
        others = self.rates["draft"].steps + self.rates["guesses"].steps
        return self.rates["root"].steps < MIN_STEPS and others >= MIN_STEPS

    def guesses_allowed(self) -> bool:
        """Whether to hang n-gram guesses this step: unless they measured a loss, explored
        again every ``EXPLORE_EVERY`` steps. (A counter and past steps, never this step.)"""
        self.guess_idle += 1
        lost = self.measured_loss("guesses")
        if lost and self.guess_idle < self.guess_every:
            return False
        if not self.may_try("guesses"):
            return False
        self.guess_every = (min(self.guess_every * 2, EXPLORE_EVERY * MAX_BACKOFF) if lost
                            else EXPLORE_EVERY)
        self.guess_idle = 0
        return True

    def expand(self, frontier: list[float], scores: list[float], t_spent: float,
               calibration: float, levels_left: int, baseline: float = 0.0) -> int:
        """How many of the best ``frontier`` nodes (scores, best first) to expand with one
        draft batch; 0 stops drafting. ``scores`` are all drafted nodes' scores so far, and
        drafting has taken ``t_spent`` seconds. A batch must yield more tokens per second
        than the step does so far, and than ``baseline`` (what another tree offers)."""
        if self.draft is None or not frontier or levels_left < 1:
            return 0
        n, now = self.best_cut(scores, t_spent, calibration)
        p = self.confidence.value * calibration
        best_m, best_ratio = 0, max(now, baseline)
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

    def least_worth(self) -> float:
        """The acceptance probability a drafted node needs at the very least to pay for its
        place in the batch: the cheapest extra batch token (up to 32) in single-token
        passes. A step runs at no less than the target alone's rate, 1 / cost(1) tokens per
        second, and a node adds its acceptance probability in tokens for the cost of one more
        batch token, so below this no node pays. ~0.3 on this CPU, ~0 where batches are free."""
        if self.least is None:  # the curve is fixed: once (it is asked at every n-gram step)
            curve = self.target.curve
            cheapest = min(curve(n + 1) - curve(n) for n in range(1, 32))
            self.least = max(cheapest, 0.0) / curve(1)
        return self.least

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
