"""Katz-backoff trigram model over token ids: stage 2 of staged speculative decoding.

Spector & Ré (2023) speed up the draft model itself with an even cheaper guesser. Ours is a
trigram model counted once over a corpus (the Python standard library source) and updated with
the conversation; it only proposes tokens that a real model then checks, so it has to be cheap
rather than good: `KatzTrigram.greedy` answers from per-context caches without dense vectors.

Definitions (V = n_vocab, c(.) = n-gram counts, d_r = `good_turing_discounts` with threshold k):

- Unigram, add-delta smoothed (delta = `UNIGRAM_DELTA`) so that every token has P1 > 0:
  ``P1(w) = (c(w) + delta) / (N + delta * V)``, ``N = sum_w c(w)``, with the unigram counts as
  of the last refresh: updates (the conversation) refresh P1 once the tokens added since reach
  ``P1_REFRESH`` of N. Every level above reads P1, so a refresh drops every cached answer and
  re-sorts the vocabulary (the trees after it compute their nodes' answers afresh); between
  refreshes an update drops only the answers of the histories it changed. A
  model counted over a large corpus never refreshes within a conversation (whose tokens would
  barely move P1); small models refresh at every update, exactly.
- A history ``h`` is ``b`` (bigram level) or ``(a, b)`` (trigram level); ``h'`` drops its first
  token (``b -> ()``, ``(a, b) -> b``) and ``P_lower`` is the level below (P1, resp. P2).
  ``T(h) = c(h)`` is the count of the history itself (the textbook relative frequency
  ``c(h w) / c(h)``); ``S(h) = {w : c(h w) > 0}`` are its seen continuations.
- ``P(w | h) = d(c(hw)) * c(hw) / T(h)``           for w in S(h),
  ``P(w | h) = alpha(h) * P_lower(w | h')``         otherwise, where
  ``beta(h) = 1 - sum_{w in S(h)} d(c(hw)) c(hw) / T(h)`` is the mass left over (computed as
  ``[sum (1 - d) c + (T(h) - sum c)] / T(h)`` so that it is exactly 0 when nothing is left;
  occurrences of h at the end of a sequence have no continuation and their share is in beta),
  ``M(h) = sum_{w not in S(h)} P_lower(w | h')`` is what the lower level gives the unseen, and
  ``alpha(h) = beta(h) / M(h)``.
- If ``M(h) = 0`` (the lower level puts all its mass on S(h), e.g. S(b) is the whole
  vocabulary), there is nowhere to back off to: as in SRILM, the seen probabilities are rescaled
  to ``d c / sum_{S(h)} d c`` and ``alpha(h) = 0``.
- If ``T(h) = 0`` or ``S(h)`` is empty, ``P(. | h) = P_lower(. | h')``.

Every probability is computed by exactly one expression, shared by `probs` and `greedy`, so the
greedy token is the argmax of `probs`, ties going to the smallest token id. (Caveat: within one
group of candidates, say the tokens backed off to P2, greedy picks the best P2 before the common
factor alpha is applied; if alpha rounded two P2 values less than an ulp apart to the same double,
`probs` would break that tie by id. N-gram probabilities are ratios of counts and never that
close.)
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

UNIGRAM_DELTA = 1.0  # add-one: the unigram level must give every token some mass
MAX_VOCAB = 1 << 21  # trigram keys (a * V + b) * V + c must fit in an int64
_CACHE_LIMIT = 200_000  # per-context cache entries before the caches are dropped
P1_REFRESH = 1e-3  # refresh P1 once the tokens added since reach this share of its N
_FORMAT = 1  # version of the .npz layout written by `save`, whose arrays are:
_ARRAYS = ("format", "n_vocab", "k", "discounts2", "discounts3", "unigrams", "bigram_a",
           "bigram_b", "bigram_count", "trigram_a", "trigram_b", "trigram_c", "trigram_count")


def good_turing_discounts(counts_of_counts: np.ndarray, k: int) -> np.ndarray:
    """Katz's discount ratios: ``d[r]`` multiplies an n-gram count r, for r = 0 .. k + 1.

    ``counts_of_counts[r] = n_r``, the number of distinct n-grams seen exactly r times (entries
    up to index k + 1 are read, missing ones count as 0). For 1 <= r <= k, with
    ``r* = (r + 1) n_{r+1} / n_r`` (Good-Turing) and ``R = (k + 1) n_{k+1} / n_1``::

        d_r = (r* / r - R) / (1 - R)

    and ``d_r = 1`` for r > k (large counts are reliable). ``d[0]`` is unused (1) and ``d[k + 1]``
    stands for every r > k. Where the formula is undefined or leaves (0, 1] (n_1 = 0, n_r = 0,
    R >= 1, or r* > r: counts-of-counts too irregular, as in tiny corpora) d_r = 1, SRILM's rule.
    """
    n = np.zeros(k + 2, dtype=np.float64)
    m = min(k + 2, len(counts_of_counts))
    n[:m] = counts_of_counts[:m]
    d = np.ones(k + 2, dtype=np.float64)
    if k < 1 or n[1] == 0:
        return d
    big_r = (k + 1) * n[k + 1] / n[1]
    if big_r >= 1.0:
        return d
    for r in range(1, k + 1):
        if n[r] == 0:
            continue
        ratio = (r + 1) * n[r + 1] / (r * n[r])  # r* / r
        d_r = (ratio - big_r) / (1.0 - big_r)
        if 0.0 < d_r <= 1.0:
            d[r] = d_r
    return d


def _token(x: object, n_vocab: int) -> int:
    t = operator.index(x)  # rejects floats instead of truncating them
    if not 0 <= t < n_vocab:
        raise ValueError(f"token id {t} out of range [0, {n_vocab})")
    return t


def _as_tokens(seq: Sequence[int], n_vocab: int) -> np.ndarray:
    """``seq`` as an int64 array, every id checked to lie in [0, n_vocab)."""
    arr = np.asarray(seq)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"expected integer token ids, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= n_vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} out of range [0, {n_vocab})")
    return arr.astype(np.int64, copy=False)


def _column(z: np.lib.npyio.NpzFile, name: str, n_vocab: int, path: str | Path) -> np.ndarray:
    """Token column ``name`` of a saved model as int64, every id checked against n_vocab."""
    col = z[name]
    if col.ndim != 1 or col.dtype.kind != "u" or (col.size and int(col.max()) >= n_vocab):
        raise ValueError(f"{path}: {name} must hold token ids in [0, {n_vocab})")
    return col.astype(np.int64)


def _ngram_keys(arr: np.ndarray, n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Bigram keys ``a * V + b`` and trigram keys ``(a * V + b) * V + c`` of one sequence."""
    bigrams = arr[:-1] * n_vocab + arr[1:]
    trigrams = bigrams[:-1] * n_vocab + arr[2:]
    return bigrams, trigrams


