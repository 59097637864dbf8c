"""Pair evaluation through llama.cpp on tiny generated models."""

from __future__ import annotations

import numpy as np

from models.evaluate import (
    evaluate_pair,
    format_samples,
    indentation_decisions,
    judge,
    longest_loop,
    samples_report,
)


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


def test_judge_flags_degenerate_text_and_accepts_code() -> None:
    prompt = 'def add(a, b):\n    """Add."""\n'
    spaces = judge(prompt, [220] * 40, " " * 40)
    assert spaces.degenerate is not None and not spaces.plausible
    code = "    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ok = judge(prompt, list(range(20)), code)
    assert ok.degenerate is None and ok.plausible
    # cut at a line boundary: a broken last line does not matter
    assert judge(prompt, list(range(20)), "    total = a + b\n    return total +").plausible
    # a body that never parses is not plausible, even without repetition
    assert not judge(prompt, list(range(20)), "    return a +\n    ) ) (\n").plausible
    assert judge(prompt, list(range(20)), "xx = xx\n").degenerate == "1 distinct words"
    # a loop of a few tokens is as degenerate as one token repeated; a short repeat is not
    loop = [10, 11, 12] * 5
    assert judge(prompt, list(range(20)) + loop, code).degenerate == (
        "a loop of 3 tokens over 15 tokens")
    assert judge(prompt, [1, 2, 3] + [7, 8] * 6 + [4], code).degenerate is None  # 12 tokens
    assert longest_loop([5] * 13) == (13, 1)


def test_samples_report_prints_and_judges_every_prompt(tiny_models) -> None:
    prompts = ["def f(x):\n", "class A:\n"]
    report = samples_report(tiny_models["q8_0-target"], prompts, max_tokens=8, threads=1)
    for part in ("greedy", "sampled"):
        rows = report[part]["samples"]
        assert [r["prompt"] for r in rows] == prompts
        assert 0.0 <= report[part]["degenerate"] <= 1.0
    text = format_samples(report)
    assert "def f(x):" in text and "=== greedy" in text and "=== sampled" in text


def test_indentation_decisions_are_counted_where_a_line_starts_with_spaces(tiny_models) -> None:
    from models.corpus import tokenize_documents

    code = "def f(x):\n    if x:\n        return 1\n    return 2\n" * 20
    tokens = tokenize_documents([code], 50256)[:-1].astype(np.int64)
    result = indentation_decisions(tiny_models["q8_0-target"], tokens, window=64, threads=1)
    # per 4-line block: 3 + 7 + 3 spaces continue, 3 indented lines stop (the window's first
    # and last tokens aside)
    assert result.stop_positions > 0 and result.continue_positions > 3 * result.stop_positions
    assert 0.0 <= result.stop_accuracy <= 1.0 and 0.0 <= result.continue_accuracy <= 1.0
