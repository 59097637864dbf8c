"""``auto`` mode: each step takes the kind of step that has been fastest here, sized by cost.

Three kinds of step (``StepKind``): the target alone, the n-gram model's tree, and the draft
model's tree (staged: stage-2 guesses cut its draft batches) merged with the n-gram's. With a
draft model loaded, the n-gram's tree is not a kind of its own. Sampled, the draft's tree runs
alone (a node's children must all come from one q, so the n-gram model serves it as stage 2
only): chosen as a kind, the n-gram's tree and the draft's were a few percent apart, which one
held was the noise of the few steps each was measured on, and every return to the draft paid its
catching up. Greedy, the n-gram's tree alone is a choice each step of the draft's kind makes
before running the draft (``AutoPolicy.without_draft``): with the n-gram's tree grown, it prices
the target alone (as such steps take now), that tree alone, and the draft's merged tree (both
from the n-gram tree's expected tokens and seconds, each corrected by how far its steps measured
from that estimate on steps whose n-gram tree looked alike: ``Margin``), and takes the fastest.
On text the n-gram model knows its tree alone runs, where nothing pays the target alone, and the
draft elsewhere, step by step; chosen as a kind, the n-gram's tree ran for dozens of steps at a
time, by rates measured a few noisy steps at a time, and the draft paid its catching up at every
exploration. Within a kind, the cost model sizes the tree (``speculative.sizing``): a draft
batch only where its expected tokens per second beat the step's so far, then the cut that
maximises them; greedy, the n-gram's greedy chain is hung below the draft tree's best leaf and
the n-gram's own tree merged in (``AutoPolicy.merge``), each n-gram branch beside the draft's
choices scored by its own measured acceptance (``Scorer.BRANCHES``), and the final cut keeps
what pays (at least the best node once the draft model has been paid for). A step of the
n-gram's kind (without a draft model) verifies at least its best node, as ``ngram`` does: on a
steep cost curve the model may price a lone node as not paying where ``ngram``'s steps, which
verify it anyway, run faster (docs/results-log.md), and whether it pays is measured instead: the
target alone is a kind of its own, timed in every drafted step's place.

Which kind runs is measured, not predicted: how many tokens per second each kind gave against
the target alone on the same steps (see below; decayed, the text's difficulty drifts), and the
fastest runs. The other drafted kinds are explored again after ``EXPLORE_EVERY`` steps (the
wait doubles while explorations keep surely losing, up to ``MAX_BACKOFF`` times), and a kind
not yet measured is tried first; the target alone, once measured, is not run to be measured
again (it is timed in every drafted step's place, below). An exploration runs ``TRIAL_STEPS``
steps in a row (while the budget below allows): one step is a noisy sample of the text as it is
now, and the draft pays its catching up once per exploration, not per step. What a kind
measured before it sat idle has aged by the steps it sat out (the text has moved on since): a
kind timed on the first steps of a reply, where every new batch shape builds a graph, would
otherwise keep that slow measurement against a few explorations, and lose to a kind measured
since. The draft's catching up on text it skipped while other kinds ran is left out of the
draft's measured speed (a cost of switching, not of the kind: a kind explored one step at a
time would pay it at every step) and priced where switching is decided: the kind that has been
running stays the fastest against one that must catch up until the measured difference, over
the steps the new kind would run, repays the catching up (and the draft's kind, left, against
any other until it repays the catching up that coming back will take), and against any kind
until it leads by more than ``SWITCH_MARGIN``, compared on the same steps where one ran with
the other as its alternative, and by more than ``SWITCH_DOUBTS`` standard errors of that
comparison (the steps' own spread: two kinds about as fast would otherwise alternate with the
noise of their measurements, pay the catching up at every switch, and a kind that won a short
exploration by chance would run until the noise turned), the lead itself weighed against how
far apart kinds usually are (``LEAD_SPREAD``: a lead measured over three scattered steps is
mostly chance, however far it reads). A kind measured faster than the running one by more than
the margin, but not surely, is explored again at once rather than after the wait (the budget
allowing): its own steps are what can make the lead sure, and while it runs faster they refill
the budget they draw on. It is counted in the regret below.

Exploring is paid for from a budget, so that ``auto`` is never much slower than its best kind:
the *regret*, the time explorations (steps of another kind than the fastest) took beyond what
the fastest would have taken for their tokens at that moment (the target alone's time, timed in
each drafted step's place, over the fastest kind's lead: another program's load slows both
alike, and an exploration that ran while the machine was busy would otherwise be charged the
load too, and keep ``auto`` from exploring long after the load had gone), may reach what the
time spent has earned (plus an allowance of ``START_STEPS`` plain steps' time for a fresh
start); a kind other than the fastest runs only while regret is under budget. Each step earns a
share of its seconds, the share of its moment (earned once, kept: a share applied to all the
time spent would take back, when speculation stops paying, what was earned while it paid, and
``auto`` would stop exploring just when the text has changed). The share follows what
speculation gains here: ``EXPLORE_SHARE`` where the fastest kind leads the target alone by
``FULL_SHARE_LEAD`` or more, down to ``EXPLORE_FLOOR`` where nothing has beaten the target
alone (a steep cost curve: every exploration there is a loss unless the text has changed, and
exploring at the full share kept ``auto`` a few percent below plain decoding). The regret is
counted against the fastest kind, not against the target alone: counted against the target
alone, what the fastest kind gains over it would pay for explorations until ``auto`` had lost
its whole lead over plain decoding to them. The first measurements, before any kind is
measured, are not regret. Beyond the budget, a kind whose wait is over is explored where that
is worth what it may cost (``Planner.worth_exploring``): the chance that it now leads, from
its measurement aged by the steps it sat out, times what it would gain over the steps it
would then run, against its catching up and the exploration's expected loss. The budget is a
cap on losses and knows nothing of gains: where the draft's catching up on the steps it sat
out grows faster than the budget is earned, one poor early measurement kept it from running
again at all.

Which kind is fastest is judged on the same text where possible: a step's plan names what the
other kinds would have verified in its place (``Alternative``: greedy, the n-gram's own cut
tree beside a draft step, and the target alone beside every drafted step), and the text the
target writes from there tells exactly how many tokens those would have emitted (``Guessed``: a
tree is followed down the text until it leaves the tree or reaches a leaf); their time is the
step's own outside planning, their planning, and this step's target pass scaled by the cost
curve to their batch. Rates measured at different moments differ more with the text (a new
prompt, a docstring against code) than the kinds differ from each other; paired on the same
steps, the text's difficulty cancels (``Paired``). Where the n-gram's tree is a kind of its own
(without a draft model), a step of the target alone plans the n-gram's tree beside it
(``AutoPolicy.aside``; its planning may take ``ASIDE_SHARE`` of a target-alone step's
time, no more): greedy, decided by the text as above; sampled, priced by the step's own target
pass (its distributions where the step's tree shares the n-gram tree's paths, the root's
children always: ``verify.verify_sampling``'s ``beside``); either way, timed beside the target
alone it is the n-gram kind's speed against it (``Planner.with_root``). Once the target alone
ran, the n-gram's kind was otherwise measured only by explorations, each a loss while the text
was hard (on a steep curve a wrong guess verified costs much of a pass more), their waits
doubling while they lost, and the target alone ran on for hundreds of steps where the n-gram's
kind had become the faster. The wait before exploring a kind counts from when it was
last timed against the fastest (``Planner.since``), not from when it last ran. A sampled step
counts the tokens its tree yields on average over the acceptance rule's draws
(``Verdict.expected``), not the ones it drew: by the draws alone one step emits 1 token and the
next 5, and kinds a few percent apart are told apart only after many steps.

What was measured carries over: from one sampling to the other and back (sampled trees accept
far less than greedy ones, so each sampling has its own measurements), and, through
``Planner.memory`` and ``Planner.recall``, from one run of the app to the next on the same models
and machine. A recalled measurement counts as ``RECALL_STEPS`` steps, enough to be trusted from
the first step and soon outweighed by the run's own: a new run starts with the kind that was
fastest, instead of paying again to find it (the first reply of a fresh start would otherwise
measure every kind, the draft's reading of the prompt included).

Every choice depends on past steps and this step's distributions, never on this step's sampled
tokens, so ``auto`` is as exact as the tree modes it is made of.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .costmodel import Running, VerifyCost, accepted_estimate, recalled_sums, shrink
from .drafting import (
    DraftCounters,
    DraftTree,
    ModelDrafter,
    NgramDrafter,
    TreeBudget,
    grow_tree,
)
from .plan import Alternative, Path, Scorer, StepKind, StepPlan
from .policies import (
    Outcome,
    Resources,
    StepInput,
    drafting_time,
    grow,
)
from .sizing import Sizer
from .tree import TokenTree

log = logging.getLogger(__name__)

EXPLORE_EVERY = 24  # steps after which a kind of step not the fastest is tried again
MAX_BACKOFF = 16    # at most this many times longer while explorations keep losing
EXPLORE_SHARE = 0.02   # time auto may lose to exploring, as a share of its time, at most
EXPLORE_FLOOR = 0.005  # ... and at least, where no kind has beaten the target alone
FULL_SHARE_LEAD = 0.1  # the fastest kind's lead over the target alone that earns the most
START_STEPS = 4        # plain steps' time a fresh planner may lose to exploring
MIN_STEPS = 3.0  # decayed steps of a kind before its measured rate counts
HOLD_STEPS = EXPLORE_EVERY  # steps a newly fastest kind is expected to run, at the least
TRIAL_STEPS = 3  # steps in a row an exploration runs (the budget allowing)
EXPECTED_RUN = 4 * EXPLORE_EVERY  # steps a kind that takes over is expected to run (it
                                  # runs until another is surely faster)
SWITCH_MARGIN = 0.03  # how much faster than the running kind another must be to take over
SWITCH_DOUBTS = 1.0   # ... beyond this many standard errors of the measured difference
LEAD_SPREAD = 0.2  # how far apart (in log speed) kinds usually are: what a measured lead is
                   # weighed against (``Planner.lead``)
PAIR_DECAY = 0.95  # a paired timing's weight after each later step (``Paired``)
ASIDE_SHARE = 0.02  # time planning the n-gram's tree beside target-alone steps may take
RECALL_STEPS = MIN_STEPS  # decayed steps a measurement recalled from an earlier run counts as
MARGIN_DECAY = 0.97  # the weight of a step's measured miss of its estimate after each later
                     # such step of the same bin (``Missed``)
MARGIN_BINS = (1.5, 2.5)  # the n-gram tree's expected tokens that bound the margins' bins
DRAFT_DOUBTS = 1.0  # standard errors of its steps' tokens the draft is given the benefit of


@dataclasses.dataclass(slots=True)
class Rate:
    """Decayed running tokens per second of one kind of step (what a step really yielded): the
    steps' rates averaged with their seconds as weights, i.e. decayed tokens over seconds."""

    mean: Running = dataclasses.field(default_factory=lambda: Running(prior=0.0))
    steps: float = 0.0  # decayed count of the steps seen

    def add(self, tokens: float, seconds: float) -> None:
        if seconds > 0:
            self.mean.add(tokens / seconds, seconds)
        self.steps = self.mean.decay * self.steps + 1.0

    def age(self, steps: int) -> None:
        """Decay by ``steps`` steps of other kinds, as if each had been one of this kind's."""
        k = self.mean.decay ** steps
        self.mean.total, self.mean.weight, self.steps = (
            self.mean.total * k, self.mean.weight * k, self.steps * k)

    @property
    def value(self) -> float:
        return self.mean.value

    @property
    def measured(self) -> bool:
        return self.steps >= MIN_STEPS

    def memory(self) -> list[float]:
        return [self.mean.total, self.mean.weight, self.steps]

    @classmethod
    def recalled(cls, memory: Sequence[float], steps: float) -> Rate:
        """A rate from ``memory``, weighing ``steps`` steps at most."""
        total, weight, seen = recalled_sums(memory, 3)
        k = shrink(seen, steps)
        return cls(Running(total * k, weight * k, prior=0.0), min(seen, steps))


