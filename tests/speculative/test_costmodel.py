"""Choosing the tree size from measured verification cost."""

from __future__ import annotations

import time

import numpy as np
import pytest

from speculative.costmodel import (
    Calibration,
    VerifyCost,
    best_size,
    cached_verify_cost,
    curve_sizes,
    measure_verify_cost,
    paying_floor,
)
from speculative.sizing import Sizer
from tests.fakes import FakeContext, logit_table


class _VirtualClock:
    """The time the fakes below take: a sleep moves this clock on and the cost model reads
    it, so what is measured is exactly what a fake declares, however late a loaded machine
    would wake a sleeping thread."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def perf_counter(self) -> float:
        return self.now


_CLOCK = _VirtualClock()


@pytest.fixture
def virtual_time(monkeypatch):
    """The cost model's clock is ``_CLOCK`` for the test (wall-clock dates stay real)."""
    import types

    from speculative import costmodel

    _CLOCK.now = 0.0
    monkeypatch.setattr(costmodel, "time", types.SimpleNamespace(
        perf_counter=_CLOCK.perf_counter, time=time.time, monotonic=time.monotonic))
    return _CLOCK


def test_cost_interpolates_and_extrapolates() -> None:
    cost = VerifyCost((1, 2, 4), (1.0, 2.0, 3.0))
    assert cost(1) == 1.0 and cost(3) == 2.5 and cost(4) == 3.0
    assert cost(6) == pytest.approx(4.0)  # the last slope, 0.5 per token
    assert cost(0) == 1.0
    # a noisy last timing does not set the slope for a long text (the draft catching up)
    noisy = VerifyCost((1, 8, 12, 16, 20, 21), (1.0, 3.0, 4.0, 5.0, 6.0, 8.0))
    assert noisy(121) < 8.0 + 100 * 0.5 < 8.0 + 100 * 2.0  # slope 0.25-0.4, not the last 2.0


def test_a_new_batch_shape_pays_the_switch() -> None:
    cost = VerifyCost((1, 2, 4), (1.0, 2.0, 3.0), switch=0.25)
    assert cost(2) == 2.0  # unpriced: the curve alone
    after_two = cost.after(2)
    assert after_two(2) == 2.0 and after_two(1) == 1.25 and after_two(3) == 2.75
    assert after_two.curve(1) == 1.0
    # after a plain step, a tree must gain more than the switch (and the next plain step's)
    scores = [0.3]
    assert best_size(scores, VerifyCost((1, 2), (1.0, 1.2)), 0.0, 1.0) == 1
    assert best_size(scores, VerifyCost((1, 2), (1.0, 1.2), 0.1).after(1), 0.0, 1.0) == 0
    assert best_size(scores, VerifyCost((1, 2), (1.0, 1.2), 0.1).after(2), 0.0, 1.0) == 1


def test_best_size_follows_the_hardware() -> None:
    scores = [0.9, 0.8, 0.5, 0.3, 0.1, 0.05]
    flat = VerifyCost((1, 8), (1.0, 1.0))  # a GPU-like cost: more nodes are free
    steep = VerifyCost((1, 2, 8), (1.0, 3.0, 9.0))  # a second token costs two
    assert best_size(scores, flat, 0.0, 1.0) == len(scores)
    assert best_size(scores, steep, 0.0, 1.0) == 0
    linear = VerifyCost((1, 8), (1.0, 1.7))  # 0.1 per extra token: stop where score < ~0.1
    n = best_size(scores, linear, 0.0, 1.0)
    assert 3 <= n <= 5
    assert best_size(scores, linear, 0.0, 0.1) < n  # a draft that over-promises gets less


