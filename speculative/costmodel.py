"""How big a tree to verify (and how far stage 2 guesses): measured cost against expected gain.

Verifying n tokens in one target pass costs ``cost(n)``, which depends on the hardware (on a
2-core CPU a second token can cost as much as the first; on a GPU 16 cost little more than 1).
A tree of N drafted nodes is expected to yield ``1 + c * sum(top-N scores)`` tokens, where a node's
score is the draft's probability of its path and ``c`` calibrates the draft's confidence against
what the target actually accepted so far. The best N maximises tokens per second:

    N* = argmax_N (1 + c * S_N) / (t_draft + cost(N + 1))

A batch whose shape (tokens, sequences, outputs) differs from the context's previous batch also
pays ``switch``: llama.cpp keeps the compute graph of the last batch only and builds a new one
for a new shape (a few percent of a pass; ``measure_verify_cost`` times it beside the curve).
Plain decoding never pays it; a step that alternates
between drafting and the target alone pays it twice. ``VerifyCost.after(last)`` prices each
size as the step after a batch of ``last`` tokens sees it.

Exactness: greedy verification is exact for any tree, so greedy steps choose N from their own
scores. A sampled step must not choose its shape from its own drawn tokens (that would bias
which draws get verified), so it uses the previous step's scores, drawn independently.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .protocols import Context

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyCost:
    """Seconds to decode n tokens after a prefix, measured at a few n, interpolated between:
    the cost of a batch shaped like the one before it, plus ``switch`` for a new shape when
    ``last`` (the previous batch's size) is set."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    switch: float = 0.0  # seconds to build the compute graph of a new batch shape
    last: int | None = None  # the previous batch's size; None: shapes are not priced

    def after(self, last: int) -> VerifyCost:
        """This curve as seen by the batch after one of ``last`` tokens."""
        return dataclasses.replace(self, last=last)

    def __call__(self, n: int) -> float:
        if self.last is not None and n != self.last:
            return self.curve(n) + self.switch
        return self.curve(n)

    def curve(self, n: int) -> float:
        """Seconds for n tokens after a batch of the same shape (no switch)."""
        i = bisect.bisect_left(self.sizes, n)
        if i < len(self.sizes) and self.sizes[i] == n:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.sizes):  # beyond the table: extend the last slope
            (a, b), (ta, tb) = self.sizes[-2:], self.seconds[-2:]
            return tb + (n - b) * (tb - ta) / (b - a)
        a, b = self.sizes[i - 1], self.sizes[i]
        ta, tb = self.seconds[i - 1], self.seconds[i]
        return ta + (n - a) * (tb - ta) / (b - a)


DENSE_UP_TO = 8  # every batch size up to this one is measured; beyond it, every 4th
ROUNDS = 3       # timings of each size, taken in rounds across all sizes


def curve_sizes(max_tokens: int) -> list[int]:
    """The batch sizes whose cost is measured: every size up to ``DENSE_UP_TO`` (the curve is
    not smooth there: llama.cpp's matrix kernels work on tiles of a few tokens, so a batch one
    token past a tile can cost as much as a whole extra tile), then every 4th, and the largest."""
    dense = range(1, min(max_tokens, DENSE_UP_TO) + 1)
    sparse = range(DENSE_UP_TO + 4, max_tokens + 1, 4)
    return sorted({*dense, *sparse, max_tokens})


def measure_verify_cost(ctx: Context, max_tokens: int, prefix: int = 64,
                        rounds: int = ROUNDS) -> VerifyCost:
    """Time one-batch decodes of every size in ``curve_sizes`` after ``prefix`` tokens, each
    after a batch of the same size (the first decode of a shape builds its graph), and the
    switch cost: what batches of 1 and 2 tokens take beyond that when they alternate. The
    sizes are timed in ``rounds`` passes over all of them and each size's median kept, so a
    change in the machine's load during the measurement shifts every size alike instead of
    bending the curve (what decides a tree's size is the ratio of the sizes' costs). Leaves
    the context empty."""
    sizes = [n for n in curve_sizes(max_tokens) if n <= min(ctx.n_batch, ctx.n_ctx - 1)]
    prefix = max(1, min(prefix, ctx.n_ctx - sizes[-1], ctx.n_batch))
    ctx.clear()
    ctx.decode([0] * prefix, list(range(prefix)), [[0]] * prefix, False)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            _timed_decode(ctx, prefix, n)  # after a batch of another size: not the curve
            times[n].append(_timed_decode(ctx, prefix, n))
    seconds = [float(np.median(times[n])) for n in sizes]
    switch = _measure_switch(ctx, prefix, 2 * rounds + 2) if len(sizes) > 1 else 0.0
    ctx.clear()
    return VerifyCost(tuple(sizes), tuple(seconds), switch)


def _timed_decode(ctx: Context, prefix: int, n: int) -> float:
    """Seconds to decode n tokens after the first ``prefix`` (dropping any others first)."""
    ctx.seq_rm(0, prefix, -1)
    t0 = time.perf_counter()
    ctx.decode([0] * n, list(range(prefix, prefix + n)), [[0]] * n, True)
    return time.perf_counter() - t0


