"""Every statistic of a generation, defined once. The CLI, the benchmark and the GUI only show them.

A *step* is one target forward pass during generation (prefill excluded): the target verifies a
tree (plain decoding: a lone root) and the output grows by the accepted path plus one token of
the target's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ORIGINS = ("draft", "ngram", "target")


@dataclasses.dataclass(frozen=True, slots=True)
class StepStats:
    drafted: int           # tree nodes the target verified, root excluded
    accepted: int          # drafted tokens accepted: the length of the accepted path
    offered: int           # tree depths at which the target was offered at least one candidate
    emitted: int           # tokens added to the output (accepted + 1; fewer at a stop or limit)
    origins: dict[str, int]  # emitted tokens by proposer: draft model, n-gram, target itself
    draft_calls: int       # draft-model decodes this step
    stage2_proposed: int   # n-gram tokens the draft decoded speculatively (stage 2)
    stage2_used: int       # ... of which tree growth then needed
    t_draft: float         # seconds growing the tree with the draft model
    t_stage2: float        # seconds in the n-gram model
    t_verify: float        # seconds in the target's forward pass and the acceptance rule
    t_other: float         # the rest of the step (bookkeeping, KV commits)
    batch: int = 0         # tokens in the target's pass (pending committed ones, root, nodes)
    # seconds plain decoding would have taken for this step's emitted tokens, timed in the same
    # moments: the target's single-token cost read off this step's own pass (its time over the
    # cost curve's cost(batch) / cost(1)), per token; 0 when no cost curve was measured
    t_plain: float = 0.0
    steered: int = 0       # verified positions where penalties changed the target's top token
    # accepted tokens of the step before decoded again in this pass (they sat past cells that
    # later tokens would fill: see Engine._commit)
    redecoded: int = 0
    t_penalties: float = 0.0  # seconds penalising logits (already inside draft and verify)
    # the kind of step its policy took (``plan.StepKind``'s value: the target alone, the
    # n-gram's tree, the draft model's), as ``auto`` chooses and measures them; "" if none
    kind: str = ""
    # the stop token the step ended on (1, else 0): not in the output, but its pass produced
    # it, and plain decoding too decodes it before it stops
    stopped: int = 0

    @property
    def seconds(self) -> float:
        return self.t_draft + self.t_stage2 + self.t_verify + self.t_other

    @classmethod
    def timed(cls, drafting: Any, drafted: int, accepted: int, offered: int, t0: float,
              t1: float, t2: float, t3: float, batch: int = 0,
              plain_per_token: float = 0.0, kind: str = "") -> StepStats:
        """A step's statistics from what drafting cost (``drafting.DraftCounters``) and the
        clock read at its start, when its tree was planned, verified and committed;
        ``plain_per_token``: what one token of plain decoding costs at this moment (0:
        unknown); ``kind``: the kind of step."""
        return cls(
            drafted=drafted, accepted=accepted, offered=offered, emitted=accepted + 1,
            origins={}, draft_calls=drafting.calls, stage2_proposed=drafting.stage2_proposed,
            stage2_used=drafting.stage2_used, t_draft=drafting.t_draft,
            t_stage2=drafting.t_stage2, t_verify=t2 - t1,
            t_other=max(0.0, (t1 - t0) - drafting.t_draft - drafting.t_stage2) + (t3 - t2),
            batch=batch, t_plain=(accepted + 1) * plain_per_token, kind=kind)

    @classmethod
    def empty(cls) -> StepStats:
        """A step that did nothing (a cancel before it began)."""
        return cls(0, 0, 0, 0, dict.fromkeys(ORIGINS, 0), 0, 0, 0, 0.0, 0.0, 0.0, 0.0)


@dataclasses.dataclass(slots=True)
class RunStats:
    """The steps of one generation, and what is derived from them."""

    mode: str = ""
    prompt_tokens: int = 0
    t_prefill: float = 0.0  # seconds decoding the prompt into both caches
    steps: list[StepStats] = dataclasses.field(default_factory=list)

    def add(self, step: StepStats) -> None:
        self.steps.append(step)

    @property
    def tokens(self) -> int:
        return sum(s.emitted for s in self.steps)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward pass: emitted tokens, and a stop token a pass ended
        on, over steps (plain decoding: 1)."""
        produced = self.tokens + sum(s.stopped for s in self.steps)
        return produced / len(self.steps) if self.steps else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted path length per step (drafted tokens only; tau is about this + 1)."""
        return sum(s.accepted for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def mean_drafted(self) -> float:
        """Mean tree size verified per step (drafted nodes, root excluded)."""
        return sum(s.drafted for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def node_acceptance(self) -> float:
        """Accepted / drafted nodes. A tree drafts several candidates per depth and at most one
        per depth can be accepted, so this is the tree's *efficiency*, not its hit rate."""
        drafted = sum(s.drafted for s in self.steps)
        return sum(s.accepted for s in self.steps) / drafted if drafted else 0.0

    def depth_acceptance(self) -> list[float]:
        """rate[d-1] = P(a token is accepted at depth d | the target was offered candidates at
        depth d) = #steps with accepted >= d / #steps with offered >= d."""
        deepest = max((s.offered for s in self.steps), default=0)
        rates = []
        for d in range(1, deepest + 1):
            offered = sum(s.offered >= d for s in self.steps)
            rates.append(sum(s.accepted >= d for s in self.steps) / offered)
        return rates

    def origins(self) -> dict[str, int]:
        return {o: sum(s.origins.get(o, 0) for s in self.steps) for o in ORIGINS}

    @property
    def seconds(self) -> float:
        """Generation time, prefill excluded."""
        return sum(s.seconds for s in self.steps)

    def seconds_until(self, n_tokens: int) -> float:
        """Generation seconds until the step that emitted the ``n_tokens``-th token ended (a
        step's tokens arrive together); all of them if the run emitted fewer."""
        total, emitted = 0.0, 0
        for s in self.steps:
            total += s.seconds
            emitted += s.emitted
            if emitted >= n_tokens:
                break
        return total

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def estimated_speedup(self, plain_seconds_per_token: float | None = None) -> float:
        """Speed over plain decoding of the same target, *estimated* without running it: the
        seconds plain decoding would have taken for this run's tokens over the seconds it took.
        Each step's counterfactual (``StepStats.t_plain``) is read off the step's own target
        pass, so the estimate follows the machine's load as the reply runs; steps without one
        (no cost curve measured) count ``plain_seconds_per_token`` each token (a figure timed
        earlier, e.g. when the models loaded), or make the estimate 0 without it. A step's
        tokens after a stop are not counted; the stop token is (plain decoding, too, takes a
        pass to produce it: a short reply would otherwise read a pass slow). The race in the
        app and ``staged-chat bench`` measure the speedup side by side instead."""
        plain = self.plain_seconds(plain_seconds_per_token)
        return plain / self.seconds if self.seconds > 0 else 0.0

    def plain_seconds(self, plain_seconds_per_token: float | None = None) -> float:
        """The seconds plain decoding would have taken for this run's tokens, as
        ``estimated_speedup`` counts them; 0 where a step has no estimate."""
        plain = 0.0
        for s in self.steps:
            produced = s.emitted + s.stopped
            if s.t_plain > 0:
                plain += s.t_plain * (produced / (s.accepted + 1))
            elif plain_seconds_per_token is not None:
                plain += produced * plain_seconds_per_token
            else:
                return 0.0
        return plain

    def kinds(self) -> dict[str, dict[str, float]]:
        """By kind of step (``StepStats.kind``, those that ran): the steps, the tokens they
        emitted and their seconds. ``auto`` switches between kinds; which ran, and how fast
        each ran where it did, is what its speed is made of."""
        out: dict[str, dict[str, float]] = {}
        for s in self.steps:
            if s.kind:
                k = out.setdefault(s.kind, {"steps": 0, "tokens": 0, "seconds": 0.0})
                k["steps"] += 1
                k["tokens"] += s.emitted
                k["seconds"] += s.seconds
        return out

    def time_split(self) -> dict[str, float]:
        return {k: sum(getattr(s, f"t_{k}") for s in self.steps)
                for k in ("draft", "stage2", "verify", "other")}

    @property
    def draft_calls_per_step(self) -> float:
        return sum(s.draft_calls for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def draft_seconds_per_accepted(self) -> float:
        """Drafting time (draft model and n-gram) per drafted token the target accepted: what
        one accepted token cost to propose; 0 when none was accepted."""
        accepted = sum(s.accepted for s in self.steps)
        spent = sum(s.t_draft + s.t_stage2 for s in self.steps)
        return spent / accepted if accepted else 0.0

    @property
    def stage2_hit_rate(self) -> float:
        """Share of stage-2 n-gram tokens that the tree then needed."""
        proposed = sum(s.stage2_proposed for s in self.steps)
        return sum(s.stage2_used for s in self.steps) / proposed if proposed else 0.0

    @property
    def steered(self) -> int:
        """Target passes' positions where the penalties changed the most likely token (greedy:
        where the text went another way than the unpenalised target's)."""
        return sum(s.steered for s in self.steps)

    def summary(self) -> dict[str, Any]:
        """Plain data for JSON output and display."""
        return {
            "mode": self.mode,
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "target_passes": len(self.steps),
            "tau": self.tau,
            "mean_accepted": self.mean_accepted,
            "mean_drafted": self.mean_drafted,
            "node_acceptance": self.node_acceptance,
            "depth_acceptance": self.depth_acceptance(),
            "origins": self.origins(),
            "kinds": self.kinds(),
            "draft_calls_per_step": self.draft_calls_per_step,
            "draft_seconds_per_accepted": self.draft_seconds_per_accepted,
            "stage2_hit_rate": self.stage2_hit_rate,
            "time": {"prefill": self.t_prefill, **self.time_split()},
            "penalties": {"steered": self.steered,
                          "seconds": sum(s.t_penalties for s in self.steps)},
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
        }
