"""Temperature, top-k and top-p against a brute-force definition."""

from __future__ import annotations

import numpy as np
import pytest

from speculative.sampling import SamplingParams, distribution, sample, top_k


def brute_force(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Sort everything (descending, ties to the smaller id), keep k, softmax, keep top-p."""
    z = logits.astype(np.float64) / (params.temperature or 1.0)
    order = np.lexsort((np.arange(z.size), -z))
    if params.top_k:
        order = order[:params.top_k]
    e = np.exp(z[order] - z[order].max())
    p = e / e.sum()
    if params.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(p), params.top_p * (1 - 1e-12))) + 1
        p = p[:cut] / p[:cut].sum()
        order = order[:cut]
    out = np.zeros(z.size)
    out[order] = p
    return out


@pytest.mark.parametrize("seed", range(40))
def test_distribution_is_temperature_then_top_k_then_top_p(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, 2000).astype(np.float32)
    if seed % 4 == 0:
        logits[rng.integers(0, 2000, 30)] = logits.max()  # ties at the top
    params = SamplingParams(float(rng.uniform(0.2, 2.0)), int(rng.choice([0, 1, 5, 40, 300])),
                            float(rng.choice([1.0, 0.95, 0.5, 0.1])))
    got, want = distribution(logits, params), brute_force(logits, params)
    assert np.array_equal(got > 0, want > 0)
    assert np.allclose(got, want, atol=1e-12)
    assert got.sum() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_top_k_is_the_k_largest_best_first_ties_to_the_smaller_id(seed: int) -> None:
    """Against a full sort, on rows of the vocabulary's size and short ones, with ties at and
    around the k-th value and masked (-inf) tokens."""
    rng = np.random.default_rng(seed)
    n = int(rng.choice([7, 300, 50257]))
    row = (rng.normal(0, rng.uniform(0.1, 5), n)).astype(np.float32)
    if seed % 3 == 0:
        row = np.round(row, 1)  # many ties
    if seed % 5 == 0:
        row[rng.integers(0, n, n // 2)] = -np.inf
    for k in (1, 2, 3, 8, 40, 50, 400):
        want = np.lexsort((np.arange(n), -row))[:k]
        assert np.array_equal(top_k(row, k), want), k


def test_sample_draws_by_the_whole_rows_inverse_cdf() -> None:
    """Drawing over the support gives, draw for draw, the token the whole row's cumulative
    sums give (zeros add nothing to them)."""
    rng = np.random.default_rng(3)
    p = np.zeros(50257)
    p[rng.choice(50257, 50, replace=False)] = rng.dirichlet(np.ones(50))
    cum = np.cumsum(p)
    for seed in range(200):
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        whole = int(np.searchsorted(cum, b.random() * cum[-1], side="right"))
        assert sample(p, a) == whole
