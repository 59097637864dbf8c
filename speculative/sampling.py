"""Turning logits into the distributions that drafting and verification compare.

The same ``distribution`` is applied to draft and target logits: speculative sampling is exact
for the *processed* target distribution (temperature, then top-k, then top-p), so both sides must
be processed identically.
"""

from __future__ import annotations

import dataclasses

import numpy as np

DRY_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's default sequence breakers


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampler chain, in the order it runs (``speculative.penalties`` for the first three):

    repetition penalty, presence and frequency penalties, DRY (each over the text so far),
    min-p, temperature, top-k, top-p. Every setting has an off value (its default here).
    """

    temperature: float = 0.0  # 0 means greedy: the output is the target's argmax, token for token
    top_k: int = 0            # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0        # keep the smallest set whose mass reaches top_p; 1 keeps all
    seed: int | None = None   # same seed, same settings, same models: same output
    min_p: float = 0.0        # drop tokens less likely than min_p times the most likely; 0: off
    # CTRL's repetition penalty on the tokens of the last repeat_last_n: a positive logit is
    # divided by it, a negative one multiplied; 1: off
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64   # the window of the three penalties on single tokens
    presence_penalty: float = 0.0   # subtracted from the logit of a token in the window; 0: off
    frequency_penalty: float = 0.0  # ... times the token's count in the window; 0: off
    # DRY ("don't repeat yourself"): a token that would extend a repeat of an earlier sequence
    # of n >= dry_allowed_length tokens loses dry_multiplier * dry_base ** (n -
    # dry_allowed_length) from its logit; sequences do not run across a breaker; 0: off
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_last_n: int = 0       # tokens of the text DRY looks back over; 0: all of it
    dry_breakers: tuple[str, ...] = DRY_BREAKERS

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < 0 or self.dry_last_n < 0:
            raise ValueError("repeat_last_n and dry_last_n must be >= 0")
        if self.dry_multiplier < 0:
            raise ValueError(f"dry_multiplier must be >= 0, got {self.dry_multiplier}")
        if self.dry_base < 1.0:
            raise ValueError(f"dry_base must be >= 1, got {self.dry_base}")
        if self.dry_allowed_length < 1:
            raise ValueError(f"dry_allowed_length must be >= 1, got {self.dry_allowed_length}")
        if isinstance(self.dry_breakers, str) or not all(
                isinstance(b, str) and b for b in self.dry_breakers):
            raise ValueError("dry_breakers must be a sequence of non-empty strings")
        object.__setattr__(self, "dry_breakers", tuple(self.dry_breakers))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_sampler(self, other: SamplingParams) -> SamplingParams:
        """These params with ``other``'s repetition control and min-p (``SAMPLER_FIELDS``)."""
        return dataclasses.replace(self, **{f: getattr(other, f) for f in SAMPLER_FIELDS})

    @property
    def token_penalties(self) -> bool:
        """The repetition, presence or frequency penalty is on (over a window of tokens)."""
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1.0
                                           or self.presence_penalty != 0.0
                                           or self.frequency_penalty != 0.0)

    @property
    def penalized(self) -> bool:
        """Any setting that depends on the text so far is on."""
        return self.token_penalties or self.dry_multiplier > 0.0


