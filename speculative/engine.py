"""The generation loop: draft a tree, verify it in one target pass, commit, repeat.

``Engine.generate`` is a plain generator of ``Step`` results (one per target forward pass), so
a GUI worker can run it on another thread, turn each step into a signal and stop between steps.
Settings are read at every step: changing ``engine.config`` mid-generation applies from the
next step, and the output stays exact because each step is exact on its own.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence

import numpy as np

from .costmodel import (
    Calibration,
    VerifyCost,
    best_size,
    cached_verify_cost,
    guess_length,
)
from .drafting import (
    DraftCounters,
    Drafter,
    DraftTree,
    ModelDrafter,
    NgramDrafter,
    TreeBudget,
    grow_tree,
    sparse_top,
)
from .errors import IncompatibleModels, PromptTooLong
from .kvtree import COMMIT, KVTree, Parent, Slot
from .ngram import KatzTrigram
from .oracle import OracleDrafter
from .planner import Planner
from .protocols import Context
from .sampling import SamplingParams
from .stats import ORIGINS, RunStats, StepStats
from .tree import TokenTree
from .verify import Verdict, verify_greedy, verify_sampling

log = logging.getLogger(__name__)

PROBE = 3  # draft tokens (a chain) of an exploring step, when drafting measured a loss


class Mode(str, enum.Enum):
    PLAIN = "plain"    # the target alone: the baseline every speedup is measured against
    CHAIN = "chain"    # standard speculative decoding: a chain of draft tokens
    TREE = "tree"      # stage 1: a draft tree verified in one pass
    STAGED = "staged"  # stages 1 + 2: the tree's draft model sped up by the n-gram model
    NGRAM = "ngram"    # the n-gram model drafts a tree for the target directly
    AUTO = "auto"      # each step drafts as much as pays on this machine (speculative.planner)
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
    adaptive: bool = True            # size each tree by measured verify cost (see costmodel)

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
class Step:
    tokens: list[int]     # tokens this step adds to the output
    stats: StepStats
    finish: str | None    # None while generating; "stop", "length", "context" or "cancelled"
    origins: list[str] = dataclasses.field(default_factory=list)  # per token: stats.ORIGINS


@dataclasses.dataclass(slots=True)
class Learned:
    """What an engine measured of this machine and these models while it ran: ``auto``'s
    planner and the calibrations of who drafts. An app keeps its engine, and so this, across
    replies; a benchmark that makes an engine per reply hands it on (``Engine.adopt``)."""

    planner: Planner | None
    calibrations: dict[str, Calibration]
    stage2: Calibration


class Engine:
    """A target context, optionally a draft context and an n-gram model, and the loop."""

    def __init__(self, target: Context, draft: Context | None = None,
                 ngram: KatzTrigram | None = None, config: SpecConfig | None = None) -> None:
        if draft is not None and draft.n_vocab != target.n_vocab:
            raise IncompatibleModels(f"draft vocabulary has {draft.n_vocab} tokens, target "
                                     f"{target.n_vocab}")
        if ngram is not None and ngram.n_vocab != target.n_vocab:
            raise IncompatibleModels(f"n-gram model covers {ngram.n_vocab} tokens, target "
                                     f"{target.n_vocab}")
        self.target = KVTree(target)
        self.draft = KVTree(draft) if draft is not None else None
        self.ngram = ngram if ngram is not None else KatzTrigram.build([], target.n_vocab)
        self.ngram.warm()  # not in the first step's time
        self._ngram_fed: list[int] = []
        self.config = config if config is not None else SpecConfig()
        self.oracle: OracleDrafter | None = None  # Mode.ORACLE's drafter (benchmarks)
        # when set, steps sample with these instead of generate()'s (changed mid-reply; each
        # step is exact for the parameters it ran with)
        self.sampling: SamplingParams | None = None
        self.planner: Planner | None = None       # Mode.AUTO's, made once costs are measured
        self.verify_cost: VerifyCost | None = None  # measured on first use (adaptive trees)
        self.draft_cost: VerifyCost | None = None   # the draft's, for stage-2 guess lengths
        # accepted tokens / predicted, by who scored the tree: the draft model or the n-gram;
        # and in auto's merged trees, the n-gram's branches beside the draft's (see _merge)
        self._calibrations = {"draft": Calibration(), "ngram": Calibration(),
                              "branches": Calibration()}
        self._stage2 = Calibration()  # used / proposed stage-2 guess tokens
        # the last step's scores and drafting time, by who scored the tree (sampled sizing)
        self._previous: dict[str, tuple[list[float], float]] = {}
        self._guesses: tuple = ()  # auto: (path, n-gram chain) added below the best leaf
        # auto, greedy: the merged tree's nodes by path: whose calibration, raw score (_merge)
        self._merged: dict[tuple[int, ...], tuple[str, float]] | None = None

    def learned(self) -> Learned:
        return Learned(self.planner, self._calibrations, self._stage2)

    def adopt(self, learned: Learned) -> None:
        """Carry on from what another engine on the same models learned (``Learned``)."""
        self.planner = learned.planner
        self._calibrations, self._stage2 = learned.calibrations, learned.stage2

    def check(self, config: SpecConfig) -> None:
        if config.mode.needs_draft and self.draft is None:
            raise ValueError(f"mode {config.mode.value!r} needs a draft model")
        if config.mode is Mode.ORACLE and self.oracle is None:
            raise ValueError("the oracle mode needs the target's own continuation (set "
                             "engine.oracle: benchmarks only)")
        budget = config.budget()
        if budget is None:
            return
        ctx = self.target.ctx
        if budget.max_nodes + 1 > min(ctx.n_batch, ctx.n_seq_max):
            raise ValueError(f"a tree of {budget.max_nodes} nodes needs n_batch and n_seq_max "
                             f">= {budget.max_nodes + 1}; the target context has "
                             f"{ctx.n_batch} and {ctx.n_seq_max}")

    def generate(self, prompt: Sequence[int], max_new_tokens: int,
                 params: SamplingParams | None = None, stop: Collection[int] = (),
                 cancel: Callable[[], bool] = lambda: False,
                 run: RunStats | None = None) -> Iterator[Step]:
        """Yield one ``Step`` per target pass until a stop token, the limit or the context end."""
        params = params if params is not None else SamplingParams()
        self.check(self.config)
        committed = list(prompt)
        run = run if run is not None else RunStats()
        run.mode, run.prompt_tokens = self.config.mode.value, len(committed)
        rng = np.random.default_rng(params.seed)
        if (self.config.adaptive and self.config.mode is not Mode.PLAIN) or (
                self.config.mode is Mode.AUTO):
            self.measure_cost()
        if self.planner is not None:
            self.planner.new_text(params.greedy)
        t0 = time.perf_counter()
        self.target.prepare(committed, max_pending=1)  # raises PromptTooLong before any work
        if self.config.mode.needs_draft:
            self.draft.prepare(committed, max_pending=1)
        elif self._uses_draft(self.config) and len(committed) > self.draft.ctx.n_ctx:
            raise PromptTooLong(len(committed), self.draft.ctx.n_ctx)
        # (auto: the draft catches up on the prompt when it first runs, if it does)
        run.t_prefill = time.perf_counter() - t0
        produced = 0
        while produced < max_new_tokens:
            if cancel():
                yield Step([], _empty_stats(), "cancelled")
                return
            config = self.config  # read once per step: settings may change between steps
            self.check(config)
            step_params = self.sampling or params
            tokens, origins, stats = self._step(committed, config, step_params, rng)
            tokens, finish = _truncate(tokens, stop, max_new_tokens - produced)
            origins = origins[:len(tokens)]
            counts = {o: origins.count(o) for o in ORIGINS}
            stats = dataclasses.replace(stats, emitted=len(tokens), origins=counts)
            committed += tokens
            produced += len(tokens)
            if finish is None and len(committed) > self._n_ctx(config):
                finish = "context"
            run.add(stats)
            yield Step(tokens, stats, finish, origins)
            if finish is not None:
                return

    def measure_cost(self, force: bool = False) -> VerifyCost:
        """Time the target's verification of 1..max_nodes+1 tokens (once; clears its cache)."""
        budget = self.config.budget() or TreeBudget()
        if self.verify_cost is None or force:
            n = min(max(budget.max_nodes, self.config.chain_length, 16) + 1,
                    self.target.ctx.n_batch)
            self.verify_cost = cached_verify_cost(self.target.ctx, n, refresh=force)
            self.target.reset()
            log.info("verify cost (ms): %s, a new batch shape +%.2f", _ms(self.verify_cost),
                     self.verify_cost.switch * 1000)
        if self.draft is not None and (self.draft_cost is None or force):
            n = min(budget.max_nodes + self.config.lookahead + 1, self.draft.ctx.n_batch)
            self.draft_cost = cached_verify_cost(self.draft.ctx, n, refresh=force)
            self.draft.reset()
            log.info("draft cost (ms): %s, a new batch shape +%.2f", _ms(self.draft_cost),
                     self.draft_cost.switch * 1000)
        if self.planner is None or force:
            self.planner = Planner(self.verify_cost, self.draft_cost)
        return self.verify_cost

    def _n_ctx(self, config: SpecConfig | None = None) -> int:
        """The usable window: the smaller context, if a draft runs beside the target."""
        if self._uses_draft(config or self.config):
            return min(self.target.ctx.n_ctx, self.draft.ctx.n_ctx)
        return self.target.ctx.n_ctx

    def _uses_draft(self, config: SpecConfig) -> bool:
        """The draft model runs in this mode (``auto`` uses it when there is one)."""
        return self.draft is not None and (
            config.mode.needs_draft or config.mode is Mode.AUTO)

    def _step(self, committed: list[int], config: SpecConfig, params: SamplingParams,
              rng: np.random.Generator) -> tuple[list[int], list[str], StepStats]:
        """One target pass: the emitted tokens, who proposed each, and the step's statistics."""
        t0 = time.perf_counter()
        self._guesses, self._merged = (), None  # set by this step's auto tree, if any
        self._tried_ngram = False  # auto grew (or would grow) the n-gram's tree this step
        if self.verify_cost is not None and self.planner is not None:
            # auto decides whether to draft at all against a batch shaped like the last one:
            # leaving the target alone for a tree, and coming back, each build a graph
            self.planner.target = self.verify_cost.after(self.target.last_batch)
        budget = self._fit(config, committed)
        drafter = self._drafter(config, budget, params) if budget is not None else None
        if config.mode in (Mode.NGRAM, Mode.STAGED):
            self._feed_ngram(committed)
        try:
            if drafter is None or budget is None:
                draft = DraftTree(TokenTree.rooted(committed[-1]), {})
            elif config.mode is Mode.AUTO and self.planner is not None:
                draft, drafter = self._auto_tree(drafter, committed, budget, params, rng)
            else:
                # tree and staged, adaptive: a draft batch only where it pays (Planner.expand),
                # ngram: only nodes that could pay grow; a chain keeps its length (standard
                # speculative decoding, the baseline)
                grow = config.adaptive and self.planner is not None
                expand = (self._expander(budget) if grow and config.mode in (
                    Mode.TREE, Mode.STAGED) else self._worth_growing()
                    if grow and config.mode is Mode.NGRAM else None)
                draft = grow_tree(drafter, committed, budget, params, rng, expand)
                if config.adaptive and self.verify_cost is not None:
                    draft = self._right_size(draft, drafter, params)
            t1 = time.perf_counter()
            verdict, slots = self._verify(committed, draft, params, rng)
        except BaseException:
            self.target.rollback()
            if self.draft is not None:
                self.draft.rollback()
            raise
        t2 = time.perf_counter()
        tree = draft.tree
        accepted = [tree.tokens[n] for n in verdict.accepted]
        last = verdict.accepted[-1] if verdict.accepted else 0
        self.target.commit(slots[last], accepted)
        if drafter is not None:
            drafter.commit(tuple(accepted))
            self._calibrate(tree, verdict.accepted, drafter)
            if self.planner is not None and self._guesses:
                self._observe_guesses(tuple(accepted))
            if drafter.counters.stage2_proposed:
                self._stage2.add(drafter.counters.stage2_used, drafter.counters.stage2_proposed)
        counters = drafter.counters if drafter is not None else DraftCounters()
        origins = [tree.origins[n] for n in verdict.accepted] + ["target"]
        t3 = time.perf_counter()
        stats = StepStats(
            drafted=len(tree) - 1, accepted=len(accepted), offered=verdict.offered,
            emitted=len(origins), origins={}, draft_calls=counters.calls,
            stage2_proposed=counters.stage2_proposed, stage2_used=counters.stage2_used,
            t_draft=counters.t_draft, t_stage2=counters.t_stage2, t_verify=t2 - t1,
            t_other=max(0.0, (t1 - t0) - counters.t_draft - counters.t_stage2) + (t3 - t2))
        if self.planner is not None:
            self.planner.steps_overhead.add(stats.t_other)
            if config.mode is Mode.AUTO:
                # a kind is what the step tried, whatever the cut then kept: an n-gram tree
                # grown and cut to nothing cost its time too (a "root" step is the target alone)
                kind = ("draft" if counters.calls else
                        "guesses" if self._tried_ngram or len(tree) > 1 else "root")
                self.planner.observe_step(kind, stats.emitted, t3 - t0)
        return [*accepted, verdict.next_token], origins, stats

    def _auto_tree(self, drafter: Drafter, committed: list[int], budget: TreeBudget,
                   params: SamplingParams, rng: np.random.Generator
                   ) -> tuple[DraftTree, Drafter]:
        """``auto``: draft only as deep and wide as pays (``Planner.expand``), add the n-gram's
        free guesses below the best leaf and merge in the n-gram's own tree (greedy,
        ``_merge``), keep the nodes worth verifying. When the
        draft model does not run, the n-gram model's own tree instead (as ``ngram`` mode grows
        it, greedy or sampled). Greedy, that tree is grown first (its nodes' best children
        cost ~0.1 ms each) and the draft runs only if it promises more tokens per second than
        the n-gram's tree does at this step. Returns the tree and the drafter that scored it."""
        planner = self.planner
        assert planner is not None
        expand = self._expander(budget)
        if planner.wants_root():
            return DraftTree(TokenTree.rooted(committed[-1]), {}), drafter
        if isinstance(drafter, NgramDrafter):  # no draft model
            self._tried_ngram = True
            self._feed_ngram(committed)
            draft = grow_tree(drafter, committed, budget, params, rng, self._worth_growing())
            return self._right_size(draft, drafter, params), drafter
        # (whether to guess, like whether to draft, follows past steps and this step's
        # distributions, never its draws: sampled, the n-gram's tree is grown only if chosen).
        # The measured rates gate the n-gram's trees even greedy, where they are judged on the
        # step's own scores: on code those promised more than they gave (auto 0.82x, as ngram)
        guesses = self._tried_ngram = planner.guesses_allowed()
        if guesses:
            self._feed_ngram(committed)
        ngram = NgramDrafter(self.ngram, sparse_top(params, budget.max_children))
        ngram_tree, baseline = None, 0.0
        if guesses and params.greedy:
            ngram_tree = grow_tree(ngram, committed, budget, params, rng, self._worth_growing())
            n, rate = planner.best_cut(ngram_tree.scores(), ngram.counters.t_stage2,
                                       self._calibrations["ngram"].factor)
            baseline = rate if n > 0 else 0.0
        draft = self._maybe_draft(drafter, committed, budget, params, rng, expand, baseline)
        if len(draft.tree) > 1:
            if ngram_tree is not None:
                draft = self._add_guesses(draft, committed, budget)
                return self._merge(draft, ngram_tree, drafter, ngram, budget), drafter
            return self._right_size(draft, drafter, params), drafter
        if not guesses:
            return draft, drafter
        if ngram_tree is None:  # sampled: sized by the last step's scores, so an exploration
            # while the n-gram's trees measure a loss is a probe (see _maybe_draft)
            if planner.measured_loss("guesses"):
                budget = _probe(budget)
            ngram_tree = grow_tree(ngram, committed, budget, params, rng, self._worth_growing())
        return self._right_size(ngram_tree, ngram, params), ngram

    def _worth_growing(self) -> Callable[[TokenTree, list[int], int], int]:
        """``grow_tree``'s ``expand`` for the n-gram's trees (``auto``, adaptive ``ngram``):
        expand only the frontier nodes whose calibrated score could still pay for a node of
        the batch (a child scores at most its parent; ``Planner.least_worth``). Growing the
        whole tree cost 6-9 ms on new text here, against a 2-3 ms pass of the built-in
        target; most of it was cut away."""
        planner = self.planner
        assert planner is not None
        least = planner.least_worth() / self._calibrations["ngram"].factor

        def expand(tree: TokenTree, frontier: list[int], depth: int) -> int:
            return sum(tree.scores[v] >= least for v in frontier)  # best first

        return expand

    def _expander(self, budget: TreeBudget) -> Callable[[TokenTree, list[int], int], int]:
        """``grow_tree``'s ``expand``: how many frontier nodes the next draft batch takes, as
        many as pay on the measured cost curves (``Planner.expand``); 0 stops growing."""
        planner = self.planner
        assert planner is not None
        calibration = self._calibrations["draft"].factor
        t0 = time.perf_counter()

        def expand(tree: TokenTree, frontier: list[int], depth: int) -> int:
            # the draft's confidence in each new node's best child, for the next decisions
            planner.observe([tree.scores[v] / tree.scores[tree.parents[v]] for v in frontier
                             if tree.ranks[v] == 0 and tree.scores[tree.parents[v]] > 0])
            return planner.expand([tree.scores[v] for v in frontier], tree.scores[1:],
                                  time.perf_counter() - t0, calibration,
                                  budget.max_depth - depth)

        return expand

    def _maybe_draft(self, drafter: Drafter, committed: list[int], budget: TreeBudget,
                     params: SamplingParams, rng: np.random.Generator,
                     expand: Callable[[TokenTree, list[int], int], int],
                     baseline: float = 0.0) -> DraftTree:
        """Grow the draft tree if even its first batch pays (against the target alone, or the
        ``baseline`` tokens per second another tree offers); else a lone root, or now and then
        a probe: a short chain, to see whether drafting pays again (a full tree, verified at
        the steep end of the cost curve, cost 6-7 target passes for 4-7 tokens here)."""
        planner = self.planner
        assert planner is not None
        pays = (planner.expand([1.0], [], 0.0, self._calibrations["draft"].factor,
                               budget.max_depth, baseline) > 0
                and not planner.measured_loss("draft") and planner.may_try("draft"))
        if not pays:
            # no probe where the n-gram's tree pays at this step: a short chain would not beat
            # it, and would pay the draft's catching up on the text (on repetitive chat text,
            # probes cost auto 6% against ngram)
            assert self.draft is not None
            if baseline > 0 or not planner.explore(
                    planner.probe_risk(self.draft.behind(committed), PROBE)):
                return DraftTree(TokenTree.rooted(committed[-1]), {})
            budget = _probe(budget)
        planner.drafted()
        self._feed_ngram(committed)  # the draft's stage 2 guesses from it
        return grow_tree(drafter, committed, budget, params, rng, expand)

    def _merge(self, draft: DraftTree, ngram_tree: DraftTree, drafter: Drafter,
               ngram: NgramDrafter, budget: TreeBudget) -> DraftTree:
        """Greedy: the draft's tree and the n-gram's tree as one tree, verified in one pass.

        Each node's score becomes its estimated acceptance: the draft's path probability times
        the draft's calibration (accepted over predicted, on its own nodes); a path only the
        n-gram proposed (a branch beside the draft's choices) its n-gram path probability
        times the calibration of such branches, measured on them alone: where the draft is
        unsure the free n-gram often names the target's token (on code, the built-in n-gram's
        first choice was right at 42% of the positions where the draft's was wrong), but a
        branch the draft disagrees with is accepted far less often than the n-gram's own
        trees are, and on a CPU whose every batch token costs a quarter of a pass few pay.
        The merged tree is cut, like any other, to the size that maximises expected tokens per
        second. Greedy verification is exact for any tree; sampled steps never merge (a
        node's children must all come from one distribution)."""
        factor = {k: c.factor for k, c in self._calibrations.items()}
        tree = draft.tree
        guessed = self._guess_nodes(tree)
        merged = TokenTree.rooted(tree.tokens[0])
        node_of: dict[tuple[int, ...], int] = {(): 0}
        scored: dict[tuple[int, ...], tuple[str, float]] = {}  # path -> (calibration, score)
        for v in range(1, len(tree)):
            path = tree.path(v)
            node_of[path] = merged.add(node_of[path[:-1]], tree.tokens[v],
                                       factor["draft"] * tree.scores[v], tree.origins[v])
            if v not in guessed:  # auto's n-gram guesses are scored by the chain's hit rate
                scored[path] = ("draft", tree.scores[v])
        other = ngram_tree.tree
        for v in range(1, len(other)):
            path = other.path(v)
            if path not in node_of:
                node_of[path] = merged.add(node_of[path[:-1]], other.tokens[v],
                                           factor["branches"] * other.scores[v], "ngram")
                scored[path] = ("branches", other.scores[v])
        self._merged = scored
        t_spent = (drafter.counters.t_draft + drafter.counters.t_stage2
                   + ngram.counters.t_stage2)
        merged_tree = DraftTree(merged, {})  # scores already calibrated: factor 1
        return self._cut(merged_tree, merged_tree.scores(), t_spent, 1.0, budget.max_nodes)

    def _calibrate(self, tree: TokenTree, accepted: list[int], drafter: Drafter) -> None:
        """Update the calibration of whoever scored the verified tree's nodes: the drafter's,
        or after a merge (``_merge``) the draft's and the n-gram branches', each on its own."""
        if self._merged is None:
            guessed = self._guess_nodes(tree)  # auto's n-gram guesses have their own rate
            self._calibrations[_scorer(drafter)].add(
                sum(v not in guessed for v in accepted),
                sum(tree.scores[v] for v in range(1, len(tree)) if v not in guessed))
            return
        kept = set(accepted)
        totals: dict[str, list[float]] = {}
        for v in range(1, len(tree)):
            name, score = self._merged.get(tree.path(v), ("", 0.0))
            if name:
                total = totals.setdefault(name, [0.0, 0.0])
                total[0] += v in kept
                total[1] += score
        for name, (hits, predicted) in totals.items():
            self._calibrations[name].add(int(hits), predicted)

    def _add_guesses(self, draft: DraftTree, committed: list[int],
                     budget: TreeBudget) -> DraftTree:
        """Chain the n-gram's greedy continuation below the best path's leaf (free to draft;
        the final cut keeps the guesses whose expected acceptance pays their share of the
        target pass). Greedy only: a sampled node's children must all come from one q."""
        assert self.planner is not None
        tree = draft.tree
        leaf = 0
        while tree.children[leaf]:
            leaf = tree.children[leaf][0]  # rank 0: the draft's most likely continuation
        room = min(budget.max_nodes - (len(tree) - 1), budget.max_depth - tree.depths[leaf])
        if room < 1:
            return draft
        path = tree.path(leaf)
        guess = self.ngram.greedy([*committed, *path][-2:], room)
        scores = self.planner.ngram_scores(tree.scores[leaf], room)
        node = leaf
        for token, score in zip(guess, scores, strict=True):
            node = tree.add(node, token, score, "ngram")
        self._guesses = (path, tuple(guess))
        return draft

    def _guess_nodes(self, tree: TokenTree) -> set[int]:
        """Nodes of ``tree`` that are auto's n-gram guesses (below the leaf they extend)."""
        if not self._guesses:
            return set()
        path, guess = self._guesses
        below = (*path, *guess[:1])
        return {v for v in range(1, len(tree)) if tree.depths[v] > len(path)
                and tree.path(v)[:len(below)] == below}

    def _observe_guesses(self, accepted: tuple[int, ...]) -> None:
        """How far the target followed the n-gram's chain, if it reached its start."""
        assert self.planner is not None
        path, guess = self._guesses
        self._guesses = ()
        if accepted[:len(path)] != path:
            return
        kept = accepted[len(path):]
        n = 0
        while n < min(len(kept), len(guess)) and kept[n] == guess[n]:
            n += 1
        self.planner.observe_ngram(len(guess), n)

    def _right_size(self, draft: DraftTree, drafter: Drafter, params: SamplingParams
                    ) -> DraftTree:
        """Cut the tree to the size that maximises expected tokens per second (costmodel)."""
        scorer = _scorer(drafter)
        scores = draft.scores()
        t_draft = drafter.counters.t_draft + drafter.counters.t_stage2
        # greedy: this step's own scores; sampling: the last step's by the same scorer
        # (independent of this step's draws, which keeps the verified tree's shape free of them)
        basis, t_basis = (scores, t_draft) if params.greedy else self._previous.get(scorer,
                                                                                   ([], 0.0))
        self._previous[scorer] = (scores, t_draft)
        if not basis:
            return draft
        return self._cut(draft, basis, t_basis, self._calibrations[scorer].factor)

    def _cut(self, draft: DraftTree, basis: list[float], t_draft: float, factor: float,
             most: int | None = None) -> DraftTree:
        """``draft`` cut to its best n nodes, n = ``best_size`` of the ``basis`` scores (at
        least 1, at most ``most``)."""
        # the curve alone, not priced by the last batch's shape: a tree's size settles over
        # steps, and a step that paid to change it would keep paying to keep it small
        assert self.verify_cost is not None
        n = max(best_size(basis, self.verify_cost, t_draft, factor), 1)
        return draft.best(n if most is None else min(n, most))

    def _drafter(self, config: SpecConfig, budget: TreeBudget, params: SamplingParams
                 ) -> Drafter | None:
        if config.mode is Mode.PLAIN:
            return None
        if config.mode is Mode.ORACLE:
            return self.oracle
        if config.mode is Mode.NGRAM or (config.mode is Mode.AUTO and self.draft is None):
            # greedy trees need each node's best children only (cheap from the n-gram)
            return NgramDrafter(self.ngram, sparse_top(params, budget.max_children))
        assert self.draft is not None
        lookahead = self.ngram if config.mode in (Mode.STAGED, Mode.AUTO) else None
        if not (config.adaptive and self.draft_cost is not None and lookahead is not None):
            return ModelDrafter(self.draft, lookahead, config.lookahead)
        cost, hit_rate = self.draft_cost, self._stage2.factor

        def worth(batch: int, most: int) -> int:  # guess tokens worth their draft cost
            return guess_length(cost, batch, most, hit_rate)

        return ModelDrafter(self.draft, lookahead, config.lookahead, worth)

    def _fit(self, config: SpecConfig, committed: list[int]) -> TreeBudget | None:
        """Shrink the tree so that it fits the context window; None when only plain fits.

        The target's batch is the pending committed tokens (root included) plus the drafted
        nodes, each in a KV cell of its own beside the cached ones, so the nodes must fit the
        ``n_ctx - len(committed)`` cells left, not only the positions: near the end of the
        window a deep bushy tree would otherwise not find its cells. (The draft's own cells,
        nodes plus stage-2 guesses, are counted as it decodes: ``ModelDrafter``.)
        """
        budget = config.budget()
        if budget is None:
            return None
        room = self._n_ctx(config) - len(committed)
        if room < 1:
            return None
        return dataclasses.replace(budget, max_nodes=min(budget.max_nodes, room),
                                   max_depth=min(budget.max_depth, room))

    def _verify(self, committed: list[int], draft: DraftTree, params: SamplingParams,
                rng: np.random.Generator) -> tuple[Verdict, list[Slot]]:
        """One target pass over the pending tokens and the tree; the acceptance rule."""
        tree = draft.tree
        pending = self.target.prepare(committed,
                                      max_pending=self.target.ctx.n_batch - len(tree) + 1)
        k = len(pending) - 1  # batch index of the root
        tokens = pending + tree.tokens[1:]
        parents: list[Parent] = [COMMIT] * len(pending)
        parents += [k + tree.parents[i] for i in range(1, len(tree))]
        want = [False] * k + [True] * len(tree)
        slots, logits = self.target.decode(tokens, parents, want)
        if params.greedy:
            verdict = verify_greedy(tree, logits)
        else:
            verdict = verify_sampling(tree, logits, draft.q, params, rng)
        return verdict, slots[k:]  # slots of the tree's nodes, by node id

    def _feed_ngram(self, committed: list[int]) -> None:
        """Teach the n-gram model the conversation (only what it has not seen yet). Called
        where a step is about to use the model, not after every step: plain decoding and
        ``auto``'s steps with the target alone never pay for it (~0.3 ms a call, a tenth of
        the built-in target's pass)."""
        fed = self._ngram_fed
        if committed[:len(fed)] != fed:
            fed = self._ngram_fed = []
        if len(committed) > len(fed):
            self.ngram.update_continued(fed, committed[len(fed):])
            self._ngram_fed = list(committed)