def test_a_longer_context_moves_the_curve_and_flattens_it() -> None:
    """Each token of context adds a + b * n seconds to a batch of n: after a long context a
    pass costs more and a tree relatively less, so more nodes pay; a context no longer than
    the one timed is priced as timed."""
    cost = VerifyCost((1, 2, 4, 8), (1.0, 1.6, 2.4, 4.0), context=64, per_context=(0.01, 0.0))
    assert cost.at(10) == cost.at(64) == cost
    far = cost.at(164)  # one more second for every batch size
    assert far.seconds == pytest.approx((2.0, 2.6, 3.4, 5.0)) and far.context == 164
    assert far.curve(2) / far.curve(1) < cost.curve(2) / cost.curve(1)
    scores = [0.7, 0.5, 0.4, 0.3, 0.2]
    assert best_size(scores, far, 0.0, 1.0) > best_size(scores, cost, 0.0, 1.0)
    wide = VerifyCost((1, 8), (1.0, 4.0), context=64, per_context=(0.0, 0.01))
    assert wide.at(164).seconds == pytest.approx((2.0, 12.0))  # b: per batch token


def test_a_moved_curve_extends_beyond_its_table_as_a_refitted_one_would() -> None:
    """``at`` shifts the fitted tail slope instead of refitting at every step: the result is
    the slope a fit of the moved table gives."""
    cost = VerifyCost((1, 2, 4, 8, 12, 16), (1.0, 1.6, 2.4, 4.0, 5.1, 6.3), context=64,
                      per_context=(0.002, 0.0005))
    for context in (65, 300, 2000):
        moved = cost.at(context)
        refitted = VerifyCost(moved.sizes, moved.seconds, context=context)
        assert moved.tail == pytest.approx(refitted.tail)
        assert moved.curve(40) == pytest.approx(refitted.curve(40))
    falling = VerifyCost((1, 8, 16), (1.0, 4.0, 5.0), context=64, per_context=(0.01, -0.002))
    moved = falling.at(500)  # some sizes clamped at no growth: fitted again
    assert moved.tail == pytest.approx(VerifyCost(moved.sizes, moved.seconds).tail)


def test_no_node_is_expected_to_yield_more_than_one_token() -> None:
    """A calibration above 1 (the target accepts more than the scores say) never makes a node
    worth more than one token: where a second batch token costs 1.2 passes, no single node
    pays, however confident; eight nodes in one tile can."""
    steep = VerifyCost((1, 2, 4, 8, 9), (1.0, 2.2, 3.0, 3.2, 4.5))
    assert best_size([0.8], steep, 0.0, 2.0) == 0
    assert best_size([0.8] * 8, steep, 0.0, 2.0) == 7
    sizer = Sizer(steep, None)
    assert sizer.best_cut([0.9], 0.0, 2.0)[0] == 0
    assert sizer.best_cut([0.9] * 8, 0.0, 2.0)[0] == 7


def test_drafted_passes_priced_as_decoding_found_them_size_the_trees() -> None:
    """Where a drafted pass in decoding costs less against a single token than the bare
    curve says (a single token's pass also reads logits and applies the penalties, which do
    not grow with the batch), the sizer prices batches of two or more tokens by that factor
    and keeps nodes the bare curve would cut; where they cost more, fewer. A single token
    and the measured curve itself are unchanged."""
    curve = VerifyCost((1, 2, 4, 8), (1.0, 1.9, 3.0, 5.0))
    cheaper = curve.drafted(0.75)
    assert cheaper.curve(1) == 1.0 and cheaper.curve(2) == pytest.approx(1.425)
    assert cheaper.curve(20) == pytest.approx(0.75 * curve.curve(20))  # beyond the table
    assert curve.drafted(1.0) is curve
    sizer = Sizer(curve, None)
    scores = [0.75, 0.6, 0.5]
    assert sizer.best_cut(scores, 0.0, 1.0)[0] == 0
    sizer.locate(0, None, drafted=0.75)
    assert sizer.curve is curve and sizer.priced.curve(2) == pytest.approx(1.425)
    assert sizer.best_cut(scores, 0.0, 1.0)[0] == 2
    assert best_size(scores, sizer.priced, 0.0, 1.0) == 2
    assert sizer.least_worth() < Sizer(curve, None).least_worth()
    sizer.locate(0, None, drafted=1.5)
    assert best_size([0.95], sizer.priced, 0.0, 1.0) == 0 < best_size([0.95], curve, 0.0, 1.0)


