"""How big a tree to verify (and how far stage 2 guesses): measured cost against expected gain.

Verifying n tokens in one target pass costs ``cost(n)``, which depends on the hardware (on a
2-core CPU a second token can cost as much as the first; on a GPU 16 cost little more than 1).
A tree of N drafted nodes is expected to yield ``1 + sum(min(1, c * score))`` over its top-N
nodes, where a node's score is its estimated chance of acceptance (the product along its path
of how often the target accepted nodes of its probability, its parent accepted: ``Acceptance``)
and ``c`` corrects what that still misses against what the target actually accepted so far (no
node yields more than one token, whatever ``c``). The best N maximises tokens per second:

    N* = argmax_N (1 + S_N) / (t_draft + cost(N + 1)),  S_N = sum of the N best min(1, c * score)

A batch whose shape (tokens, sequences, outputs) differs from the context's previous batch also
pays ``switch``: llama.cpp keeps the compute graph of the last batch only and builds a new one
for a new shape (a few percent of a pass; ``measure_verify_cost`` times it beside the curve).
Plain decoding never pays it; a step that alternates
between drafting and the target alone pays it twice. ``VerifyCost.after(last)`` prices each
size as the step after a batch of ``last`` tokens sees it.

A pass also costs more the longer the context its tokens attend to, and not alike for every
batch size: the attention over the cached context is a larger share of a single token's pass
than of a wide batch's, so the longer the conversation, the relatively cheaper a tree. The
curve is timed after a short prefix, and again at a few sizes after a long one; the
difference, a line in the batch size per token of context (``per_context``), moves the curve
to the step's context (``VerifyCost.at``).

Exactness: greedy verification is exact for any tree, so greedy steps choose N from their own
scores. A sampled step must not choose its shape from its own drawn tokens (that would bias
which draws get verified): it keeps the nodes scoring at least what one more node needed to
pay at the best cut of the previous step's candidates, drawn independently (``paying_floor``),
each node's children counted before they are drawn (``drafting.grow_tree``).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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
    context: int = 0  # tokens of context before the batches ``seconds`` were timed after
    # (a, b): seconds each further token of context adds to a batch of n tokens, a + b * n
    per_context: tuple[float, float] = (0.0, 0.0)
    # the least-squares slope of the table's upper half (``tail_slope``), fitted once per
    # measured curve: ``at`` moves it exactly (it adds a line in n to every size), so a curve
    # located at every step never refits
    fitted_tail: float | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.fitted_tail is None:
            object.__setattr__(self, "fitted_tail", self._fit_tail())

    @property
    def tail(self) -> float:
        """Seconds per token beyond the table (never negative)."""
        return max(self.fitted_tail or 0.0, 0.0)

    def after(self, last: int | None) -> VerifyCost:
        """This curve as seen by the batch after one of ``last`` tokens (None: unpriced)."""
        return dataclasses.replace(self, last=last)

    def at(self, context: int) -> VerifyCost:
        """This curve after ``context`` tokens of context (a shorter context than the one
        timed is priced as that one: llama.cpp attends over a padded block of cache cells,
        so short contexts cost alike)."""
        a, b = self.per_context
        extra = max(context - self.context, 0)
        if extra == 0 or (a == 0.0 and b == 0.0):
            return self
        seconds = tuple(t + extra * max(a + b * n, 0.0)
                        for n, t in zip(self.sizes, self.seconds, strict=True))
        # the added line's slope b moves the fitted slope by extra * b where no size is
        # clamped at 0 (the usual case); otherwise fit again
        clamped = any(a + b * n < 0.0 for n in self.sizes)
        tail = None if clamped or self.fitted_tail is None else self.fitted_tail + extra * b
        return dataclasses.replace(self, seconds=seconds, context=context, fitted_tail=tail)

    def drafted(self, factor: float) -> VerifyCost:
        """This curve with every batch of more than one token ``factor`` times as dear: the
        curve times bare decodes back to back, and in decoding a pass also reads its logits,
        applies the penalties and the acceptance rule, between the draft's passes, so a
        drafted pass there costs that much more (or less) against a single token than the
        curve's shape says (``PassLoads.drafted_factor``)."""
        if factor == 1.0:
            return self
        seconds = tuple(t if n <= 1 else t * factor
                        for n, t in zip(self.sizes, self.seconds, strict=True))
        tail = None if self.fitted_tail is None else self.fitted_tail * factor
        return dataclasses.replace(self, seconds=seconds, fitted_tail=tail)

    def __call__(self, n: int) -> float:
        if self.last is not None and n != self.last:
            return self.curve(n) + self.switch
        return self.curve(n)

    def _fit_tail(self) -> float:
        """The least-squares slope over the sizes in the table's upper half (the last two
        sizes alone are one timing's noise apart, and the draft catching up on a long text
        is priced far beyond them)."""
        if len(self.sizes) < 2:
            return 0.0
        upper = [(n, t) for n, t in zip(self.sizes, self.seconds, strict=True)
                 if 2 * n >= self.sizes[-1]]
        if len(upper) < 2:
            upper = list(zip(self.sizes[-2:], self.seconds[-2:], strict=True))
        n, t = np.array(upper, dtype=float).T
        return float(np.polyfit(n, t, 1)[0])

    def curve(self, n: int) -> float:
        """Seconds for n tokens after a batch of the same shape (no switch)."""
        i = bisect.bisect_left(self.sizes, n)
        if i < len(self.sizes) and self.sizes[i] == n:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.sizes):  # beyond the table: extend the slope of its upper half
            return self.seconds[-1] + (n - self.sizes[-1]) * self.tail
        a, b = self.sizes[i - 1], self.sizes[i]
        ta, tb = self.seconds[i - 1], self.seconds[i]
        return ta + (n - a) * (tb - ta) / (b - a)


