"""Inflation: a tiny GPT-2 (d=64, 2 layers, 1 head of 64) widened to 4 layers, d=192, 3 heads
(r = 3 copies of the stream: not a power of two, so no scaling could be exact by luck) computes
the same function, in numpy and in llama.cpp.

Tolerances (max |logit difference| over 64 positions x 50257 tokens, logit std ~0.7):
- numpy float64, inflated vs source: 1e-9 (measured 2e-15: the construction is exact);
- llama.cpp F32, inflated vs source: 1e-3 (measured 1.2e-4: summation order in the longer dot
  products, now and then amplified by the F16 KV cache's rounding);
- llama.cpp Q8_0, inflated vs source Q8_0: 1e-3 (measured 0.0, bit-identical: every live weight
  and activation sits in the same Q8_0 block with the same scale as in the source).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from models.gguf_writer import Gpt2Config, Vocab, random_gpt2_weights, write_gpt2_gguf
from models.inflate import SHAPES, Shape, copies, inflate, main
from models.numpy_gpt2 import forward
from speculative.backend import ContextConfig, LlamaContext, LlamaModel

SOURCE = Gpt2Config(n_vocab=50257, n_ctx=128, n_embd=64, n_layer=2, n_head=1)
TARGET = Shape(n_layer=4, n_embd=192, n_head=3)
TOLERANCE = {"numpy": 1e-9, "f32": 1e-3, "q8_0": 1e-3}
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away",
           "import numpy as np\n", "In 1905, Albert Einstein", "Hello, my name is"]


@pytest.fixture(scope="module")
def source() -> dict[str, np.ndarray]:
    """Sharp random weights with non-trivial LayerNorms (a forgotten LayerNorm bias would
    otherwise go unnoticed)."""
    weights = random_gpt2_weights(SOURCE, seed=0, scale=4.0)
    rng = np.random.default_rng(1000)
    for key, w in weights.items():
        if "norm." in key:
            weights[key] = (w + rng.normal(0.0, 0.2, w.shape)).astype(np.float32)
    return weights


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return np.random.default_rng(3).integers(0, SOURCE.n_vocab, 64).tolist()


def llama_logits(path: Path, tokens: Sequence[int]) -> np.ndarray:
    config = ContextConfig(n_ctx=128, n_batch=64, n_seq_max=1, n_threads=1)
    with LlamaModel(path) as model, LlamaContext(model, config) as ctx:
        return ctx.decode(tokens, range(len(tokens)), [[0]] * len(tokens))


def greedy(path: Path, prompts: Sequence[str], n_new: int = 32) -> list[list[int]]:
    """Plain greedy decoding, one token per decode after the prompt."""
    config = ContextConfig(n_ctx=128, n_batch=64, n_seq_max=1, n_threads=1)
    with LlamaModel(path) as model, LlamaContext(model, config) as ctx:
        outputs = []
        for text in prompts:
            ctx.clear()
            prompt = model.vocab.tokenize(text)
            n = len(prompt)
            logits = ctx.decode(prompt, range(n), [[0]] * n, [False] * (n - 1) + [True])
            out: list[int] = []
            for _ in range(n_new):
                out.append(int(logits[-1].argmax()))
                logits = ctx.decode(out[-1:], [n + len(out) - 1], [[0]])
            outputs.append(out)
    return outputs


def test_construction_is_exact_in_numpy(source: dict[str, np.ndarray],
                                        tokens: list[int]) -> None:
    big, wide = inflate(SOURCE, source, TARGET)
    assert (big.n_layer, big.n_embd, big.n_head, big.ff) == (4, 192, 3, 768)
    assert (big.n_vocab, big.n_ctx) == (SOURCE.n_vocab, SOURCE.n_ctx)
    ref = forward(source, SOURCE, tokens)
    assert np.abs(forward(wide, big, tokens) - ref).max() < TOLERANCE["numpy"]
    for i in (2, 3):  # identity layers: LayerNorms output 0, everything after it is random
        for name in ("attn_norm.weight", "attn_norm.bias", "ffn_norm.weight", "ffn_norm.bias",
                     "attn_output.bias", "ffn_down.bias"):
            assert not wide[f"blk.{i}.{name}"].any()
        for name in ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                     "ffn_down.weight"):
            assert np.all(wide[f"blk.{i}.{name}"] != 0)
        assert wide[f"blk.{i}.attn_qkv.weight"].std() == pytest.approx(
            source["blk.0.attn_qkv.weight"].std(), rel=0.05)
    # no big zero regions (all-zero pages can be cheaper to read than real weights)
    matrices = [w for w in wide.values() if w.ndim == 2]
    assert sum((w == 0).sum() for w in matrices) < 0.05 * sum(w.size for w in matrices)
    assert "output.weight" not in wide  # tied, as in GPT-2


def test_untied_output_is_kept(source: dict[str, np.ndarray], tokens: list[int]) -> None:
    out = np.random.default_rng(4).normal(0.0, 0.1, (SOURCE.n_vocab, 64)).astype(np.float32)
    untied = source | {"output.weight": out}
    big, wide = inflate(SOURCE, untied, TARGET)
    assert np.abs(forward(wide, big, tokens[:16]) - forward(untied, SOURCE, tokens[:16])).max() \
        < TOLERANCE["numpy"]


@pytest.mark.parametrize("ftype", ["f32", "q8_0"])
def test_llama_logits_and_greedy_match_the_source(tmp_path: Path, vocab: Vocab,
                                                  source: dict[str, np.ndarray],
                                                  tokens: list[int], ftype: str) -> None:
    src = write_gpt2_gguf(tmp_path / "src.gguf", SOURCE, source, vocab, ftype)
    out = tmp_path / "big.gguf"
    assert main([str(src), str(out), "--layers", "4", "--embd", "192", "--heads", "3",
                 "--type", ftype]) == 0
    with LlamaModel(out) as model:
        assert model.meta("gpt2.block_count") == "4"
        assert model.meta("gpt2.embedding_length") == "192"
        assert model.meta("gpt2.attention.head_count") == "3"
    small, wide = llama_logits(src, tokens), llama_logits(out, tokens)
    assert np.abs(wide - small).max() < TOLERANCE[ftype]
    assert greedy(out, PROMPTS) == greedy(src, PROMPTS)


def test_real_shapes() -> None:
    assert SHAPES["gpt2"] == Shape(12, 768, 12)
    assert SHAPES["gpt2-medium"] == Shape(24, 1024, 16)
    assert SHAPES["gpt2-large"] == Shape(36, 1280, 20)
    assert SHAPES["gpt2-xl"] == Shape(48, 1600, 25)
    tiny, small = Gpt2Config(n_embd=64, n_head=1), Gpt2Config(n_embd=256, n_head=4)
    assert [copies(tiny, s) for s in SHAPES.values()] == [12, 16, 20, 25]
    assert [copies(small, SHAPES[n]) for n in ("gpt2", "gpt2-medium", "gpt2-large")] == [3, 4, 5]
    with pytest.raises(ValueError, match="multiple"):
        copies(small, SHAPES["gpt2-xl"])  # 1600 = 6.25 x 256


@pytest.mark.parametrize(("shape", "message"), [
    (Shape(4, 160, 2), "multiple"),          # 160 = 2.5 x 64
    (Shape(4, 192, 2), "head size"),         # 96-wide heads
    (Shape(1, 192, 3), "fewer"),
])
def test_impossible_shapes_are_refused(source: dict[str, np.ndarray], shape: Shape,
                                       message: str) -> None:
    with pytest.raises(ValueError, match=message):
        inflate(SOURCE, source, shape)


def test_cli_needs_exactly_one_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args in ([], ["--shape", "gpt2", "--layers", "4"], ["--layers", "4", "--embd", "128"]):
        with pytest.raises(SystemExit):
            main([str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf"), *args])
    assert "shape" in capsys.readouterr().err
