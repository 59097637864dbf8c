"""The Hugging Face converter: a tiny GPT-2 checkpoint written here, with random weights and the
real GPT-2 tokenizer, converts to a GGUF that llama.cpp runs to the logits of a numpy forward
pass written directly against the Hugging Face names and ``Conv1D`` layout (so a transposition
in the converter cannot be cancelled by the same mistake in the reference).

Tolerances are those of ``test_gguf_writer.py`` (same shapes, same weight scale): F16 0.01,
Q8_0 0.2 on the max |logit difference|; measured maxima here: F16 0.0033, Q8_0 0.071.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import gguf
import numpy as np
import pytest

from models.convert import (
    ConversionError,
    convert,
    gguf_weights,
    main,
    read_safetensors,
    read_tokenizer,
)
from models.gguf_writer import VOCAB_PATH, Vocab
from models.numpy_gpt2 import causal_attention, gelu_tanh, layer_norm
from speculative.backend import ContextConfig, LlamaContext, LlamaModel

TOLERANCE = {"f16": 0.01, "q8_0": 0.2}
N_LAYER, N_EMBD, N_HEAD, N_POS, EPS = 2, 64, 2, 128, 1e-5
TEXTS = ["Hello world", "  multiple   spaces\n\nand newlines\t", "naïve café, 日本語 🙂",
         "The year 2024: 3.14159 and 1,000,000!", "don't we'll they're <|endoftext|> tail"]


def hf_state(n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random GPT-2 weights named and shaped as Hugging Face stores them (Conv1D: (in, out))."""
    rng = np.random.default_rng(seed)
    d = N_EMBD

    def normal(std: float, *shape: int) -> np.ndarray:
        return rng.normal(0.0, std, shape).astype(np.float32)

    state = {"wte.weight": normal(0.08, n_vocab, d), "wpe.weight": normal(0.04, N_POS, d),
             "ln_f.weight": 1 + normal(0.2, d), "ln_f.bias": normal(0.2, d)}
    for i in range(N_LAYER):
        p = f"h.{i}."
        state |= {
            p + "ln_1.weight": 1 + normal(0.2, d), p + "ln_1.bias": normal(0.2, d),
            p + "attn.c_attn.weight": normal(0.08, d, 3 * d), p + "attn.c_attn.bias": normal(
                0.02, 3 * d),
            p + "attn.c_proj.weight": normal(0.08, d, d), p + "attn.c_proj.bias": normal(0.02, d),
            p + "ln_2.weight": 1 + normal(0.2, d), p + "ln_2.bias": normal(0.2, d),
            p + "mlp.c_fc.weight": normal(0.08, d, 4 * d), p + "mlp.c_fc.bias": normal(0.02, 4 * d),
            p + "mlp.c_proj.weight": normal(0.08, 4 * d, d), p + "mlp.c_proj.bias": normal(0.02, d),
        }
    return state


def hf_forward(state: Mapping[str, np.ndarray], tokens: Sequence[int]) -> np.ndarray:
    """GPT-2 as Hugging Face's modeling_gpt2 computes it: Conv1D is ``x @ W + b``."""
    s = {k: v.astype(np.float64) for k, v in state.items()}
    x = s["wte.weight"][list(tokens)] + s["wpe.weight"][:len(tokens)]
    for i in range(N_LAYER):
        p = f"h.{i}."
        h = layer_norm(x, s[p + "ln_1.weight"], s[p + "ln_1.bias"], EPS)
        a = causal_attention(h @ s[p + "attn.c_attn.weight"] + s[p + "attn.c_attn.bias"], N_HEAD)
        x = x + a @ s[p + "attn.c_proj.weight"] + s[p + "attn.c_proj.bias"]
        h = layer_norm(x, s[p + "ln_2.weight"], s[p + "ln_2.bias"], EPS)
        h = gelu_tanh(h @ s[p + "mlp.c_fc.weight"] + s[p + "mlp.c_fc.bias"])
        x = x + h @ s[p + "mlp.c_proj.weight"] + s[p + "mlp.c_proj.bias"]
    return layer_norm(x, s["ln_f.weight"], s["ln_f.bias"], EPS) @ s["wte.weight"].T


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], dtype: str = "F32") -> None:
    encode = {"F32": lambda a: a.astype("<f4"), "F16": lambda a: a.astype("<f2"),
              "BF16": lambda a: (a.astype("<f4").view("<u4") >> 16).astype("<u2"),
              "BOOL": lambda a: a.astype(np.uint8)}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, array in tensors.items():
        kind = "BOOL" if array.dtype == bool else dtype
        blob = encode[kind](array).tobytes()
        header[name] = {"dtype": kind, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def write_config(directory: Path, n_vocab: int, **extra: object) -> None:
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": N_EMBD,
              "n_layer": N_LAYER, "n_head": N_HEAD, "n_positions": N_POS, "n_ctx": N_POS,
              "n_inner": None, "layer_norm_epsilon": EPS, "vocab_size": n_vocab,
              "activation_function": "gelu_new", "bos_token_id": 50256, "eos_token_id": 50256}
    (directory / "config.json").write_text(json.dumps(config | extra))