DENSE_UP_TO = 8  # every batch size up to this one is measured; beyond it, every 4th
ROUNDS = 3       # timings of each size, taken in rounds across all sizes, at least
MAX_ROUNDS = 9   # ... and at most, while the ratios to a single token are imprecise
PRECISION = 0.04  # relative standard error of each cost(n)/cost(1) measured for
MEASURE_BUDGET = 20.0  # seconds after which no further round is begun
PREFIX = 64      # tokens of context the curve is timed after
FAR = 512        # ... and the few sizes that measure what a longer context adds
FAR_SIZES = (1, 2, 4, 8)  # (and the largest): enough for a line in the batch size


def curve_sizes(max_tokens: int) -> list[int]:
    """The batch sizes whose cost is measured: every size up to ``DENSE_UP_TO`` (the curve is
    not smooth there: llama.cpp's matrix kernels work on tiles of a few tokens, so a batch one
    token past a tile can cost as much as a whole extra tile), then every 4th, and the largest."""
    dense = range(1, min(max_tokens, DENSE_UP_TO) + 1)
    sparse = range(DENSE_UP_TO + 4, max_tokens + 1, 4)
    return sorted({*dense, *sparse, max_tokens})


def measure_verify_cost(ctx: Context, max_tokens: int, prefix: int = PREFIX,
                        rounds: int = ROUNDS, far: int = FAR,
                        max_rounds: int = MAX_ROUNDS) -> VerifyCost:
    """Time one-batch decodes of every size in ``curve_sizes`` after ``prefix`` tokens, each
    after a batch of the same size (the first decode of a shape builds its graph), and the
    switch cost: what batches of 1 and 2 tokens take beyond that when they alternate. The
    sizes are timed in passes over all of them (rounds) and each size's median kept, so a
    change in the machine's load during the measurement shifts every size alike instead of
    bending the curve (what decides a tree's size, and what the meter's counterfactual reads,
    is the ratio of the sizes' costs). At least ``rounds`` rounds, then more, up to
    ``max_rounds`` and ``MEASURE_BUDGET`` seconds, while some cost(n)/cost(1) is not yet
    ``PRECISION``-precise (``precise``): where single decodes jitter, a few timings can
    leave a ratio well off. In the first ``rounds`` rounds, a few sizes are also
    timed after ``far`` tokens (where the context allows one clearly longer than ``prefix``):
    what each token of context adds (``per_context``). Leaves the context empty."""
    sizes = [n for n in curve_sizes(max_tokens) if n <= min(ctx.n_batch, ctx.n_ctx - 1)]
    prefix = max(1, min(prefix, ctx.n_ctx - sizes[-1], ctx.n_batch))
    far = min(far, ctx.n_ctx - sizes[-1])
    far_sizes = [n for n in sizes if n in FAR_SIZES or n == sizes[-1]] if far >= 2 * prefix else []
    ctx.clear()
    _fill(ctx, 0, prefix)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    far_times: dict[int, list[float]] = {n: [] for n in far_sizes}
    start = time.perf_counter()
    for r in range(max(rounds, max_rounds)):
        if r >= rounds and (precise(times) or time.perf_counter() - start > MEASURE_BUDGET):
            break
        for n in sizes:
            _timed_decode(ctx, prefix, n)  # after a batch of another size: not the curve
            times[n].append(_timed_decode(ctx, prefix, n))
        if far_sizes and r < rounds:
            ctx.seq_rm(0, prefix, -1)
            _fill(ctx, prefix, far)
            for n in far_sizes:
                _timed_decode(ctx, far, n)
                far_times[n].append(_timed_decode(ctx, far, n))
            ctx.seq_rm(0, prefix, -1)
    seconds = [float(np.median(times[n])) for n in sizes]
    # each round's far timing against the same round's (the machine's load of the moment)
    slopes = {n: float(np.median(np.subtract(far_times[n], times[n][:len(far_times[n])])))
              / (far - prefix) for n in far_sizes}
    switch = _measure_switch(ctx, prefix, 2 * rounds + 2) if len(sizes) > 1 else 0.0
    ctx.clear()
    return VerifyCost(tuple(sizes), tuple(seconds), switch, context=prefix,
                      per_context=_line(slopes))


