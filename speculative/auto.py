"""``auto`` mode: each step drafts as much as pays on this machine, and no more.

Each step is sized by the cost model (``speculative.sizing``): a draft batch only where its
expected tokens per second beat the step's so far, then the cut that maximises them. On top:

- **The n-gram model's free guesses** (greedy only): its greedy chain hung below the draft
  tree's best leaf, and its own tree merged into the draft's (``AutoPolicy.merge``), each
  n-gram branch beside the draft's choices scored by its own measured acceptance
  (``Scorer.BRANCHES``). The final cut keeps what pays.
- **The n-gram's tree first**: greedy, the n-gram model's own tree is grown first (its nodes'
  best children cost little), and the draft runs only if its first batch promises more tokens
  per second than that tree at this step; on repetitive text the free n-gram out-guesses the
  draft. A step without the draft model verifies the n-gram's tree (greedy or sampled).
- **Measured rates check the model**: the tokens per second of steps where the draft ran, of
  steps with the n-gram's tree only, and of the target alone (``StepKind``), as decayed running
  rates. A kind of step measured slower than the target alone is not taken, whatever the model
  predicts (it does not see every cost: the draft's sampling, cache bookkeeping), and is
  explored again after ``EXPLORE_EVERY`` steps, since the text's difficulty drifts (the wait
  doubles while explorations keep losing, up to ``MAX_BACKOFF`` times; the n-gram's wait
  starts over with each reply). While drafting measures a loss, an exploration is a probe: a
  chain of at most ``PROBE`` tokens.
- **A budget for exploring**, so that ``auto`` is never much slower than the target alone:
  the *regret*, the time steps took beyond what the target alone would have taken for their
  tokens (at its measured rate), may reach ``EXPLORE_SHARE`` of the time spent (plus an
  allowance of ``EXPLORE_START`` plain steps' time for a fresh start). A kind of step not yet
  measured faster than the target alone, by the model's word or as an exploration, runs only
  while regret is under budget; a kind measured faster runs regardless, and what it gains
  (negative regret) is budget for later explorations.

Every choice depends on the draft's distributions and past steps, never on this step's sampled
tokens, so ``auto`` is as exact as the tree modes it is made of.
"""

from __future__ import annotations

import dataclasses

from .costmodel import Running
from .drafting import DraftTree, Expand, ModelDrafter, NgramDrafter, TreeBudget, grow_tree
from .plan import Path, Scorer, StepKind, StepPlan
from .policies import (
    Outcome,
    Resources,
    StepInput,
    drafting_time,
    grow,
)
from .sizing import Sizer
from .tree import TokenTree

EXPLORE_EVERY = 24  # steps without drafting after which the draft is tried once more
MAX_BACKOFF = 16    # at most this many times longer while explorations keep losing
EXPLORE_SHARE = 0.01  # time auto may lose to unproven kinds of step, as a share of its time
EXPLORE_START = 200   # plain steps' time a fresh planner counts as spent (2 steps to lose)
PROBE = 3  # draft tokens (a chain) of an exploring step, when drafting measured a loss
MIN_STEPS = 3.0  # decayed steps of both kinds before measured rates overrule the model


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


def _backoff(every: int, lost: bool) -> int:
    """The wait before the next exploration: doubled while explorations keep losing."""
    return min(every * 2, EXPLORE_EVERY * MAX_BACKOFF) if lost else EXPLORE_EVERY