@dataclasses.dataclass(eq=False)
class NgramCounts:
    """Counts of the n-grams ``context + (token,)`` of one order, keyed ``context * V + token``.

    Built once as sorted arrays. `add` increments keys already there in place and keeps new keys
    in a small dict by context: a conversation adds thousands of n-grams, and re-sorting millions
    of keys on every update would cost tens of milliseconds.
    """

    n_vocab: int
    keys: np.ndarray  # (n,) int64, strictly increasing
    counts: np.ndarray  # (n,) int64, > 0
    # context -> token -> count, for keys added by `add` that are not in `keys`
    extra: dict[int, dict[int, int]] = dataclasses.field(default_factory=dict)

    def count(self, key: int) -> int:
        """c(key), 0 if unseen."""
        i = int(np.searchsorted(self.keys, key))
        if i < self.keys.size and self.keys[i] == key:
            return int(self.counts[i])
        ctx, tok = divmod(key, self.n_vocab)
        return self.extra.get(ctx, {}).get(tok, 0)

    def continuations(self, context: int) -> tuple[np.ndarray, np.ndarray]:
        """The tokens seen after ``context`` (ascending ids, int64) and their counts."""
        lo = context * self.n_vocab
        i, j = np.searchsorted(self.keys, (lo, lo + self.n_vocab))
        tokens, counts = self.keys[i:j] - lo, self.counts[i:j]
        more = self.extra.get(context)
        if more:  # tokens not in the base slice: insert them in order
            new = np.array(sorted(more.items()), dtype=np.int64)  # (m, 2) token, count
            at = np.searchsorted(tokens, new[:, 0])
            tokens, counts = np.insert(tokens, at, new[:, 0]), np.insert(counts, at, new[:, 1])
        return tokens, counts

    def add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """c(key) += count for each (strictly increasing) key."""
        pos = np.searchsorted(self.keys, keys)
        found = pos < self.keys.size
        found[found] = self.keys[pos[found]] == keys[found]
        self.counts[pos[found]] += counts[found]
        for key, c in zip(keys[~found].tolist(), counts[~found].tolist(), strict=True):
            ctx, tok = divmod(key, self.n_vocab)
            by_token = self.extra.setdefault(ctx, {})
            by_token[tok] = by_token.get(tok, 0) + c

    def merged(self) -> tuple[np.ndarray, np.ndarray]:
        """All keys (strictly increasing) and their counts, base and added ones together."""
        if not self.extra:
            return self.keys, self.counts
        new = [(ctx * self.n_vocab + tok, c)
               for ctx, by_token in self.extra.items() for tok, c in by_token.items()]
        keys = np.concatenate([self.keys, np.array([k for k, _ in new], dtype=np.int64)])
        counts = np.concatenate([self.counts, np.array([c for _, c in new], dtype=np.int64)])
        order = np.argsort(keys, kind="stable")
        return keys[order], counts[order]