def precise(times: dict[int, list[float]], precision: float = PRECISION) -> bool:
    """Whether every size's cost relative to a single token's is known within ``precision``
    (relative standard error), from each size's timings so far (the first size's: the single
    token's). A median's standard error is estimated from the timings' median absolute
    deviation (robust to the odd timing a busy moment stretched); a ratio's combines both
    sizes'."""
    def error(ts: list[float]) -> float:
        t = np.asarray(ts)
        mid = float(np.median(t))
        if len(t) < 2 or mid <= 0:
            return float("inf")
        spread = 1.4826 * float(np.median(np.abs(t - mid)))  # sigma, were the jitter normal
        return 1.2533 * spread / np.sqrt(len(t)) / mid        # the median's, relative

    sizes = sorted(times)
    one = error(times[sizes[0]])
    return all(np.hypot(one, error(times[n])) <= precision for n in sizes[1:])


def _fill(ctx: Context, start: int, end: int) -> None:
    """Decode filler tokens at positions start..end-1, in batches llama.cpp accepts."""
    for s in range(start, end, ctx.n_batch):
        k = min(ctx.n_batch, end - s)
        ctx.decode([0] * k, list(range(s, s + k)), [[0]] * k, False)


def _line(slopes: dict[int, float]) -> tuple[float, float]:
    """(a, b) of the least-squares line a + b * n through the slopes measured at batch sizes
    n; a line that would make some measured size's context cheaper with more context (timing
    noise) gives way to the slopes' mean (and no slope is below 0)."""
    if not slopes:
        return 0.0, 0.0
    n = np.array(list(slopes), dtype=float)
    y = np.array(list(slopes.values()))
    if len(n) > 1:
        b, a = np.polyfit(n, y, 1)
        if a + b * n.min() >= 0.0 and a + b * n.max() >= 0.0:
            return float(a), float(b)
    return max(float(y.mean()), 0.0), 0.0


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