@dataclasses.dataclass(slots=True)
class Planner:
    """What ``auto`` has measured of its steps: rates by kind, the regret budget, when to
    explore, and how far the target follows the n-gram's guesses. Sizing uses ``sizer``."""

    sizer: Sizer
    # P(an n-gram guess is accepted | its parent was): the chain's per-level hit rate
    ngram_hits: Running = dataclasses.field(default_factory=lambda: Running(prior=0.3))
    rates: dict[StepKind, Rate] = dataclasses.field(
        default_factory=lambda: {kind: Rate() for kind in StepKind})
    idle: int = 0  # steps since the draft last ran
    explore_every: int = EXPLORE_EVERY  # steps between explorations (backs off)
    guess_idle: int = 0  # steps since n-gram guesses were last verified
    guess_every: int = EXPLORE_EVERY  # steps between n-gram explorations while they lose
    elapsed: float = 0.0  # seconds of all steps observed
    regret: float = 0.0   # their seconds beyond the target alone's for their tokens

    # --- questions (they change nothing) ---

    def plain_seconds(self) -> float:
        """Seconds per token of the target alone: measured, or before any such step, the cost
        model's single-token pass (without the steps' overhead, which the n-gram's trees and
        the draft's catching up inflate: a baseline too slow would book losses as gains)."""
        root = self.rates[StepKind.ROOT]
        if root.steps > 0 and root.value > 0:
            return 1.0 / root.value
        return self.sizer.target.curve(1)

    def within_budget(self, risk: float = 0.0) -> bool:
        """Whether the regret so far leaves room for a step that may lose up to ``risk``
        seconds (see the module docstring)."""
        allowance = EXPLORE_SHARE * (self.elapsed + EXPLORE_START * self.plain_seconds())
        return self.regret + risk < allowance

    def probe_risk(self, behind: int, length: int) -> float:
        """What a probe may lose: the draft catching up on ``behind`` tokens (it last ran
        that long ago), drafting a chain of ``length`` tokens one by one, and verifying them,
        against one token of the target alone."""
        draft = self.sizer.draft
        if draft is None:
            return 0.0
        catch_up = draft.curve(behind) if behind > 0 else 0.0
        return (catch_up + length * draft.curve(1) + self.sizer.target(length + 1)
                - self.plain_seconds())

    def proven(self, kind: StepKind) -> bool:
        """Steps of ``kind`` have really been at least as fast as the target alone."""
        mine, root = self.rates[kind], self.rates[StepKind.ROOT]
        return (mine.steps >= MIN_STEPS and root.steps >= MIN_STEPS
                and mine.value >= root.value)

    def may_try(self, kind: StepKind) -> bool:
        """A step of ``kind`` may run: proven, or an affordable try (``within_budget``)."""
        return self.proven(kind) or self.within_budget()

    def measured_loss(self, kind: StepKind) -> bool:
        """Steps of ``kind`` have really been slower than the target alone, over enough recent
        steps of both: the cost model's prediction was wrong on this machine. (Not against
        each other: greedy, the n-gram's trees win exactly where they were chosen.)"""
        mine, root = self.rates[kind], self.rates[StepKind.ROOT]
        return (mine.steps >= MIN_STEPS and root.steps >= MIN_STEPS
                and mine.value < root.value)

    def wants_root(self) -> bool:
        """Take a step with the target alone, to measure it: the other kinds have been
        measured and it has not (the model may have predicted that drafting always pays)."""
        others = self.rates[StepKind.DRAFT].steps + self.rates[StepKind.GUESSES].steps
        return self.rates[StepKind.ROOT].steps < MIN_STEPS and others >= MIN_STEPS

    def exploration_due(self, risk: float = 0.0) -> bool:
        """Draft at this step although the estimates say it does not pay (they were made when
        the text was different, and only steps that draft update them): the wait is over and
        the budget holds the exploration's ``risk`` (``probe_risk``). Decided by a counter and
        past steps, never by this step's draws."""
        return (self.sizer.draft is not None and self.idle + 1 >= self.explore_every
                and self.within_budget(risk))

    def guesses_due(self) -> bool:
        """Whether to hang n-gram guesses at this step: unless they measured a loss, or when
        their wait is over, and if they may be tried. (Past steps, never this step.)"""
        lost = self.measured_loss(StepKind.GUESSES)
        if lost and self.guess_idle + 1 < self.guess_every:
            return False
        return self.may_try(StepKind.GUESSES)

    def ngram_scores(self, leaf_score: float, n: int) -> list[float]:
        """Scores to give ``n`` chained n-gram guesses below a leaf (their expected
        acceptance, before calibration)."""
        h = self.ngram_hits.value
        return [leaf_score * h ** (i + 1) for i in range(n)]

    # --- what happened ---

    def waited(self) -> None:
        """A step in which the draft did not run."""
        self.idle += 1

    def explored(self) -> None:
        """An exploration starts: the next one waits longer if drafting still measures a
        loss."""
        self.explore_every = _backoff(self.explore_every, self.measured_loss(StepKind.DRAFT))

    def drafted(self) -> None:
        self.idle = 0

    def guessed(self, allowed: bool) -> None:
        """The step did (``allowed``) or did not hang n-gram guesses (``guesses_due``)."""
        if not allowed:
            self.guess_idle += 1
            return
        self.guess_every = _backoff(self.guess_every, self.measured_loss(StepKind.GUESSES))
        self.guess_idle = 0

    def new_text(self, greedy: bool) -> None:
        """A new reply begins: its text may suit the n-gram's trees better than the last
        reply's end did, so their backoff starts over, and greedy (where the tree is cheap and
        sized by the step's own scores) they are explored at the reply's first step. Sampled,
        an exploration is a probe that mostly loses, so the backoff alone decides."""
        self.guess_every = EXPLORE_EVERY
        if greedy:
            self.guess_idle = EXPLORE_EVERY - 1

    def observe_step(self, kind: StepKind, tokens: int, seconds: float) -> None:
        """A finished step of ``kind`` emitted ``tokens``."""
        self.regret += seconds - tokens * self.plain_seconds()
        self.elapsed += seconds
        self.rates[kind].add(tokens, seconds)

    def observe_ngram(self, offered: int, accepted: int) -> None:
        """A chain of ``offered`` n-gram guesses of which the first ``accepted`` were kept."""
        for i in range(offered):
            self.ngram_hits.add(1.0 if i < accepted else 0.0)
            if i >= accepted:
                break


