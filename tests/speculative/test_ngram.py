"""Tests of speculative/ngram.py against an exact (Fraction) reference Katz model."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from speculative.ngram import P1_REFRESH, UNIGRAM_DELTA, KatzTrigram, good_turing_discounts

Corpus = list[list[int]]


def random_corpus(rng: np.random.Generator, n_vocab: int, n_tokens: int,
                  n_used: int | None = None) -> Corpus:
    """Sequences mixing Zipf-distributed tokens with a repeated trigram rule, so that counts
    range from 1 to large and both seen and unseen continuations occur. Only ``n_used``
    (random) ids ever appear, leaving the others unseen."""
    n_used = n_vocab if n_used is None else n_used
    ids = rng.permutation(n_vocab)[:n_used]
    zipf = 1.0 / np.arange(1, n_used + 1)
    zipf /= zipf.sum()
    corpus: Corpus = []
    total = 0
    while total < n_tokens:
        seq: list[int] = []
        for _ in range(int(rng.integers(0, 30))):
            if len(seq) >= 2 and rng.random() < 0.5:
                seq.append(int(ids[(3 * seq[-2] + 7 * seq[-1]) % n_used]))
            else:
                seq.append(int(ids[rng.choice(n_used, p=zipf)]))
        corpus.append(seq)
        total += len(seq)
    return corpus


# -- exact reference ------------------------------------------------------------------------


def reference_discounts(counts: Counter, k: int) -> Callable[[int], Fraction]:
    """Katz's d_r from the counts-of-counts, as Fractions (1 where out of (0, 1])."""
    n = Counter(counts.values())
    d = {}
    big_r = Fraction((k + 1) * n[k + 1], n[1]) if n[1] else None
    for r in range(1, k + 1):
        d[r] = Fraction(1)
        if big_r is not None and big_r < 1 and n[r]:
            d_r = (Fraction((r + 1) * n[r + 1], r * n[r]) - big_r) / (1 - big_r)
            if 0 < d_r <= 1:
                d[r] = d_r
    return lambda r: d.get(r, Fraction(1))


class Reference:
    """Textbook Katz backoff in exact arithmetic, written independently of the module."""

    def __init__(self, corpus: Corpus, n_vocab: int, k: int = 5,
                 discounts: tuple[Callable, Callable] | None = None) -> None:
        self.v = n_vocab
        self.c1: Counter = Counter()
        self.c2: Counter = Counter()
        self.c3: Counter = Counter()
        for seq in corpus:
            for i, w in enumerate(seq):
                self.c1[w] += 1
                if i >= 1:
                    self.c2[seq[i - 1], w] += 1
                if i >= 2:
                    self.c3[seq[i - 2], seq[i - 1], w] += 1
        if discounts is None:
            discounts = reference_discounts(self.c2, k), reference_discounts(self.c3, k)
        self.d2, self.d3 = discounts
        n = sum(self.c1.values())
        delta = Fraction(UNIGRAM_DELTA)
        self.p1 = [(self.c1[w] + delta) / (n + delta * n_vocab) for w in range(n_vocab)]

    def _katz(self, total: int, seen: dict[int, int], d: Callable,
              lower: list[Fraction]) -> list[Fraction]:
        if total == 0 or not seen:
            return lower
        disc = {w: d(r) * r / total for w, r in seen.items()}
        beta = 1 - sum(disc.values())
        lower_unseen = 1 - sum(lower[w] for w in seen)
        if lower_unseen == 0:  # nowhere to back off to: rescale the seen ones
            s = sum(disc.values())
            return [disc[w] / s if w in seen else Fraction(0) for w in range(self.v)]
        alpha = beta / lower_unseen
        return [disc[w] if w in seen else alpha * lower[w] for w in range(self.v)]

    def p2(self, b: int) -> list[Fraction]:
        seen = {w: c for (x, w), c in self.c2.items() if x == b}
        return self._katz(self.c1[b], seen, self.d2, self.p1)

    def p3(self, a: int, b: int) -> list[Fraction]:
        seen = {w: c for (x, y, w), c in self.c3.items() if (x, y) == (a, b)}
        return self._katz(self.c2[a, b], seen, self.d3, self.p2(b))

    def probs(self, context: Sequence[int]) -> np.ndarray:
        if len(context) == 0:
            out = self.p1
        elif len(context) == 1:
            out = self.p2(context[-1])
        else:
            out = self.p3(context[-2], context[-1])
        assert sum(out) == 1
        return np.array([float(p) for p in out])