def cache_dir() -> Path:
    """Where what is measured of this machine is remembered between runs."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "staged-chat"


def cache_path() -> Path:
    return cache_dir() / "costs.json"


def cached_verify_cost(ctx: Context, max_tokens: int, path: Path | None = None,
                       refresh: bool = False) -> VerifyCost:
    """``measure_verify_cost``, remembered per machine, model file and settings.

    Measuring a large model's curve takes seconds at every start; the curve only changes with
    the file, the threads, the batch size and llama.cpp's build, which ``ctx.cost_key`` names
    (contexts without one are always measured). A cache that cannot be read or written is
    ignored: the measurement is then simply taken again. A curve that is not trustworthy
    (``_measure_trusted``: timed on a busy machine) is measured again, and is never cached.
    """
    key = getattr(ctx, "cost_key", None)
    if key is None:
        return _measure_trusted(ctx, max_tokens)[0]
    path = path or cache_path()
    # the sizes name how the curve is measured: a cache of another way of measuring is stale
    sizes = curve_sizes(max_tokens)
    how = (f"{key}|{max_tokens}|{sizes}|{ROUNDS}|{MAX_ROUNDS}|{PRECISION}|{PREFIX}|{FAR}|"
           f"{FAR_SIZES}")
    digest = hashlib.sha256(how.encode()).hexdigest()[:24]
    entries = read_cache(path)
    hit = entries.get(digest)
    cached = _from_entry(hit) if hit is not None and not refresh else None
    if cached is not None:
        if plausible(cached) or (hit.get("reproduced") and floored(cached)):
            return cached
        log.info("cached decode costs %s are implausible: measuring again", cached.seconds)
    cost, trusted = _measure_trusted(ctx, max_tokens)
    if not trusted:
        return cost  # used for this run, never remembered
    entries[digest] = {"sizes": list(cost.sizes), "seconds": list(cost.seconds),
                       "switch": cost.switch, "context": cost.context,
                       "per_context": list(cost.per_context), "measured": time.time(),
                       "reproduced": not plausible(cost)}
    write_cache(path, entries)
    return cost


def write_cache(path: Path, entries: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        tmp.replace(path)
    except OSError as exc:
        log.info("%s not written: %s", path, exc)


WINDOW_POINTS = (0.25, 0.75)  # where in the window a setting's single-token cost is timed
SAME_SPEED = 0.03  # settings whose costs differ less than this are taken as equally fast


def window_costs(contexts: Sequence[Context], rounds: int = ROUNDS) -> list[float]:
    """Each context's seconds for one token, averaged over the window: the mean of single-token
    decodes after a quarter and after three quarters of its window of filler (for a cost that
    grows about linearly with the context, the mean over the whole window; a reply's tokens
    are decoded anywhere in it). The contexts are timed in rounds, one after another within
    each, so that a change of load shifts them alike; they are filled first, and left empty."""
    n_ctx = min(ctx.n_ctx for ctx in contexts)
    points = sorted({max(1, min(int(f * n_ctx), n_ctx - 2)) for f in WINDOW_POINTS})
    times: list[list[float]] = [[] for _ in contexts]
    filled = 0
    for point in points:
        for ctx in contexts:
            _fill(ctx, filled, point)
            _timed_decode(ctx, point, 1)  # the first single-token graph: not timed
        filled = point
        for _ in range(rounds):
            for i, ctx in enumerate(contexts):
                times[i].append(_timed_decode(ctx, point, 1))
        for ctx in contexts:
            ctx.seq_rm(0, point, -1)
    for ctx in contexts:
        ctx.clear()
    # each point's median, then their mean
    per_point = [np.median(np.reshape(t, (len(points), rounds)), axis=1) for t in times]
    return [float(np.mean(p)) for p in per_point]


@dataclasses.dataclass(frozen=True, slots=True)
class FlashChoice:
    """Flash attention on or off for one model here, and what decided it: one token's seconds
    over the window with it on and with it off (``window_costs``)."""

    on: bool
    seconds_on: float
    seconds_off: float


def cached_flash_attn(key: str, measure: Callable[[], tuple[float, float]],
                      path: Path | None = None) -> FlashChoice:
    """Whether flash attention decodes faster on this machine (``key``: the model file, the
    machine, the settings, the window), as ``measure`` times it: (seconds with it on, off),
    from ``window_costs``. On unless off is faster by more than ``SAME_SPEED``: with it on a
    row's logits do not depend on its batch, and the cache a run leaves is plain decoding's
    bit for bit (``speculative.engine``). Remembered beside the cost curves."""
    path = path or cache_path()
    digest = "flash-" + hashlib.sha256(key.encode()).hexdigest()[:24]
    entries = read_cache(path)
    hit = entries.get(digest)
    try:
        return FlashChoice(hit["flash_attn"], hit["seconds"]["on"], hit["seconds"]["off"])
    except (KeyError, TypeError):
        pass  # not measured yet, or a broken entry: measure
    on, off = measure()
    choice = not off < (1.0 - SAME_SPEED) * on
    log.info("one token over the window: %.2f ms with flash attention, %.2f ms without: %s",
             on * 1000, off * 1000, "on" if choice else "off")
    entries[digest] = {"flash_attn": choice, "seconds": {"on": on, "off": off},
                       "measured": time.time()}
    write_cache(path, entries)
    return FlashChoice(choice, on, off)


@dataclasses.dataclass(frozen=True, slots=True)
class ThreadsChoice:
    """How many threads decode one model fastest here, and what decided it: one token's
    seconds over the window with each count measured (``window_costs``)."""

    threads: int
    seconds: dict[int, float]


def choose_threads(seconds: dict[int, float], margin: float = SAME_SPEED,
                   handicap: dict[int, float] | None = None) -> int:
    """The fewest threads whose measured seconds, plus the count's ``handicap`` (seconds a
    pass with that many threads is expected to lose where it will run), are within ``margin``
    of the best. Fewer threads leave cores to the rest of the machine, and a small model can
    decode faster on fewer: its passes are too short to pay for waking and joining more."""
    handicap = handicap or {}
    total = {n: t + handicap.get(n, 0.0) for n, t in seconds.items()}
    best = min(total.values())
    return min(n for n, t in total.items() if t <= (1.0 + margin) * best)


def cached_threads(key: str, candidates: Sequence[int],
                   measure: Callable[[Sequence[int]], list[float]], margin: float = SAME_SPEED,
                   handicap: dict[int, float] | None = None,
                   path: Path | None = None) -> ThreadsChoice:
    """``choose_threads`` among ``candidates`` (``key``: the model file, the machine, the
    settings, the window), as ``measure`` times them (seconds per count, from
    ``window_costs``), measured once and remembered beside the cost curves."""
    counts = sorted(set(candidates))
    path = path or cache_path()
    digest = "threads-" + hashlib.sha256(f"{key}|{counts}".encode()).hexdigest()[:24]
    entries = read_cache(path)
    hit = entries.get(digest)
    seconds: dict[int, float] | None = None
    try:
        seconds = {int(n): float(t) for n, t in hit["seconds"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        pass  # not measured yet, or a broken entry: measure
    if seconds is None or sorted(seconds) != counts:
        seconds = dict(zip(counts, measure(counts), strict=True))
        entries[digest] = {"seconds": {str(n): t for n, t in seconds.items()},
                           "measured": time.time()}
        write_cache(path, entries)
    choice = choose_threads(seconds, margin, handicap)
    log.info("one token over the window by threads: %s ms, handicaps %s: %d",
             {n: round(t * 1000, 2) for n, t in seconds.items()}, handicap or {}, choice)
    return ThreadsChoice(choice, seconds)


MEASURE_ATTEMPTS = 3  # measurements of a curve before an untrusted one is used as it is
REPRODUCED = 0.15  # two curves whose every cost(n)/cost(1) agrees this closely have one shape


def plausible(cost: VerifyCost, slack: float = 0.8) -> bool:
    """Whether no batch costs much less than a smaller one measured before it. A curve that
    says otherwise was timed while something else used the cores (another program, a build),
    and, cached, would mislead every later choice on this machine, unless the hardware
    itself steps that way (``same_shape``)."""
    most = 0.0
    for seconds in cost.seconds:
        if seconds < slack * most:
            return False
        most = max(most, seconds)
    return True


def floored(cost: VerifyCost, slack: float = 0.8) -> bool:
    """Whether no batch costs much less than a single token: a batch is at least one token's
    work. (A busy core slows single tokens and leaves wider batches, which spread over the
    other core, looking cheaper than one.)"""
    return all(t >= slack * cost.seconds[0] for t in cost.seconds)


def same_shape(a: VerifyCost, b: VerifyCost, tolerance: float = REPRODUCED) -> bool:
    """Whether two measurements of one curve agree on every cost(n)/cost(1) within
    ``tolerance``: the shape is the hardware's, not a disturbance's."""
    if a.sizes != b.sizes or a.seconds[0] <= 0 or b.seconds[0] <= 0:
        return False
    return all(abs((x / a.seconds[0]) / (y / b.seconds[0]) - 1.0) <= tolerance
               for x, y in zip(a.seconds, b.seconds, strict=True))


def _measure_trusted(ctx: Context, max_tokens: int) -> tuple[VerifyCost, bool]:
    """``measure_verify_cost``, again (up to ``MEASURE_ATTEMPTS`` times) while the curve is
    not ``plausible``; and whether it can be trusted. llama.cpp's matrix kernels work on
    tiles of rows, and on some CPUs a batch that fills a tile costs less than one that does
    not (8 tokens below 5-7): a curve that steps down, measured twice with the same shape and
    no batch below a single token (``floored``), is the hardware's and is trusted."""
    previous = None
    for attempt in range(1, MEASURE_ATTEMPTS + 1):
        cost = measure_verify_cost(ctx, max_tokens)
        if plausible(cost):
            return cost, True
        if previous is not None and floored(cost) and same_shape(previous, cost):
            log.info("decode costs %s step down at the same sizes in two measurements: the "
                     "hardware's tiles", [round(t * 1000, 2) for t in cost.seconds])
            return cost, True
        log.warning("decode costs %s look disturbed (attempt %d of %d)",
                    [round(t * 1000, 2) for t in cost.seconds], attempt, MEASURE_ATTEMPTS)
        previous = cost
    return cost, False


