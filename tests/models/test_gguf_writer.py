"""llama.cpp runs the GGUF files we write and computes what the numpy reference computes.

Tolerances on the logits: max |difference| over 64 positions x 50257 tokens, for random weights
at 4x GPT-2's init scale (logit standard deviation ~0.7, median top-1/top-2 gap ~0.09). Even
from F32 weights llama.cpp is not bit-exact: its KV cache is F16 and ``ggml_gelu`` looks up an
F16 table. F16 weights also round the activations to F16 in the matrix products; Q8_0 quantizes
weights *and* activations to 8 bits per 32-value block (most of its error is the activations').
Measured maxima (seed 0, this CPU): F32 0.0019, F16 0.0035, Q8_0 0.095. A transposed or swapped
tensor gives errors of the order of the logits themselves (~1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import pytest

from models.gguf_writer import Gpt2Config, Vocab, random_gpt2_weights, write_gpt2_gguf
from models.numpy_gpt2 import forward, gelu_tanh, load_gguf_weights
from speculative.backend import ContextConfig, LlamaContext, LlamaModel

TOLERANCE = {"f32": 0.005, "f16": 0.01, "q8_0": 0.2}
CFG = Gpt2Config(n_vocab=50257, n_ctx=128, n_embd=64, n_layer=2, n_head=2)


def sharp_weights(cfg: Gpt2Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights with sharp next-token distributions and non-trivial LayerNorms (ones and
    zeros would hide a LayerNorm weight/bias mix-up)."""
    weights = random_gpt2_weights(cfg, seed, scale=4.0)
    rng = np.random.default_rng(seed + 1000)
    for key, w in weights.items():
        if "norm." in key:
            weights[key] = (w + rng.normal(0.0, 0.2, w.shape)).astype(np.float32)
    return weights


def llama_logits(path: Path, tokens: Sequence[int], chunk: int = 40) -> np.ndarray:
    """Logits of every token, decoded in chunks so that later ones read the KV cache."""
    config = ContextConfig(n_ctx=128, n_batch=64, n_seq_max=1, n_threads=1)
    with LlamaModel(path) as model, LlamaContext(model, config) as ctx:
        parts = []
        for start in range(0, len(tokens), chunk):
            part = list(tokens[start:start + chunk])
            parts.append(ctx.decode(part, range(start, start + len(part)), [[0]] * len(part)))
    return np.concatenate(parts)


def assert_same_argmax(got: np.ndarray, ref: np.ndarray, tol: float) -> None:
    """Greedy tokens agree except on near-ties: every token llama.cpp picks has a reference logit
    within 2 * tol of the reference's best (so where the top two differ by more, they agree)."""
    picked = np.take_along_axis(ref, got.argmax(-1)[:, None], axis=-1)[:, 0]
    assert np.all(picked >= ref.max(-1) - 2 * tol), np.flatnonzero(picked < ref.max(-1) - 2 * tol)


@pytest.mark.parametrize(("ftype", "untied"), [("f32", False), ("f32", True), ("f16", False),
                                               ("q8_0", False)])
def test_llama_logits_match_numpy(tmp_path: Path, vocab: Vocab, ftype: str,
                                  untied: bool) -> None:
    weights = sharp_weights(CFG)
    if untied:  # llama.cpp must then use output.weight, not token_embd
        weights["output.weight"] = np.random.default_rng(7).normal(
            0.0, 0.1, (CFG.n_vocab, CFG.n_embd)).astype(np.float32)
    path = write_gpt2_gguf(tmp_path / "m.gguf", CFG, weights, vocab, ftype)
    tokens = np.random.default_rng(3).integers(0, CFG.n_vocab, 64).tolist()
    got = llama_logits(path, tokens)
    ref = forward(weights, CFG, tokens)
    assert got.shape == ref.shape == (64, CFG.n_vocab)
    assert np.abs(got - ref).max() < TOLERANCE[ftype]
    assert_same_argmax(got, ref, TOLERANCE[ftype])


@pytest.fixture(scope="module")
def small_vocab(vocab: Vocab) -> Vocab:
    """1000 tokens: GGUFReader takes ~2 s to parse the full vocabulary, once per file."""
    tokens = [*vocab.tokens[:999], "<|endoftext|>"]
    types = [*vocab.token_types[:999], int(gguf.TokenType.CONTROL)]
    return Vocab(tokens=tokens, merges=vocab.merges[:500], token_types=types, bos_id=999,
                 eos_id=999)


