"""Inflate a small GPT-2 into a real GPT-2 shape that computes the same function.

    python -m models.inflate SRC.gguf OUT.gguf --shape gpt2-large [--type q8_0|f16|f32]
    python -m models.inflate SRC.gguf OUT.gguf --layers 4 --embd 128 --heads 2

Why: to measure speculative decoding at a real target model's cost with a target whose outputs
we control (a small trained model), the inflated model must cost what gpt2-large costs per token
and still say exactly what the small model says.

The construction ("write every copy, read one"), for a source of width d, h heads of size
s = d/h, L layers and FFN width f, into a target of width D = r*d (r an integer), H = D/s heads
(the head size s is kept), T >= L layers and FFN width F = 4*D >= f:

- Residual stream: r copies of the source stream side by side (wide unit i copies source unit
  i % d). LayerNorm's mean and biased variance over the D units then equal those over the d
  units (every term counted r times, divided by r*d), so the normalized vector is r copies of
  the source's. Everything that *writes* the stream writes every copy: token and position
  embeddings, and the rows (and biases) of attn_output and ffn_down, are tiled r times.
- Everything that *reads* the stream reads it through a LayerNorm (GPT-2 is pre-LN), and every
  LayerNorm keeps its source weight and bias on the first copy and has weight = bias = 0 on the
  others, so its output is [LN(x) | 0 ... 0] exactly. The matrices after it (q, k, v, ffn_up,
  the tied output embedding) hold the source weights in their first d columns and anything in
  the others, which only ever multiply exact zeros. Nothing is divided by r, so every live
  weight and activation is the source's own value in the same 32-value Q8_0 block (when d is a
  multiple of 32) and the products are bit-for-bit the source's. (Letting the matrices read all
  r copies with their weights divided by r is exact in real arithmetic too, but Q8_0's F16
  block scales cannot hold scale/3: that rounding, only 2**-12 but shared by a whole block,
  grew into logit errors of ~0.04 in a random test model.)
- Heads: the first h heads are the source's; the other H - h are inert: random q and k (real
  attention work), but v = 0 (zero weights on the first copy, zero bias), so their output is
  exactly 0 and attn_output's columns for them can be random. Likewise the first f FFN units
  are the source's and the other F - f have pre-activation 0 (zero weights on the first copy,
  zero bias), gelu(0) = 0, and random ffn_down columns.
- Layers L..T-1 are identities: their LayerNorms have weight = bias = 0, so v = 0 and every FFN
  pre-activation is 0; attn_output and ffn_down are random but multiply exact zeros, and their
  biases are 0, so the layer adds exactly 0 to the stream.

So the file has exactly the tensors of the real shape (tied output), random numbers with the
source tensors' magnitudes wherever a weight does not matter, and exact zeros only in 1-D
LayerNorms and biases and in the first-copy columns of inert v and ffn_up rows (a fraction
~L/T * d/D of the weights). Large zero regions are avoided on purpose: a hypervisor or KSM can
back all-zero pages with one physical page, which is cheaper to read than real weights.
llama.cpp's dense kernels do not skip zero activations, so the per-token work is that of the
real shape. Measured through
llama.cpp: F32 logits equal the source's up to summation order (~1e-4), F16 to ~1e-7, and Q8_0
bit for bit (also for gpt2-large from a d=64 source, r = 20).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from models.gguf_writer import FILE_TYPES, Gpt2Config, write_gpt2_gguf
from models.numpy_gpt2 import load_gguf_weights

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int


SHAPES = {
    "gpt2": Shape(12, 768, 12),
    "gpt2-medium": Shape(24, 1024, 16),
    "gpt2-large": Shape(36, 1280, 20),
    "gpt2-xl": Shape(48, 1600, 25),
}


def copies(cfg: Gpt2Config, shape: Shape) -> int:
    """The number r of copies of the residual stream; raises if the shape cannot be reached."""
    d, s = cfg.n_embd, cfg.n_embd // cfg.n_head
    if shape.n_embd % d:
        raise ValueError(f"target width {shape.n_embd} is not a multiple of the source's {d}")
    if shape.n_head * s != shape.n_embd:
        raise ValueError(f"head size must stay {s}: a {shape.n_embd}-wide target needs "
                         f"{shape.n_embd / s:g} heads, not {shape.n_head}")
    if shape.n_layer < cfg.n_layer:
        raise ValueError(f"target has {shape.n_layer} layers, fewer than the source's "
                         f"{cfg.n_layer}")
    if 4 * shape.n_embd < cfg.ff:
        raise ValueError(f"target FFN width {4 * shape.n_embd} is below the source's {cfg.ff}")
    return shape.n_embd // d


def _random(shape: tuple[int, ...], like: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Inert weights: random, with the magnitude of the source tensor they stand beside."""
    std = np.float32(like.std() or 0.02)
    return rng.standard_normal(shape, np.float32) * std