def test_a_step_asks_for_the_drafted_passes_factor_only_when_it_prices_a_drafted_pass(
        ) -> None:
    """The factor is a median over recent passes: a step of the target alone (what ``auto``
    runs most on a steep curve) reads the target's curve at its context and never asks for
    it; a step that prices a tree asks once."""
    curve = VerifyCost((1, 2, 4, 8), (1.0, 1.9, 3.0, 5.0), per_context=(0.01, 0.0),
                       context=10)
    sizer = Sizer(curve, curve)
    asked = []

    def factor() -> float:
        asked.append(1)
        return 0.75

    sizer.locate(110, 1, factor)
    assert sizer.curve.curve(1) == pytest.approx(2.0) and sizer.draft is not None
    assert asked == []
    assert sizer.target.curve(2) == pytest.approx(0.75 * 2.9)
    assert sizer.priced.curve(4) == pytest.approx(0.75 * 4.0)
    assert asked == [1]
    sizer.locate(120, 2, factor)  # the next step asks again
    assert sizer.priced.curve(2) == pytest.approx(0.75 * 3.0) and asked == [1, 1]


def test_time_spent_drafting_does_not_lower_the_bar_for_a_node() -> None:
    """After a slow drafting, the step's own rate is low, and a node that adds 0.7 tokens for
    0.8 of a pass would raise it; but the target alone does better per second: the node is
    cut. One that adds 0.9 tokens for the same still pays, slow drafting or not."""
    curve = VerifyCost((1, 2, 4), (1.0, 1.8, 2.6))
    assert best_size([0.7], curve, 0.0, 1.0) == 0
    assert best_size([0.7], curve, 2.0, 1.0) == 0
    assert best_size([0.9], curve, 0.0, 1.0) == 1
    assert best_size([0.9], curve, 2.0, 1.0) == 1
    sizer = Sizer(curve, VerifyCost((1, 2, 4), (0.5, 0.6, 0.7)))
    sizer.confidence.add(0.7)  # the draft's next levels: about 0.6 each
    # drafting has taken 3 passes: its next batch's tokens must still beat the target alone
    assert sizer.expand([0.7], [0.7], 3.0, 1.0, levels_left=1) == 0


def test_a_sampled_trees_floor_is_what_one_more_node_needed_to_pay() -> None:
    """A sampled tree keeps the nodes scoring at least the floor set from the last step's
    candidates: between the weakest node its best cut took and the best it left, where one
    more node's acceptance would beat the rate it dilutes; infinite where nothing paid."""
    steep = VerifyCost((1, 2, 4, 8, 16), (1.0, 1.63, 2.03, 3.02, 4.71))
    chain = [0.8, 0.64, 0.51, 0.41, 0.2, 0.1]
    n = best_size(chain, steep, 0.0, 1.0)
    assert 0 < n < len(chain)
    floor = paying_floor(chain, steep, 0.0, 1.0)
    assert chain[n] <= floor <= chain[n - 1]
    assert paying_floor([0.5, 0.2], steep, 0.0, 1.0) == float("inf")  # a node costs 0.63
    # every candidate paid: the floor lets a deeper node in where it would pay too
    flat = VerifyCost((1, 2, 4, 8, 16), (1.0, 1.0, 1.05, 1.2, 1.5))
    sure = [0.9, 0.85, 0.8, 0.75]
    assert best_size(sure, flat, 0.0, 1.0) == len(sure)
    assert paying_floor(sure, flat, 0.0, 1.0) < sure[-1]
    # a drafter that over-promises (calibration below 1) needs higher scores
    assert paying_floor(chain, steep, 0.0, 0.5) > floor


def test_the_draft_is_not_asked_for_children_a_sampled_trees_floor_would_refuse() -> None:
    curve = VerifyCost((1, 2, 4, 8), (1.0, 1.05, 1.1, 1.3))
    sizer = Sizer(curve, VerifyCost((1, 2, 4), (0.1, 0.11, 0.12)))
    sizer.confidence.add(0.9)
    assert sizer.expand([0.6], [0.6], 0.0, 1.0, levels_left=3) == 1
    # the frontier's best child would score about 0.6 * confidence: under a floor of 0.7
    assert sizer.expand([0.6], [0.6], 0.0, 1.0, levels_left=3, floor=0.7) == 0