def _from_entry(entry: dict) -> VerifyCost | None:
    """A cached curve; None for an entry missing what is measured now (an older cache)."""
    try:
        return VerifyCost(tuple(entry["sizes"]), tuple(entry["seconds"]), entry["switch"],
                          context=entry["context"], per_context=tuple(entry["per_context"]))
    except (KeyError, TypeError, ValueError):
        return None


def read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def accepted_estimate(score: float, calibration: float) -> float:
    """A node's estimated chance of acceptance: its score times its scorer's factor, at most
    1 (the factor is a ratio over all of a scorer's nodes, and alone it could promise the
    strongest nodes more than one token each)."""
    return min(calibration * score, 1.0)


def best_size(scores: Sequence[float], cost: VerifyCost, t_draft: float,
              calibration: float) -> int:
    """N* for node scores sorted best first (see the module docstring); 0 means plain.

    Drafting's ``t_draft`` is spent whatever N is. Where the best step still beats the target
    alone's rate, 1 / cost(1), N* is the one that maximises the step's rate. Where it does
    not, the step's own rate is too low a bar (a node adding 0.9 tokens for 1.4 passes would
    raise a step slowed by its drafting): the nodes are then taken only as far as they beat
    the target alone's rate, the N that maximises ``S_N - (cost(N + 1) - cost(1)) / cost(1)``
    (tokens gained less the single-token passes they cost; what maximises the rate of a whole
    reply running at that rate)."""
    best_n, best_rate, total = 0, 1.0 / (t_draft + cost(1)), 0.0
    totals = [0.0]
    for n, s in enumerate(scores, start=1):
        total += accepted_estimate(s, calibration)
        totals.append(total)
        rate = (1.0 + total) / (t_draft + cost(n + 1))
        if rate > best_rate:
            best_n, best_rate = n, rate
    one = cost(1)
    if best_rate * one >= 1.0 or one <= 0.0:
        return best_n
    return max(range(len(totals)), key=lambda n: totals[n] - (cost(n + 1) - one) / one)