# the settings beyond temperature, top-k, top-p and seed: a prompt format's defaults
SAMPLER_FIELDS = ("min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                  "frequency_penalty", "dry_multiplier", "dry_base", "dry_allowed_length",
                  "dry_last_n", "dry_breakers")


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax in float64 over the last axis (float32 loses the small residual masses)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _top_p_keep(p: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest most-likely set whose mass reaches ``top_p`` (ties by index)."""
    n = p.size
    k = min(64, n)
    while True:
        idx = top_k(p, k)  # descending probability, then ascending id
        cum = np.cumsum(p[idx])
        if cum[-1] >= top_p or k == n:
            cut = int(np.searchsorted(cum, top_p * (1 - 1e-12))) + 1
            return idx[:cut]
        k = min(n, k * 8)


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampling distribution for one row of (penalised) logits, float64, summing to 1.

    min-p first drops the tokens whose probability at temperature 1 is below min_p times the
    most likely token's (as llama.cpp does, so that min-p means the same at any temperature);
    temperature scales the logits; top-k then zeroes all but the k largest; top-p then keeps
    the smallest prefix (by probability) with mass >= top_p; what is kept is renormalised.
    With temperature 0 this is the softmax at temperature 1 (used to rank draft candidates;
    greedy verification looks at the argmax only).
    """
    temp = params.temperature or 1.0
    if params.top_k and params.top_k < np.size(logits):
        return _top_k_distribution(np.asarray(logits), temp, params)
    z = np.asarray(logits, dtype=np.float64)
    if params.min_p > 0.0:
        z = np.where(z >= z.max() + np.log(params.min_p), z, -np.inf)
    p = softmax(z / temp)
    if params.top_p < 1.0:
        keep = _top_p_keep(p, params.top_p)
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


def _top_k_distribution(logits: np.ndarray, temp: float, params: SamplingParams) -> np.ndarray:
    """``distribution`` when top-k keeps k of V tokens: the softmax, and top-p, over those k only
    (the others' probability is exactly 0 either way). A full-vocabulary softmax per drafted
    node was most of a sampled step's bookkeeping time."""
    kth = top_k(logits, params.top_k)  # largest first, ties to the smaller id
    return top_k_distribution(kth, logits[kth], logits.size, params)


def top_k_distribution(kth: np.ndarray, logits: np.ndarray, n_vocab: int,
                       params: SamplingParams) -> np.ndarray:
    """``distribution`` with top-k from the k best tokens ``kth`` (largest first, ties to the
    smaller id) and their ``logits`` alone: the rest of the vocabulary gets probability 0
    either way, so a drafter that can name its best tokens never builds the full row."""
    kth, kept = top_k_support(kth, logits, params)
    p = np.zeros(n_vocab, dtype=np.float64)
    p[kth] = kept
    return p


def top_k_support(kth: np.ndarray, logits: np.ndarray, params: SamplingParams
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``top_k_distribution``'s tokens with probability (best first) and those probabilities."""
    temp = params.temperature or 1.0
    z = np.asarray(logits, dtype=np.float64)
    if params.min_p > 0.0:
        # min-p keeps a prefix of the best-first tokens (before temperature: ``distribution``)
        cut = int(np.count_nonzero(z >= z[0] + np.log(params.min_p)))
        z, kth = z[:cut], kth[:cut]
    z = z / temp
    e = np.exp(z - z[0])
    kept = e / e.sum()
    if params.top_p < 1.0:
        # kth is already in top-p's order (descending probability, then ascending id)
        cut = int(np.searchsorted(np.cumsum(kept), params.top_p * (1 - 1e-12))) + 1
        kept = kept[:cut] / kept[:cut].sum()
        kth = kth[:cut]
    return kth, kept


def argmax(logits: np.ndarray) -> int:
    """Greedy choice; ties go to the smallest token id (numpy's argmax), on both sides."""
    return int(np.argmax(logits))


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from distribution ``p`` (by inverse CDF, robust to rounding), over its
    support: the tokens of probability 0 add nothing to the cumulative sums, so the token
    drawn is the one the whole row's inverse CDF gives, at a fraction of its cost after
    top-k."""
    support = np.flatnonzero(p)
    if support.size == 0:
        return p.size - 1
    cum = np.cumsum(p[support])
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    return int(support[min(i, support.size - 1)])


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries, largest first, ties to the smaller index.

    Repeated argmax for the smallest k. Otherwise the candidates are the entries at least the
    k-th largest of the maxima of ``4 k`` equal blocks (k of those maxima are distinct entries
    at least that large, so every one of the k largest entries and their ties is among the
    candidates), sorted exactly: over a large vocabulary a few passes over ``x`` instead of a
    partition of it, which was most of a sampled step's bookkeeping.
    """
    k = min(k, x.size)
    if k <= 2:
        work = np.array(x, dtype=np.float64 if x.dtype == np.float64 else np.float32)
        out = np.empty(k, dtype=np.int64)
        for i in range(k):
            out[i] = np.argmax(work)
            work[out[i]] = -np.inf
        return out
    blocks = 4 * k
    size = x.size // blocks
    if size < 16:  # a short row: sort it
        return np.lexsort((np.arange(x.size), -x))[:k]
    maxima = x[:blocks * size].reshape(blocks, size).max(axis=1)
    floor = np.partition(maxima, blocks - k)[blocks - k]
    candidates = np.flatnonzero(x >= floor)
    return candidates[np.lexsort((candidates, -x[candidates]))][:k]


def greedy_children(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most likely tokens and their probabilities under softmax(logits)."""
    z = np.asarray(logits, dtype=np.float32)
    tokens = top_k(z, k)
    top = float(z[tokens[0]])
    log_total = top + float(np.log(np.exp(z - top, dtype=np.float32).sum(dtype=np.float64)))
    return tokens, np.exp(z[tokens].astype(np.float64) - log_total)


def sample_without_replacement(p: np.ndarray, k: int, rng: np.random.Generator) -> list[int]:
    """``k`` distinct tokens drawn one after another from ``p`` renormalised over the tokens not
    yet drawn (fewer when fewer have any probability). Works on ``p``'s support only: after
    top-k that is k tokens, not the vocabulary, and a peaked ``p`` costs no redraws."""
    support = np.flatnonzero(p)
    w = p[support].astype(np.float64)
    out: list[int] = []
    for _ in range(min(k, support.size)):
        cum = np.cumsum(w)
        # side="right" never lands on a drawn (zero) weight below the total; a draw rounded
        # up to the total takes the last token still in
        i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
        if i >= w.size or w[i] == 0.0:
            i = int(np.flatnonzero(w)[-1])
        out.append(int(support[i]))
        w[i] = 0.0
    return out