def _wide(live: np.ndarray, shape: tuple[int, int], rng: np.random.Generator,
          inert_reads: int = 0) -> np.ndarray:
    """``live`` in the top-left corner and random weights elsewhere; the rows below the live
    ones (inert heads or units) get zeros in their first ``inert_reads`` columns."""
    out = _random(shape, live, rng)
    out[:live.shape[0], :live.shape[1]] = live
    out[live.shape[0]:, :inert_reads] = 0.0
    return out


def _padded(live: np.ndarray, n: int, rng: np.random.Generator | None) -> np.ndarray:
    """A bias: the live units' values, then random ones (or zeros when ``rng`` is None)."""
    rest = np.zeros(n - live.size, np.float32) if rng is None else _random(
        (n - live.size,), live, rng)
    return np.concatenate([live, rest])


def inflate(cfg: Gpt2Config, weights: Mapping[str, np.ndarray], shape: Shape, seed: int = 0,
            ) -> tuple[Gpt2Config, dict[str, np.ndarray]]:
    """The wide model (config, float32 weights) computing the same logits as ``weights``."""
    r = copies(cfg, shape)
    d, big_d = cfg.n_embd, shape.n_embd
    big = Gpt2Config(n_vocab=cfg.n_vocab, n_ctx=cfg.n_ctx, n_embd=big_d, n_layer=shape.n_layer,
                     n_head=shape.n_head, layer_norm_eps=cfg.layer_norm_eps)  # FFN 4 * D
    big_f = big.ff
    rng = np.random.default_rng(seed)

    def w(name: str) -> np.ndarray:
        return np.asarray(weights[name], np.float32)

    def tiled(name: str) -> np.ndarray:  # written to every copy of the stream
        return np.tile(w(name), (1, r) if w(name).ndim == 2 else r)

    def first_copy(name: str) -> np.ndarray:  # a LayerNorm whose output is [LN(x) | 0]
        return _padded(w(name), big_d, None)

    out = {"token_embd.weight": tiled("token_embd.weight"),
           "position_embd.weight": tiled("position_embd.weight"),
           "output_norm.weight": first_copy("output_norm.weight"),
           "output_norm.bias": first_copy("output_norm.bias")}
    if "output.weight" in weights:
        out["output.weight"] = tiled("output.weight")
    def zero(n: int = big_d) -> np.ndarray:
        return np.zeros(n, np.float32)

    for i in range(big.n_layer):
        src, p = f"blk.{i % cfg.n_layer}.", f"blk.{i}."
        qkv, qkv_b = w(src + "attn_qkv.weight"), w(src + "attn_qkv.bias")
        up, up_b = w(src + "ffn_up.weight"), w(src + "ffn_up.bias")
        wo, wd = w(src + "attn_output.weight"), w(src + "ffn_down.weight")
        if i < cfg.n_layer:  # a source layer, with inert heads and FFN units beside it
            q, k, v = (qkv[j * d:(j + 1) * d] for j in range(3))
            bq, bk, bv = (qkv_b[j * d:(j + 1) * d] for j in range(3))
            out |= {
                p + "attn_norm.weight": first_copy(src + "attn_norm.weight"),
                p + "attn_norm.bias": first_copy(src + "attn_norm.bias"),
                # inert heads: any q and k, but v = 0 (zero weights on the first copy, bias 0)
                p + "attn_qkv.weight": np.concatenate([
                    _wide(q, (big_d, big_d), rng), _wide(k, (big_d, big_d), rng),
                    _wide(v, (big_d, big_d), rng, inert_reads=d)]),
                p + "attn_qkv.bias": np.concatenate([
                    _padded(bq, big_d, rng), _padded(bk, big_d, rng), _padded(bv, big_d, None)]),
                p + "attn_output.weight": _wide(np.tile(wo, (r, 1)), (big_d, big_d), rng),
                p + "attn_output.bias": tiled(src + "attn_output.bias"),
                p + "ffn_norm.weight": first_copy(src + "ffn_norm.weight"),
                p + "ffn_norm.bias": first_copy(src + "ffn_norm.bias"),
                # inert units: pre-activation 0 (zero weights on the first copy, bias 0),
                # and gelu(0) = 0
                p + "ffn_up.weight": _wide(up, (big_f, big_d), rng, inert_reads=d),
                p + "ffn_up.bias": _padded(up_b, big_f, None),
                p + "ffn_down.weight": _wide(np.tile(wd, (r, 1)), (big_d, big_f), rng),
                p + "ffn_down.bias": tiled(src + "ffn_down.bias"),
            }
        else:  # an identity layer: LayerNorm outputs 0, so v = 0 and gelu(0) = 0 feed the
            # (random) attn_output and ffn_down, which with zero biases add exactly 0
            out |= {
                p + "attn_norm.weight": zero(), p + "attn_norm.bias": zero(),
                p + "attn_qkv.weight": _random((3 * big_d, big_d), qkv, rng),
                p + "attn_qkv.bias": np.concatenate([_random((2 * big_d,), qkv_b, rng), zero()]),
                p + "attn_output.weight": _random((big_d, big_d), wo, rng),
                p + "attn_output.bias": zero(),
                p + "ffn_norm.weight": zero(), p + "ffn_norm.bias": zero(),
                p + "ffn_up.weight": _random((big_f, big_d), up, rng),
                p + "ffn_up.bias": zero(big_f),
                p + "ffn_down.weight": _random((big_d, big_f), wd, rng),
                p + "ffn_down.bias": zero(),
            }
    return big, out


