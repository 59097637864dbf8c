"""The generation loop: plan a tree, verify it in one target pass, commit, observe, repeat.

``Engine.generate`` is a plain generator of ``Step`` results (one per target forward pass), so
a GUI worker can run it on another thread, turn each step into a signal and stop between steps.
What each step drafts is its mode's policy's business (``speculative.policies``,
``speculative.auto``): it returns an immutable ``StepPlan``; the engine verifies the plan's tree,
commits the accepted path to every cache, and hands the verdict back. Settings are read at
every step: changing ``engine.config`` mid-generation applies from the next step, and the
output stays exact because each step is exact on its own.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .auto import RECALL_STEPS, AutoPolicy, Planner
from .costmodel import PassLoads, Running, VerifyCost
from .drafting import DraftTree, TreeBudget
from .errors import IncompatibleModels, PromptTooLong
from .kvtree import COMMIT, KVTree, Parent, Slot
from .ngram import KatzTrigram
from .penalties import Penalizer, StepPenalties, penalizer_for
from .plan import Calibrations, StepKind, StepPlan
from .policies import (
    Mode,
    Outcome,
    Policy,
    Resources,
    SpecConfig,
    StepInput,
    TreePolicy,
    fit_budget,
)
from .protocols import Context
from .sampling import SamplingParams
from .sizing import Sizer
from .stats import ORIGINS, RunStats, StepStats
from .tree import TokenTree
from .verify import Verdict, verify_greedy, verify_sampling

log = logging.getLogger(__name__)

CHECK_PASSES = 32  # single-token passes a curve is checked against (``Engine.curve_too_dear``)
TOO_DEAR = 0.85    # ... and the share of its single-token cost below which it is measured again


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    tokens: list[int]     # tokens this step adds to the output
    stats: StepStats
    finish: str | None    # None while generating; "stop", "length", "context" or "cancelled"
    origins: list[str] = dataclasses.field(default_factory=list)  # per token: stats.ORIGINS


@dataclasses.dataclass(slots=True)
class Learned:
    """What an engine measured of this machine and these models while it ran: ``auto``'s
    planner (with the sizer's running estimates) and the calibrations of who drafts. An app
    keeps its engine, and so this, across replies; a benchmark that makes an engine per reply
    hands it on (``Engine.adopt``). With it, the time a step with the target alone spends
    outside its pass, which the meter's counterfactual adds to a pass."""

    planner: Planner | None
    calibrations: Calibrations
    overhead: Running = dataclasses.field(default_factory=lambda: Running(prior=0.0))

    def copy(self) -> Learned:
        """A snapshot: an engine that adopts it learns on in its own copy, and this stays as
        it was (the app's race replays a reply from what the engine knew when it began)."""
        return copy.deepcopy(self)


def _forwarded(name: str) -> property:
    return property(lambda self: getattr(self.res, name),
                    lambda self, value: setattr(self.res, name, value))


class Engine:
    """A target context, optionally a draft context and an n-gram model, and the loop."""

    def __init__(self, target: Context, draft: Context | None = None,
                 ngram: KatzTrigram | None = None, config: SpecConfig | None = None,
                 breakers: Callable[[Sequence[str]], frozenset[int]] | None = None) -> None:
        """``breakers``: the tokens whose text contains one of the given strings (DRY's
        sequence breakers; ``Vocabulary.tokens_containing``); without it none breaks one."""
        if draft is not None and draft.n_vocab != target.n_vocab:
            raise IncompatibleModels(f"draft vocabulary has {draft.n_vocab} tokens, target "
                                     f"{target.n_vocab}")
        if ngram is not None and ngram.n_vocab != target.n_vocab:
            raise IncompatibleModels(f"n-gram model covers {ngram.n_vocab} tokens, target "
                                     f"{target.n_vocab}")
        ngram = ngram if ngram is not None else KatzTrigram.build([], target.n_vocab)
        ngram.warm()  # not in the first step's time
        self.res = Resources(KVTree(target), KVTree(draft) if draft is not None else None, ngram)
        self.config = config if config is not None else SpecConfig()
        # when set, steps sample with these instead of generate()'s (changed mid-reply; each
        # step is exact for the parameters it ran with)
        self.sampling: SamplingParams | None = None
        self._policies: dict[Mode, Policy] = {}
        # seconds a step with the target alone spends outside its pass (decayed mean)
        self._overhead = Running(prior=0.0)
        # single-token passes timed in steady decoding over what the curve says they cost
        self._one_seen: collections.deque[float] = collections.deque(maxlen=CHECK_PASSES)
        # the target's passes against the curve, single and drafted (a model pair's engines
        # share one: ``ModelPair.engine``); what the meter's counterfactual corrects by
        self.passes = PassLoads()
        self._redecode = 0  # accepted tokens the last commit left for the next pass to decode
        self._breakers = breakers
        self._penalizer: Penalizer | None = None  # the last params' (they rarely change)

    # the engine's parts, as callers name them (set: a benchmark's oracle, a test's curves)
    target = property(lambda self: self.res.target)
    draft = property(lambda self: self.res.draft)
    ngram = _forwarded("ngram")
    verify_cost = _forwarded("verify_cost")
    draft_cost = _forwarded("draft_cost")
    planner = _forwarded("planner")
    oracle = _forwarded("oracle")  # Mode.ORACLE's drafter: the target's own continuation

    def learned(self) -> Learned:
        return Learned(self.res.planner, self.res.calibrations, self._overhead)

    def adopt(self, learned: Learned) -> None:
        """Carry on from what another engine on the same models learned (``Learned``)."""
        self.res.planner = learned.planner
        self.res.sizer = learned.planner.sizer if learned.planner is not None else None
        self.res.calibrations = learned.calibrations
        self._overhead = learned.overhead

    def memory(self) -> dict[str, Any]:
        """What this engine learned, as JSON-able data for a later run of a program on the same
        models and machine (``recall``): ``auto``'s planner, the calibrations, the draft's
        running confidence, and what drafted passes cost beyond the curve against single
        tokens (``PassLoads.known``)."""
        res = self.res
        return {"planner": res.planner.memory() if res.planner is not None else None,
                "calibrations": res.calibrations.memory(),
                "confidence": res.sizer.confidence.memory() if res.sizer is not None else None,
                "drafted_factor": self.passes.known}

    def recall(self, memory: Mapping[str, Any]) -> None:
        """Carry on from ``memory()`` of an earlier run, each measurement weighing a few
        steps (``auto.RECALL_STEPS``): the first reply then starts where the last run left
        off. Needs the cost curves (``measure_cost``: measured now if nobody has). ValueError
        for a memory it cannot read (nothing is then changed)."""
        self.measure_cost()
        res = self.res
        assert res.planner is not None and res.sizer is not None
        try:
            calibrations = res.calibrations.recalled(memory["calibrations"], RECALL_STEPS)
            confidence = (res.sizer.confidence.recalled(memory["confidence"], RECALL_STEPS)
                          if memory["confidence"] is not None else res.sizer.confidence)
            planner = memory["planner"]
            factor = float(memory.get("drafted_factor", self.passes.known))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an engine's memory: {exc!r}") from exc
        if planner is not None:
            res.planner.recall(planner)
        res.calibrations, res.sizer.confidence = calibrations, confidence
        with contextlib.suppress(ValueError):  # out of range: measured afresh
            self.passes.recall(factor)

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
        # adaptive modes size by the curves; known curves also price the meter's plain time
        if self.config.mode is not Mode.PLAIN and (
                self.config.adaptive or self.config.mode is Mode.AUTO
                or self.res.verify_cost is not None):
            self.measure_cost()
        if self.planner is not None:
            self.planner.new_text(params.greedy)
        self._penalizer_for(params)  # the vocabulary's breakers, scanned once, untimed
        t0 = time.perf_counter()
        self.target.prepare(committed, max_pending=1)  # raises PromptTooLong before any work
        self._redecode = 0  # decoded just now
        # auto decodes the prompt into the draft too when its next steps will draft (as the
        # draft's modes do): that is reading the prompt, not drafting. Otherwise the draft
        # catches up when it first runs, if it does.
        if self.config.mode.needs_draft or (
                self._uses_draft(self.config) and self.planner is not None
                and self.planner.runs_first(StepKind.DRAFT)):
            self.draft.prepare(committed, max_pending=1)
        elif self._uses_draft(self.config) and len(committed) > self.draft.ctx.n_ctx:
            raise PromptTooLong(len(committed), self.draft.ctx.n_ctx)
        run.t_prefill = time.perf_counter() - t0
        produced = 0
        while produced < max_new_tokens:
            if cancel():
                yield Step([], StepStats.empty(), "cancelled")
                return
            config = self.config  # read once per step: settings may change between steps
            self.check(config)
            tokens, origins, stats = self._step(committed, config, self.sampling or params, rng)
            tokens, finish = _truncate(tokens, stop, max_new_tokens - produced)
            origins = origins[:len(tokens)]
            counts = {o: origins.count(o) for o in ORIGINS}
            stats = dataclasses.replace(stats, emitted=len(tokens), origins=counts,
                                        stopped=int(finish == "stop"))
            committed += tokens
            produced += len(tokens)
            if finish is None and len(committed) > self._n_ctx(config):
                finish = "context"
            run.add(stats)
            yield Step(tokens, stats, finish, origins)
            if finish is not None:
                return

    def measure_cost(self, force: bool = False) -> VerifyCost:
        """Measure the cost curves once (``Resources.measure_costs``); the sizer and ``auto``'s
        planner start from them."""
        res = self.res
        res.measure_costs(self.config, force)
        if res.planner is None or force:
            res.sizer = Sizer(res.verify_cost, res.draft_cost)
            res.planner = Planner(res.sizer)
        return res.verify_cost

    def curve_too_dear(self) -> bool:
        """Whether the target's curve prices a single token well above what the run's own
        single-token passes took: the median of the last ``CHECK_PASSES`` of them (each after
        another, at its context) below ``TOO_DEAR`` of the curve's cost. A busy machine makes
        passes dearer, never cheaper, so such a curve was timed in a slow moment; every ratio
        to its single token is then too small (trees sized for a flatter curve than the
        machine's, the meter reading high), and once cached it would stay so."""
        seen = self._one_seen
        return len(seen) >= CHECK_PASSES and float(np.median(seen)) < TOO_DEAR

    def check_curve(self) -> bool:
        """Measure the target's curve again if it is ``curve_too_dear`` (between replies:
        it takes a few passes of every size); whether it was."""
        if not self.curve_too_dear():
            return False
        log.warning("single tokens took %.0f%% of the measured curve's cost: measuring it "
                    "again", 100 * float(np.median(self._one_seen)))
        self.res.remeasure_target()
        self._one_seen.clear()
        self.passes.clear()  # priced by the curve replaced
        return True

    def _n_ctx(self, config: SpecConfig | None = None) -> int:
        """The usable window: the smaller context, if a draft runs beside the target."""
        if self._uses_draft(config or self.config):
            return min(self.target.ctx.n_ctx, self.draft.ctx.n_ctx)
        return self.target.ctx.n_ctx

    def _uses_draft(self, config: SpecConfig) -> bool:
        """The draft model runs in this mode (``auto`` uses it when there is one)."""
        return self.draft is not None and (
            config.mode.needs_draft or config.mode is Mode.AUTO)

    def _policy(self, mode: Mode) -> Policy:
        if mode not in self._policies:
            self._policies[mode] = (AutoPolicy(self.res) if mode is Mode.AUTO
                                    else TreePolicy(self.res, mode))
        return self._policies[mode]

    def _penalizer_for(self, params: SamplingParams) -> Penalizer | None:
        """The params' penalties (None when none is on), kept while the params stay."""
        if self._penalizer is None or self._penalizer.params != params:
            self._penalizer = penalizer_for(params, self.target.ctx.n_vocab, self._breakers)
        return self._penalizer

    def _penalties(self, params: SamplingParams, committed: list[int]) -> StepPenalties | None:
        """The params' penalties for this step's nodes (None when none is on)."""
        penalizer = self._penalizer_for(params)
        return penalizer.step(committed) if penalizer is not None else None

    def _step(self, committed: list[int], config: SpecConfig, params: SamplingParams,
              rng: np.random.Generator) -> tuple[list[int], list[str], StepStats]:
        """One target pass: the emitted tokens, who proposed each, and the step's statistics."""
        t0 = time.perf_counter()
        res, policy = self.res, self._policy(config.mode)
        penalties = self._penalties(params, committed)
        last_shape = res.target.last_batch
        if res.sizer is not None:
            # at this context, priced after a batch shaped like the last one: leaving the
            # target alone for a tree, and coming back, each build a graph
            res.sizer.locate(len(committed), res.target.last_batch,
                             self.passes.drafted_factor)
        step = StepInput(committed, config, self._fit(config, committed), params, rng, penalties,
                         t0)
        try:
            plan = policy.plan(step)
            t1 = time.perf_counter()
            beside = [(alt.tree, alt.q) for alt in plan.alternatives if alt.q is not None]
            verdict, slots, in_place = self._verify(committed, plan.tree, params, rng,
                                                    penalties, beside)
        except BaseException:
            self._rollback()
            raise
        t2 = time.perf_counter()
        batch, shape_before = self.target.last_batch, last_shape
        if res.verify_cost is not None and len(committed) >= res.verify_cost.context:
            # a pass with at least the context the curve was timed after (a shorter one is
            # priced as that one, and costs less), over the curve's price: a single token
            # after another checks the curve's single token, and against drafted passes
            # corrects the meter's counterfactual (``PassLoads``)
            curve = (res.sizer.curve if res.sizer is not None
                     else res.verify_cost.at(len(committed)))
            if batch == 1 and shape_before == 1:
                load = (t2 - t1) / curve.curve(1)
                self._one_seen.append(load)
                self.passes.add(1, load)
            elif batch > 1:
                switch = curve.switch if batch != shape_before else 0.0
                self.passes.add(batch, max(t2 - t1 - switch, 0.0) / curve.curve(batch))
        redecoded = self._redecode
        accepted = self._commit(plan, verdict, slots, in_place)
        t3 = time.perf_counter()
        drafting = plan.counters.t_draft + plan.counters.t_stage2 + plan.t_aside
        single = self._single_pass(batch, shape_before, t2 - t1)
        plain = self._plain_per_token(batch, single, t3 - t0 - (t2 - t1) - drafting)
        stats = StepStats.timed(plan.counters, len(plan.tree.tree) - 1, len(verdict.accepted),
                                verdict.offered, t0, t1, t2, t3, batch, plain,
                                plan.kind.value)
        if redecoded:
            stats = dataclasses.replace(stats, redecoded=redecoded)
        if penalties is not None:
            stats = dataclasses.replace(stats, steered=verdict.changed,
                                        t_penalties=penalties.seconds)
        if res.sizer is not None:
            res.sizer.steps_overhead.add(stats.t_other)
        alone = plain if batch == 1 or self._overhead.weight > 0 else 0.0
        policy.observe(plan, Outcome(verdict.accepted, accepted, stats.emitted, t3 - t0,
                                     t1 - t0, t2 - t1, batch, verdict.next_token, single,
                                     alone, verdict.expected + 1,
                                     _beside_tokens(plan, verdict)))
        tree = plan.tree.tree
        origins = [tree.origins[n] for n in verdict.accepted] + ["target"]
        return [*accepted, verdict.next_token], origins, stats

    def _single_pass(self, batch: int, shape_before: int, t_verify: float) -> float:
        """What the target's pass over one token, with the acceptance rule, costs now: this
        step's own where it verified the root alone; any other step's pass of ``batch`` tokens
        scaled by the cost curve to one token (less the graph switch when the batch's shape
        changed), and by what drafted passes have recently cost beyond the curve's shape
        against single tokens (``PassLoads.drafted_factor``: a pass's fixed costs, logits and
        penalties among them, do not shrink with the curve); 0 without a cost curve."""
        if batch == 1:
            return t_verify
        if self.res.sizer is None:
            return 0.0
        cost = self.res.sizer.curve  # at this step's context
        switch = cost.switch if batch != shape_before else 0.0
        return (max(t_verify - switch, 0.0) * cost.curve(1) / cost.curve(batch)
                / self.passes.drafted_factor())

    def _plain_per_token(self, batch: int, single: float, t_rest: float) -> float:
        """What one token of plain decoding costs now: a step with the target alone is one
        (its pass and the rest of its time outside drafting: ``auto`` may draft a tree and
        keep none of it); for any other, its ``single`` pass (``_single_pass``) plus the
        loop's overhead around a pass with the target alone (the decayed mean of such
        steps'); 0 without an estimate of the pass."""
        if batch == 1:
            self._overhead.add(t_rest)
            return single + t_rest
        if single <= 0.0:
            return 0.0
        return single + self._overhead.value  # (its prior, 0, before any such step)

    def _verify(self, committed: list[int], draft: DraftTree, params: SamplingParams,
                rng: np.random.Generator, penalties: StepPenalties | None,
                beside: Sequence[tuple[TokenTree, Mapping[int, np.ndarray]]] = ()
                ) -> tuple[Verdict, list[Slot], int]:
        """One target pass over the pending tokens and the tree; the acceptance rule (sampled:
        with the trees ``beside`` priced from the same pass, ``verify_sampling``). Returns
        the verdict, the nodes' slots (by node id) and how many of the accepted nodes sit in
        the batch's rows right after the root, in order (in consecutive cells)."""
        tree = draft.tree
        pending = self.target.prepare(committed,
                                      max_pending=self.target.ctx.n_batch - len(tree) + 1)
        k = len(pending) - 1  # batch index of the root
        # the batch lays the tree out likeliest path first: llama.cpp gives a batch's tokens
        # free cells in batch order and the attention's sums depend on how the cells are laid
        # out, so an accepted likeliest path then sits in consecutive cells right after the
        # committed text, as plain decoding's tokens do, and the cells its rejected siblings
        # freed lie after it, not between its tokens (with flash attention on, whose rows do
        # not depend on their batch, the cache then gives plain decoding's logits: see
        # speculative/divergence.py and its tests)
        order = tree.likeliest_first()
        at = [0] * len(tree)  # batch row (past the root) of each node
        for row, node in enumerate(order):
            at[node] = row
        tokens = pending + [tree.tokens[v] for v in order[1:]]
        parents: list[Parent] = [COMMIT] * len(pending)
        parents += [k + at[tree.parents[v]] for v in order[1:]]
        want = [False] * k + [True] * len(tree)
        slots, logits = self.target.decode(tokens, parents, want)
        if any(node != row for row, node in enumerate(order)):  # back in node order
            logits = logits[at]
            slots = slots[:k] + [slots[k + at[v]] for v in range(len(tree))]
        if params.greedy:
            verdict = verify_greedy(tree, logits, penalties)
        else:
            verdict = verify_sampling(tree, logits, draft.q, params, rng, penalties, beside)
        in_place = 0
        while in_place < len(verdict.accepted) and at[verdict.accepted[in_place]] == in_place + 1:
            in_place += 1
        return verdict, slots[k:], in_place  # the tree's slots, by node id

    def _commit(self, plan: StepPlan, verdict: Verdict, slots: list[Slot],
                in_place: int) -> tuple[int, ...]:
        """Keep the accepted path in the target's cache and the drafter's; calibrate.
        Returns the accepted tokens.

        The target's cache keeps only the first ``in_place`` accepted nodes: where the target
        took another path than the likeliest, the rest of its path sits in cells past the
        freed cells of the nodes it passed over, which later tokens would fill, before tokens
        they follow; those are decoded again with the next batch, in text order, so that the
        cache stays laid out as plain decoding's (a token more in the next batch for each)."""
        tree = plan.tree.tree
        accepted = tuple(tree.tokens[n] for n in verdict.accepted)
        self.target.commit(slots[verdict.accepted[in_place - 1] if in_place else 0],
                           list(accepted[:in_place]))
        self._redecode = len(accepted) - in_place
        if plan.drafter is not None:
            plan.drafter.commit(accepted, verdict.next_token)
            self.res.calibrations.observe(plan, verdict.accepted, verdict.reached)
        return accepted

    def _rollback(self) -> None:
        self.target.rollback()
        if self.draft is not None:
            self.draft.rollback()

    def _fit(self, config: SpecConfig, committed: list[int]) -> TreeBudget | None:
        """The tree budget that fits the window after ``committed`` (``fit_budget``)."""
        return fit_budget(config.budget(), self._n_ctx(config) - len(committed))


def _beside_tokens(plan: StepPlan, verdict: Verdict) -> tuple[float | None, ...]:
    """What each of the plan's alternatives would have added on average (the target's next
    token included), where the verdict priced it (``Alternative.q``); None elsewhere."""
    priced = iter(verdict.beside)
    out: list[float | None] = []
    for alt in plan.alternatives:
        expected = next(priced, None) if alt.q is not None else None
        out.append(None if expected is None else expected + 1)
    return tuple(out)


def _truncate(tokens: list[int], stop: Collection[int], limit: int) -> tuple[list[int], str | None]:
    for i, t in enumerate(tokens[:limit]):
        if t in stop:
            return tokens[:i], "stop"
    if len(tokens) >= limit:
        return tokens[:limit], "length"
    return tokens, None