def all_contexts(n_vocab: int) -> list[list[int]]:
    return [[], *([b] for b in range(n_vocab)),
            *([a, b] for a in range(n_vocab) for b in range(n_vocab))]


def chained_argmax(model: KatzTrigram, context: Sequence[int], n: int) -> list[int]:
    ctx = list(context)
    for _ in range(n):
        ctx.append(int(np.argmax(model.probs(ctx))))
    return ctx[len(context):]


# -- corpora --------------------------------------------------------------------------------

ZIPF_CORPUS = random_corpus(np.random.default_rng(3), n_vocab=20, n_tokens=300, n_used=16)
DENSE_CORPUS = [[int(t) for t in np.random.default_rng(3).integers(0, 3, 200)], [0, 0, 0, 1]]
TINY_CORPUS = [[1, 2, 3, 1, 2, 4], [5], [], [2, 3]]
CORPORA = {"zipf": (ZIPF_CORPUS, 20), "dense": (DENSE_CORPUS, 3), "tiny": (TINY_CORPUS, 8)}


@pytest.fixture(scope="module")
def zipf_model() -> KatzTrigram:
    return KatzTrigram.build(ZIPF_CORPUS, 20)


# -- discounts ------------------------------------------------------------------------------


def test_good_turing_discounts_follow_katz_formula() -> None:
    # n_r for r = 0..6; R = 6 n_6 / n_1 = 0.3
    n = np.array([0, 100, 40, 20, 12, 8, 5])
    d = good_turing_discounts(n, k=5)
    assert d[1] == pytest.approx((2 * 40 / 100 - 0.3) / 0.7)  # 5/7
    assert d[2] == pytest.approx((3 * 20 / 80 - 0.3) / 0.7)  # 9/14
    assert d[5] == pytest.approx((6 * 5 / 40 - 0.3) / 0.7)
    assert d[0] == d[6] == 1.0


def test_good_turing_discounts_fall_back_to_one_out_of_range() -> None:
    d = good_turing_discounts(np.array([0, 100, 40, 0, 12, 8, 5]), k=5)
    assert d[2] == 1.0  # n_3 = 0 makes the formula negative
    assert d[3] == 1.0  # n_3 = 0: undefined
    assert 0.0 < d[1] < 1.0 and 0.0 < d[4] < 1.0
    assert np.all(good_turing_discounts(np.array([0, 0, 5, 3]), k=2) == 1.0)  # no singletons
    assert np.all(good_turing_discounts(np.array([0, 10, 5, 8]), k=2) == 1.0)  # R >= 1


def test_built_discounts_lie_in_unit_interval_and_match_reference() -> None:
    corpus = random_corpus(np.random.default_rng(1), n_vocab=300, n_tokens=30_000)
    model = KatzTrigram.build(corpus, 300)
    ref = Reference(corpus, 300)
    for d, d_ref in ((model.discounts2, ref.d2), (model.discounts3, ref.d3)):
        assert np.all((d > 0.0) & (d <= 1.0))
        assert np.any(d < 1.0)  # the corpus is large enough for Katz to discount something
        assert d[0] == d[-1] == 1.0
        np.testing.assert_allclose(d[1:-1], [float(d_ref(r)) for r in range(1, 6)], rtol=1e-12)