def paying_floor(scores: Sequence[float], cost: VerifyCost, t_draft: float,
                 calibration: float) -> float:
    """The least score a node needs to pay for its place in a tree like the one ``scores``
    (best first) offered: at the best cut N* (``best_size``), one more node pays when its
    estimated acceptance beats the rate it would dilute, R * (cost(N* + 2) - cost(N* + 1)),
    R the cut's tokens per second (at least the target alone's); the score that reaches it,
    kept between the weakest node the cut took and the best it left. Infinite where the cut
    took none (nothing paid)."""
    n = best_size(scores, cost, t_draft, calibration)
    if n == 0:
        return math.inf
    gained = sum(accepted_estimate(s, calibration) for s in scores[:n])
    rate = max((1.0 + gained) / (t_draft + cost(n + 1)), 1.0 / cost(1))
    floor = rate * max(cost(n + 2) - cost(n + 1), 0.0) / max(calibration, 1e-9)
    return min(max(floor, scores[n] if n < len(scores) else 0.0), scores[n - 1])


def guess_length(cost: VerifyCost, batch: int, max_len: int, hit_rate: float) -> int:
    """Stage-2 guess tokens worth adding to a draft batch of ``batch`` tokens: the g that
    maximises ``hit_rate * g * cost(1) - (cost(batch + g) - cost(batch))``, ``hit_rate`` the
    draft calls a guess token has saved (``plan.saved_calls``), each saved call priced as a
    single-token one; 0 when no g gains. Where a batch's second token costs as much as its
    first, guesses only ride along with batches that are already wide, or where they have
    saved calls often."""
    best_g, best_gain = 0, 0.0
    for g in range(1, max_len + 1):
        gain = hit_rate * g * cost(1) - (cost(batch + g) - cost(batch))
        if gain > best_gain:
            best_g, best_gain = g, gain
    return best_g


PASS_WINDOW = 32      # recent passes of each kind ``PassLoads`` compares
PASS_HORIZON = 120.0  # seconds after which a pass no longer counts (the machine's load drifts)
PASS_MIN = 8          # passes of each kind before their comparison counts
PASS_FACTOR_RANGE = (0.67, 2.0)  # what the comparison may say at most, either way