def probe(budget: TreeBudget) -> TreeBudget:
    """An exploration's tree: a chain of at most ``PROBE`` tokens."""
    return dataclasses.replace(budget, max_nodes=min(budget.max_nodes, PROBE),
                               max_depth=min(budget.max_depth, PROBE), max_children=1)


class AutoPolicy:
    """``auto``: the draft's tree, the n-gram's guesses and tree, or the target alone, as the
    cost model and the measured rates say pays (see the module docstring)."""

    def __init__(self, res: Resources) -> None:
        self.res = res

    @property
    def planner(self) -> Planner:
        assert self.res.planner is not None, "auto needs measured costs (Engine.measure_cost)"
        return self.res.planner

    def plan(self, step: StepInput) -> StepPlan:
        res, planner, budget = self.res, self.planner, step.budget
        if budget is None:
            return StepPlan.alone(step.root)
        # (a draft batch pays against the whole step's drafting time, the n-gram's included)
        expand = res.expander(budget, staged=True)
        if res.draft is None:
            ngram = res.ngram_drafter(step.params, budget)
            if planner.wants_root():
                return StepPlan.alone(step.root, ngram, frozenset({Scorer.NGRAM}))
            res.feed_ngram(step.committed)
            tree = grow_tree(ngram, step.committed, budget, step.params, step.rng,
                             res.worth_growing())
            tree = res.right_size(tree, Scorer.NGRAM, drafting_time(ngram), step.params)
            return StepPlan.scored_by(tree, ngram, StepKind.GUESSES, Scorer.NGRAM)
        drafter = res.model_drafter(step.config, staged=True)
        if planner.wants_root():
            return StepPlan.alone(step.root, drafter, frozenset({Scorer.DRAFT}))
        # whether to guess, like whether to draft, follows past steps and this step's
        # distributions, never its draws (sampled, the n-gram's tree is grown only if chosen);
        # the measured rates gate the n-gram's trees even greedy, where they are judged on
        # the step's own scores
        guesses = planner.guesses_due()
        planner.guessed(guesses)
        if guesses:
            res.feed_ngram(step.committed)
        ngram = res.ngram_drafter(step.params, budget)
        ngram_tree, baseline = None, 0.0
        if guesses and step.params.greedy:
            ngram_tree = grow_tree(ngram, step.committed, budget, step.params, step.rng,
                                   res.worth_growing())
            n, rate = planner.sizer.best_cut(ngram_tree.scores(), ngram.counters.t_stage2,
                                             res.calibrations.factor(Scorer.NGRAM))
            baseline = rate if n > 0 else 0.0
        draft = self.maybe_draft(drafter, step, expand, baseline)
        if len(draft.tree) > 1:
            if ngram_tree is not None:
                draft, chain = self.add_guesses(draft, step)
                return self.merge(draft, ngram_tree, drafter, ngram, budget, chain)
            draft = res.right_size(draft, Scorer.DRAFT, drafting_time(drafter), step.params)
            return StepPlan.scored_by(draft, drafter, StepKind.DRAFT, Scorer.DRAFT)
        if not guesses:
            return StepPlan.alone(step.root, drafter, frozenset({Scorer.DRAFT}))
        if ngram_tree is None:  # sampled: sized by the last step's scores, so an exploration
            # while the n-gram's trees measure a loss is a probe (see maybe_draft)
            if planner.measured_loss(StepKind.GUESSES):
                budget = probe(budget)
            ngram_tree = grow_tree(ngram, step.committed, budget, step.params, step.rng,
                                   res.worth_growing())
        tree = res.right_size(ngram_tree, Scorer.NGRAM, drafting_time(ngram), step.params)
        return StepPlan.scored_by(tree, ngram, StepKind.GUESSES, Scorer.NGRAM)

    def maybe_draft(self, drafter: ModelDrafter, step: StepInput, expand: Expand,
                    baseline: float = 0.0) -> DraftTree:
        """Grow the draft tree if even its first batch pays (against the target alone, or the
        ``baseline`` tokens per second another tree offers); else a lone root, or now and then
        a probe: a short chain, to see whether drafting pays again."""
        res, planner, budget = self.res, self.planner, step.budget
        assert budget is not None and res.draft is not None
        pays = (planner.sizer.expand([1.0], [], 0.0, res.calibrations.factor(Scorer.DRAFT),
                                     budget.max_depth, baseline) > 0
                and not planner.measured_loss(StepKind.DRAFT)
                and planner.may_try(StepKind.DRAFT))
        if not pays:
            # no probe where the n-gram's tree pays at this step: a short chain would not beat
            # it, and would pay the draft's catching up on the text since it last ran
            if baseline > 0:
                return DraftTree(TokenTree.rooted(step.root), {})
            risk = planner.probe_risk(res.draft.behind(step.committed), PROBE)
            if not planner.exploration_due(risk):
                planner.waited()
                return DraftTree(TokenTree.rooted(step.root), {})
            planner.explored()
            budget = probe(budget)
        planner.drafted()
        res.feed_ngram(step.committed)  # the draft's stage-2 guesses come from it
        return grow(drafter, dataclasses.replace(step, budget=budget), expand)

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

        Each node's score becomes its estimated acceptance: the draft's path probability times
        the draft's calibration (accepted over predicted, on its own nodes); a path only the
        n-gram proposed (a branch beside the draft's choices) its n-gram path probability
        times the calibration of such branches, measured on them alone: where the draft is
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
        for v in range(1, len(tree)):
            path = tree.path(v)
            node_of[path] = merged.add(node_of[path[:-1]], tree.tokens[v],
                                       calibrations.factor(Scorer.DRAFT) * tree.scores[v],
                                       tree.origins[v])
            if v not in guessed:
                scored[path] = (Scorer.DRAFT, tree.scores[v])
        other = ngram_tree.tree
        for v in range(1, len(other)):
            path = other.path(v)
            if path not in node_of:
                node_of[path] = merged.add(node_of[path[:-1]], other.tokens[v],
                                           calibrations.factor(Scorer.BRANCHES)
                                           * other.scores[v], "ngram")
                scored[path] = (Scorer.BRANCHES, other.scores[v])
        t_spent = drafting_time(drafter) + ngram.counters.t_stage2
        whole = DraftTree(merged, {})  # scores already calibrated: factor 1
        cut = self.res.cut(whole, whole.scores(), t_spent, 1.0, budget.max_nodes)
        kept = cut.tree
        names = frozenset(scored[p][0] for p in (kept.path(v) for v in range(1, len(kept)))
                          if p in scored)
        return StepPlan(cut, drafter, StepKind.DRAFT, names, scored, chain)

    def observe(self, plan: StepPlan, outcome: Outcome) -> None:
        planner = self.planner
        if plan.guesses is not None:
            path, guess = plan.guesses
            if outcome.accepted[:len(path)] == path:  # the target reached the chain's start
                kept = outcome.accepted[len(path):]
                n = 0
                while n < min(len(kept), len(guess)) and kept[n] == guess[n]:
                    n += 1
                planner.observe_ngram(len(guess), n)
        planner.observe_step(plan.kind, outcome.emitted, outcome.seconds)


def guess_nodes(tree: TokenTree, chain: tuple[Path, Path] | None) -> frozenset[int]:
    """Nodes of ``tree`` that are an n-gram chain's guesses (below the leaf they extend)."""
    if not chain:
        return frozenset()
    path, guess = chain
    below = (*path, *guess[:1])
    return frozenset(v for v in range(1, len(tree)) if tree.depths[v] > len(path)
                     and tree.path(v)[:len(below)] == below)

