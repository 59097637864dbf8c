"""Write GPT-2 architecture GGUF files (F32, F16 or Q8_0) that llama.cpp loads.

Weights are given in llama.cpp's orientation: every matrix is ``(n_out, n_in)`` as numpy shapes
(ggml stores the reverse, ``ne = [n_in, n_out]``), so ``y = W @ x``. Hugging Face GPT-2 stores its
``Conv1D`` weights as ``(n_in, n_out)``; callers transpose them (see ``models/convert.py``).

``random_gpt2`` makes small random-weight models for tests and speed measurements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np

VOCAB_PATH = Path(__file__).resolve().parent / "vocab" / "ggml-vocab-gpt-2.gguf"
"""The GPT-2 tokenizer as a vocab-only GGUF, as shipped in llama.cpp's ``models/`` (MIT)."""

FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


@dataclasses.dataclass(frozen=True, slots=True)
class Gpt2Config:
    n_vocab: int = 50257
    n_ctx: int = 1024        # learned position embeddings: llama.cpp refuses n_ctx beyond this
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_ff: int = 0            # 0 means the GPT-2 convention, 4 * n_embd
    layer_norm_eps: float = 1e-5

    @property
    def ff(self) -> int:
        return self.n_ff or 4 * self.n_embd


@dataclasses.dataclass(frozen=True, slots=True)
class Vocab:
    """A GPT-2 BPE tokenizer as GGUF stores it."""

    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    bos_id: int
    eos_id: int


def _field_strings(reader: gguf.GGUFReader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _field_ints(reader: gguf.GGUFReader, key: str) -> list[int]:
    field = reader.fields[key]
    return [int(field.parts[i][0]) for i in field.data]


def read_vocab(path: str | Path | gguf.GGUFReader = VOCAB_PATH) -> Vocab:
    """Read the tokenizer of any GPT-2 GGUF (vocab-only or a full model), or of an open reader
    (parsing the 100k token and merge strings takes ~2 s: don't do it twice)."""
    reader = path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(str(path))
    tokens = _field_strings(reader, "tokenizer.ggml.tokens")
    eot = tokens.index("<|endoftext|>") if "<|endoftext|>" in tokens else len(tokens) - 1

    def scalar(key: str, default: int) -> int:
        field = reader.fields.get(key)
        return int(field.parts[field.data[0]][0]) if field is not None else default

    types = (_field_ints(reader, "tokenizer.ggml.token_type")
             if "tokenizer.ggml.token_type" in reader.fields else _default_types(len(tokens), eot))
    return Vocab(tokens=tokens, merges=_field_strings(reader, "tokenizer.ggml.merges"),
                 token_types=types, bos_id=scalar("tokenizer.ggml.bos_token_id", eot),
                 eos_id=scalar("tokenizer.ggml.eos_token_id", eot))


def _default_types(n: int, control_id: int) -> list[int]:
    types = [int(gguf.TokenType.NORMAL)] * n
    types[control_id] = int(gguf.TokenType.CONTROL)
    return types


def tensor_shapes(cfg: Gpt2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp's GPT-2 graph needs, as numpy shapes; ``output.weight`` is tied."""
    d, f = cfg.n_embd, cfg.ff
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.n_vocab, d),
        "position_embd.weight": (cfg.n_ctx, d),
        "output_norm.weight": (d,),
        "output_norm.bias": (d,),
    }
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (d,), p + "attn_norm.bias": (d,),
            p + "attn_qkv.weight": (3 * d, d), p + "attn_qkv.bias": (3 * d,),
            p + "attn_output.weight": (d, d), p + "attn_output.bias": (d,),
            p + "ffn_norm.weight": (d,), p + "ffn_norm.bias": (d,),
            p + "ffn_up.weight": (f, d), p + "ffn_up.bias": (f,),
            p + "ffn_down.weight": (d, f), p + "ffn_down.bias": (d,),
        }
    return shapes