def test_calibration_tracks_accepted_over_predicted() -> None:
    cal = Calibration()
    assert cal.factor == 1.0
    for _ in range(50):
        cal.add(accepted=1, predicted=4.0)
    assert cal.factor == pytest.approx(0.25, abs=0.02)  # the prior's weight has faded


def test_one_missed_node_does_not_make_a_drafter_look_useless() -> None:
    """A fresh calibration that sees one node of score 0.14 rejected moves a little from 1, not
    to the floor (from which its drafter would never be given a step to recover); a step with
    nothing of this scorer's changes nothing."""
    cal = Calibration()
    cal.add(accepted=0, predicted=0.14)
    assert 0.8 < cal.factor < 1.0
    before = (cal.accepted, cal.predicted)
    cal.add(accepted=0, predicted=0.0)
    assert (cal.accepted, cal.predicted) == before


def test_measure_leaves_the_context_empty() -> None:
    ctx = FakeContext(logit_table(5, seed=0), n_ctx=40, n_batch=16)
    cost = measure_verify_cost(ctx, 13, rounds=1)
    assert cost.sizes == (1, 2, 3, 4, 5, 6, 7, 8, 12, 13)
    assert all(t > 0 for t in cost.seconds) and cost.switch >= 0.0
    assert ctx.cells == []