@dataclasses.dataclass(slots=True)
class Paired:
    """Two kinds timed on the same steps: one as it ran, the other as what it would have
    verified there and how long that would have taken (``counterfactual``). Decayed sums, so
    the ratio of their rates follows the text as it changes; and of each step's log ratio of
    the two rates, so that how far one step differs from another (a step accepts 1 token or
    6) says how much the pooled ratio can be trusted (``doubt``)."""

    tokens: float = 0.0      # the kind that ran
    seconds: float = 0.0
    alt_tokens: float = 0.0  # the other, on the same steps
    alt_seconds: float = 0.0
    steps: float = 0.0
    logs: float = 0.0     # sum of the steps' log(rate / alt rate)
    squares: float = 0.0  # ... and of its squares
    decay: float = PAIR_DECAY

    def add(self, tokens: float, seconds: float, alt_tokens: float, alt_seconds: float,
            ) -> None:
        d = self.decay
        self.tokens = d * self.tokens + tokens
        self.seconds = d * self.seconds + seconds
        self.alt_tokens = d * self.alt_tokens + alt_tokens
        self.alt_seconds = d * self.alt_seconds + alt_seconds
        self.steps = d * self.steps + 1.0
        ratio = (math.log(tokens * alt_seconds / (seconds * alt_tokens))
                 if min(tokens, seconds, alt_tokens, alt_seconds) > 0 else 0.0)
        self.logs = d * self.logs + ratio
        self.squares = d * self.squares + ratio * ratio

    def age(self, steps: int) -> None:
        """Decay by ``steps`` steps in which this pair was not timed."""
        k = self.decay ** steps
        self.tokens, self.seconds, self.alt_tokens, self.alt_seconds, self.steps = (
            self.tokens * k, self.seconds * k, self.alt_tokens * k, self.alt_seconds * k,
            self.steps * k)
        self.logs, self.squares = self.logs * k, self.squares * k

    @property
    def measured(self) -> bool:
        return self.steps >= MIN_STEPS and min(self.seconds, self.alt_seconds,
                                               self.alt_tokens) > 0

    @property
    def advantage(self) -> float:
        """The ran kind's rate over the other's on the same steps."""
        return (self.tokens / self.seconds) / (self.alt_tokens / self.alt_seconds)

    @property
    def doubt(self) -> float:
        """The standard error of the log of ``advantage``: the steps' log ratios' spread over
        the square root of their (decayed) number."""
        if self.steps <= 0:
            return math.inf
        mean = self.logs / self.steps
        spread = max(self.squares / self.steps - mean * mean, 0.0)
        return math.sqrt(spread / self.steps)

    def memory(self) -> list[float]:
        return [self.tokens, self.seconds, self.alt_tokens, self.alt_seconds, self.steps,
                self.logs, self.squares]

    @classmethod
    def recalled(cls, memory: Sequence[float], steps: float) -> Paired:
        """Timings from ``memory``, weighing ``steps`` steps at most (their ratio kept); a
        memory without the steps' log ratios (an older version's) is as sure as it is
        many."""
        memory = list(memory)
        if len(memory) == 5:
            memory += [0.0, 0.0]
        if len(memory) != 7:
            raise ValueError(f"not a pair's timings: {memory!r}")
        *sums, seen = recalled_sums(memory[:5], 5)
        logs, squares = (float(x) for x in memory[5:])
        if not (math.isfinite(logs) and math.isfinite(squares) and squares >= 0.0):
            raise ValueError(f"not a pair's timings: {memory!r}")
        k = shrink(seen, steps)
        return cls(*(x * k for x in sums), min(seen, steps), logs * k, squares * k)


@dataclasses.dataclass(slots=True)
class Missed:
    """How far steps of one choice measured from what they were estimated to emit and take
    when planned: decayed sums of the tokens and the seconds beyond the estimate."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0
    squares: float = 0.0  # of the tokens beyond the estimate: their spread
    decay: float = MARGIN_DECAY

    def add(self, tokens: float, seconds: float) -> None:
        d = self.decay
        self.tokens, self.seconds = d * self.tokens + tokens, d * self.seconds + seconds
        self.squares = d * self.squares + tokens * tokens
        self.steps = d * self.steps + 1.0

    @property
    def measured(self) -> bool:
        return self.steps >= MIN_STEPS

    def mean(self) -> tuple[float, float]:
        """The tokens and seconds beyond the estimate, on average (0, 0 before any step)."""
        if self.steps <= 0.0:
            return 0.0, 0.0
        return self.tokens / self.steps, self.seconds / self.steps

    def doubt(self) -> float:
        """The standard error of the mean tokens beyond the estimate (a step emits one token
        or several, far more than choices differ by on average)."""
        if self.steps <= 1.0:
            return 0.0
        mean = self.tokens / self.steps
        return math.sqrt(max(self.squares / self.steps - mean * mean, 0.0) / self.steps)

    def memory(self) -> list[float]:
        return [self.tokens, self.seconds, self.steps, self.squares]

    @classmethod
    def recalled(cls, memory: Sequence[Any], steps: float) -> Missed:
        """The sums of ``memory()``, weighing ``steps`` steps at most (their means kept);
        ValueError for what is not four finite sums, the steps and squares not negative
        (the misses themselves may be)."""
        values = [float(x) for x in memory]
        if len(values) != 4 or not all(math.isfinite(x) for x in values) or min(
                values[2:]) < 0.0:
            raise ValueError(f"not a choice's misses: {memory!r}")
        tokens, seconds, seen, squares = values
        k = shrink(seen, steps)
        return cls(tokens * k, seconds * k, min(seen, steps), squares * k)


@dataclasses.dataclass(slots=True)
class Margin:
    """What prices a greedy step of the draft's kind before it runs
    (``AutoPolicy.without_draft``), for steps whose n-gram tree was expected to emit about as
    many tokens (``MARGIN_BINS``): how far steps that ran the draft, and the n-gram's cut
    tree, each measured from that tree's estimate (its calibrated scores' tokens; the
    planning so far, the loop after a pass and the cost curve's price of its pass). Both
    choices are priced from one estimate, corrected by what each measured: the draft's
    steps as they ran (less their catching up), the n-gram's tree where it ran alone and,
    beside steps that ran the draft, as the text decided it (``Guessed``). Each choice is
    then priced as it runs, whatever the estimate's error: priced as the n-gram tree's
    estimate plus what running the draft added beside it, the draft's step inherited that
    estimate's errors (where the n-gram's nodes are unsure, its tokens low), and read slower
    than the target alone where it ran faster. Kept apart by bin: where the
    n-gram model knows the text (a run of indentation, a repeated name) its tree often emits
    more than the merged tree's cut keeps of it, and where it does not the draft adds most
    of the step's tokens; averaged together, the one hid the other."""

    drafted: Missed = dataclasses.field(default_factory=Missed)
    ngram: Missed = dataclasses.field(default_factory=Missed)

    def memory(self) -> list[list[float]]:
        return [self.drafted.memory(), self.ngram.memory()]

    @classmethod
    def recalled(cls, memory: Sequence[Any], steps: float) -> Margin:
        """``memory()``'s two choices, each weighing ``steps`` steps at most; ValueError for
        what cannot be read."""
        drafted, ngram = memory
        return cls(Missed.recalled(drafted, steps), Missed.recalled(ngram, steps))


