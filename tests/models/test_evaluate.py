"""Pair evaluation through llama.cpp on tiny generated models."""

from __future__ import annotations

import numpy as np

from models.evaluate import evaluate_pair


def test_a_model_agrees_with_itself_and_scores_like_itself(tiny_models) -> None:
    tokens = np.random.default_rng(0).integers(0, 50257, 130)
    same = evaluate_pair(tiny_models["q8_0-target"], tiny_models["q8_0-target"], tokens,
                         window=64, threads=1)
    assert same.tokens == 129
    assert same.greedy_agreement == 1.0
    assert same.target_loss == same.draft_loss
    assert 0 < same.target_loss < 30
    other = evaluate_pair(tiny_models["q8_0-target"], tiny_models["q8_0-draft"], tokens,
                          window=64, threads=1)
    assert other.greedy_agreement < 1.0
    assert other.target_loss == same.target_loss
    assert other.draft_loss != other.target_loss
