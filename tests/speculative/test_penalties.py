"""Repetition control and min-p: the penalties against a reference written the slow, obvious way,
and every mode's greedy output with penalties equal to the penalised target alone."""

from __future__ import annotations

import numpy as np
import pytest

from speculative.costmodel import VerifyCost
from speculative.drafting import TreeBudget
from speculative.engine import Engine
from speculative.ngram import KatzTrigram
from speculative.penalties import Penalizer, breaker_tokens
from speculative.policies import Mode, SpecConfig
from speculative.sampling import SamplingParams, distribution
from tests.fakes import FakeContext, logit_table, noisy

V = 12
TARGET = logit_table(V, seed=1)
DRAFT = noisy(TARGET, seed=2, noise=1.0)
BREAKERS = frozenset({0})  # token 0 stands for a newline


def reference(logits: np.ndarray, history: list[int], params: SamplingParams,
              breakers: frozenset[int] = frozenset()) -> np.ndarray:
    """The penalties as defined in ``SamplingParams``, one token and one position at a time."""
    out = np.array(logits, dtype=np.float64)
    if params.repeat_last_n > 0:
        window = history[-params.repeat_last_n:]
        for t in set(window):
            if out[t] > 0:
                out[t] /= params.repeat_penalty
            else:
                out[t] *= params.repeat_penalty
            out[t] -= window.count(t) * params.frequency_penalty + params.presence_penalty
    if params.dry_multiplier > 0:
        seq = history[-params.dry_last_n:] if params.dry_last_n else list(history)
        n = len(seq)
        tail = 0  # tokens at the end that are not breakers
        while tail < n and seq[n - 1 - tail] not in breakers:
            tail += 1
        cap = min(tail, params.dry_allowed_length + 24)
        longest: dict[int, int] = {}
        for j in range(n - 1):  # an earlier text ending at j, followed by seq[j + 1]
            length = 0
            while (length < cap and j - length >= 0
                   and seq[j - length] == seq[n - 1 - length]):
                length += 1
            t = seq[j + 1]
            if length and t not in breakers:
                longest[t] = max(longest.get(t, 0), length)
        for t, length in longest.items():
            if length >= params.dry_allowed_length:
                out[t] -= params.dry_multiplier * params.dry_base ** (
                    length - params.dry_allowed_length)
    return out


def random_params(rng: np.random.Generator) -> SamplingParams:
    return SamplingParams(
        repeat_penalty=float(rng.choice([1.0, 1.1, 1.5])),
        repeat_last_n=int(rng.choice([0, 3, 8, 64])),
        presence_penalty=float(rng.choice([0.0, 0.4])),
        frequency_penalty=float(rng.choice([0.0, 0.3])),
        dry_multiplier=float(rng.choice([0.0, 0.8])),
        dry_base=float(rng.choice([1.5, 2.0])),
        dry_allowed_length=int(rng.choice([1, 2, 3])),
        dry_last_n=int(rng.choice([0, 6, 40])))


def test_penalised_logits_equal_the_reference_on_random_texts() -> None:
    rng = np.random.default_rng(0)
    checked = changed = 0
    for _ in range(400):
        params = random_params(rng)
        vocab = int(rng.choice([3, 5, 12]))  # few tokens: long repeats happen
        committed = rng.integers(0, vocab, size=int(rng.integers(1, 60))).tolist()
        path = tuple(rng.integers(0, vocab, size=int(rng.integers(0, 5))).tolist())
        logits = rng.normal(0, 3, size=V).astype(np.float32)
        step = Penalizer(params, BREAKERS, V).step(committed)
        got = step.apply(logits, path)
        want = reference(logits, [*committed, *path], params, BREAKERS)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
        tokens = np.array([2, 7, 1, 0, 11])
        sparse = step.apply_sparse(tokens, logits[tokens].astype(np.float64), path)
        np.testing.assert_allclose(sparse, want[tokens], rtol=1e-5, atol=1e-4)
        checked += 1
        changed += not np.allclose(got, logits)
    assert changed > checked // 2  # the cases do exercise the penalties