# -- probabilities --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CORPORA))
def test_probs_equal_exact_reference(name: str) -> None:
    corpus, n_vocab = CORPORA[name]
    model = KatzTrigram.build(corpus, n_vocab)
    ref = Reference(corpus, n_vocab)
    for context in all_contexts(n_vocab):
        np.testing.assert_allclose(model.probs(context), ref.probs(context), rtol=1e-12,
                                   atol=1e-15, err_msg=f"context {context}")


def test_reference_corpora_exercise_every_case(zipf_model: KatzTrigram) -> None:
    # guards the test above: discounting, backoff and the nowhere-to-back-off case all occur
    assert np.any(zipf_model.discounts2 < 1.0) and np.any(zipf_model.discounts3 < 1.0)
    # S(1) is the whole vocabulary and 1 ends a sequence: its leftover mass has nowhere to go,
    # so the seen probabilities (undiscounted here) are rescaled to c / sum(c) instead of c / T
    dense = KatzTrigram.build(DENSE_CORPUS, 3)
    tokens, counts = dense.bigrams.continuations(1)
    assert tokens.tolist() == [0, 1, 2] and counts.sum() < dense.unigrams[1]
    assert np.all(dense.discounts2 == 1.0)
    np.testing.assert_allclose(dense.probs([1]), counts / counts.sum(), rtol=1e-12)
    # nothing discounted after 2 nor after (1, 2): tokens never seen there get probability 0
    tiny = KatzTrigram.build(TINY_CORPUS, 8)
    assert np.all(tiny.discounts3 == 1.0)  # counts-of-counts too irregular: no discount
    np.testing.assert_array_equal(tiny.probs([1, 2]), [0, 0, 0, 0.5, 0.5, 0, 0, 0])


@pytest.mark.parametrize("context", [[], [3], [5, 9], [0, 1, 2, 3], [17, 18], [19, 19], [2, 19]])
def test_probs_sum_to_one_and_are_positive(zipf_model: KatzTrigram, context: list[int]) -> None:
    # 16 of the 20 ids are used: 17..19 may be unseen (all-unseen contexts back off to P1)
    p = zipf_model.probs(context)
    assert p.shape == (20,) and p.dtype == np.float64
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.all(p >= 0.0)


def test_unseen_context_backs_off_to_smoothed_unigram(zipf_model: KatzTrigram) -> None:
    unseen = [w for w in range(20) if zipf_model.unigrams[w] == 0]
    assert unseen, "the corpus should leave some ids unused"
    p1 = zipf_model.probs([])
    np.testing.assert_array_equal(zipf_model.probs(unseen[:1]), p1)
    np.testing.assert_array_equal(zipf_model.probs([unseen[0], unseen[-1]]), p1)
    assert np.all(p1 > 0.0)
    assert p1[unseen[0]] == pytest.approx(1.0 / (zipf_model.unigrams.sum() + 20))


# -- greedy ---------------------------------------------------------------------------------


def _random_models(seed: int) -> Iterator[tuple[str, KatzTrigram, list[int]]]:
    """(label, model, context) over 40 random corpora, each model queried before and after an
    update with random text."""
    rng = np.random.default_rng(seed)
    for trial in range(40):
        n_vocab = int(rng.integers(2, 26))
        corpus = random_corpus(rng, n_vocab, int(rng.integers(0, 400)),
                               n_used=int(rng.integers(1, n_vocab + 1)))
        model = KatzTrigram.build(corpus, n_vocab, k=int(rng.integers(0, 6)))
        for step in range(2):
            for _ in range(15):
                context = [int(t) for t in rng.integers(0, n_vocab, int(rng.integers(0, 4)))]
                yield f"trial {trial} step {step} context {context}", model, context
            model.update([int(t) for t in rng.integers(0, n_vocab, int(rng.integers(0, 60)))])


def test_greedy_equals_chained_argmax_on_random_corpora() -> None:
    for label, model, context in _random_models(0):
        assert model.greedy(context, 6) == chained_argmax(model, context, 6), label