def _backoff(every: int, lost: bool) -> int:
    """The wait before the next exploration: doubled while explorations keep losing."""
    return min(every * 2, EXPLORE_EVERY * MAX_BACKOFF) if lost else EXPLORE_EVERY


def _rates() -> dict[StepKind, Rate]:
    return {kind: Rate() for kind in StepKind}


def _counts(value: int) -> dict[StepKind, int]:
    return dict.fromkeys(StepKind, value)


def _sampling(greedy: bool) -> str:
    return "greedy" if greedy else "sampled"


@dataclasses.dataclass(slots=True)
class Planner:
    """What ``auto`` has measured of its steps: each kind's rate, when to explore each, the
    regret budget, how far the target follows the n-gram's guesses, what running the draft
    gains over the n-gram's tree, and the loop's time after a pass. An engine hands it on
    (``Engine.learned``), so it outlives the policy that measured it. Sizing uses
    ``sizer``."""

    sizer: Sizer
    # P(an n-gram guess is accepted | its parent was): the chain's per-level hit rate
    ngram_hits: Running = dataclasses.field(default_factory=lambda: Running(prior=0.3))
    rates: dict[StepKind, Rate] = dataclasses.field(default_factory=_rates)
    # (kind that ran, kind it was compared with on the same steps) -> their paired timings
    pairs: dict[tuple[StepKind, StepKind], Paired] = dataclasses.field(default_factory=dict)
    idle: dict[StepKind, int] = dataclasses.field(default_factory=lambda: _counts(0))
    steps: int = 0  # steps observed (the one being observed included)
    # the step at which each kind was last timed against the target alone (``with_root``):
    # as it ran, beside a step of another kind, or beside a target-alone step
    timed: dict[StepKind, int] = dataclasses.field(default_factory=lambda: _counts(0))
    every: dict[StepKind, int] = dataclasses.field(
        default_factory=lambda: _counts(EXPLORE_EVERY))
    greedy: bool | None = None  # the sampling the rates were measured under
    elapsed: float = 0.0  # seconds of all steps observed
    earned: float = 0.0   # the budget they earned: each step's seconds times its share
    regret: float = 0.0   # their seconds beyond the fastest kind's for their tokens, at the time
    held: StepKind | None = None  # the kind ``fastest`` named after the last step
    # the kinds the policy chooses among (it sets them as it plans: greedy with a draft
    # model, the n-gram's tree is no kind of its own), what a step is compared with
    kinds: tuple[StepKind, ...] = tuple(StepKind)
    trial: StepKind | None = None  # the kind being explored, and its steps still to run
    trial_left: int = 0
    # greedy with a draft model: how running the draft, and the n-gram's tree alone, measured
    # from that tree's estimate, by how many tokens it was expected to emit (``Margin``;
    # ``AutoPolicy.without_draft``)
    margins: list[Margin] = dataclasses.field(
        default_factory=lambda: [Margin() for _ in range(len(MARGIN_BINS) + 1)])
    # a step of the target alone at this moment, pass and loop (``Outcome.t_alone``): what
    # ``without_draft`` prices the target alone by (the cost curve's bare pass is timed
    # back to back, without the logits read, the penalties and the loop of a step)
    alone: Running = dataclasses.field(default_factory=lambda: Running(decay=0.9))
    # the loop's time after the target's pass, by the kind of step: a tree's commit and
    # bookkeeping take longer than a lone token's
    after: dict[StepKind, Running] = dataclasses.field(
        default_factory=lambda: {k: Running(prior=0.0) for k in StepKind})
    # seconds a kind must spend catching up before its next step (``observe_catch_up``)
    catch_up: dict[StepKind, float] = dataclasses.field(default_factory=dict)
    # the draft's measured catching up, seconds per token skipped (``observe_caught_up``)
    caught_up: Running = dataclasses.field(default_factory=lambda: Running(decay=0.9))
    # what was measured under the sampling not running now (or recalled, not yet running), by
    # ``_sampling`` name: picked up again when a reply of that sampling begins (``new_text``),
    # each measurement weighing that many steps at most (put aside in this run: all it had)
    stashed: dict[str, tuple[dict[str, Any], float]] = dataclasses.field(default_factory=dict)

    # --- questions (they change nothing) ---

    def best_seconds(self, best: StepKind | None) -> float:
        """Seconds per token of ``best`` (the fastest measured kind), at most the target
        alone's (``plain_seconds``, also what it is before any kind is measured)."""
        speed = self.speed(best) if best is not None else 1.0
        return self.plain_seconds() / max(speed, 1.0)

    def best_now(self, best: StepKind,
                 alternatives: Sequence[tuple[StepKind, float, float]] = ()) -> float:
        """Seconds per token of ``best`` at the moment of a step: the target alone's time
        timed in the step's place (``alternatives``), over ``best``'s lead on it, where the
        step has that; otherwise ``best_seconds``. Another program's load slows the step and
        its counterpart alike, and an exploration that ran while the machine was busy is
        charged what it lost against the fastest kind, not the load as well."""
        for kind, tokens, seconds in alternatives:
            if kind is StepKind.ROOT and tokens > 0 and seconds > 0:
                return seconds / tokens / max(self.speed(best), 1.0)
        return self.best_seconds(best)

    def plain_seconds(self) -> float:
        """Seconds per token of the target alone: measured, or before any such step, the cost
        model's single-token pass."""
        root = self.rates[StepKind.ROOT]
        if root.steps > 0 and root.value > 0:
            return 1.0 / root.value
        return self.sizer.target.curve(1)

    def runs_first(self, kind: StepKind) -> bool:
        """Whether a new reply's first steps will likely be of ``kind``: the fastest so far,
        or, not yet measured, to be measured."""
        return not self.rates[kind].measured or self.held is kind

    def within_budget(self, risk: float = 0.0) -> bool:
        """Whether the regret so far leaves room to explore a step that may lose up to ``risk``
        seconds more (see the module docstring)."""
        plain = self.plain_seconds()
        allowance = self.earned + START_STEPS * plain
        return self.regret + risk < allowance

    def explore_share(self) -> float:
        """The share of its time ``auto`` may lose to exploring: from ``EXPLORE_FLOOR`` where
        the fastest kind is the target alone (or no faster) to ``EXPLORE_SHARE`` where it
        leads by ``FULL_SHARE_LEAD`` (before anything is measured: the most)."""
        return self._share(self.fastest(self.kinds))

    def _share(self, best: StepKind | None) -> float:
        """``explore_share`` where ``best`` is the fastest of the kinds in play (``kinds``)."""
        lead = self.speed(best) - 1.0 if best is not None else FULL_SHARE_LEAD
        return EXPLORE_FLOOR + (EXPLORE_SHARE - EXPLORE_FLOOR) * min(
            max(lead, 0.0) / FULL_SHARE_LEAD, 1.0)

    def speed(self, kind: StepKind) -> float:
        """How fast ``kind`` is, as its rate over the target alone's: measured on the same
        steps where possible (every drafted step is timed against the target alone in its
        place, ``Paired``), otherwise from the rates measured apart. One scale for all kinds,
        so that the fastest is well defined (pairs measured at different moments need not
        agree with each other)."""
        if kind is StepKind.ROOT:
            return 1.0
        pair = self.pairs.get((kind, StepKind.ROOT))
        if pair is not None and pair.measured:
            return pair.advantage
        root = self.rates[StepKind.ROOT].value
        rate = self.rates[kind].value
        return rate / root if root > 0 else rate * self.plain_seconds()

    def fastest(self, kinds: Sequence[StepKind]) -> StepKind | None:
        """The measured kind of ``kinds`` with the highest ``speed``, or None; but the kind
        that has been running (``held``) stays the fastest until another is faster by more
        than ``SWITCH_MARGIN`` (compared on the same steps where they were: ``relative``)
        and the switch pays: the catching up (the draft, on the text it skipped:
        ``catch_up``) costs its seconds at once, the speed difference gains only over the
        steps the new kind then runs (``HOLD_STEPS`` at least, before anything is explored
        again). Two kinds about as fast would otherwise alternate with the noise of their
        measured speeds, and the draft would catch up at every switch. A drafted kind must
        lead surely (by ``SWITCH_DOUBTS`` standard errors beyond the margin): it was measured
        over a few explorations. The target alone needs only the margin (its lead weighed as
        ``lead`` weighs any): it is timed in the place of every step the running kind takes,
        so its lead is measured on all of them, and a switch to it costs nothing; held to
        the doubt of steps that emit 1 token or 5, a drafted kind slower than the target alone
        by a fifth kept running for hundreds of steps. Leaving the draft's kind has a cost
        of its own, paid later (``returning``): coming back, the draft catches up on every
        step it sat out, and a switch that gains less than that over the steps it runs is
        not taken (kinds about as fast would otherwise trade places with the text's easy and
        hard stretches, and the draft catch up at every return). Of the kinds faster than the
        running one, the fastest that may take over does: the pair that keeps the fastest
        from taking over (the draft's steps with the n-gram's tree priced beside them, read
        slower than it) says nothing of the target alone, and the n-gram's kind, running
        slower than the target alone, kept running while the draft could not take over."""
        measured = sorted((k for k in kinds if self.rates[k].measured), key=self.speed,
                          reverse=True)
        if not measured:
            return None
        held = self.held
        if held is None or held not in measured:
            return measured[0]
        # the fastest kind that would take over; one that cannot (its lead on the running
        # kind, measured on the same steps, is not sure) does not keep a slower one that
        # can from taking over (the target alone from a kind measured slower than it)
        for top in measured[:measured.index(held)]:
            lead, doubt = self.lead(top, held)
            doubts = 0.0 if top is StepKind.ROOT else SWITCH_DOUBTS
            if lead <= math.log1p(SWITCH_MARGIN) + doubts * doubt:
                continue
            gain = (1.0 - math.exp(-lead)) * HOLD_STEPS * self.plain_seconds()
            if gain > self.catch_up.get(top, 0.0) + self.returning(held):
                return top
        return held

    def returning(self, kind: StepKind) -> float:
        """Seconds that coming back to ``kind`` after ``HOLD_STEPS`` steps of another costs
        before its first step: the draft's catching up on them, for the draft's kind (the
        n-gram model reads the text for next to nothing, the target alone nothing)."""
        return self.catching_up(HOLD_STEPS) if kind is StepKind.DRAFT else 0.0

    def catching_up(self, tokens: int) -> float:
        """Seconds the draft will take to catch up on ``tokens`` it skipped: as measured on
        its returns so far (``observe_caught_up``), or before any, on its cost curve (which
        prices a batch that wide by extending the slope of the sizes it was timed at, and
        can put it at twice what it takes)."""
        if self.caught_up.weight > 0:
            return self.caught_up.value * tokens
        draft = self.sizer.draft
        return draft.curve(tokens) if draft is not None else 0.0

    def lead(self, a: StepKind, b: StepKind, sat_out: int = 0) -> tuple[float, float]:
        """How far ``a`` leads ``b`` (log of ``relative``) as far as the steps can tell, and
        the standard error of that: the measured lead weighed against how far apart kinds
        usually are (``LEAD_SPREAD``), as a normal prior on it centred on no lead. A lead
        measured over a few scattered steps (an exploration whose first step emitted 7
        tokens, the next 1) is mostly chance and counts for little; one measured over many
        steady ones counts nearly in full. ``sat_out``: steps since ``a`` last ran, by which
        its measurement has aged (the text has moved on: a pair's evidence decays by
        ``PAIR_DECAY`` a step, and its doubt grows as the evidence left shrinks)."""
        measured = math.log(max(self.relative(a, b), 1e-9))
        doubt = self.doubt(a, b) / math.sqrt(max(PAIR_DECAY ** sat_out, 1e-12))
        trust = LEAD_SPREAD ** 2 / (LEAD_SPREAD ** 2 + doubt ** 2)
        return trust * measured, doubt * math.sqrt(trust)

    def relative(self, a: StepKind, b: StepKind) -> float:
        """How much faster ``a`` is than ``b``: timed on the same steps where one ran with the
        other as its alternative (the text's difficulty cancels), else by their ``speed``."""
        pair = self.pairs.get((a, b))
        if pair is not None and pair.measured:
            return pair.advantage
        pair = self.pairs.get((b, a))
        if pair is not None and pair.measured:
            return 1.0 / pair.advantage
        return self.speed(a) / self.speed(b)

    def ahead(self, kind: StepKind, best: StepKind | None) -> bool:
        """Whether ``kind``, measured, is faster than ``best`` by more than ``SWITCH_MARGIN``
        as measured (however unsure): on the same steps (``relative``), and by each one's
        speed over the target alone now (``speed``). A pair of the two was timed on the
        steps where ``best`` ran, and ``kind``'s own steps do not change it; read on that
        alone, a kind that led on a few steps long ago would be explored at every step
        while its own steps ran slower than ``best``, each charged to the regret."""
        if best is None or not self.rates[kind].measured:
            return False
        now = self.speed(kind) / self.speed(best)
        return min(self.relative(kind, best), now) > 1.0 + SWITCH_MARGIN

    def doubt(self, a: StepKind, b: StepKind) -> float:
        """How far ``relative(a, b)`` may be off by chance, as the standard error of its log:
        its pair's (``Paired.doubt``), or where it is read off two pairs with the target
        alone, both of theirs; 0 where rates measured apart decide (nothing to tell)."""
        for pair in (self.pairs.get((a, b)), self.pairs.get((b, a))):
            if pair is not None and pair.measured:
                return pair.doubt
        doubts = [p.doubt for p in (self.pairs.get((k, StepKind.ROOT)) for k in (a, b))
                  if p is not None and p.measured]
        return math.sqrt(sum(d * d for d in doubts))

    def choose(self, kinds: Sequence[StepKind],
               risks: Mapping[StepKind, float] | None = None) -> StepKind:
        """The kind of step to take now, among ``kinds`` (in the order to try them while none
        is measured): a kind not yet measured, or one whose wait is over, while the budget
        allows it and what switching to it costs (``risks``: the draft's catching up on text
        it skipped); otherwise the fastest measured one. The target alone is the baseline the
        budget is counted against: measuring it never needs the budget (a kind that loses to
        it must not keep it from being measured)."""
        best = self.fastest(kinds)
        trial = self.trial
        if (self.trial_left > 0 and trial in kinds and trial is not best
                and (self.within_budget() or self.worth_exploring(trial, best, 0.0))):
            return trial  # an exploration under way (its catching up paid)
        # a kind not yet measured first, then one due to be explored (below)
        for kind in sorted(kinds, key=lambda k: self.rates[k].measured):
            if kind is best:
                continue
            # the target alone, once measured, is timed in every drafted step's place
            # (``counterfactuals``): running it again tells nothing new. A kind measured
            # faster than the fastest (by more than the margin, not yet surely: ``fastest``
            # holds on) is explored again at once: its steps are what can make the lead sure,
            # and while it runs faster than the fastest they refill the budget they draw on
            due = not self.rates[kind].measured or (kind is not StepKind.ROOT and (
                self.since(kind, best) + 1 >= self.every[kind] or self.ahead(kind, best)))
            risk = (risks or {}).get(kind, 0.0)
            if due and (best is None or kind is StepKind.ROOT or self.within_budget(risk)
                        or self.worth_exploring(kind, best, risk)):
                return kind
        return best if best is not None else kinds[-1]

    def worth_exploring(self, kind: StepKind, best: StepKind, risk: float) -> bool:
        """Whether exploring ``kind`` now is worth more than it may cost, whatever the budget:
        the chance that it leads ``best`` by more than ``SWITCH_MARGIN``, times what it would
        then gain over the ``EXPECTED_RUN`` steps a kind that takes over runs, against
        ``risk`` (catching up) and what the exploration's steps lose if it is as far behind
        as measured. Its lead is read as ``lead`` reads any, aged by the steps it sat out
        (a poor measurement of long ago says little of the text now). The budget alone
        starves a kind whose catching up grows, step by step, faster than the budget is
        earned (the draft reading every token it skipped, on a host where a draft batch's
        tokens cost a few percent of a target pass each): one poor measurement at a fresh
        start, on text the draft did not yet know, kept the draft's kind from running again
        for hundreds of steps where it was the fastest. A kind that surely lost its
        explorations waits longer between them (``every``), so this asks again only as
        often."""
        need = math.log1p(SWITCH_MARGIN)
        lead, doubt = self.lead(kind, best, self.since(kind, best))
        if doubt <= 0.0:
            ahead, expected = float(lead > need), lead
        else:  # the normal's tail beyond the margin: its mass and its mean
            a = (need - lead) / doubt
            ahead = 0.5 * math.erfc(a / math.sqrt(2.0))
            density = math.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
            expected = lead + doubt * density / max(ahead, 1e-12)
        plain = self.best_seconds(best)
        value = ahead * (1.0 - math.exp(-expected)) * EXPECTED_RUN * plain
        loss = TRIAL_STEPS * max(1.0 - math.exp(lead), 0.0) * plain
        return value > risk + loss

    def ngram_scores(self, leaf_score: float, n: int) -> list[float]:
        """Scores to give ``n`` chained n-gram guesses below a leaf (their expected
        acceptance, before calibration)."""
        h = self.ngram_hits.value
        return [leaf_score * h ** (i + 1) for i in range(n)]

    # --- what happened ---

    def new_text(self, greedy: bool) -> None:
        """A new reply begins; what was measured under the other sampling does not carry over
        (sampled trees accept far less than greedy ones): it is put aside, and what was
        measured under this one before, if anything, is picked up again."""
        if greedy == self.greedy:
            return
        if self.greedy is not None:
            self.stashed[_sampling(self.greedy)] = (self._measures(), math.inf)
            self.rates, self.every = _rates(), _counts(EXPLORE_EVERY)
            self.idle, self.timed = _counts(0), _counts(self.steps)
            self.pairs, self.held = {}, None
            self.trial, self.trial_left = None, 0
        self.greedy = greedy
        stashed = self.stashed.pop(_sampling(greedy), None)
        if stashed is not None:
            try:
                self._restore(*stashed)
            except (KeyError, TypeError, ValueError) as exc:
                log.info("auto's measurements of %s steps not recalled: %r",
                         _sampling(greedy), exc)

    def memory(self) -> dict[str, Any]:
        """What this planner measured, as JSON-able data for a later run on the same models
        and machine (``recall``): each sampling's rates and paired timings of every kind, the
        waits before exploring each, the kind that ran last, the n-gram's hit rate, how far
        each greedy choice of the draft's kind measured from its estimate (``margins``), and
        a target-alone step's time (``alone``)."""
        sampling = {name: measures for name, (measures, _) in self.stashed.items()}
        if self.greedy is not None:
            sampling[_sampling(self.greedy)] = self._measures()
        return {"sampling": sampling, "ngram_hits": self.ngram_hits.memory(),
                "margins": [m.memory() for m in self.margins], "alone": self.alone.memory()}

    def recall(self, memory: Mapping[str, Any]) -> None:
        """Carry on from ``memory()`` of an earlier run, each measurement counting as
        ``RECALL_STEPS`` steps at most; taken up when a reply of its sampling begins (a
        planner that has measured something of its own keeps that). Raises ValueError for a
        memory it cannot read."""
        try:
            sampling = {str(name): dict(m) for name, m in memory["sampling"].items()}
            hits = self.ngram_hits.recalled(memory["ngram_hits"], RECALL_STEPS)
            # (an older version's memory has neither: they are measured afresh)
            margins = [Margin.recalled(m, RECALL_STEPS) for m in memory.get("margins", [])]
            if margins and len(margins) != len(self.margins):
                raise ValueError(f"{len(margins)} margins, not {len(self.margins)}")
            alone = (self.alone.recalled(memory["alone"], RECALL_STEPS) if "alone" in memory
                     else self.alone)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"not a planner's memory: {exc!r}") from exc
        if self.elapsed > 0:
            return  # measured here already: newer than the memory
        self.ngram_hits, self.alone = hits, alone
        self.margins = margins or self.margins
        self.stashed = {name: (m, RECALL_STEPS) for name, m in sampling.items()}
        if self.greedy is not None:  # a reply's sampling is known: take its measurements
            greedy, self.greedy = self.greedy, None
            self.new_text(greedy)

    def _measures(self) -> dict[str, Any]:
        """This sampling's measurements (see ``memory``)."""
        return {"rates": {k.value: r.memory() for k, r in self.rates.items()},
                "pairs": [[a.value, b.value, *p.memory()] for (a, b), p in self.pairs.items()],
                "every": {k.value: n for k, n in self.every.items()},
                "held": self.held.value if self.held is not None else None}

    def _restore(self, measures: Mapping[str, Any], steps: float) -> None:
        """Take up ``_measures()`` of an earlier run or sampling, each weighing ``steps``
        steps at most; the waits before exploring start over from the recalled ones."""
        rates = {StepKind(k): Rate.recalled(m, steps) for k, m in measures["rates"].items()}
        pairs = {(StepKind(a), StepKind(b)): Paired.recalled(m, steps)
                 for a, b, *m in measures["pairs"]}
        every = {StepKind(k): min(max(int(n), 1), EXPLORE_EVERY * MAX_BACKOFF)
                 for k, n in measures["every"].items()}
        held = StepKind(measures["held"]) if measures["held"] is not None else None
        self.rates = {**_rates(), **rates}
        self.pairs = pairs
        self.every = {**_counts(EXPLORE_EVERY), **every}
        self.idle, self.timed = _counts(0), _counts(self.steps)
        self.held = held

    def observe_step(self, kind: StepKind, tokens: float, seconds: float,
                     switch: float = 0.0,
                     alternatives: Sequence[tuple[StepKind, float, float]] = ()) -> None:
        """A finished step of ``kind`` emitted ``tokens`` in ``seconds`` (sampled: what it
        emits on average given its tree, ``Outcome.expected``), ``switch`` of them
        spent catching up after other kinds ran (left out of the kind's rate);
        ``alternatives``: what other kinds would have emitted there, in how many seconds."""
        self.steps += 1
        best = self.fastest(self.kinds)
        exploring = best is not None and kind is not best
        if exploring:  # what it lost (or won)
            self.regret += seconds - tokens * self.best_now(best, alternatives)
        self.elapsed += seconds
        self.earned += self._share(best) * seconds
        ran = max(seconds - switch, 1e-9)
        idle = self.idle[kind]
        self.rates[kind].age(idle)
        self.rates[kind].add(tokens, ran)
        for alt, alt_tokens, alt_seconds in alternatives:
            # catching up left out here too: a kind explored one step at a time would pay it
            # at every step and never look as fast as it runs; switching is priced where it
            # is decided (``fastest`` holds the running kind until a switch pays). Against
            # the target alone, the kind's speed now (``with_root``); against another drafted
            # kind, the pair is the evidence of which is faster, gathered one exploration at
            # a time, and not aged by the steps between them: each exploration's few steps
            # would decide alone (one step emits 1 token, the next 6: far too few to tell
            # kinds a few percent apart)
            self.pair(kind, tokens, ran, alt, alt_tokens, alt_seconds)
        for a, alt_a in enumerate(alternatives):  # the alternatives against each other
            for alt_b in alternatives[a + 1:]:
                self.pair(*alt_a, *alt_b)
        for k in StepKind:
            self.idle[k] = 0 if k is kind else self.idle[k] + 1
        if not exploring:
            self.trial, self.trial_left = None, 0
        else:
            if kind is not self.trial:  # an exploration starts
                self.trial, self.trial_left = kind, TRIAL_STEPS
            self.trial_left -= 1
            if self.trial_left == 0 and not self.rates[kind].measured:
                # its measurement aged away over a long wait, and TRIAL_STEPS steps do not
                # measure it again (MIN_STEPS decayed steps): the exploration goes on until
                # they do, so that its outcome sets the next wait (ended unmeasured, the next
                # wait would stay as it was, and the waits stop doubling once they are long)
                self.trial_left = 1
            if self.trial_left == 0 and self.rates[kind].measured:
                # an exploration done: wait longer before the next while this kind surely
                # loses (by more than the margin, beyond the doubt, as ``fastest`` switches);
                # one about as fast is explored again at the usual wait, and costs about
                # nothing: what decides between such kinds is more of their steps
                lead, doubt = self.lead(best, kind)
                lost = lead > math.log1p(SWITCH_MARGIN) + SWITCH_DOUBTS * doubt
                self.every[kind] = _backoff(self.every[kind], lost)
        self.held = self.fastest(self.kinds)

    def observe_aside(self, kind: StepKind, tokens: float, seconds: float,
                      against: Sequence[tuple[StepKind, float, float]]) -> None:
        """A step of ``kind`` that did not run would have emitted ``tokens`` in ``seconds``
        (known once the text decided it: a recent step's, counted as this one's) where the
        kinds ``against`` ran or were timed, each (kind, tokens, seconds): paired with each
        as if ``kind`` had run beside it (against the target alone: ``with_root``)."""
        for other, other_tokens, other_seconds in against:
            self.pair(other, other_tokens, other_seconds, kind, tokens, seconds)

    def pair(self, a: StepKind, a_tokens: float, a_seconds: float,
             b: StepKind, b_tokens: float, b_seconds: float) -> None:
        """``a`` and ``b`` timed on the same step, each as (tokens, seconds). Against the
        target alone the timing is the other kind's speed now (``with_root``), whichever of
        the two ran: a tree priced beside a target-alone step (sampled: ``aside``) counts as
        one decided by the text does (``observe_aside``), where ``speed`` reads it. Otherwise
        it is ``a`` against ``b``."""
        if b is StepKind.ROOT:
            self.with_root(a).add(a_tokens, a_seconds, b_tokens, b_seconds)
        elif a is StepKind.ROOT:
            self.with_root(b).add(b_tokens, b_seconds, a_tokens, a_seconds)
        else:
            self.pairs.setdefault((a, b), Paired()).add(a_tokens, a_seconds, b_tokens,
                                                        b_seconds)

    def with_root(self, kind: StepKind) -> Paired:
        """``kind``'s timings against the target alone, to be added to at the step being
        observed: aged by the steps since in which nothing was added (the text has moved on),
        whichever kind ran then."""
        paired = self.pairs.setdefault((kind, StepKind.ROOT), Paired())
        paired.age(max(self.steps - self.timed[kind] - 1, 0))
        self.timed[kind] = self.steps
        return paired

    def since(self, kind: StepKind, best: StepKind | None) -> int:
        """Steps since ``kind`` was last compared with ``best``: against the target alone,
        since it was last timed against it (``timed``: it ran, or was timed beside another
        kind's step); against a drafted kind, since it last ran."""
        return self.steps - self.timed[kind] if best is StepKind.ROOT else self.idle[kind]

    def observe_catch_up(self, seconds: Mapping[StepKind, float]) -> None:
        """What switching to each kind would cost before its next step (the draft's catching
        up on the text it skipped), as the text stands now."""
        self.catch_up = dict(seconds)

    def observe_caught_up(self, tokens: int, seconds: float) -> None:
        """The draft caught up on ``tokens`` it had skipped, in ``seconds`` (measured:
        ``catching_up`` below)."""
        if tokens > 0:
            self.caught_up.add(seconds / tokens, tokens)

    def observe_ngram(self, offered: int, accepted: int) -> None:
        """A chain of ``offered`` n-gram guesses of which the first ``accepted`` were kept."""
        for i in range(offered):
            self.ngram_hits.add(1.0 if i < accepted else 0.0)
            if i >= accepted:
                break