def _count_ngrams(sequences: Iterable[Sequence[int]], n_vocab: int,
                  ) -> tuple[np.ndarray, NgramCounts, NgramCounts]:
    """Unigram counts (V,) and the bigram and trigram counts of ``sequences``."""
    unigrams = np.zeros(n_vocab, dtype=np.int64)
    bigram_keys: list[np.ndarray] = []
    trigram_keys: list[np.ndarray] = []
    for seq in sequences:
        arr = _as_tokens(seq, n_vocab)
        unigrams += np.bincount(arr, minlength=n_vocab)
        bigrams, trigrams = _ngram_keys(arr, n_vocab)
        bigram_keys.append(bigrams)
        trigram_keys.append(trigrams)
    orders = []
    for parts in (bigram_keys, trigram_keys):
        keys = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        unique, counts = np.unique(keys, return_counts=True)
        orders.append(NgramCounts(n_vocab, unique, counts.astype(np.int64)))
    return unigrams, orders[0], orders[1]


@dataclasses.dataclass(slots=True, frozen=True)
class _Level:
    """P(. | h) of one history, as the seen part plus the weight on the level below."""

    tokens: np.ndarray  # (m,) S(h), ascending ids
    probs: np.ndarray  # (m,) P(w | h) for w in S(h)
    alpha: float  # alpha(h); 1.0 when h backs off entirely (T(h) = 0 or S(h) empty)
    rest: float  # alpha(h) * M(h): the mass P(. | h) puts outside S(h)


_BACKOFF = _Level(np.zeros(0, np.int64), np.zeros(0, np.float64), 1.0, 1.0)


def _make_level(tokens: np.ndarray, counts: np.ndarray, total: int, discounts: np.ndarray,
                lower_mass: float) -> _Level:
    """The Katz level of a history with continuations ``tokens``/``counts`` and T(h) = ``total``.

    ``lower_mass`` is M(h) and must be exactly 0.0 when the lower level has no mass outside S(h).
    """
    d = discounts[np.minimum(counts, discounts.size - 1)]
    kept = d * counts  # d_r * r
    beta = (float(np.sum((1.0 - d) * counts)) + float(total - counts.sum())) / total
    if lower_mass > 0.0:
        alpha = beta / lower_mass
        return _Level(tokens, kept / total, alpha, alpha * lower_mass)
    return _Level(tokens, kept / kept.sum(), 0.0, 0.0)  # nowhere to back off to


def _pick(best: tuple[int, float], token: int, value: float) -> tuple[int, float]:
    """The better of two (token, probability) candidates: higher probability, then smaller id."""
    if value > best[1] or (value == best[1] and token < best[0]):
        return token, value
    return best