def _store(writer: gguf.GGUFWriter, name: str, array: np.ndarray, ftype: str) -> None:
    array = np.ascontiguousarray(array, dtype=np.float32)
    # 1-D tensors (norms, biases) stay F32, as llama.cpp's converters do; they are tiny and the
    # CPU kernels add them in F32 anyway. Position embeddings are added, not multiplied: F32 too.
    if array.ndim == 1 or ftype == "f32" or name == "position_embd.weight":
        writer.add_tensor(name, array)
    elif ftype == "f16":
        writer.add_tensor(name, array.astype(np.float16))
    elif ftype == "q8_0":
        if array.shape[-1] % 32:
            raise ValueError(f"{name}: Q8_0 needs rows that are a multiple of 32, "
                             f"got {array.shape}")
        quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        raise ValueError(f"unknown file type {ftype!r}; expected one of {sorted(FILE_TYPES)}")


def write_gpt2_gguf(path: str | Path, cfg: Gpt2Config, weights: Mapping[str, np.ndarray],
                    vocab: Vocab, ftype: str = "f16", name: str = "gpt2") -> Path:
    """Write ``weights`` (names and shapes as in ``tensor_shapes``) as a GPT-2 GGUF file."""
    if len(vocab.tokens) != cfg.n_vocab:
        raise ValueError(f"vocab has {len(vocab.tokens)} tokens, config says {cfg.n_vocab}")
    expected = tensor_shapes(cfg)
    missing = set(expected) - set(weights)
    if missing:
        raise ValueError(f"missing tensors: {sorted(missing)[:5]}")
    for key, shape in expected.items():
        if tuple(weights[key].shape) != shape:
            raise ValueError(f"{key}: shape {weights[key].shape}, expected {shape}")
    if "output.weight" in weights and weights["output.weight"].shape != (cfg.n_vocab, cfg.n_embd):
        raise ValueError(f"output.weight: shape {weights['output.weight'].shape}")
    if ftype not in FILE_TYPES:
        raise ValueError(f"unknown file type {ftype!r}; expected one of {sorted(FILE_TYPES)}")
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
    if ftype == "q8_0":  # refuse before quantizing anything (slow for big models)
        for key, shape in expected.items():
            if len(shape) == 2 and key != "position_embd.weight" and shape[1] % 32:
                raise ValueError(f"{key}: Q8_0 needs rows that are a multiple of 32, got {shape}")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[ftype])
    writer.add_context_length(cfg.n_ctx)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(cfg.ff)
    writer.add_block_count(cfg.n_layer)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # without it llama.cpp silently pre-tokenizes differently
    writer.add_token_list(vocab.tokens)
    writer.add_token_merges(vocab.merges)
    writer.add_token_types(vocab.token_types)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    for key in expected:
        _store(writer, key, weights[key], ftype)
    if "output.weight" in weights:
        _store(writer, "output.weight", weights["output.weight"], ftype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_gpt2_weights(cfg: Gpt2Config, seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Random weights with GPT-2's init; ``scale`` > 1 sharpens the next-token distributions
    (random models are otherwise near-uniform, which makes argmax ties common)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for key, shape in tensor_shapes(cfg).items():
        if key.endswith("norm.weight"):
            weights[key] = np.ones(shape, np.float32)
        elif key.endswith("norm.bias"):
            weights[key] = np.zeros(shape, np.float32)
        elif key.endswith(".bias"):
            weights[key] = rng.normal(0.0, 0.02, shape).astype(np.float32)
        else:
            weights[key] = rng.normal(0.0, 0.02 * scale, shape).astype(np.float32)
    return weights


def random_gpt2(path: str | Path, cfg: Gpt2Config, seed: int = 0, ftype: str = "f16",
                vocab: Vocab | None = None, scale: float = 1.0) -> Path:
    """Write a GPT-2 GGUF with random weights (for tests and cost measurements)."""
    vocab = vocab or read_vocab()
    return write_gpt2_gguf(path, cfg, random_gpt2_weights(cfg, seed, scale), vocab, ftype,
                           name=f"random-gpt2-{cfg.n_layer}L-{cfg.n_embd}d-seed{seed}")