def test_dry_punishes_a_loop_and_spares_short_repeats_and_line_starts() -> None:
    params = SamplingParams(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    step = Penalizer(params, BREAKERS, V).step
    flat = np.zeros(V, dtype=np.float32)
    # "5 6 7 5 6 7 5 6": extending with 7 repeats "5 6 7" once more (a match of 5: 6 7 5 6
    # before the 7 at 5, and "5 6" before the 7 at 2)
    loop = step([5, 6, 7, 5, 6, 7, 5, 6]).apply(flat, ())
    assert loop[7] == pytest.approx(-(2.0 ** (5 - 2)))
    assert np.count_nonzero(loop) == 1
    # a repeat of one token ("4 9 ... 4") is within the allowed length: nothing punished
    assert not np.any(step([4, 9, 3, 4]).apply(flat, ()))
    # a breaker (a newline) ends every match: after "3 4 0 3 4 0", token 3 is free
    assert not np.any(step([3, 4, 0, 3, 4, 0]).apply(flat, ()))
    # ... and a match does not run across it: "3 4 0 3 4" punishes 0 but only as "3 4"
    after = step([8, 3, 4, 9, 0, 3, 4]).apply(flat, ())
    assert after[9] == pytest.approx(-1.0) and np.count_nonzero(after) == 1


def test_breaker_tokens_are_the_tokens_containing_a_breaker() -> None:
    pieces = [b"a", b"\n", b"b:", b" c", b'"', b"\xe2"]  # the last: half a UTF-8 character
    got = breaker_tokens(("\n", ":", '"'), len(pieces), lambda t: pieces[t])
    assert got == {1, 2, 4}


def test_min_p_keeps_the_tokens_near_the_best_at_any_temperature() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04]))
    for temp in (0.5, 1.0, 2.0):
        for top_k in (0, 4):
            p = distribution(logits, SamplingParams(temperature=temp, top_k=top_k, min_p=0.15))
            assert np.flatnonzero(p).tolist() == [0, 1, 2]  # 0.1 >= 0.15 * 0.5 > 0.06
            assert p.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.0)


def _plain_penalised(prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """The target alone, greedy, penalised by the reference."""
    ctx = list(prompt)
    for _ in range(n):
        a, b = ([0, 0, *ctx])[-2:]
        ctx.append(int(np.argmax(reference(TARGET[a, b].astype(np.float32), ctx, params,
                                           BREAKERS))))
    return ctx[len(prompt):]


def _engine(mode: Mode, budget: TreeBudget) -> Engine:
    ngram = KatzTrigram.build([list(np.random.default_rng(9).integers(0, V, 200))], V)
    engine = Engine(FakeContext(TARGET), FakeContext(DRAFT), ngram,
                    SpecConfig(mode=mode, tree=budget, chain_length=3, lookahead=3),
                    breakers=lambda strings: BREAKERS)
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16), (1.0, 1.02, 1.05, 1.1, 1.2))
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16), (0.05, 0.06, 0.07, 0.09, 0.12))
    return engine


PENALTIES = [
    SamplingParams(repeat_penalty=1.3, repeat_last_n=16),
    SamplingParams(presence_penalty=0.6, frequency_penalty=0.3),
    SamplingParams(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2),
    SamplingParams(repeat_penalty=1.1, dry_multiplier=1.5, dry_allowed_length=1, min_p=0.1),
]


@pytest.mark.parametrize("mode", Mode.selectable())
@pytest.mark.parametrize("params", PENALTIES, ids=["repeat", "presence", "dry", "all"])
def test_greedy_with_penalties_equals_the_penalised_target_alone(mode: Mode,
                                                                 params: SamplingParams) -> None:
    engine = _engine(mode, TreeBudget(8, 5, 3))
    rng = np.random.default_rng(4)
    differs = accepted = steered = 0
    for _ in range(8):
        prompt = rng.integers(0, V, size=int(rng.integers(1, 6))).tolist()
        want = _plain_penalised(prompt, 30, params)
        got: list[int] = []
        for step in engine.generate(prompt, 30, params):
            got += step.tokens
            accepted += step.stats.accepted
            steered += step.stats.steered
        assert got == want, (mode, prompt)
        differs += want != _plain_penalised(prompt, 30, SamplingParams())
    assert differs > 0  # the penalties change the text: the comparison means something
    assert steered > 0
    assert accepted > 0 or mode is Mode.PLAIN


def test_steered_counts_where_the_penalties_changed_the_top_token() -> None:
    engine = _engine(Mode.PLAIN, TreeBudget())
    prompt = [3, 4]
    params = PENALTIES[2]
    plain = _plain_penalised(prompt, 30, SamplingParams())
    steps = list(engine.generate(prompt, 30, params))
    steered = [s.stats.steered for s in steps]
    got = [s.tokens[0] for s in steps]
    # the first position where the penalised text parts from the unpenalised one is steered
    first = next(i for i, (a, b) in enumerate(zip(got, plain, strict=True)) if a != b)
    assert steered[first] == 1 and sum(steered[:first]) == 0
    assert all(s.stats.steered == 0 for s in engine.generate(prompt, 30, SamplingParams()))