def _probe(budget: TreeBudget) -> TreeBudget:
    """An exploration's tree: a chain of at most ``PROBE`` tokens."""
    return dataclasses.replace(budget, max_nodes=min(budget.max_nodes, PROBE),
                               max_depth=min(budget.max_depth, PROBE), max_children=1)


def _scorer(drafter: Drafter) -> str:
    """Who scored a tree's nodes: ``"ngram"`` (the n-gram model's probabilities) or
    ``"draft"`` (a draft model's; the oracle's count as these too)."""
    return "ngram" if isinstance(drafter, NgramDrafter) else "draft"


def _ms(cost: VerifyCost) -> dict[int, float]:
    return {n: round(t * 1000, 2) for n, t in zip(cost.sizes, cost.seconds, strict=True)}


def _truncate(tokens: list[int], stop: Collection[int], limit: int) -> tuple[list[int], str | None]:
    for i, t in enumerate(tokens[:limit]):
        if t in stop:
            return tokens[:i], "stop"
    if len(tokens) >= limit:
        return tokens[:limit], "length"
    return tokens, None


def _empty_stats() -> StepStats:
    return StepStats(0, 0, 0, 0, {"draft": 0, "ngram": 0, "target": 0}, 0, 0, 0,
                     0.0, 0.0, 0.0, 0.0)