class AutoPolicy:
    """``auto``: the draft's tree, the n-gram's guesses and tree, or the target alone, as the
    cost model and the measured rates say pays (see the module docstring)."""

    def __init__(self, res: Resources) -> None:
        self.res = res
        # n-gram trees beside target-alone steps, followed until the text decides them
        self.guessed: list[Guessed] = []
        self.text_at: tuple[int, int] | None = None  # (length, last token) observed last
        self.planned_at = 0  # the text's length at the last step planned
        self.aside_wait = 0  # target-alone steps until the next plans the n-gram's tree
        # greedy, a step of the draft's kind (``without_draft``): its n-gram tree's margin
        # bin, that tree's expected tokens and seconds, and what the step verifies (the
        # draft's tree: DRAFT; the n-gram's tree alone: GUESSES; the target alone: ROOT);
        # None where the step priced none
        self.bin = 0
        self.estimate: tuple[float, float] | None = None
        self.chose: StepKind | None = None
        # the steps in a row that left the draft out, after how many the next runs it anyway
        self.left_out = 0
        self.refresh = EXPLORE_EVERY

    @property
    def planner(self) -> Planner:
        assert self.res.planner is not None, "auto needs measured costs (Engine.measure_cost)"
        return self.res.planner

    def plan(self, step: StepInput) -> StepPlan:
        res, planner, budget = self.res, self.planner, step.budget
        if self.text_at != (len(step.committed), step.root):
            self.guessed.clear()  # another text (a new reply, a step undone)
        self.planned_at = len(step.committed)
        self.estimate = self.chose = None  # (set where the step prices the n-gram's tree)
        if budget is None:
            return StepPlan.alone(step.root)
        if res.draft is not None:
            # greedy, the draft's kind verifies the n-gram's tree alone where that pays more
            # (``without_draft``): a kind of the n-gram's tree alone would only differ by
            # being chosen for many steps at a time, by rates measured a few noisy steps at a
            # time. Sampled, the n-gram's tree is no kind either: its steps and the draft's
            # are a few percent apart, which kind held was the noise of a few steps'
            # measurements, and every return to the draft paid its catching up
            kinds = [StepKind.DRAFT, StepKind.ROOT]
        else:
            kinds = [StepKind.GUESSES, StepKind.ROOT]
        risks = {}
        if res.draft is not None:
            behind = res.draft.behind(step.committed)
            # (priced only where there is catching up: a step's draft curve is made on use)
            risks[StepKind.DRAFT] = planner.catching_up(behind) if behind > 1 else 0.0
        planner.observe_catch_up(risks)
        planner.kinds = tuple(kinds)
        kind = planner.choose(kinds, risks)
        if kind is StepKind.ROOT:
            return self.alone(step)
        # an alternative's planning counts from the step's start: the step's own setup
        # before planning (its penalties, pricing, the choice of kind) is the alternative's
        # too, and is not in the time outside planning that ``counterfactuals`` adds
        t0 = time.perf_counter() if step.t0 is None else step.t0
        alone = Alternative(StepKind.ROOT, TokenTree.rooted(step.root), time.perf_counter() - t0)
        res.feed_ngram(step.committed)  # the n-gram's tree, or the draft's stage-2 guesses
        if kind is StepKind.GUESSES:
            ngram = res.ngram_drafter(step.params, budget)
            tree = self.ngram_tree(ngram, step)
            return StepPlan.scored_by(tree, ngram, StepKind.GUESSES, Scorer.NGRAM,
                                      alternatives=(alone,))
        # the draft's tree; greedy, merged with the n-gram's (grown first: the draft's
        # batches pay against the whole step's drafting time, the n-gram's included)
        floor = res.floor(Scorer.DRAFT, step.params)  # sampled trees only
        expand = res.expander(budget, staged=True, floor=floor)
        if not step.params.greedy:
            # a node's children must all come from one q: the draft's tree alone, as grown;
            # the draft model decodes the root whatever the tree, so its best node is
            # verified, as in the fixed modes (a step that paid for the draft and verified
            # nothing gets nothing for it)
            drafter = res.model_drafter(step.config, staged=True)
            draft = grow(drafter, step, expand, floor, at_least=1)
            draft = res.right_size(draft, Scorer.DRAFT, drafting_time(drafter), step.params)
            return StepPlan.scored_by(draft, drafter, StepKind.DRAFT, Scorer.DRAFT,
                                      alternatives=(alone,))
        ngram = res.ngram_drafter(step.params, budget)
        ngram_tree = grow_tree(ngram, step.committed, budget, step.params, step.rng,
                               res.worth_growing(), step.penalties)
        # what a step of the n-gram's tree alone would have verified here
        cut = res.cut(ngram_tree, ngram_tree.scores(), drafting_time(ngram),
                      res.calibrations.factor(Scorer.NGRAM), at_least=1)
        left = self.without_draft(cut, t0)
        if left is not None:
            return StepPlan.scored_by(left, ngram, StepKind.DRAFT, Scorer.NGRAM,
                                      alternatives=(alone,))
        guesses = Alternative(StepKind.GUESSES, cut.tree, time.perf_counter() - t0)
        drafter = res.model_drafter(step.config, staged=True)
        draft = grow(drafter, step, expand, floor, at_least=1)
        draft, chain = self.add_guesses(draft, step)
        plan = self.merge(draft, ngram_tree, drafter, ngram, budget, chain)
        return dataclasses.replace(plan, alternatives=(guesses, alone))

    def without_draft(self, cut: DraftTree, t0: float) -> DraftTree | None:
        """Greedy, a step of the draft's kind: what it verifies without running the draft, or
        None to run it. Three steps are priced, each as its expected tokens over its seconds:
        the target alone (1 token, in the time such a step takes now: ``Planner.alone``);
        ``cut``, the n-gram's tree cut to what pays; and the draft's merged tree. The last two
        from ``cut``'s estimate (its nodes' calibrated scores; the planning so far, the loop
        after a pass, and the cost curve's price of its pass), each corrected by how far
        such steps measured from theirs, on steps whose n-gram tree was expected to emit
        about as many tokens (``Margin``); without the draft, each also pays for the draft's
        catching up on its tokens later. The fastest is taken: on text the n-gram model
        knows (a run of indentation, a repeated name) its tree alone emits as much for less,
        where neither it nor the draft gains (a steep curve, text neither knows) the target
        alone runs, and elsewhere the draft. Until the draft's steps are measured it runs;
        once it has been left out ``refresh`` steps in a row it runs anyway, so that they
        stay measured on the text as it is (the wait doubling while it keeps losing)."""
        res, planner = self.res, self.planner
        assert res.sizer is not None
        factor = res.calibrations.factor(Scorer.NGRAM)
        tree = cut.tree
        tokens = 1.0 + sum(accepted_estimate(s, factor) for s in tree.scores[1:])
        self.bin = bisect.bisect_right(MARGIN_BINS, tokens)
        margin = planner.margins[self.bin]
        priced = res.sizer.priced
        seconds = time.perf_counter() - t0 + planner.after[StepKind.DRAFT].value + priced(
            len(tree))
        self.estimate, self.chose = (tokens, seconds), StepKind.DRAFT
        if not margin.drafted.measured:
            return None
        if self.left_out >= self.refresh:
            self.left_out = 0
            self.refresh = min(self.refresh * 2, EXPLORE_EVERY * MAX_BACKOFF)
            return None
        per_token = planner.catching_up(1)  # left out, the draft reads them later

        def rate(missed: Missed, catching_up: float, doubts: float = 0.0) -> float:
            more_tokens, more_seconds = missed.mean()
            # the target's own token at least
            n = max(tokens + more_tokens + doubts * missed.doubt(), 1.0)
            took = max(seconds + more_seconds, 0.0) + n * catching_up
            return n / took if took > 0.0 else math.inf

        # the draft's steps are measured only where it runs: it is left out only where it is
        # slower by more than their doubt (a few short steps in a row would otherwise leave
        # it out, unmeasured, until its next refresh)
        drafted = rate(margin.drafted, 0.0, DRAFT_DOUBTS)
        ngram = rate(margin.ngram, per_token)
        alone_seconds = (planner.alone.value if planner.alone.weight > 0
                         else seconds - priced(len(tree)) + priced(1))
        alone = 1.0 / (alone_seconds + per_token)
        if drafted >= max(ngram, alone):
            self.left_out, self.refresh = 0, EXPLORE_EVERY
            return None
        self.left_out += 1
        self.chose = StepKind.GUESSES if ngram >= alone else StepKind.ROOT
        return cut if ngram >= alone else cut.best(0)

    def ngram_tree(self, ngram: NgramDrafter, step: StepInput) -> DraftTree:
        """The tree a step of the n-gram's kind verifies: grown as far as its nodes may pay,
        cut to what pays, at least its best node."""
        res, budget = self.res, step.budget
        assert budget is not None
        tree = grow_tree(ngram, step.committed, budget, step.params, step.rng,
                         res.worth_growing(), step.penalties,
                         res.floor(Scorer.NGRAM, step.params), at_least=1)
        return res.right_size(tree, Scorer.NGRAM, drafting_time(ngram), step.params,
                              at_least=1)

    def alone(self, step: StepInput) -> StepPlan:
        """A step of the target alone, with the n-gram's tree beside it where that is a kind
        to choose (``Planner.kinds``; ``aside``)."""
        plan = StepPlan.alone(step.root)
        guesses, t_aside = self.aside(step)
        if guesses is None:
            return dataclasses.replace(plan, t_aside=t_aside) if t_aside else plan
        return dataclasses.replace(plan, t_aside=t_aside, alternatives=(guesses,))

    def aside(self, step: StepInput) -> tuple[Alternative | None, float]:
        """The tree a step of the n-gram's kind would have verified here, planned beside a
        step of the target alone (where the n-gram's tree is a kind to choose,
        ``Planner.kinds``), and the seconds its planning took: the n-gram's kind is then
        timed on the same text while the target alone runs, for the price of planning it, not
        of steps that may lose (on a steep cost curve a wrong guess verified costs much of
        a pass more). Greedy, the text written next decides exactly what it would have
        emitted (``Guessed``); sampled, the step's own target pass prices it from the
        target's distributions (``Alternative.q``: exactly along the paths the step
        verifies, the root's children always; below the others by the n-gram's acceptance
        map), and its draws are made apart from the step's own tree, which stays as it
        would have been (nothing chooses between the two). Its planning may take
        ``ASIDE_SHARE`` of a target-alone step's time at most: where it takes more, only one
        step in as many plans it."""
        if step.budget is None or StepKind.GUESSES not in self.planner.kinds:
            return None, 0.0
        if self.aside_wait > 0:
            self.aside_wait -= 1
            return None, 0.0
        t0 = time.perf_counter()
        self.res.feed_ngram(step.committed)
        draft = self.ngram_tree(self.res.ngram_drafter(step.params, step.budget), step)
        t1 = time.perf_counter()
        share = (t1 - t0) / (ASIDE_SHARE * self.planner.plain_seconds())
        self.aside_wait = max(math.ceil(share), 1) - 1
        if len(draft.tree) < 2:
            return None, t1 - t0
        # its planning counts from the step's start, as beside a drafted step (the step's
        # setup is the alternative's too)
        begun = t0 if step.t0 is None else step.t0
        q = None if step.params.greedy else draft.q
        return Alternative(StepKind.GUESSES, draft.tree, t1 - begun, q), t1 - t0

    def add_guesses(self, draft: DraftTree, step: StepInput
                    ) -> tuple[DraftTree, tuple[Path, Path] | None]:
        """Chain the n-gram's greedy continuation below the best path's leaf (free to draft;
        the final cut keeps the guesses whose expected acceptance pays their share of the
        target pass). Greedy only: a sampled node's children must all come from one q.
        Returns the tree and (the leaf's path, the chain), or None when no room is left."""
        budget = step.budget
        assert budget is not None
        tree = draft.tree
        leaf = 0
        while tree.children[leaf]:
            leaf = tree.children[leaf][0]  # rank 0: the draft's most likely continuation
        room = min(budget.max_nodes - (len(tree) - 1), budget.max_depth - tree.depths[leaf])
        if room < 1:
            return draft, None
        path = tree.path(leaf)
        guess = self.res.ngram.greedy([*step.committed, *path][-2:], room)
        scores = self.planner.ngram_scores(tree.scores[leaf], room)
        node = leaf
        for token, score in zip(guess, scores, strict=True):
            node = tree.add(node, token, score, "ngram")
        return draft, (path, tuple(guess))

    def merge(self, draft: DraftTree, ngram_tree: DraftTree, drafter: ModelDrafter,
              ngram: NgramDrafter, budget: TreeBudget,
              chain: tuple[Path, Path] | None = None) -> StepPlan:
        """Greedy: the draft's tree and the n-gram's tree as one tree, verified in one pass.

        Each node's score is its estimated acceptance, from the draft's acceptance map, times
        the draft's factor (accepted over predicted, on its own nodes); a path only the
        n-gram proposed (a branch beside the draft's choices) its estimate from the n-gram's
        map times the factor of such branches, measured on them alone: where the draft is
        unsure the free n-gram often names the target's token, but a branch the draft
        disagrees with is accepted less often than the n-gram's own trees are. The merged
        tree is cut, like any other, to the size that maximises expected tokens per second.
        Greedy verification is exact for any tree; sampled steps never merge (a node's
        children must all come from one distribution). ``chain``: ``add_guesses``'s n-gram
        chain in ``draft``, scored by the chain's hit rate and calibrated by none."""
        calibrations = self.res.calibrations
        tree = draft.tree
        guessed = guess_nodes(tree, chain)
        merged = TokenTree.rooted(tree.tokens[0])
        node_of: dict[Path, int] = {(): 0}
        scored: dict[Path, tuple[Scorer, float]] = {}
        def capped(parent: int, score: float) -> float:
            # a child never scores above its parent (the cut takes the best nodes and must
            # get a tree: ``TokenTree.top_nodes``); two scorers' calibrations can break that
            return min(score, merged.scores[parent]) if parent else score

        for v in range(1, len(tree)):
            path = tree.path(v)
            parent = node_of[path[:-1]]
            node_of[path] = merged.add(parent, tree.tokens[v], capped(
                parent, calibrations.factor(Scorer.DRAFT) * tree.scores[v]),
                tree.origins[v], tree.probs[v])
            if v not in guessed:
                scored[path] = (Scorer.DRAFT, tree.scores[v])
        other = ngram_tree.tree
        for v in range(1, len(other)):
            path = other.path(v)
            if path not in node_of:
                parent = node_of[path[:-1]]
                node_of[path] = merged.add(parent, other.tokens[v], capped(
                    parent, calibrations.factor(Scorer.BRANCHES) * other.scores[v]),
                    "ngram", other.probs[v])
                scored[path] = (Scorer.BRANCHES, other.scores[v])
        t_spent = drafting_time(drafter) + ngram.counters.t_stage2
        whole = DraftTree(merged, {})  # scores already calibrated: factor 1
        # once the draft model has decoded in this step, its best node is verified, as the
        # fixed modes do: the merged scores price it low where the draft is unsure, but a
        # step that paid for the draft and verified nothing gets nothing for it, and this
        # kind then ran slower than the same drafter in ``staged``
        paid = int(drafter.counters.calls > 0)
        cut = self.res.cut(whole, whole.scores(), t_spent, 1.0, budget.max_nodes,
                           at_least=paid)
        kept = cut.tree
        names = frozenset(scored[p][0] for p in (kept.path(v) for v in range(1, len(kept)))
                          if p in scored)
        return StepPlan(cut, drafter, StepKind.DRAFT, names, scored, chain)

    def observe(self, plan: StepPlan, outcome: Outcome) -> None:
        planner = self.planner
        written = (*outcome.accepted, outcome.next_token)
        self.text_at = (self.planned_at + len(written), written[-1])
        planner.after[plan.kind].add(
            max(outcome.seconds - outcome.t_plan - outcome.t_verify, 0.0))
        if plan.guesses is not None:
            path, guess = plan.guesses
            if outcome.accepted[:len(path)] == path:  # the target reached the chain's start
                kept = outcome.accepted[len(path):]
                n = 0
                while n < min(len(kept), len(guess)) and kept[n] == guess[n]:
                    n += 1
                planner.observe_ngram(len(guess), n)
        counters = plan.counters
        switch = 0.0
        if counters.caught_up > 1:
            switch = catching_up(counters, planner.sizer.draft)
            planner.observe_caught_up(counters.caught_up, switch)
        # sampled, what the step yields on average given its tree: the tokens it drew vary
        # from one to several with the rule's own draws, far more than the kinds differ
        tokens = (outcome.emitted if planner.greedy or outcome.expected is None
                  else outcome.expected)
        ran = outcome.seconds - plan.t_aside  # the step as its kind takes it
        now, trees = [], []
        for kind, tree, seconds, known in self.counterfactuals(plan, outcome):
            if known is not None:
                now.append((kind, known, seconds))
            else:
                trees.append((kind, tree, seconds))
        if outcome.t_alone > 0:
            planner.alone.add(outcome.t_alone)
        estimate, chose = self.estimate, self.chose  # (this step's: read once)
        self.estimate = self.chose = None
        if estimate is not None and chose is not StepKind.ROOT:
            # a step of the draft's kind that priced its choice: how far it measured
            expected, priced = estimate
            margin = planner.margins[self.bin]
            missed = margin.drafted if chose is StepKind.DRAFT else margin.ngram
            missed.add(tokens - expected, ran - switch - priced)
        planner.observe_step(plan.kind, tokens, ran, switch, now)
        # the trees are decided by the text written from here on (greedy: the target's own
        # tokens, whichever kind writes them), and timed then against what ran here
        against = ((plan.kind, tokens, max(ran - switch, 1e-9)), *now)
        estimate = estimate if chose is StepKind.DRAFT else None
        self.guessed += [Guessed(tree, kind, seconds, against, self.bin, estimate)
                         for kind, tree, seconds in trees]
        self.follow(written)

    def follow(self, written: Sequence[int]) -> None:
        """Follow the alternatives' trees along the tokens a step wrote; each that the text
        has now decided is timed against the kinds that ran or were timed in its step
        (``Planner.observe_aside``)."""
        pending = []
        for guessed in self.guessed:
            tokens = guessed.follow(written)
            if tokens is None:
                pending.append(guessed)
                continue
            self.planner.observe_aside(guessed.kind, tokens, guessed.seconds, guessed.against)
            if guessed.estimate is not None and guessed.kind is StepKind.GUESSES:
                # beside a step that ran the draft: how far the n-gram's tree, as the text
                # decided it, measured from its estimate
                expected, priced = guessed.estimate
                self.planner.margins[guessed.bin].ngram.add(tokens - expected,
                                                            guessed.seconds - priced)
        self.guessed = pending

    def counterfactuals(self, plan: StepPlan, outcome: Outcome
                        ) -> list[tuple[StepKind, TokenTree, float, float | None]]:
        """What each of the plan's alternatives would have verified in this step, and in how
        many seconds: the step's own time outside planning and the target's pass, the
        alternative's planning, and the target's pass over the alternative's batch at this
        moment (so the machine's load of the moment is in both): over a tree, this pass scaled
        by the cost curve (beside the target alone, with the graph switch to the tree's
        shape, and the loop's time after the pass as measured on the n-gram kind's own
        steps, where it has run: a tree's commit and bookkeeping take longer than a lone
        token's); the target alone, a step of its own at this moment
        (``Outcome.t_alone``: the engine's estimate of its pass, whose fixed costs do not
        shrink with the cost curve, and the loop's time around such a pass as measured on its
        steps, which is less than around a tree's: a tree's verification and bookkeeping
        counted in, the target alone read slow beside the drafted kinds where a pass costs
        little more than the loop, and they ran where it was faster), or before any such
        step, this step's time outside planning and its pass, its planning, and the
        estimated pass. With each, the tokens it would have added where this step tells
        them: the target alone 1; a sampled tree what the step's pass priced
        (``Outcome.beside``: a sampled tree's acceptance is a draw, not known from the text,
        and one not priced is not timed); None for a greedy tree (decided by the text
        written next: ``Guessed``)."""
        if outcome.batch < 1 or not plan.alternatives:
            return []
        target = self.planner.sizer.target
        curve = target.curve
        rest = max(outcome.seconds - outcome.t_plan - outcome.t_verify, 0.0)
        priced = outcome.beside or (None,) * len(plan.alternatives)
        out = []
        for alt, tokens in zip(plan.alternatives, priced, strict=True):
            if len(alt.tree) == 1:
                tokens = 1.0  # the target alone: its token, whatever it is
            elif tokens is None and not self.planner.greedy:
                continue
            batch = outcome.batch - len(plan.tree.tree) + len(alt.tree)
            if plan.kind is StepKind.ROOT:
                after = self.planner.after
                extra = (max(after[StepKind.GUESSES].value - after[StepKind.ROOT].value, 0.0)
                         if after[StepKind.GUESSES].weight > 0 else 0.0)
                seconds = rest + alt.t_plan + extra + (
                    outcome.t_verify * target(batch) / curve(outcome.batch))
            elif batch == 1 and outcome.t_alone > 0:
                seconds = outcome.t_alone
            elif batch == 1 and outcome.t_single > 0:
                seconds = rest + alt.t_plan + outcome.t_single
            else:
                seconds = rest + alt.t_plan + (
                    outcome.t_verify * curve(batch) / curve(outcome.batch))
            out.append((alt.kind, alt.tree, seconds, tokens))
        return out