@dataclasses.dataclass(eq=False)
class KatzTrigram:
    """Katz-backoff trigram model over token ids in [0, n_vocab); see the module docstring.

    Make one with `build` or `load`. Per-history levels and greedy answers are cached, by the
    history's last token ``b`` (every answer for a history ``(a, b)`` reads the level of ``b``);
    `update` drops the answers of the histories whose counts it changed, or all of them when it
    refreshes P1 (see the module docstring), and the first query of such a history costs
    O(|S(b)| + V) numpy work again.
    """

    n_vocab: int
    k: int  # counts 1..k are discounted
    discounts2: np.ndarray  # (k + 2,) d_r of bigrams, index r (k + 1 stands for r > k)
    discounts3: np.ndarray  # (k + 2,) d_r of trigrams
    unigrams: np.ndarray = dataclasses.field(repr=False)  # (V,) int64 c(w)
    bigrams: NgramCounts = dataclasses.field(repr=False)
    trigrams: NgramCounts = dataclasses.field(repr=False)
    _levels2: dict[int, _Level] = dataclasses.field(default_factory=dict, init=False, repr=False)
    # caches of answers by history (a, b), stored as [b][a] (see _drop); a, b = -1: no token
    _levels3: dict[int, dict[int, _Level]] = dataclasses.field(
        default_factory=dict, init=False, repr=False)
    _best: dict[int, dict[int, int]] = dataclasses.field(
        default_factory=dict, init=False, repr=False)  # argmax
    _outside: dict[int, int] = dataclasses.field(default_factory=dict, init=False, repr=False)
    # (k asked, tokens, probs) of the most likely next tokens (``top``)
    _tops: dict[int, dict[int, tuple[int, np.ndarray, np.ndarray]]] = dataclasses.field(
        default_factory=dict, init=False, repr=False)
    _order: np.ndarray | None = dataclasses.field(default=None, init=False, repr=False)  # by P1
    _p1: np.ndarray | None = dataclasses.field(default=None, init=False, repr=False)  # (V,) P1
    _n_tokens: int = dataclasses.field(default=0, init=False, repr=False)  # N, set with _p1
    _p1_counts: np.ndarray | None = dataclasses.field(default=None, init=False, repr=False)
    _added: int = dataclasses.field(default=0, init=False, repr=False)  # tokens since P1 was set

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], n_vocab: int, k: int = 5) -> KatzTrigram:
        """Count unigrams, bigrams and trigrams of each sequence and fix the discounts.

        N-grams do not cross sequence boundaries. The bigram and trigram discount ratios
        d_r (1 <= r <= k; r > k: no discount) come from each order's counts-of-counts by
        `good_turing_discounts`. Token ids must lie in [0, n_vocab) (ValueError otherwise).
        """
        if not 1 <= n_vocab <= MAX_VOCAB:
            raise ValueError(f"n_vocab must be in [1, {MAX_VOCAB}], got {n_vocab}")
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        t0 = time.perf_counter()
        unigrams, bigrams, trigrams = _count_ngrams(sequences, n_vocab)
        d2 = good_turing_discounts(np.bincount(bigrams.counts, minlength=k + 2), k)
        d3 = good_turing_discounts(np.bincount(trigrams.counts, minlength=k + 2), k)
        log.info("trigram model: %d tokens, %d bigrams, %d trigrams in %.1f s",
                 unigrams.sum(), bigrams.keys.size, trigrams.keys.size, time.perf_counter() - t0)
        return cls(n_vocab, k, d2, d3, unigrams, bigrams, trigrams)

    def update(self, tokens: Sequence[int]) -> None:
        """Add the unigrams, bigrams and trigrams of ``tokens``, as one more sequence.

        N-grams do not cross calls (see `update_continued` to feed a conversation piecewise).
        The discount ratios d_r stay those fixed at build time, an approximation: strictly they
        follow the counts-of-counts, but a conversation of thousands of tokens barely moves
        counts-of-counts over millions of n-grams, and recomputing them would change every
        history's probabilities at each update. Every alpha is recomputed (lazily, on the next
        query), so `probs` still sums to 1.
        """
        self.update_continued((), tokens)

    def update_continued(self, previous: Sequence[int], tokens: Sequence[int]) -> None:
        """`update` with ``tokens`` continuing ``previous``, tokens already added.

        Adds the unigrams of ``tokens`` and every bigram and trigram of ``previous + tokens``
        that ends inside ``tokens``, so ``update_continued(x, y)`` after ``update(x)`` counts
        exactly what ``update(x + y)`` counts. Only the last two tokens of ``previous`` are read.
        """
        before = np.array(self._last_two(previous), dtype=np.int64)
        before = before[before >= 0]
        arr = _as_tokens(tokens, self.n_vocab)  # validate everything before changing anything
        if arr.size == 0:
            return
        np.add.at(self.unigrams, arr, 1)
        bigrams, trigrams = _ngram_keys(np.concatenate([before, arr]), self.n_vocab)
        skip = max(before.size - 1, 0)  # bigrams that end inside `previous`
        for counts, keys in ((self.bigrams, bigrams[skip:]), (self.trigrams, trigrams)):
            unique, n = np.unique(keys, return_counts=True)
            counts.add(unique, n.astype(np.int64))
        self._added += int(arr.size)
        if self._p1 is None or self._added >= P1_REFRESH * self._n_tokens:
            self._invalidate()
        else:
            # the histories whose counts changed: b = the last token before and each new token
            # (T(b) and S(b)), and every (a, b) with such a b (T(a, b), S(a, b) and level2(b))
            self._drop({*before[-1:].tolist(), *arr.tolist()})

    def probs(self, context: Sequence[int]) -> np.ndarray:
        """P(next | last two tokens of ``context``): float64 (n_vocab,), sums to 1.

        Only the last two tokens are read (and checked); shorter contexts back off to the bigram
        (one token) or unigram (none) level.
        """
        a, b = self._last_two(context)
        if b < 0:
            return self._unigram_probs().copy()
        level2 = self._level2(b)
        out = level2.alpha * self._unigram_probs()  # (V,)
        out[level2.tokens] = level2.probs
        if a < 0:
            return out
        level3 = self._level3(a, b)
        out *= level3.alpha
        out[level3.tokens] = level3.probs
        return out

    def greedy(self, context: Sequence[int], n: int) -> list[int]:
        """The n most likely next tokens, chained: each is argmax `probs` of the ones before.

        Ties go to the smallest token id. Answers come from a per-history cache; a miss
        costs O(|S(b)| + V) numpy work and never builds the distribution.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        a, b = self._last_two(context)
        out: list[int] = []
        best = self._best
        for _ in range(n):
            token = best.get(b, {}).get(a)
            if token is None:
                token = self._argmax(a, b)
            out.append(token)
            a, b = b, token
        return out

    def top(self, context: Sequence[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` most likely next tokens, most likely first (ties to the smaller id), and
        their probabilities: exactly ``probs(context)``'s, from the seen continuations and the
        unigram order, without the dense vector (a greedy tree's node needs only these).
        Fewer than ``k`` when fewer tokens have any probability.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        a, b = self._last_two(context)
        hit = self._tops.get(b, {}).get(a)
        if hit is not None and hit[0] >= k:
            return hit[1][:k], hit[2][:k]
        self.warm()
        p1 = self._unigram_probs()
        assert self._order is not None
        if b < 0:
            tokens = self._order[:k]
            probs = p1[tokens]
        else:
            level2 = self._level2(b)
            level3 = self._level3(a, b) if a >= 0 else _BACKOFF
            parts = [(level3.tokens, level3.probs)]
            if level3.alpha > 0.0:
                # seen after b, not after (a, b); S(a, b) lies inside S(b)
                mask = self._not_in(level2.tokens, level3.tokens)
                parts.append((level2.tokens[mask], level3.alpha * level2.probs[mask]))
                if level2.alpha > 0.0:
                    # unseen after b: P1's order, the first k outside S(b) and S(a, b)
                    seen = np.zeros(self.n_vocab, dtype=bool)
                    seen[level2.tokens] = True
                    seen[level3.tokens] = True
                    head = self._order[:k + level2.tokens.size + level3.tokens.size]
                    head = head[~seen[head]][:k]
                    parts.append((head, (level2.alpha * p1[head]) * level3.alpha))  # as probs
            tokens = np.concatenate([t for t, _ in parts]).astype(np.int64)
            probs = np.concatenate([p for _, p in parts])
            if tokens.size > 2 * k:  # S(b) can hold thousands: sort only those that can win
                kth = np.partition(probs, tokens.size - k)[tokens.size - k]  # k-th largest
                keep = probs >= kth  # ties at the k-th value all stay (then ids decide)
                tokens, probs = tokens[keep], probs[keep]
            best = np.lexsort((tokens, -probs))[:k]
            best = best[probs[best] > 0.0]
            tokens, probs = tokens[best], probs[best]
        self._store2(self._tops, a, b, (k, tokens, probs))
        return tokens, probs

    def save(self, path: str | Path, min_count: int = 1) -> None:
        """Write the counts and discounts to a compressed ``.npz`` (no pickle).

        Token columns are uint16 when n_vocab <= 65536 (else uint32), counts uint32, discounts
        float64. ``min_count > 1`` drops trigrams seen fewer times: their mass then goes to the
        backoff (T(a, b) is the bigram count, which is kept), the saved discounts stay those of
        the full counts, and the file shrinks several-fold since most trigrams are singletons.
        """
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        tok = np.uint16 if self.n_vocab <= 1 << 16 else np.uint32
        if int(self.unigrams.max(initial=0)) >= 1 << 32:
            raise ValueError("counts of 2**32 or more do not fit the .npz format")
        keys2, counts2 = self.bigrams.merged()
        keys3, counts3 = self.trigrams.merged()
        keep = counts3 >= min_count
        keys3, counts3 = keys3[keep], counts3[keep]
        v = self.n_vocab
        with open(path, "wb") as f:
            np.savez_compressed(
                f, format=np.array([_FORMAT], np.uint32), n_vocab=np.array([v], np.uint32),
                k=np.array([self.k], np.uint32), discounts2=self.discounts2,
                discounts3=self.discounts3, unigrams=self.unigrams.astype(np.uint32),
                bigram_a=(keys2 // v).astype(tok), bigram_b=(keys2 % v).astype(tok),
                bigram_count=counts2.astype(np.uint32),
                trigram_a=(keys3 // (v * v)).astype(tok), trigram_b=(keys3 // v % v).astype(tok),
                trigram_c=(keys3 % v).astype(tok), trigram_count=counts3.astype(np.uint32))

    @classmethod
    def load(cls, path: str | Path) -> KatzTrigram:
        """Read a model written by `save`; ValueError if the file is not a consistent one."""
        with np.load(path, allow_pickle=False) as z:
            if not set(_ARRAYS) <= set(z.files) or int(z["format"][0]) != _FORMAT:
                raise ValueError(f"{path}: not a trigram model of format {_FORMAT}")
            v, k = int(z["n_vocab"][0]), int(z["k"][0])
            a2, b2 = (_column(z, name, v, path) for name in ("bigram_a", "bigram_b"))
            a3, b3, c3 = (_column(z, name, v, path)
                          for name in ("trigram_a", "trigram_b", "trigram_c"))
            model = cls(v, k, z["discounts2"].astype(np.float64),
                        z["discounts3"].astype(np.float64), z["unigrams"].astype(np.int64),
                        NgramCounts(v, a2 * v + b2, z["bigram_count"].astype(np.int64)),
                        NgramCounts(v, (a3 * v + b3) * v + c3,
                                    z["trigram_count"].astype(np.int64)))
        model._check(path)
        return model

    @staticmethod
    def vocabulary_size(path: str | Path) -> int:
        """The number of token ids a model written by `save` covers (reads only that field);
        ValueError if the file is not such a model."""
        try:
            with np.load(path, allow_pickle=False) as z:
                if "format" not in z.files or int(z["format"][0]) != _FORMAT:
                    raise ValueError(f"{path}: not a trigram model of format {_FORMAT}")
                return int(z["n_vocab"][0])
        except (OSError, KeyError, IndexError) as exc:
            raise ValueError(f"{path}: not a readable trigram model ({exc})") from None

    def warm(self) -> None:
        """Compute P1 and the vocabulary's order by it now (a sort of the vocabulary) rather than
        at the first query, which a generation step would pay for."""
        self._unigram_probs()
        if self._order is None:
            self._order = np.lexsort((np.arange(self.n_vocab), -self._p1_counts))

    # -- levels -------------------------------------------------------------------------------

    def _invalidate(self) -> None:
        """Drop every cached answer and P1 (its next use takes the counts as they are now)."""
        self._levels2.clear()
        self._levels3.clear()
        self._best.clear()
        self._outside.clear()
        self._tops.clear()
        self._order = None
        self._p1 = None
        self._p1_counts = None

    def _drop(self, histories: set[int]) -> None:
        """Drop the cached answers of the histories ``b`` and ``(a, b)`` for b in ``histories``."""
        for b in histories:
            for cache in (self._levels2, self._levels3, self._best, self._outside, self._tops):
                cache.pop(b, None)

    def _last_two(self, context: Sequence[int]) -> tuple[int, int]:
        """The last two tokens of ``context``, -1 where it is shorter."""
        padded = [-1, -1, *(_token(x, self.n_vocab) for x in context[-2:])]
        return padded[-2], padded[-1]

    def _unigram_probs(self) -> np.ndarray:
        if self._p1 is None:
            self._p1_counts = self.unigrams.copy()
            self._n_tokens = int(self._p1_counts.sum())
            norm = self._n_tokens + UNIGRAM_DELTA * self.n_vocab
            self._p1 = (self._p1_counts + UNIGRAM_DELTA) / norm
            self._added = 0
        return self._p1

    def _level2(self, b: int) -> _Level:
        level = self._levels2.get(b)
        if level is None:
            tokens, counts = self.bigrams.continuations(b)
            if tokens.size == 0:
                level = _BACKOFF
            else:
                # M(b) = P1 mass outside S(b), from integers so that it is exactly 0 when S(b) = V
                self._unigram_probs()  # sets _n_tokens = N and the counts P1 was made from
                assert self._p1_counts is not None
                n_out = self._n_tokens - int(self._p1_counts[tokens].sum())
                v = self.n_vocab
                lower_mass = ((n_out + UNIGRAM_DELTA * (v - tokens.size))
                              / (self._n_tokens + UNIGRAM_DELTA * v))
                level = _make_level(tokens, counts, int(self.unigrams[b]), self.discounts2,
                                    lower_mass)
            self._store(self._levels2, b, level)
        return level

    def _level3(self, a: int, b: int) -> _Level:
        level = self._levels3.get(b, {}).get(a)
        if level is None:
            tokens, counts = self.trigrams.continuations(a * self.n_vocab + b)
            if tokens.size == 0:
                level = _BACKOFF
            else:
                # M(a, b) = P2 mass outside S(a, b), which lies inside S(b): a sum of positive
                # terms, exactly 0 when nothing is outside
                level2 = self._level2(b)
                lower_mass = float(level2.probs[self._not_in(level2.tokens, tokens)].sum())
                lower_mass += level2.rest
                level = _make_level(tokens, counts, self.bigrams.count(a * self.n_vocab + b),
                                    self.discounts3, lower_mass)
            self._store2(self._levels3, a, b, level)
        return level

    def _not_in(self, tokens: np.ndarray, excluded: np.ndarray) -> np.ndarray:
        """Mask of ``tokens`` not in ``excluded``."""
        mask = np.zeros(self.n_vocab, dtype=bool)
        mask[excluded] = True
        return ~mask[tokens]

    def _store(self, cache: dict, key: object, value: object) -> None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()  # bounded memory over a long session; hits refill it quickly
        cache[key] = value

    def _store2(self, cache: dict[int, dict], a: int, b: int, value: object) -> None:
        """``_store`` for a cache of histories (a, b), kept as [b][a]."""
        inner = cache.get(b)
        if inner is None:
            if len(cache) >= _CACHE_LIMIT // 4:
                cache.clear()
            inner = cache[b] = {}
        elif len(inner) >= _CACHE_LIMIT // 4:
            inner.clear()
        inner[a] = value

    # -- greedy -------------------------------------------------------------------------------

    def _argmax(self, a: int, b: int) -> int:
        """argmax_c P(c | a, b) without the dense vector (a, b = -1 when absent)."""
        p1 = self._unigram_probs()
        if b < 0:
            token = int(np.argmax(p1))
            self._store2(self._best, a, b, token)
            return token
        level2 = self._level2(b)
        level3 = self._level3(a, b) if a >= 0 else _BACKOFF
        best = (-1, -np.inf)
        if level3.tokens.size:  # seen after (a, b): the first maximum has the smallest id
            i = int(np.argmax(level3.probs))
            best = (int(level3.tokens[i]), level3.probs[i])
        if level3.alpha > 0.0:  # unseen after (a, b) but seen after b: alpha3 * P2
            probs2 = np.where(self._not_in(level2.tokens, level3.tokens), level2.probs, -1.0)
            if probs2.size and probs2.max() > 0.0:
                j = int(np.argmax(probs2))
                best = _pick(best, int(level2.tokens[j]), level3.alpha * level2.probs[j])
            if level2.alpha > 0.0 and level2.tokens.size < self.n_vocab:  # unseen after b
                u = self._best_outside(b, level2.tokens)
                best = _pick(best, u, level3.alpha * (level2.alpha * p1[u]))
        self._store2(self._best, a, b, best[0])
        return best[0]

    def _best_outside(self, b: int, seen: np.ndarray) -> int:
        """argmax of P1 over tokens not in ``seen`` = S(b): most counted, then smallest id."""
        u = self._outside.get(b)
        if u is None:
            self._unigram_probs()  # P1's counts
            assert self._p1_counts is not None
            counts = self._p1_counts.copy()
            counts[seen] = -1
            u = int(np.argmax(counts))
            self._store(self._outside, b, u)
        return u

    # -- loading ------------------------------------------------------------------------------

    def _check(self, path: str | Path) -> None:
        """Raise ValueError unless the counts nest as counting guarantees (greedy relies on it)."""
        v, k = self.n_vocab, self.k
        if not 1 <= v <= MAX_VOCAB or self.unigrams.shape != (v,):
            raise ValueError(f"{path}: unigram counts do not match n_vocab = {v}")
        for name, d in (("discounts2", self.discounts2), ("discounts3", self.discounts3)):
            if d.shape != (k + 2,) or not np.all((d > 0.0) & (d <= 1.0)):
                raise ValueError(f"{path}: {name} must be k + 2 ratios in (0, 1]")
        for name, counts, parents in (
            ("bigram", self.bigrams, self.unigrams),
            ("trigram", self.trigrams, self.bigrams),
        ):
            keys, c = counts.keys, counts.counts
            if keys.shape != c.shape or np.any(c <= 0) or np.any(np.diff(keys) <= 0):
                raise ValueError(f"{path}: {name} keys must be strictly increasing with counts > 0")
            self._check_nested(path, name, keys, c, parents)

    def _check_nested(self, path: str | Path, name: str, keys: np.ndarray, counts: np.ndarray,
                      parents: np.ndarray | NgramCounts) -> None:
        """Each history's continuations sum to at most its count; suffixes are seen bigrams."""
        if keys.size == 0:
            return
        history = keys // self.n_vocab
        starts = np.flatnonzero(np.r_[True, history[1:] != history[:-1]])
        sums = np.add.reduceat(counts, starts)
        if isinstance(parents, NgramCounts):
            totals = self._lookup(path, parents, history[starts])
            self._lookup(path, parents, keys % (self.n_vocab * self.n_vocab))
        else:
            totals = parents[history[starts]]
        if np.any(sums > totals):
            raise ValueError(f"{path}: {name} counts exceed their history's count")

    @staticmethod
    def _lookup(path: str | Path, bigrams: NgramCounts, keys: np.ndarray) -> np.ndarray:
        """Counts of bigram ``keys``, which must all have been seen."""
        pos = np.searchsorted(bigrams.keys, keys).clip(max=max(bigrams.keys.size - 1, 0))
        if bigrams.keys.size == 0 or np.any(bigrams.keys[pos] != keys):
            raise ValueError(f"{path}: a trigram contains an unseen bigram")
        return bigrams.counts[pos]