def _measure_switch(ctx: Context, prefix: int, pairs: int) -> float:
    """Seconds a one-token batch takes after a two-token one beyond what it takes after a
    one-token one (llama.cpp building a new graph): the median over ``pairs`` adjacent pairs,
    whose two timings share the machine's load of the moment."""
    differences = []
    for _ in range(pairs):
        _timed_decode(ctx, prefix, 2)
        after_other = _timed_decode(ctx, prefix, 1)
        differences.append(after_other - _timed_decode(ctx, prefix, 1))
    return max(0.0, float(np.median(differences)))


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "staged-chat" / "costs.json"


def cached_verify_cost(ctx: Context, max_tokens: int, path: Path | None = None,
                       refresh: bool = False) -> VerifyCost:
    """``measure_verify_cost``, remembered per machine, model file and settings.

    Measuring a large model's curve takes seconds at every start; the curve only changes with
    the file, the threads, the batch size and llama.cpp's build, which ``ctx.cost_key`` names
    (contexts without one are always measured). A cache that cannot be read or written is
    ignored: the measurement is then simply taken again. A curve that is not ``plausible``
    (timed on a busy machine) is measured again, and is never cached.
    """
    key = getattr(ctx, "cost_key", None)
    if key is None:
        return _measure_plausible(ctx, max_tokens)
    path = path or cache_path()
    # the sizes name how the curve is measured: a cache of another way of measuring is stale
    sizes = curve_sizes(max_tokens)
    digest = hashlib.sha256(f"{key}|{max_tokens}|{sizes}|{ROUNDS}".encode()).hexdigest()[:24]
    entries = _read_cache(path)
    hit = entries.get(digest)
    if hit is not None and "switch" in hit and not refresh:  # (no "switch": an older cache)
        cached = VerifyCost(tuple(hit["sizes"]), tuple(hit["seconds"]), hit["switch"])
        if plausible(cached):
            return cached
        log.info("cached decode costs %s are implausible: measuring again", cached.seconds)
    cost = _measure_plausible(ctx, max_tokens)
    if not plausible(cost):
        return cost  # used for this run, never remembered
    entries[digest] = {"sizes": list(cost.sizes), "seconds": list(cost.seconds),
                       "switch": cost.switch, "measured": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        tmp.replace(path)
    except OSError as exc:
        log.info("decode costs not cached: %s", exc)
    return cost


MEASURE_ATTEMPTS = 3  # measurements of a curve before an implausible one is used as it is


def plausible(cost: VerifyCost, slack: float = 0.8) -> bool:
    """Whether no batch costs much less than a smaller one measured before it. A curve that
    says otherwise was timed while something else used the cores (another program, a build),
    and, cached, would mislead every later choice on this machine."""
    most = 0.0
    for seconds in cost.seconds:
        if seconds < slack * most:
            return False
        most = max(most, seconds)
    return True


def _measure_plausible(ctx: Context, max_tokens: int) -> VerifyCost:
    """``measure_verify_cost``, again (up to ``MEASURE_ATTEMPTS`` times) while implausible."""
    for attempt in range(1, MEASURE_ATTEMPTS + 1):
        cost = measure_verify_cost(ctx, max_tokens)
        if plausible(cost):
            return cost
        log.warning("decode costs %s look disturbed (attempt %d of %d)",
                    [round(t * 1000, 2) for t in cost.seconds], attempt, MEASURE_ATTEMPTS)
    return cost


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def best_size(scores: Sequence[float], cost: VerifyCost, t_draft: float,
              calibration: float) -> int:
    """N* for node scores sorted best first (see the module docstring); 0 means plain."""
    best_n, best_rate, total = 0, 1.0 / (t_draft + cost(1)), 0.0
    for n, s in enumerate(scores, start=1):
        total += s
        rate = (1.0 + calibration * total) / (t_draft + cost(n + 1))
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def guess_length(cost: VerifyCost, batch: int, max_len: int, hit_rate: float) -> int:
    """Stage-2 guess tokens worth adding to a draft batch of ``batch`` tokens: the g that
    maximises ``hit_rate * g * cost(1) - (cost(batch + g) - cost(batch))`` (a used guess saves
    about one single-token draft call); 0 when no g gains. Where a batch's second token costs as
    much as its first, guesses only ride along with batches that are already wide."""
    best_g, best_gain = 0, 0.0
    for g in range(1, max_len + 1):
        gain = hit_rate * g * cost(1) - (cost(batch + g) - cost(batch))
        if gain > best_gain:
            best_g, best_gain = g, gain
    return best_g


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
class Calibration:
    """c: accepted tokens / summed scores of the verified trees, averaged over recent steps,
    starting from c = 1 worth ``prior`` predicted tokens: one step that predicted a single
    token at 0.14 and missed must not make a drafter look useless (c = 0 until it drafts
    again, which it then never would); steps that verified nothing of this scorer's leave it
    as it was."""

    accepted: float = 0.0
    predicted: float = 0.0
    decay: float = 0.9  # recent steps weigh more: the text's difficulty drifts
    prior: float = 1.0  # predicted tokens the starting c = 1 counts for

    @property
    def factor(self) -> float:
        c = (self.accepted + self.prior) / (self.predicted + self.prior)
        return min(2.0, max(0.05, c))

    def add(self, accepted: int, predicted: float) -> None:
        if accepted == 0 and predicted <= 0.0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.predicted = self.decay * self.predicted + predicted