class PassLoads:
    """The target's passes in decoding, each over what the measured curve prices it at (after
    a pass of the same shape, a new shape's switch taken off): single-token passes after
    another, and passes of drafted trees. Their medians' ratio (``drafted_factor``) is what a
    drafted pass costs in decoding beyond the curve's ratio to a single token. The curve times
    batches back to back; in decoding the draft model runs between the target's drafted
    passes, while plain decoding's follow one another, and on some hosts the drafted ones then
    take longer than the curve's shape says, so a meter reading plain decoding's time off
    them through the curve alone reads high by as much (docs/results-log.md: the F16 pair).
    Shared by the engines of a model pair (the app's races and ``auto``'s target-alone steps
    time single tokens, the bench's plain runs too); passes older than ``PASS_HORIZON``
    seconds do not count."""

    def __init__(self) -> None:
        self.single: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=PASS_WINDOW)
        self.drafted: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=PASS_WINDOW)
        self.known = 1.0  # the last factor measured on enough recent passes of both kinds

    def add(self, batch: int, load: float, now: float | None = None) -> None:
        """A pass of ``batch`` tokens that took ``load`` times the curve's price."""
        if load > 0.0 and math.isfinite(load):
            (self.single if batch == 1 else self.drafted).append(
                (time.monotonic() if now is None else now, load))

    def clear(self) -> None:
        """Forget every pass and the factor (the curve they were priced by was replaced)."""
        self.single.clear()
        self.drafted.clear()
        self.known = 1.0

    def drafted_factor(self, now: float | None = None) -> float:
        """Drafted passes' median load over single tokens', within ``PASS_FACTOR_RANGE``;
        while either kind has fewer than ``PASS_MIN`` recent passes, the last factor so
        measured (``known``; 1 before any). Each load is over the curve, so the machine's
        load of the moment scales both kinds of a comparison alike: only passes timed in the
        same minutes are compared, but the ratio they gave stays true while one kind is not
        running (``auto`` drafting every step, a reply after a pause)."""
        now = time.monotonic() if now is None else now
        recent = [[load for t, load in passes if now - t <= PASS_HORIZON]
                  for passes in (self.single, self.drafted)]
        if min(len(r) for r in recent) < PASS_MIN:
            return self.known
        low, high = PASS_FACTOR_RANGE
        self.known = min(max(statistics.median(recent[1]) / statistics.median(recent[0]), low),
                         high)
        return self.known

    def recall(self, factor: object) -> None:
        """Start from a factor an earlier run measured (``known``); ValueError for one that is
        not a number within ``PASS_FACTOR_RANGE``."""
        value = float(factor)  # type: ignore[arg-type]
        low, high = PASS_FACTOR_RANGE
        if not low <= value <= high:
            raise ValueError(f"not a drafted passes' factor: {factor!r}")
        self.known = value


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

    def memory(self) -> list[float]:
        return [self.total, self.weight]

    def recalled(self, memory: Sequence[Any], weight: float) -> Running:
        """This mean's settings with ``memory``'s sums, weighing ``weight`` at most."""
        total, seen = recalled_sums(memory, 2)
        k = shrink(seen, weight)
        return Running(total * k, seen * k, self.decay, self.prior)


def recalled_sums(memory: Sequence[Any], n: int) -> list[float]:
    """``n`` decayed sums remembered from an earlier run: finite and not negative, or
    ValueError."""
    values = [float(x) for x in memory]
    if len(values) != n or not all(math.isfinite(x) and x >= 0.0 for x in values):
        raise ValueError(f"not {n} sums: {memory!r}")
    return values


def shrink(seen: float, weight: float) -> float:
    """The factor that makes ``seen`` count as ``weight`` at most (a recalled measurement
    weighs a few new ones, so that a run's own soon outweigh it)."""
    return min(1.0, weight / seen) if seen > 0 else 1.0


# bins of a proposer's probability of a node given its parent, finer where most nodes fall
ACCEPTANCE_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_CENTERS = np.convolve(ACCEPTANCE_EDGES, [0.5, 0.5], mode="valid")
_XS = [0.0, *_CENTERS.tolist(), 1.0]  # where ``Acceptance`` is read off: 0, the centres, 1
UNSEEN = 0.1  # the weight of a bin with no trials when bins are pooled into order