class _Drifting(FakeContext):
    """Decodes that take 1 ms a token plus 2 ms, on a machine whose load doubles the time of
    everything after its first ``calm`` decodes (another program starting mid-measurement)."""

    def __init__(self, *args, calm: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calm, self.decodes = calm, 0

    def decode(self, tokens, *args, **kwargs):
        self.decodes += 1
        load = 1 if self.decodes <= self.calm else 2
        _CLOCK.sleep(load * 0.001 * (len(tokens) + 2))
        return super().decode(tokens, *args, **kwargs)


@pytest.mark.usefixtures("virtual_time")
def test_a_load_change_mid_measurement_does_not_bend_the_curve() -> None:
    """Sizes are timed in rounds across all of them: a load that starts after the first round
    moves every size's median alike, so the small sizes are not timed calm and the large ones
    busy (which would make large trees look dear)."""
    sizes = len(curve_sizes(8))
    ctx = _Drifting(logit_table(5, seed=0), n_ctx=40, n_batch=16, calm=1 + 2 * sizes)
    cost = measure_verify_cost(ctx, 8, rounds=3)
    ratio = cost.curve(8) / cost.curve(1)
    assert ratio == pytest.approx(10 / 3, rel=0.2)  # (8 + 2) / (1 + 2), calm or busy alike


class _Jittery(FakeContext):
    """Decodes that take 1 ms a token plus 2 ms, each stretched by up to ``jitter`` of that at
    random (a machine whose other tenants come and go)."""

    def __init__(self, *args, jitter: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.jitter, self.decodes = jitter, 0
        self.rng = np.random.default_rng(0)

    def decode(self, tokens, *args, **kwargs):
        self.decodes += 1
        _CLOCK.sleep(0.001 * (len(tokens) + 2) * (1.0 + self.jitter * self.rng.random()))
        return super().decode(tokens, *args, **kwargs)


@pytest.mark.usefixtures("virtual_time")
def test_a_jittery_machine_is_timed_longer_than_a_steady_one() -> None:
    """Three rounds are enough where decodes take what they take; where they jitter, rounds go
    on (up to the limit) until every ratio to a single token is precise, and the ratios come
    out right."""
    steady = _Jittery(logit_table(5, seed=0), n_ctx=40, n_batch=16, jitter=0.0)
    measure_verify_cost(steady, 8, far=0)
    jittery = _Jittery(logit_table(5, seed=0), n_ctx=40, n_batch=16, jitter=0.6)
    cost = measure_verify_cost(jittery, 8, far=0, max_rounds=12)
    assert jittery.decodes > steady.decodes
    assert cost.curve(8) / cost.curve(1) == pytest.approx(10 / 3, rel=0.15)


def test_precision_is_judged_on_the_ratios_to_a_single_token() -> None:
    from speculative.costmodel import precise

    steady = {1: [1.0, 1.0, 1.01], 4: [2.0, 2.02, 2.0]}
    assert precise(steady)
    assert not precise({1: [1.0, 1.3, 0.8], 4: [2.0, 2.02, 2.0]})  # the single token jitters
    assert not precise({1: [1.0, 1.0, 1.01], 4: [2.0, 2.6, 1.6]})
    assert not precise({1: [1.0], 4: [2.0]})  # one timing says nothing of its spread
    many = {n: [t * (1.0 + 0.1 * ((i * 7) % 5 - 2) / 2) for i in range(40)]
            for n, t in ((1, 1.0), (4, 2.0))}
    assert precise(many)  # a moderate spread, timed many times, is precise enough


class _Attending(FakeContext):
    """Decodes that take 1 ms a token plus 2 ms, plus 0.1 ms for every cell of context the
    batch attends to (the cells the cache holds)."""

    def decode(self, tokens, *args, **kwargs):
        _CLOCK.sleep(0.001 * (len(tokens) + 2) + 0.0001 * len(self.cells))
        return super().decode(tokens, *args, **kwargs)


@pytest.mark.usefixtures("virtual_time")
def test_what_a_longer_context_adds_is_measured() -> None:
    ctx = _Attending(logit_table(5, seed=0), n_ctx=320, n_batch=64)
    cost = measure_verify_cost(ctx, 8, prefix=16, rounds=1, far=272)
    a, b = cost.per_context
    assert cost.context == 16 and a + 4 * b == pytest.approx(0.0001, rel=0.2)
    assert cost.at(272).curve(1) == pytest.approx(0.003 + 0.0001 * 272, rel=0.2)
    assert ctx.cells == []
    short = measure_verify_cost(_Attending(logit_table(5, seed=0), n_ctx=30, n_batch=16), 8,
                                prefix=16, rounds=1, far=272)
    assert short.per_context == (0.0, 0.0)  # no room for a clearly longer context


def test_every_small_batch_size_is_measured() -> None:
    """The curve steps where a batch passes a kernel's tile; interpolating between powers of
    two would price a batch one past a tile at half the step."""
    assert curve_sizes(17) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 17]
    assert curve_sizes(3) == [1, 2, 3]


def test_guesses_ride_along_only_where_they_are_cheap() -> None:
    from speculative.costmodel import guess_length
    jump = VerifyCost((1, 2, 4, 8), (1.0, 2.0, 2.2, 2.6))  # the second token doubles the cost
    assert guess_length(jump, batch=1, max_len=4, hit_rate=0.25) == 0
    assert guess_length(jump, batch=2, max_len=4, hit_rate=0.25) > 0
    flat = VerifyCost((1, 8), (1.0, 1.05))
    assert guess_length(flat, batch=1, max_len=4, hit_rate=0.25) == 4
    assert guess_length(flat, batch=1, max_len=4, hit_rate=0.0) == 0


class _Keyed(FakeContext):
    """A fake whose decodes take 1 ms a token, so its measured curve is plausible."""

    cost_key = "fake-model|2 threads"

    def decode(self, tokens, *args, **kwargs):
        _CLOCK.sleep(0.001 * len(tokens))
        return super().decode(tokens, *args, **kwargs)


class _Busy(_Keyed):
    """Timed while the host was busy: for its first ``busy`` decodes one token takes 20 ms and
    more take 1 ms (a curve no hardware has), then 1 ms a token."""

    busy = 0

    def decode(self, tokens, *args, **kwargs):
        if self.busy > 0:
            self.busy -= 1
            _CLOCK.sleep(0.02 if len(tokens) == 1 else 0.001)
            return FakeContext.decode(self, tokens, *args, **kwargs)
        return super().decode(tokens, *args, **kwargs)


@pytest.mark.usefixtures("virtual_time")
def test_a_curve_timed_on_a_busy_machine_is_measured_again_and_never_cached(tmp_path) -> None:
    from speculative.costmodel import plausible

    assert plausible(VerifyCost((1, 2, 4), (1.0, 0.9, 2.0)))  # noise, within the slack
    assert not plausible(VerifyCost((1, 2, 4), (1.0, 0.5, 2.0)))
    cache = tmp_path / "costs.json"
    ctx = _Busy(logit_table(6, seed=0), n_ctx=64, n_batch=16)
    ctx.busy = 17  # one whole measurement of sizes 1, 2, 4, 8 (a prefix + 4 x 4 decodes)
    cost = cached_verify_cost(ctx, 8, cache)
    assert plausible(cost) and cost.seconds[0] < 0.01
    assert cached_verify_cost(ctx, 8, cache) == cost  # the second measurement was cached
    ctx.busy = 10 ** 6  # busy for good: every attempt is disturbed
    disturbed = cached_verify_cost(ctx, 8, cache, refresh=True)
    assert not plausible(disturbed)
    ctx.busy = 0
    assert cached_verify_cost(ctx, 8, cache) == cost  # the disturbed curve was not cached
    import json  # a disturbed curve cached by an older version is measured again
    entries = json.loads(cache.read_text())
    for entry in entries.values():
        entry["seconds"] = [0.02, 0.001, 0.002, 0.004]
    cache.write_text(json.dumps(entries))
    assert plausible(cached_verify_cost(ctx, 8, cache))


class _Tiled(_Keyed):
    """A CPU whose kernels work on tiles of 4 rows and handle the rest one row at a time: a
    batch that fills its tiles costs less than one a token short (8 below 5-7)."""

    def decode(self, tokens, *args, **kwargs):
        n = len(tokens)
        _CLOCK.sleep(0.002 * (n // 4) + 0.0015 * (n % 4) + 0.001)
        return FakeContext.decode(self, tokens, *args, **kwargs)


@pytest.mark.usefixtures("virtual_time")
def test_a_curve_that_steps_down_at_the_hardwares_tiles_is_trusted_and_cached(tmp_path) -> None:
    from speculative.costmodel import floored, plausible, same_shape

    cache = tmp_path / "costs.json"
    ctx = _Tiled(logit_table(6, seed=0), n_ctx=64, n_batch=16)
    cost = cached_verify_cost(ctx, 8, cache)
    assert not plausible(cost) and floored(cost)  # 8 tokens cost less than 7, more than 1
    assert cost.curve(8) < cost.curve(7)
    decodes = ctx.decodes
    assert cached_verify_cost(ctx, 8, cache) == cost and ctx.decodes == decodes  # cached
    # the shapes compared: ratios to one token, so a uniformly slower machine has the same
    slower = VerifyCost(cost.sizes, tuple(2 * t for t in cost.seconds))
    assert same_shape(cost, slower)
    bent = VerifyCost(cost.sizes, (*cost.seconds[:-1], cost.seconds[-1] * 1.5))
    assert not same_shape(cost, bent)


@pytest.mark.usefixtures("virtual_time")
def test_decode_costs_are_measured_once_per_model_and_settings(tmp_path) -> None:
    cache = tmp_path / "costs.json"
    ctx = _Keyed(logit_table(6, seed=0), n_ctx=64, n_batch=16)
    first = cached_verify_cost(ctx, 8, cache)
    decodes = ctx.decodes
    assert decodes > 0 and cache.is_file()
    assert cached_verify_cost(ctx, 8, cache) == first
    assert ctx.decodes == decodes  # from the cache: no decode
    again = cached_verify_cost(ctx, 8, cache, refresh=True)
    assert ctx.decodes > decodes and again.sizes == first.sizes
    other = _Keyed(logit_table(6, seed=0), n_ctx=64, n_batch=16)
    other.cost_key = "fake-model|1 thread"
    cached_verify_cost(other, 8, cache)
    assert other.decodes > 0  # another key: measured
    cache.write_text("not json")
    assert cached_verify_cost(ctx, 8, cache).sizes == first.sizes  # a broken cache is remeasured
    import json  # an entry cached before context costs were measured is measured again
    entries = json.loads(cache.read_text())
    for entry in entries.values():
        del entry["per_context"]
    cache.write_text(json.dumps(entries))
    decodes = ctx.decodes
    assert cached_verify_cost(ctx, 8, cache).switch >= 0.0 and ctx.decodes > decodes
    assert all("per_context" in entry for entry in json.loads(cache.read_text()).values())


def test_measuring_a_real_context_with_its_switches_leaves_it_empty(tiny_models) -> None:
    """The curve and the switch (batches of alternating shapes) are timed on a real llama.cpp
    context, which is left empty for the conversation."""
    from speculative.backend import ContextConfig, LlamaContext, LlamaModel

    with LlamaModel(tiny_models["q8_0-target"]) as m, \
            LlamaContext(m, ContextConfig(n_ctx=64, n_batch=16, n_threads=1)) as ctx:
        cost = measure_verify_cost(ctx, 4, prefix=8, far=56)
        assert cost.switch >= 0.0 and ctx.seq_pos_max(0) == -1
        assert cost.context == 8 and min(cost.per_context) > -1.0  # measured, finite


def test_real_contexts_name_what_their_cost_depends_on(tiny_models) -> None:
    from speculative.backend import ContextConfig, LlamaContext, LlamaModel

    with LlamaModel(tiny_models["q8_0-target"]) as m:
        with LlamaContext(m, ContextConfig(n_ctx=64, n_batch=16, n_threads=1)) as one, \
                LlamaContext(m, ContextConfig(n_ctx=64, n_batch=16, n_threads=2)) as two:
            assert one.cost_key != two.cost_key
            assert str(tiny_models["q8_0-target"].name) in one.cost_key


class _Walking(FakeContext):
    """Decodes that take ``base`` ms a token plus ``per_cell`` ms for every cell of context the
    batch attends to: a flash-attention-like kernel (cheap alone, dear over a long context)
    or a matrix-product one (the other way round)."""

    def __init__(self, *args, base: float, per_cell: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.base, self.per_cell = base, per_cell

    def decode(self, tokens, *args, **kwargs):
        _CLOCK.sleep(0.001 * (self.base * len(tokens) + self.per_cell * len(self.cells)))
        return super().decode(tokens, *args, **kwargs)


@pytest.mark.usefixtures("virtual_time")
def test_window_costs_average_a_token_over_the_window() -> None:
    """Timed after a quarter and three quarters of the window: for a cost linear in the
    context, its mean over the window; both contexts left empty."""
    from speculative.costmodel import window_costs

    cheap_alone = _Walking(logit_table(5, seed=0), n_ctx=200, n_batch=64, base=1.0,
                           per_cell=0.02)
    flat = _Walking(logit_table(5, seed=0), n_ctx=200, n_batch=64, base=2.0, per_cell=0.002)
    walking, matrix = window_costs([cheap_alone, flat], rounds=2)
    # each fake's cost one token takes after half the window (100 cells)
    assert walking == pytest.approx(0.001 + 0.00002 * 100, rel=0.02)
    assert matrix == pytest.approx(0.002 + 0.000002 * 100, rel=0.02)
    assert cheap_alone.cells == [] and flat.cells == []


def test_flash_attention_is_on_unless_off_is_measurably_faster(tmp_path) -> None:
    """The choice is measured once per key and remembered; within SAME_SPEED of each other
    the two settings count as equally fast and flash attention stays on (its rows do not
    depend on their batch)."""
    from speculative.costmodel import SAME_SPEED, cached_flash_attn

    cache = tmp_path / "costs.json"
    asked = []

    def measure(on: float, off: float):
        def timed() -> tuple[float, float]:
            asked.append((on, off))
            return on, off
        return timed

    slow = cached_flash_attn("slow-walk", measure(3.0, 2.2), cache)
    assert not slow.on and (slow.seconds_on, slow.seconds_off) == (3.0, 2.2)
    assert cached_flash_attn("slow-walk", measure(1.0, 9.0), cache) == slow  # remembered
    assert asked == [(3.0, 2.2)]
    assert cached_flash_attn("fast-walk", measure(2.0, 2.2), cache).on
    close = 1.0 - SAME_SPEED / 2
    assert cached_flash_attn("about-equal", measure(1.0, close), cache).on
    cache.write_text("not json")  # a broken cache: measured again
    assert not cached_flash_attn("slow-walk", measure(3.0, 2.2), cache).on
    assert len(asked) == 4