@dataclasses.dataclass(slots=True)
class Guessed:
    """A tree another kind would have verified in a step's place (greedy), not verified:
    followed down the text written since (the target's own tokens, whichever kind wrote
    them) until the text leaves it or reaches a leaf. Then what a step verifying it would
    have emitted is known exactly: the tokens along it, and the target's next. (Counted
    as stopping where the step that ran stopped, a deep n-gram chain beside a draft step
    that stopped early was credited with what that step emitted, and the kind that ran
    looked the faster on the very steps it was worst at.)"""

    tree: TokenTree
    kind: StepKind
    seconds: float  # what a step verifying it would have taken
    # (kind, tokens, seconds) of the step's kind as it ran, and of the target alone where it
    # was timed in its place: what the tree's step is timed against once decided
    against: tuple[tuple[StepKind, float, float], ...]
    # beside a step that ran the draft: its n-gram tree's margin bin (``Margin``), and that
    # tree's expected tokens and seconds when the step was planned
    bin: int = 0
    estimate: tuple[float, float] | None = None
    node: int = 0

    def follow(self, tokens: Sequence[int]) -> int | None:
        """Follow ``tokens``, the text's next; the tokens the tree's step would have emitted,
        or None while the text has not yet decided."""
        for token in tokens:
            child = self.tree.child_with_token(self.node, token)
            if child is None:
                return self.tree.depths[self.node] + 1
            self.node = child
            if not self.tree.children[child]:
                return self.tree.depths[child] + 1
        return None


def catching_up(counters: DraftCounters, draft: VerifyCost | None) -> float:
    """Seconds a draft step spent catching up on the text it skipped: its first decodes'
    measured time beyond what their batch would have cost without the skipped tokens (on
    the draft's curve). Measured, not read off the curve for the skipped tokens: the
    catching up shares its last batch with the step's first node, and the curve, priced
    for a batch as wide as the text skipped (far beyond the sizes it was timed at), put it
    above the whole step's time, and the draft's kind read several times as fast as it ran
    in the step after each return."""
    if draft is None:
        return 0.0
    return max(counters.t_begin - draft.curve(counters.begin_tokens), 0.0)


def guess_nodes(tree: TokenTree, chain: tuple[Path, Path] | None) -> frozenset[int]:
    """Nodes of ``tree`` that are an n-gram chain's guesses (below the leaf they extend)."""
    if not chain:
        return frozenset()
    path, guess = chain
    below = (*path, *guess[:1])
    return frozenset(v for v in range(1, len(tree)) if tree.depths[v] > len(path)
                     and tree.path(v)[:len(below)] == below)