@dataclasses.dataclass(slots=True)
class Acceptance:
    """How often the target accepts a proposed node whose parent it accepted, as a function
    of the proposer's probability ``p`` of the node given its parent and of whether the node
    is its parent's first (most likely) child: a node's estimated acceptance is the product of
    this along its path (``drafting``'s node scores).

    A draft model's probabilities are not acceptance rates. A small model spreads its
    probability where the target is sure (first children it gives 0.5 are accepted nearly
    always), and the product of its probabilities along a path falls far faster with depth
    than the target's agreement does, so a path's probability, or any one multiple of it,
    calls deep nodes hopeless that the target mostly accepts. A first child of probability
    0.3 and a second child of 0.3 are not alike either: the first leads a flat distribution,
    the second trails a likelier sibling. For first and for other children, each bin of ``p``
    counts, decayed per step, the children of accepted nodes and how many of them the target
    accepted; a bin's rate starts from ``p`` itself (``prior`` trials at the bin's centre).
    A likelier node is accepted at least as often, so the rates are then made non-decreasing
    in ``p``, adjacent bins that disagree pooled by their trials (a bin with none takes its
    neighbours' rate rather than moving theirs toward its prior), and read between the bins'
    centres linearly."""

    # [first children, other children] x bins of p
    hits: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros((2, len(ACCEPTANCE_EDGES) - 1)))
    trials: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros((2, len(ACCEPTANCE_EDGES) - 1)))
    decay: float = 0.98  # per step: the text's difficulty drifts
    prior: float = 4.0   # trials each bin's starting rate, p itself, counts for
    _ys: list[list[float]] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._refresh()

    def __call__(self, p: float, first: bool = True) -> float:
        """The estimated chance that a node of probability ``p`` (its parent's first child,
        or not) is accepted, its parent having been: 0 at p = 0, the top bin's rate at 1."""
        xs, ys = _XS, self._ys[0 if first else 1]
        i = bisect.bisect_right(xs, p)
        if i >= len(xs):
            return ys[-1]
        if i == 0:
            return ys[0]
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (p - x0) * (ys[i] - ys[i - 1]) / (x1 - x0)

    def add(self, probs: Sequence[float], first: Sequence[bool],
            accepted: Sequence[float], tried: Sequence[float] | None = None) -> None:
        """One step's children of accepted nodes: their probabilities, whether each is its
        parent's first child, and whether the target accepted it (a step with none still
        decays what was seen). With ``tried``, each node counts as that many trials (its
        parent's chance of being reached) and ``accepted`` are its own chances of being
        reached: the expected counts, where the step's verdict was drawn."""
        self.hits *= self.decay
        self.trials *= self.decay
        if len(probs):
            bins = np.clip(np.searchsorted(ACCEPTANCE_EDGES, probs, side="right") - 1,
                           0, self.trials.shape[1] - 1)
            rows = np.where(np.asarray(first, dtype=bool), 0, 1)
            np.add.at(self.trials, (rows, bins), 1.0 if tried is None
                      else np.asarray(tried, dtype=float))
            np.add.at(self.hits, (rows, bins), np.asarray(accepted, dtype=float))
        self._refresh()

    def rates(self, first: bool = True) -> list[float]:
        """Each bin's estimated acceptance (non-decreasing)."""
        return self._ys[0 if first else 1][1:-1]

    def _refresh(self) -> None:
        self._ys = []
        for hits, trials in zip(self.hits, self.trials, strict=True):
            rates = (hits + self.prior * _CENTERS) / (trials + self.prior)
            # the order is imposed by what was seen: a bin's prior weighs next to nothing
            fitted = _nondecreasing(rates.tolist(), (trials + UNSEEN).tolist())
            self._ys.append([0.0, *fitted, fitted[-1]])

    def memory(self) -> list[list[float]]:
        """The decayed counts, JSON-able: hits then trials, each first children's bins then
        the others'."""
        return [self.hits.ravel().tolist(), self.trials.ravel().tolist()]

    def recalled(self, memory: Sequence[Any], weight: float) -> Acceptance:
        """This map's settings with ``memory``'s counts, worth ``weight`` trials per bin at
        most; ValueError for a memory it cannot read."""
        try:
            hits, trials = (np.array(recalled_sums(m, self.trials.size)).reshape(
                self.trials.shape) for m in memory)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not an acceptance map: {memory!r}") from exc
        if np.any(hits > trials + 1e-9):
            raise ValueError(f"more hits than trials: {memory!r}")
        k = np.array([shrink(t, weight) for t in trials.ravel()]).reshape(trials.shape)
        return Acceptance(hits * k, trials * k, self.decay, self.prior)


def _nondecreasing(values: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit of ``values`` (pool adjacent
    violators)."""
    blocks: list[list[float]] = []  # [mean, weight, bins]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [mean for mean, _, n in blocks for _ in range(int(n))]


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

    def add(self, accepted: float, predicted: float) -> None:
        if accepted == 0 and predicted <= 0.0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.predicted = self.decay * self.predicted + predicted

    def memory(self) -> list[float]:
        return [self.accepted, self.predicted]

    def recalled(self, memory: Sequence[Any], weight: float) -> Calibration:
        """This calibration's settings with ``memory``'s sums, worth ``weight`` predicted
        tokens at most."""
        accepted, predicted = recalled_sums(memory, 2)
        k = shrink(predicted, weight)
        return Calibration(accepted * k, predicted * k, self.decay, self.prior)