@pytest.mark.parametrize("ftype", ["f32", "f16", "q8_0"])
def test_load_gguf_weights_round_trips(tmp_path: Path, small_vocab: Vocab, ftype: str) -> None:
    cfg = dataclasses.replace(CFG, n_vocab=1000, n_ff=128, layer_norm_eps=1e-6)
    weights = sharp_weights(cfg)
    path = write_gpt2_gguf(tmp_path / "m.gguf", cfg, weights, small_vocab, ftype)
    cfg2, loaded, vocab2 = load_gguf_weights(path)
    assert cfg2 == cfg
    assert vocab2 == small_vocab
    assert set(loaded) == set(weights)
    for key, w in weights.items():
        got = loaded[key]
        assert got.dtype == np.float32 and got.shape == w.shape, key
        if w.ndim == 1 or key == "position_embd.weight" or ftype == "f32":
            np.testing.assert_array_equal(got, w, err_msg=key)  # stored as F32
        elif ftype == "f16":
            np.testing.assert_array_equal(got, w.astype(np.float16).astype(np.float32))
        else:  # Q8_0: each 32-block is an F16 scale (the block's max / 127) times int8
            blocks = np.abs(w).reshape(-1, 32).max(axis=1)
            err = np.abs(got - w).reshape(-1, 32).max(axis=1)
            assert np.all(err <= blocks / 127 * 0.5 + 1e-3 * blocks), key
            assert np.any(got != w)


def test_full_model_with_untied_output_round_trips(tmp_path: Path, vocab: Vocab) -> None:
    out = np.random.default_rng(9).normal(0.0, 0.1, (CFG.n_vocab, CFG.n_embd)).astype(np.float32)
    weights = sharp_weights(CFG) | {"output.weight": out}
    path = write_gpt2_gguf(tmp_path / "m.gguf", CFG, weights, vocab, "f16")
    cfg, loaded, vocab2 = load_gguf_weights(path)
    assert cfg == CFG
    assert vocab2 == vocab
    np.testing.assert_array_equal(loaded["output.weight"],
                                  out.astype(np.float16).astype(np.float32))


def test_writer_rejects_wrong_shapes(tmp_path: Path, vocab: Vocab) -> None:
    weights = sharp_weights(CFG)
    out = tmp_path / "bad.gguf"
    square = dict(weights)  # c_proj-like square matrices cannot be caught by shape; qkv can
    square["blk.1.attn_qkv.weight"] = weights["blk.1.attn_qkv.weight"].T
    with pytest.raises(ValueError, match=r"blk\.1\.attn_qkv\.weight"):
        write_gpt2_gguf(out, CFG, square, vocab, "f16")
    missing = {k: v for k, v in weights.items() if k != "blk.0.ffn_up.bias"}
    with pytest.raises(ValueError, match="missing"):
        write_gpt2_gguf(out, CFG, missing, vocab, "f16")
    with pytest.raises(ValueError, match=r"output\.weight"):
        write_gpt2_gguf(out, CFG, weights | {"output.weight": weights["token_embd.weight"].T},
                        vocab, "f16")
    with pytest.raises(ValueError, match="vocab"):
        write_gpt2_gguf(out, dataclasses.replace(CFG, n_vocab=1000), weights, vocab, "f16")
    with pytest.raises(ValueError, match="file type"):
        write_gpt2_gguf(out, CFG, weights, vocab, "q4_0")
    assert not out.exists()


def test_writer_rejects_q8_0_rows_not_multiple_of_32(tmp_path: Path, vocab: Vocab) -> None:
    cfg = dataclasses.replace(CFG, n_embd=48, n_head=1, n_ctx=8)
    weights = sharp_weights(cfg)
    with pytest.raises(ValueError, match="multiple of 32"):
        write_gpt2_gguf(tmp_path / "bad.gguf", cfg, weights, vocab, "q8_0")
    assert not (tmp_path / "bad.gguf").exists()  # refused before the file was opened
    # the same model is fine in F16: the refusal is about Q8_0's 32-value blocks only
    with LlamaModel(write_gpt2_gguf(tmp_path / "ok.gguf", cfg, weights, vocab, "f16")) as model:
        assert model.n_params == sum(w.size for w in weights.values())


def test_reference_gelu_is_the_tanh_approximation() -> None:
    # ggml_gelu (and Hugging Face's gelu_new); the erf GELU gives 0.8413447 and -0.0455003 here,
    # a difference below llama.cpp's own F32 noise, so the logit tests alone would not see it
    np.testing.assert_allclose(gelu_tanh(np.array([1.0, -2.0, 0.0])),
                               [0.8411919906, -0.0454023059, 0.0], rtol=1e-9, atol=0)