def _dense_top(model: KatzTrigram, context: list[int], k: int) -> tuple[list[int], np.ndarray]:
    p = model.probs(context)
    order = np.lexsort((np.arange(p.size), -p))[:k]
    order = order[p[order] > 0]
    return order.tolist(), p[order]


def test_top_equals_the_dense_distributions_best_on_random_corpora() -> None:
    for label, model, context in _random_models(1):
        for k in (3, 1, model.n_vocab, 6):  # asked for fewer after more: from the cache
            tokens, probs = model.top(context, k)
            want, want_p = _dense_top(model, context, k)
            assert tokens.tolist() == want, f"{label} k {k}"
            assert np.allclose(probs, want_p, rtol=1e-12, atol=0.0)
    with pytest.raises(ValueError):
        model.top([0], 0)


def test_top_on_the_built_in_model_matches_its_distributions() -> None:
    from models.catalog import BUILTIN_NGRAM
    model = KatzTrigram.load(BUILTIN_NGRAM)
    rng = np.random.default_rng(2)
    contexts = [[], [198], [220, 220], [25, 198], [13, 198], [198, 220], [11, 220]]
    contexts += [[int(t) for t in rng.integers(0, 2000, 2)] for _ in range(20)]
    for context in contexts:
        tokens, probs = model.top(context, 8)
        want, want_p = _dense_top(model, context, 8)
        assert tokens.tolist() == want, context
        assert np.allclose(probs, want_p, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize(("corpus", "context"), [([[0, 1], [0]], [0]), ([[1, 0], [1]], [1])])
def test_greedy_breaks_ties_between_seen_and_unseen_by_smallest_id(
        corpus: Corpus, context: list[int]) -> None:
    # V = 2, no discount: the seen continuation keeps c/T = 1/2 and the sequence-final
    # occurrence leaves 1/2 to the one unseen token: an exact tie across the two groups
    model = KatzTrigram.build(corpus, 2)
    assert model.probs(context).tolist() == [0.5, 0.5]
    assert model.greedy(context, 1) == [0]
    assert model.greedy([*context, 0], 1) == chained_argmax(model, [*context, 0], 1)


def test_greedy_does_not_build_dense_distributions(zipf_model: KatzTrigram,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    expected = [chained_argmax(zipf_model, [a, b], 5) for a in range(20) for b in range(20)]

    def forbidden(*_: object) -> None:
        raise AssertionError("greedy called probs()")

    monkeypatch.setattr(KatzTrigram, "probs", forbidden)
    got = [zipf_model.greedy([a, b], 5) for a in range(20) for b in range(20)]
    assert got == expected
    assert zipf_model.greedy([1, 2], 0) == []


# -- update ---------------------------------------------------------------------------------


def test_update_equals_counting_the_conversation_with_fixed_discounts() -> None:
    rng = np.random.default_rng(5)
    conversation = [int(t) for t in rng.integers(0, 20, 120)]
    model = KatzTrigram.build(ZIPF_CORPUS, 20)
    model.probs([1, 2])  # fill caches that update() must drop
    model.greedy([1, 2], 3)
    model.update(conversation[:70])
    model.update(conversation[70:])
    base = Reference(ZIPF_CORPUS, 20)
    ref = Reference([*ZIPF_CORPUS, conversation[:70], conversation[70:]], 20,
                    discounts=(base.d2, base.d3))
    for context in all_contexts(20)[::3]:
        np.testing.assert_allclose(model.probs(context), ref.probs(context), rtol=1e-12,
                                   atol=1e-15, err_msg=f"context {context}")


def test_update_continued_piecewise_counts_like_one_update() -> None:
    conversation = [int(t) for t in np.random.default_rng(6).integers(0, 20, 50)]
    whole = KatzTrigram.build(ZIPF_CORPUS, 20)
    whole.update(conversation)
    pieces = KatzTrigram.build(ZIPF_CORPUS, 20)
    cuts = [0, 1, 2, 3, 7, 8, 30, 30, 50]
    for start, stop in itertools.pairwise(cuts):
        pieces.update_continued(conversation[:start], conversation[start:stop])
    apart = KatzTrigram.build(ZIPF_CORPUS, 20)
    apart.update(conversation[:25])
    apart.update(conversation[25:])  # two sequences: the n-grams across the cut are lost
    for counts in ("bigrams", "trigrams"):
        for got, want in zip(getattr(pieces, counts).merged(), getattr(whole, counts).merged(),
                             strict=True):
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(pieces.unigrams, whole.unigrams)
    assert apart.trigrams.merged()[1].sum() == whole.trigrams.merged()[1].sum() - 2


def test_update_moves_predictions_toward_the_conversation(zipf_model: KatzTrigram) -> None:
    model = KatzTrigram.build(ZIPF_CORPUS, 20)
    a, b = ZIPF_CORPUS[0][:2]
    before = model.greedy([a, b], 1)[0]
    target = next(w for w in range(20) if w != before and model.unigrams[w] == 0)
    p_before = model.probs([a, b])[target]
    model.update([a, b, target] * 10)
    assert model.greedy([a, b], 1) == [target]
    assert model.probs([a, b])[target] > 10 * p_before
    assert model.probs([a, b]).sum() == pytest.approx(1.0, abs=1e-12)
    assert zipf_model.greedy([a, b], 1) == [before]  # other instances are untouched


def test_small_updates_keep_p1_and_the_answers_of_histories_they_do_not_touch() -> None:
    """A conversation's few tokens leave a large model's P1 as it was (a refresh re-sorts the
    vocabulary and drops every answer: ~12 ms per n-gram tree at GPT-2's vocabulary) and drop
    only the answers of the histories whose counts changed; the model stays one consistent
    distribution. Enough new tokens refresh P1 to the counts exactly."""
    corpus = random_corpus(np.random.default_rng(8), n_vocab=40, n_tokens=20000)
    model = KatzTrigram.build(corpus, 40)
    n = int(model.unigrams.sum())
    p1 = model.probs([]).copy()
    conversation = [7, 8, 9] * 3
    kept = next(b for b in range(40) if b not in (7, 8, 9) and model.unigrams[b] > 0)
    for b in (kept, 8):
        model.top([3, b], 4)
        model.greedy([3, b], 2)
    before = model._tops[kept]
    assert len(conversation) < P1_REFRESH * n
    model.update(conversation)
    np.testing.assert_array_equal(model.probs([]), p1)  # P1 as it was
    assert model._tops.get(kept) is before and kept in model._best
    assert 8 not in model._tops and 8 not in model._best and 8 not in model._levels2
    assert model.greedy([7, 8], 1) == [9]  # the conversation's trigram, counted at once
    for context in [[a, b] for a in range(0, 40, 3) for b in range(40)]:
        p = model.probs(context)
        assert p.sum() == pytest.approx(1.0, abs=1e-12), context
        tokens, probs = model.top(context, 5)
        want_tokens, want_probs = _dense_top(model, context, 5)
        assert tokens.tolist() == want_tokens, context
        np.testing.assert_allclose(probs, want_probs, rtol=1e-12)
        assert model.greedy(context, 3) == chained_argmax(model, context, 3), context
    model.update([int(t) for t in np.random.default_rng(9).integers(0, 40, int(P1_REFRESH * n))])
    counts = model.unigrams
    np.testing.assert_allclose(model.probs([]), (counts + UNIGRAM_DELTA)
                               / (counts.sum() + UNIGRAM_DELTA * 40), rtol=1e-12)


# -- save / load ----------------------------------------------------------------------------


def test_save_load_round_trip_is_exact(tmp_path: Path) -> None:
    model = KatzTrigram.build(ZIPF_CORPUS, 20)
    model.update([19, 18, 17, 19, 18, 3])  # keys only in the overlay must be saved too
    path = tmp_path / "model.bin"  # no .npz suffix added behind our back
    model.save(path)
    loaded = KatzTrigram.load(path)
    for context in all_contexts(20):
        np.testing.assert_array_equal(loaded.probs(context), model.probs(context))
        assert loaded.greedy(context, 4) == model.greedy(context, 4)
    loaded.update([1, 2, 3])
    model.update([1, 2, 3])
    np.testing.assert_array_equal(loaded.probs([1, 2]), model.probs([1, 2]))


def test_save_min_count_prunes_trigrams_and_stays_consistent(tmp_path: Path) -> None:
    corpus = random_corpus(np.random.default_rng(2), n_vocab=40, n_tokens=3000)
    model = KatzTrigram.build(corpus, 40)
    model.save(tmp_path / "full.npz")
    model.save(tmp_path / "pruned.npz", min_count=2)
    pruned = KatzTrigram.load(tmp_path / "pruned.npz")
    assert np.all(pruned.trigrams.counts >= 2)
    assert 0 < pruned.trigrams.keys.size < model.trigrams.keys.size
    np.testing.assert_array_equal(pruned.bigrams.counts, model.bigrams.counts)
    np.testing.assert_array_equal(pruned.discounts3, model.discounts3)
    assert (tmp_path / "pruned.npz").stat().st_size < (tmp_path / "full.npz").stat().st_size
    rng = np.random.default_rng(3)
    for _ in range(100):
        context = [int(t) for t in rng.integers(0, 40, 2)]
        assert pruned.probs(context).sum() == pytest.approx(1.0, abs=1e-12)
        assert pruned.greedy(context, 3) == chained_argmax(pruned, context, 3)


def test_load_rejects_bad_files(tmp_path: Path) -> None:
    model = KatzTrigram.build(ZIPF_CORPUS, 20)
    model.save(tmp_path / "good.npz")
    with np.load(tmp_path / "good.npz") as z:
        arrays = dict(z)
    arrays["trigram_c"] = arrays["trigram_c"].copy()
    arrays["trigram_c"][0] = 20
    np.savez(tmp_path / "bad_id.npz", **arrays)
    with pytest.raises(ValueError, match=r"trigram_c must hold token ids in \[0, 20\)"):
        KatzTrigram.load(tmp_path / "bad_id.npz")
    arrays = dict(np.load(tmp_path / "good.npz"))
    arrays["trigram_count"] = arrays["trigram_count"] * 1000
    np.savez(tmp_path / "bad_count.npz", **arrays)
    with pytest.raises(ValueError, match="exceed their history's count"):
        KatzTrigram.load(tmp_path / "bad_count.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a trigram model"):
        KatzTrigram.load(tmp_path / "other.npz")


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [20, -1])
def test_out_of_range_token_ids_raise(zipf_model: KatzTrigram, bad: int) -> None:
    message = rf"token id {bad} out of range \[0, 20\)"
    with pytest.raises(ValueError, match=message):
        KatzTrigram.build([[1, 2], [3, bad, 4]], 20)
    before = zipf_model.probs([1, 2])
    with pytest.raises(ValueError, match=message):
        zipf_model.update([1, 2, bad])
    np.testing.assert_array_equal(zipf_model.probs([1, 2]), before)  # nothing half-added
    with pytest.raises(ValueError, match=message):
        zipf_model.probs([1, bad])
    with pytest.raises(ValueError, match=message):
        zipf_model.greedy([bad], 3)


def test_other_bad_arguments_raise(zipf_model: KatzTrigram, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n_vocab"):
        KatzTrigram.build([[0]], 0)
    with pytest.raises(ValueError, match="k must be"):
        KatzTrigram.build([[0]], 5, k=-1)
    with pytest.raises(TypeError, match="integer token ids"):
        KatzTrigram.build([[0.5, 1.0]], 5)
    with pytest.raises(TypeError):
        zipf_model.greedy([1.0], 2)
    with pytest.raises(ValueError, match="n must be"):
        zipf_model.greedy([1], -1)
    with pytest.raises(ValueError, match="min_count"):
        zipf_model.save(tmp_path / "m.npz", min_count=0)
