"""A reference GPT-2 forward pass in numpy, and a reader that turns any GPT-2 GGUF back into it.

This is the oracle the GGUF writer, the converter and the inflater are tested against, so it
follows llama.cpp's GPT-2 graph (``src/models/gpt2.cpp``) step by step, in float64:

    x = token_embd[t] + position_embd[pos]
    per layer:  x += attn_output(attention(split_qkv(attn_qkv(LN(x)))))   # causal, 1/sqrt(hs)
                x += ffn_down(gelu(ffn_up(LN(x))))
    logits = (output.weight or token_embd) @ LN(x)

``gelu`` is the tanh approximation (``ggml_gelu``; Hugging Face's ``gelu_new``). Weights use the
names and ``(n_out, n_in)`` orientation of ``models.gguf_writer.tensor_shapes``. ``attn_qkv``
stacks the q, k and v projections along its output rows, in that order, each head a consecutive
block of ``n_embd / n_head`` rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import gguf
import numpy as np

from models.gguf_writer import Gpt2Config, Vocab, read_vocab, tensor_shapes


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)  # biased, as GPT-2 and ggml_norm
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def causal_attention(qkv: np.ndarray, n_head: int) -> np.ndarray:
    """Multi-head causal self-attention of ``(n, 3d)`` stacked q|k|v rows; returns ``(n, d)``."""
    n, three_d = qkv.shape
    d = three_d // 3
    hs = d // n_head
    q, k, v = (qkv[:, i * d:(i + 1) * d].reshape(n, n_head, hs).transpose(1, 0, 2)
               for i in range(3))                             # each (n_head, n, hs)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hs)           # (n_head, n, n)
    scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return (probs @ v).transpose(1, 0, 2).reshape(n, d)       # heads concatenated, (n, d)


def forward(weights: Mapping[str, np.ndarray], cfg: Gpt2Config, tokens: Sequence[int],
            start_pos: int = 0) -> np.ndarray:
    """Logits ``(n, n_vocab)`` (float64) of ``tokens`` at positions ``start_pos, start_pos+1...``
    with no earlier context (``start_pos`` only shifts the position embeddings)."""
    n = len(tokens)
    if start_pos + n > cfg.n_ctx:
        raise ValueError(f"{start_pos + n} positions, but the model has {cfg.n_ctx}")
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    eps = cfg.layer_norm_eps
    x = w["token_embd.weight"][np.asarray(tokens)] + w["position_embd.weight"][
        start_pos:start_pos + n]                                # (n, d)
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        h = layer_norm(x, w[p + "attn_norm.weight"], w[p + "attn_norm.bias"], eps)
        qkv = h @ w[p + "attn_qkv.weight"].T + w[p + "attn_qkv.bias"]  # (n, 3d)
        x = x + causal_attention(qkv, cfg.n_head) @ w[p + "attn_output.weight"].T \
            + w[p + "attn_output.bias"]
        h = layer_norm(x, w[p + "ffn_norm.weight"], w[p + "ffn_norm.bias"], eps)
        hidden = gelu_tanh(h @ w[p + "ffn_up.weight"].T + w[p + "ffn_up.bias"])  # (n, ff)
        x = x + hidden @ w[p + "ffn_down.weight"].T + w[p + "ffn_down.bias"]
    h = layer_norm(x, w["output_norm.weight"], w["output_norm.bias"], eps)
    return h @ w.get("output.weight", w["token_embd.weight"]).T


def _scalar(reader: gguf.GGUFReader, key: str) -> float:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"not a GPT-2 GGUF: no {key!r}")
    return field.parts[field.data[0]][0].item()


def read_config(reader: gguf.GGUFReader) -> Gpt2Config:
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if arch != "gpt2":
        raise ValueError(f"not a GPT-2 GGUF: architecture {arch!r}")
    d = int(_scalar(reader, "gpt2.embedding_length"))
    ff = int(_scalar(reader, "gpt2.feed_forward_length"))
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError("not a GPT-2 GGUF: no token_embd.weight")
    n_vocab = int(embd.shape[1])  # ggml order: [n_embd, n_vocab]
    return Gpt2Config(n_vocab=n_vocab, n_ctx=int(_scalar(reader, "gpt2.context_length")),
                      n_embd=d, n_layer=int(_scalar(reader, "gpt2.block_count")),
                      n_head=int(_scalar(reader, "gpt2.attention.head_count")),
                      n_ff=0 if ff == 4 * d else ff,
                      # stored as float32: str() gives back the short decimal (1e-05) it came from
                      layer_norm_eps=float(str(np.float32(
                          _scalar(reader, "gpt2.attention.layer_norm_epsilon")))))


def load_gguf_weights(path: str | Path) -> tuple[Gpt2Config, dict[str, np.ndarray], Vocab]:
    """Config, float32 weights (dequantized, ``(n_out, n_in)``) and tokenizer of a GPT-2 GGUF."""
    reader = gguf.GGUFReader(str(path))
    cfg = read_config(reader)
    weights = {}
    for t in reader.tensors:
        # ggml's ne is [n_in, n_out]; the reader's data is already (n_out, n_in) in numpy order
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        weights[t.name] = np.array(array, np.float32).reshape(tuple(reversed(t.shape.tolist())))
    expected = tensor_shapes(cfg)
    for key, shape in expected.items():
        if key not in weights or weights[key].shape != shape:
            got = weights[key].shape if key in weights else "missing"
            raise ValueError(f"{path}: tensor {key} is {got}, expected {shape}")
    return cfg, weights, read_vocab(reader)