def inflate_file(src: str | Path, out: str | Path, shape: Shape, ftype: str = "q8_0",
                 seed: int = 0) -> Path:
    cfg, weights, vocab = load_gguf_weights(src)
    big, wide = inflate(cfg, weights, shape, seed)
    del weights
    return write_gpt2_gguf(out, big, wide, vocab, ftype,
                           name=f"{Path(src).stem}-inflated-{shape.n_layer}L-{shape.n_embd}d")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.inflate",
        description="Make a GPT-2 GGUF of a real GPT-2 shape computing a small model's function.")
    parser.add_argument("src", type=Path, help="the small GPT-2 GGUF")
    parser.add_argument("out", type=Path, help="the inflated GGUF to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a real GPT-2 shape")
    parser.add_argument("--layers", type=int, help="custom shape: number of layers")
    parser.add_argument("--embd", type=int, help="custom shape: width")
    parser.add_argument("--heads", type=int, help="custom shape: number of heads")
    parser.add_argument("--type", dest="ftype", choices=sorted(FILE_TYPES), default="q8_0")
    parser.add_argument("--seed", type=int, default=0, help="for the inert weights")
    args = parser.parse_args(argv)
    custom = (args.layers, args.embd, args.heads)
    if (args.shape is not None) == any(v is not None for v in custom):
        parser.error("give either --shape or --layers, --embd and --heads")
    if args.shape is None and None in custom:
        parser.error("a custom shape needs all of --layers, --embd and --heads")
    shape = SHAPES[args.shape] if args.shape else Shape(*custom)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        path = inflate_file(args.src, args.out, shape, args.ftype, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    log.info("wrote %s (%.1f MB) in %.1f s", path, path.stat().st_size / 1e6,
             time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