def write_vocab_json(directory: Path, vocab: Vocab) -> None:
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    (directory / "vocab.json").write_text(json.dumps(ids), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(vocab.merges) + "\n",
                                          encoding="utf-8")


def write_tokenizer_json(directory: Path, vocab: Vocab) -> None:
    """The newer format: merges as pairs, <|endoftext|> only among the added tokens."""
    eot = vocab.tokens.index("<|endoftext|>")
    spec = {"version": "1.0",
            "added_tokens": [{"id": eot, "content": "<|endoftext|>", "special": True}],
            "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(vocab.tokens)
                                               if i != eot},
                      "merges": [m.split(" ") for m in vocab.merges]}}
    (directory / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")


@pytest.fixture(scope="module")
def safetensors_checkpoint(tmp_path_factory: pytest.TempPathFactory, vocab: Vocab,
                           ) -> tuple[Path, dict[str, np.ndarray]]:
    """A checkpoint as GPT2LMHeadModel.save_pretrained writes it: prefixed names, tied lm_head
    left out, plus a causal-mask buffer as older checkpoints carry."""
    directory = tmp_path_factory.mktemp("hf-safetensors")
    state = hf_state(len(vocab.tokens))
    stored = {f"transformer.{k}": v for k, v in state.items()}
    stored["transformer.h.0.attn.bias"] = np.tril(np.ones((1, 1, N_POS, N_POS), bool))
    write_safetensors(directory / "model.safetensors", stored)
    write_config(directory, len(vocab.tokens))
    write_vocab_json(directory, vocab)
    return directory, state


@pytest.fixture(scope="module")
def pytorch_checkpoint(tmp_path_factory: pytest.TempPathFactory, vocab: Vocab,
                       ) -> tuple[Path, dict[str, np.ndarray]]:
    """pytorch_model.bin without prefixes, an explicit (tied) lm_head, tokenizer.json, and the
    embedding padded to 50304 rows as nanoGPT-style training does."""
    torch = pytest.importorskip("torch")
    directory = tmp_path_factory.mktemp("hf-pytorch")
    state = hf_state(50304, seed=1)
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    tensors["lm_head.weight"] = tensors["wte.weight"]
    tensors["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(tensors, directory / "pytorch_model.bin")
    write_config(directory, 50304)
    write_tokenizer_json(directory, vocab)
    return directory, state


def llama_logits(path: Path, tokens: Sequence[int]) -> np.ndarray:
    config = ContextConfig(n_ctx=N_POS, n_batch=64, n_seq_max=1, n_threads=1)
    with LlamaModel(path) as model, LlamaContext(model, config) as ctx:
        return ctx.decode(tokens, range(len(tokens)), [[0]] * len(tokens))


def check_logits(path: Path, state: Mapping[str, np.ndarray], tol: float) -> None:
    tokens = np.random.default_rng(5).integers(0, 50257, 64).tolist()
    got, ref = llama_logits(path, tokens), hf_forward(state, tokens)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < tol
    # greedy picks agree except on near-ties (reference top two within 2 * tol)
    picked = np.take_along_axis(ref, got.argmax(-1)[:, None], axis=-1)[:, 0]
    assert np.all(picked >= ref.max(-1) - 2 * tol)


def check_tokenizer(path: Path) -> None:
    with LlamaModel(VOCAB_PATH, vocab_only=True) as ref, LlamaModel(path) as model:
        assert (model.vocab.bos, model.vocab.eos) == (ref.vocab.bos, ref.vocab.eos) == (50256,
                                                                                       50256)
        for text in TEXTS:
            for special in (False, True):
                expected = ref.vocab.tokenize(text, special)
                assert model.vocab.tokenize(text, special) == expected, (text, special)
        assert model.vocab.tokenize("<|endoftext|>", special=True) == [50256]


@pytest.mark.parametrize("ftype", ["f16", "q8_0"])
def test_safetensors_checkpoint_runs_like_hugging_face(
        tmp_path: Path, safetensors_checkpoint: tuple[Path, dict[str, np.ndarray]],
        ftype: str) -> None:
    directory, state = safetensors_checkpoint
    out = tmp_path / f"model-{ftype}.gguf"
    assert main([str(directory), str(out), "--type", ftype]) == 0
    check_logits(out, state, TOLERANCE[ftype])
    with LlamaModel(out) as model:  # tied: no output.weight in the file
        assert model.n_params == sum(v.size for v in state.values())
    if ftype == "f16":
        check_tokenizer(out)


def test_pytorch_checkpoint_with_tokenizer_json(
        tmp_path: Path, pytorch_checkpoint: tuple[Path, dict[str, np.ndarray]]) -> None:
    directory, state = pytorch_checkpoint
    out = convert(directory, tmp_path / "model.gguf", "f16")
    check_logits(out, state, TOLERANCE["f16"])
    check_tokenizer(out)
    with LlamaModel(out) as model:
        assert model.vocab.n_vocab == 50304
        assert model.n_params == sum(v.size for v in state.values())  # lm_head was tied
        assert model.vocab.token_text(50300) == b"[PAD50300]"


def test_tokenizer_equals_the_vocab_gguf(
        vocab: Vocab, safetensors_checkpoint: tuple[Path, dict[str, np.ndarray]],
        pytorch_checkpoint: tuple[Path, dict[str, np.ndarray]]) -> None:
    """Token texts, merges, types (<|endoftext|> control) and bos/eos, from both formats.
    (llama.cpp marks <|endoftext|> as control on load anyway, so tokenizing cannot tell.)"""
    config = {"bos_token_id": 50256, "eos_token_id": 50256}
    assert read_tokenizer(safetensors_checkpoint[0], 50257, config) == vocab
    padded = read_tokenizer(pytorch_checkpoint[0], 50304, config)
    assert padded.tokens[:50257] == vocab.tokens and padded.merges == vocab.merges
    assert padded.token_types[:50257] == vocab.token_types
    assert set(padded.token_types[50257:]) == {int(gguf.TokenType.UNUSED)}
    assert (padded.bos_id, padded.eos_id) == (50256, 50256)


def test_one_mapping_checked_independently() -> None:
    """c_proj is square, so only the values show whether it was transposed: y = x @ W_hf must
    equal W_gguf @ x, and q, k, v keep their order."""
    state = hf_state(100)
    weights = gguf_weights({f"transformer.{k}": v for k, v in state.items()})
    x = np.random.default_rng(0).normal(size=N_EMBD)
    np.testing.assert_allclose(weights["blk.1.attn_output.weight"] @ x,
                               x @ state["h.1.attn.c_proj.weight"], rtol=1e-5, atol=1e-6)
    qkv = weights["blk.0.attn_qkv.weight"]
    np.testing.assert_array_equal(qkv[N_EMBD:2 * N_EMBD],
                                  state["h.0.attn.c_attn.weight"][:, N_EMBD:2 * N_EMBD].T)
    np.testing.assert_array_equal(weights["blk.1.ffn_norm.bias"], state["h.1.ln_2.bias"])
    assert "output.weight" not in weights
    untied = gguf_weights(state | {"lm_head.weight": state["wte.weight"] + 1})
    np.testing.assert_array_equal(untied["output.weight"], state["wte.weight"] + 1)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_read_safetensors(tmp_path: Path, dtype: str) -> None:
    # exactly representable values; the last one outside F16's range for F32 and BF16
    big = {"F32": 1e30, "F16": 32768.0, "BF16": 2.0**100}[dtype]
    tensors = {"a": np.arange(-6, 6, dtype=np.float32).reshape(3, 4) / 4,
               "b.c": np.array([1.5, -2.0, big], np.float32)}
    write_safetensors(tmp_path / "m.safetensors", tensors, dtype)
    got = read_safetensors(tmp_path / "m.safetensors")
    assert set(got) == set(tensors)
    for name, array in tensors.items():
        np.testing.assert_array_equal(np.asarray(got[name], np.float32), array)


def test_read_safetensors_rejects_unknown_dtype_and_bad_ranges(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "m.safetensors", {"w": np.zeros(4, bool)})
    with pytest.raises(ConversionError, match="BOOL"):
        read_safetensors(tmp_path / "m.safetensors")
    raw = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    with pytest.raises(ConversionError, match="corrupt"):
        read_safetensors(tmp_path / "bad.safetensors")


def test_clear_errors(tmp_path: Path, safetensors_checkpoint: tuple[Path, dict[str, np.ndarray]],
                      capsys: pytest.CaptureFixture[str]) -> None:
    good, _ = safetensors_checkpoint
    bad = tmp_path / "ckpt"
    bad.mkdir()
    out = tmp_path / "out.gguf"
    with pytest.raises(ConversionError, match=r"config\.json"):
        convert(bad, out)
    write_config(bad, 50257, model_type="llama")
    with pytest.raises(ConversionError, match="'llama' model"):
        convert(bad, out)
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(ConversionError, match="vocab_size"):
        convert(bad, out)
    write_config(bad, 50257, activation_function="relu")
    with pytest.raises(ConversionError, match="relu"):
        convert(bad, out)
    write_config(bad, 50257)
    with pytest.raises(ConversionError, match="no tokenizer"):
        convert(bad, out)
    (bad / "vocab.json").write_bytes((good / "vocab.json").read_bytes())
    (bad / "merges.txt").write_bytes((good / "merges.txt").read_bytes())
    with pytest.raises(ConversionError, match="no weights"):
        convert(bad, out)
    (bad / "model.safetensors").symlink_to(good / "model.safetensors")
    write_config(bad, 50257, n_embd=2 * N_EMBD)  # config disagrees with the tensors
    with pytest.raises(ConversionError, match="shape"):
        convert(bad, out)
    assert main([str(bad), str(out)]) == 1
    assert "shape" in capsys.readouterr().err
    assert not out.exists()
