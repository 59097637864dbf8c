"""Each mode's policy: from the committed text to a ``StepPlan``, and learning from its verdict.

Every policy drafts with the engine's ``Resources`` (the target's and draft's caches, the n-gram
model, the measured cost curves, the calibrations) and returns an immutable plan; the engine
verifies it and calls ``observe``. ``auto``'s policy lives in ``speculative.auto``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .costmodel import (
    VerifyCost,
    best_size,
    cached_verify_cost,
    guess_length,
    paying_floor,
)
from .drafting import (
    Drafter,
    DraftTree,
    Expand,
    ModelDrafter,
    NgramDrafter,
    TreeBudget,
    grow_staged,
    grow_tree,
    sparse_top,
)
from .kvtree import KVTree
from .ngram import KatzTrigram
from .oracle import OracleDrafter
from .penalties import StepPenalties
from .plan import Calibrations, Scorer, StepKind, StepPlan
from .sampling import SamplingParams
from .sizing import Sizer
from .tree import TokenTree

if TYPE_CHECKING:
    from .auto import Planner

log = logging.getLogger(__name__)

REACH = 0.25  # n-gram nodes grow only above this share of the weakest node the cut keeps


class Mode(str, enum.Enum):
    PLAIN = "plain"    # the target alone: the baseline every speedup is measured against
    CHAIN = "chain"    # standard speculative decoding: a chain of draft tokens
    TREE = "tree"      # stage 1: a draft tree verified in one pass
    STAGED = "staged"  # stages 1 + 2: the tree's draft model sped up by the n-gram model
    NGRAM = "ngram"    # the n-gram model drafts a tree for the target directly
    AUTO = "auto"      # each step drafts as much as pays on this machine (speculative.auto)
    ORACLE = "oracle"  # the benchmark's ceiling: a free drafter that knows the answer

    @property
    def needs_draft(self) -> bool:
        return self in (Mode.CHAIN, Mode.TREE, Mode.STAGED)

    @classmethod
    def selectable(cls) -> list[Mode]:
        """The modes a user can run (the oracle needs the text in advance: benchmarks only)."""
        return [m for m in cls if m is not Mode.ORACLE]


@dataclasses.dataclass(frozen=True, slots=True)
class SpecConfig:
    mode: Mode = Mode.AUTO
    tree: TreeBudget = dataclasses.field(default_factory=TreeBudget)  # tree, staged, ngram
    chain_length: int = 4            # chain mode: draft tokens per target pass
    lookahead: int = 4               # stage 2: n-gram tokens decoded ahead in each draft batch
    adaptive: bool = True            # size each tree by measured verify cost (see sizing)

    def budget(self) -> TreeBudget | None:
        if self.mode is Mode.PLAIN:
            return None
        if self.mode is Mode.CHAIN:
            k = self.chain_length
            return TreeBudget(max_nodes=k, max_depth=k, max_children=1)
        if self.mode is Mode.ORACLE:  # a chain as long as the tree budget allows
            return TreeBudget(self.tree.max_nodes, self.tree.max_nodes, 1)
        return self.tree


@dataclasses.dataclass(frozen=True, slots=True)
class StepInput:
    """What a policy plans a step from."""

    committed: list[int]        # the text so far; its last token is the tree's root
    config: SpecConfig          # this step's settings (they may change between steps)
    budget: TreeBudget | None   # the tree allowed here (fitted to the window); None: plain
    params: SamplingParams
    rng: np.random.Generator
    penalties: StepPenalties | None = None  # the params' penalties below committed, if any
    t0: float | None = None  # when the step began (``time.perf_counter``), if known

    @property
    def root(self) -> int:
        return self.committed[-1]


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """A verified step, as its policy learns from it."""

    accepted_nodes: list[int]   # tree nodes of the accepted path, root-most first
    accepted: tuple[int, ...]   # their tokens
    emitted: int                # tokens the step added
    seconds: float              # the whole step
    t_plan: float = 0.0         # ... of which planning (drafting included)
    t_verify: float = 0.0       # ... and the target's pass with the acceptance rule
    batch: int = 0              # tokens in the target's pass
    next_token: int = -1        # the target's own token after the accepted path
    # the target's pass over the root alone, at this moment: this pass where it was one, else
    # the engine's estimate from it (0: unknown)
    t_single: float = 0.0
    # a step with the target alone at this moment: ``t_single`` and the loop's time around
    # such a pass, measured on such steps (the meter's plain token); 0 before any such step
    t_alone: float = 0.0
    # tokens the step adds on average over the acceptance rule's draws, given its tree and the
    # target's distributions over it (``Verdict.expected`` + 1); greedy, ``emitted``; None:
    # not known (counted as ``emitted``)
    expected: float | None = None
    # sampled: what each of the plan's alternatives would have added, likewise on average
    # (priced from this pass where it has a ``q``: ``Alternative``), in their order; None
    # where not priced
    beside: tuple[float | None, ...] = ()


def fit_budget(budget: TreeBudget | None, room: int) -> TreeBudget | None:
    """Shrink the tree so that it fits the ``room`` KV cells left in the window; None when
    only plain fits.

    The target's batch is the pending committed tokens (root included) plus the drafted
    nodes, each in a KV cell of its own beside the cached ones, so the nodes must fit the cells
    left, not only the positions: near the end of the window a deep bushy tree would otherwise
    not find its cells. (The draft's own cells, nodes plus stage-2 guesses, are counted as it
    decodes: ``ModelDrafter``.)
    """
    if budget is None or room < 1:
        return None
    return dataclasses.replace(budget, max_nodes=min(budget.max_nodes, room),
                               max_depth=min(budget.max_depth, room))


@dataclasses.dataclass(slots=True)
class Resources:
    """What every policy drafts with and learns into; an engine owns one."""

    target: KVTree
    draft: KVTree | None
    ngram: KatzTrigram
    calibrations: Calibrations = dataclasses.field(default_factory=Calibrations)
    verify_cost: VerifyCost | None = None  # the target's curve, measured on first use
    draft_cost: VerifyCost | None = None   # the draft's, for stage-2 guess lengths
    sizer: Sizer | None = None             # made once the curves are measured
    planner: Planner | None = None         # auto's measured step rates (made with the sizer)
    oracle: OracleDrafter | None = None    # Mode.ORACLE's drafter (benchmarks)
    # the last step's node scores and drafting time, by scorer (sampled steps are sized by these)
    previous: dict[Scorer, tuple[list[float], float]] = dataclasses.field(default_factory=dict)
    ngram_fed: list[int] = dataclasses.field(default_factory=list)

    def measure_costs(self, config: SpecConfig, force: bool = False) -> None:
        """Time the target's verification of 1..max_nodes+1 tokens, and the draft's decodes
        (once, or again when ``force``; clears their caches)."""
        budget = config.budget() or TreeBudget()
        if self.verify_cost is None or force:
            n = min(max(budget.max_nodes, config.chain_length, 16) + 1,
                    self.target.ctx.n_batch)
            self._measure_target(n, force)
        if self.draft is not None and (self.draft_cost is None or force):
            n = min(budget.max_nodes + config.lookahead + 1, self.draft.ctx.n_batch)
            self.draft_cost = cached_verify_cost(self.draft.ctx, n, refresh=force)
            self.draft.reset()
            log.info("draft cost (ms): %s, a new batch shape +%.2f", _ms(self.draft_cost),
                     self.draft_cost.switch * 1000)

    def remeasure_target(self) -> VerifyCost:
        """Measure the target's curve again (the same sizes), replacing the cached one, and
        size later steps by it; what was learned (calibrations, ``auto``'s rates) stays."""
        assert self.verify_cost is not None
        self._measure_target(self.verify_cost.sizes[-1], refresh=True)
        if self.sizer is not None:
            self.sizer.measured_target = self.verify_cost
            self.sizer.locate(0, None)
        return self.verify_cost

    def _measure_target(self, max_tokens: int, refresh: bool) -> None:
        self.verify_cost = cached_verify_cost(self.target.ctx, max_tokens, refresh=refresh)
        self.target.reset()
        log.info("verify cost (ms): %s, a new batch shape +%.2f", _ms(self.verify_cost),
                 self.verify_cost.switch * 1000)

    def feed_ngram(self, committed: Sequence[int]) -> None:
        """Teach the n-gram model the conversation (only what it has not seen yet). Called
        where a step is about to use the model, not after every step: plain decoding and
        ``auto``'s steps with the target alone never pay for it."""
        fed = self.ngram_fed
        if list(committed[:len(fed)]) != fed:
            fed = self.ngram_fed = []
        if len(committed) > len(fed):
            self.ngram.update_continued(fed, list(committed[len(fed):]))
            self.ngram_fed = list(committed)

    def model_drafter(self, config: SpecConfig, staged: bool) -> ModelDrafter:
        """The draft model, with the n-gram model's stage-2 guesses when ``staged``, each guess
        only where it is worth its place in the draft batch (adaptive)."""
        assert self.draft is not None
        lookahead = self.ngram if staged else None
        sizer = self.sizer
        acceptance = self.calibrations.acceptance[Scorer.DRAFT]
        if not (config.adaptive and sizer is not None and sizer.draft is not None
                and lookahead is not None):
            return ModelDrafter(self.draft, lookahead, config.lookahead, acceptance=acceptance)
        cost, hit_rate = sizer.draft, self.calibrations.stage2.factor  # at this step's context

        def worth(batch: int, most: int) -> int:  # guess tokens worth their draft cost
            return guess_length(cost, batch, most, hit_rate)

        return ModelDrafter(self.draft, lookahead, config.lookahead, worth, acceptance)

    def ngram_drafter(self, params: SamplingParams, budget: TreeBudget) -> NgramDrafter:
        # greedy trees need each node's best children only (cheap from the n-gram)
        return NgramDrafter(self.ngram, sparse_top(params, budget.max_children),
                            self.calibrations.acceptance[Scorer.NGRAM])

    def expander(self, budget: TreeBudget, staged: bool = False, floor: float = 0.0
                 ) -> Expand:
        """``grow_tree``'s ``expand`` for a draft model: how many frontier nodes the next draft
        batch takes, as many as pay on the measured cost curves (``Sizer.expand``); a
        ``staged`` drafter's batches carry stage-2 guesses and yield levels beyond their own,
        as measured so far; a sampled tree's ``floor`` (``Resources.floor``) bounds what a
        batch can add."""
        sizer, cal = self.sizer, self.calibrations
        assert sizer is not None
        calibration = cal.factor(Scorer.DRAFT)
        levels = 1.0 + cal.stage2_saved_per_call.value if staged else 1.0
        width = cal.stage2_width.value if staged else 0.0
        t0 = time.perf_counter()

        def expand(tree: TokenTree, frontier: list[int], depth: int) -> int:
            # the draft's confidence in each new node's best child, for the next decisions
            sizer.observe([tree.scores[v] / tree.scores[tree.parents[v]] for v in frontier
                           if tree.ranks[v] == 0 and tree.scores[tree.parents[v]] > 0])
            return sizer.expand([tree.scores[v] for v in frontier], tree.scores[1:],
                                time.perf_counter() - t0, calibration, budget.max_depth - depth,
                                levels_per_call=levels, guess_width=width, floor=floor)

        return expand

    def worth_growing(self) -> Expand:
        """``grow_tree``'s ``expand`` for the n-gram's trees: expand only the frontier nodes
        whose calibrated score could still pay for a node of the batch (a child scores at
        most its parent; ``Sizer.least_worth``), and, once some nodes pay, only those scoring
        at least ``REACH`` of the weakest node the best cut so far keeps (of the score one
        node needs to pay for a batch of two on its own, while none pays yet): the cut takes
        nodes best first, so a node far below the ones it keeps enters it only into a free
        slot of the batch, and its children, lower still, almost never. Most of a whole tree
        would be cut away, every expansion costs a query and the penalties along its path,
        and where the curve has free slots (``least_worth`` 0) nothing else would stop the
        growth."""
        assert self.sizer is not None
        factor = self.calibrations.factor(Scorer.NGRAM)
        least = self.sizer.least_worth() / factor
        cost = self.sizer.priced
        alone = max(cost.curve(2) / cost.curve(1) - 1.0, 0.0) / factor

        def expand(tree: TokenTree, frontier: list[int], depth: int) -> int:
            scores = sorted(tree.scores[1:], reverse=True)
            n = best_size(scores, cost, 0.0, factor)
            floor = max(least, REACH * (scores[n - 1] if n else alone))
            return sum(tree.scores[v] >= floor for v in frontier)  # best first

        return expand

    def right_size(self, draft: DraftTree, scorer: Scorer, t_draft: float,
                   params: SamplingParams, at_least: int = 1) -> DraftTree:
        """Greedy: cut the tree to the size that maximises expected tokens per second
        (costmodel) by its own scores. Sampled: the tree as grown (its size was set before
        its nodes were drawn: ``floor``); its candidates size the next sampled step of the
        same scorer. ``at_least``: see ``cut``."""
        self.previous[scorer] = (draft.basis(), t_draft)
        if not params.greedy:
            return draft
        return self.cut(draft, draft.scores(), t_draft, self.calibrations.factor(scorer),
                        at_least=at_least)

    def floor(self, scorer: Scorer, params: SamplingParams) -> float:
        """The score a node of a sampled tree needs to be verified: what a node needed to pay
        in the best cut of the last step's candidates of the same scorer (``paying_floor``;
        independent of this step's draws: ``grow_tree``), or before any such step, what
        every node of a tree of nodes as good as it would need to pay for their batch
        (``Sizer.uniform_worth``: a first sampled step of a kind would otherwise verify as
        many nodes as the budget has room for, whatever the curve charges for them); greedy
        trees are cut after growing (0). Where nothing in the last step's candidates paid, as
        before any step (see below)."""
        if params.greedy or self.sizer is None:
            return 0.0
        factor = self.calibrations.factor(scorer)
        first = self.sizer.uniform_worth() / factor
        basis, t_draft = self.previous.get(scorer, ([], 0.0))
        if not basis:
            return first
        floor = paying_floor(basis, self.sizer.priced, t_draft, factor)
        # nothing in the last step's candidates paid: floored at that, a tree keeps only the
        # root's first child, whose siblings are then the next step's only candidates, which
        # rarely pay either, and every step stays that stunted; such a step is sized as a
        # first one instead
        return floor if math.isfinite(floor) else first

    def cut(self, draft: DraftTree, basis: list[float], t_draft: float, factor: float,
            most: int | None = None, at_least: int = 1) -> DraftTree:
        """``draft`` cut to its best n nodes, n = ``best_size`` of the ``basis`` scores (at
        least ``at_least``, at most ``most``). A mode the user chose verifies at least one
        node, so that its calibration keeps learning; ``auto`` verifies none where none
        pays (its explorations are what measure the kinds it does not run)."""
        # the curve at this context as passes cost in decoding, not priced by the last
        # batch's shape: a tree's size settles over steps, and a step that paid to change it
        # would keep paying to keep it small
        assert self.sizer is not None
        n = max(best_size(basis, self.sizer.priced, t_draft, factor), at_least)
        return draft.best(n if most is None else min(n, most))


def _ms(cost: VerifyCost) -> dict[int, float]:
    return {n: round(t * 1000, 2) for n, t in zip(cost.sizes, cost.seconds, strict=True)}


def grow(drafter: Drafter, step: StepInput, expand: Expand | None, floor: float = 0.0,
         at_least: int = 0) -> DraftTree:
    """The step's draft tree: with stage-2 guesses, every node whose answer is known grows
    (``grow_staged``: guessed spines cost no draft batch); otherwise one level per batch
    (``grow_tree``). Sampled, nodes scoring under ``floor`` are not drawn, the root's first
    child whatever its score when ``at_least``."""
    assert step.budget is not None
    if isinstance(drafter, ModelDrafter) and drafter.lookahead is not None:
        return grow_staged(drafter, step.committed, step.budget, step.params, step.rng,
                           expand, step.penalties, floor, at_least)
    return grow_tree(drafter, step.committed, step.budget, step.params, step.rng, expand,
                     step.penalties, floor, at_least)


def scorer_of(drafter: Drafter) -> Scorer:
    """Who scored a drafter's nodes: the n-gram model, or a draft model (the oracle too)."""
    return Scorer.NGRAM if isinstance(drafter, NgramDrafter) else Scorer.DRAFT


def drafting_time(drafter: Drafter) -> float:
    return drafter.counters.t_draft + drafter.counters.t_stage2


class Policy(Protocol):
    def plan(self, step: StepInput) -> StepPlan:
        """This step's tree (a lone root when nothing is drafted)."""
        ...

    def observe(self, plan: StepPlan, outcome: Outcome) -> None:
        """Learn from the verified step (the engine has committed the caches and updated the
        calibrations)."""
        ...


class TreePolicy:
    """Every mode but ``auto``: one drafter grows a tree (chain, tree, staged, ngram, oracle);
    adaptive, each draft batch and the final cut only as far as they pay."""

    def __init__(self, res: Resources, mode: Mode) -> None:
        self.res, self.mode = res, mode

    def drafter(self, step: StepInput) -> Drafter | None:
        res, config = self.res, step.config
        if self.mode is Mode.PLAIN or step.budget is None:
            return None
        if self.mode is Mode.ORACLE:
            return res.oracle
        if self.mode is Mode.NGRAM:
            res.feed_ngram(step.committed)
            return res.ngram_drafter(step.params, step.budget)
        if self.mode is Mode.STAGED:
            res.feed_ngram(step.committed)  # the draft's stage-2 guesses come from it
        return res.model_drafter(config, staged=self.mode is Mode.STAGED)

    def plan(self, step: StepInput) -> StepPlan:
        drafter = self.drafter(step)
        if drafter is None or step.budget is None:
            return StepPlan.alone(step.root)
        res, config = self.res, step.config
        sized = config.adaptive and res.sizer is not None
        scorer = scorer_of(drafter)
        floor = res.floor(scorer, step.params) if sized else 0.0
        # tree and staged: a draft batch only where it pays; ngram: only nodes that could
        # pay grow; a chain keeps its length (standard speculative decoding, the baseline)
        expand = (res.expander(step.budget, staged=self.mode is Mode.STAGED, floor=floor)
                  if sized and self.mode in (Mode.TREE, Mode.STAGED)
                  else res.worth_growing() if sized and self.mode is Mode.NGRAM else None)
        draft = grow(drafter, step, expand, floor, at_least=1)
        if sized:
            draft = res.right_size(draft, scorer, drafting_time(drafter), step.params)
        kind = (StepKind.DRAFT if drafter.counters.calls else
                StepKind.GUESSES if len(draft.tree) > 1 else StepKind.ROOT)
        return StepPlan.scored_by(draft, drafter, kind, scorer)

    def observe(self, plan: StepPlan, outcome: Outcome) -> None:
        """Nothing beyond what the engine keeps for every policy (caches, calibrations)."""
