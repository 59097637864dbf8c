"""Temperature, top-k and top-p against a brute-force definition."""

from __future__ import annotations

import numpy as np
import pytest

from speculative.sampling import SamplingParams, distribution


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
