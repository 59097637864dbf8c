"""Convert a Hugging Face GPT-2 checkpoint directory to a GPT-2 GGUF file.

    python -m models.convert CHECKPOINT_DIR OUT.gguf --type f16|q8_0|f32

The directory holds ``config.json`` (``model_type: gpt2``: gpt2, distilgpt2, gpt2-medium,
gpt2-large, gpt2-xl or a model trained in that shape), the weights as ``model.safetensors``
(or a sharded ``model.safetensors.index.json``) or ``pytorch_model.bin`` (needs torch, the
``train`` extra), and the tokenizer as ``vocab.json`` + ``merges.txt`` or ``tokenizer.json``.

Name mapping (Hugging Face names may carry a ``transformer.`` prefix)::

    wte / wpe / ln_f               -> token_embd / position_embd / output_norm
    h.N.ln_1 / ln_2                -> blk.N.attn_norm / ffn_norm
    h.N.attn.c_attn / attn.c_proj  -> blk.N.attn_qkv / attn_output
    h.N.mlp.c_fc / mlp.c_proj      -> blk.N.ffn_up / ffn_down
    lm_head                        -> output (only when not tied to wte)

Hugging Face's ``Conv1D`` stores ``(n_in, n_out)``, so those four matrices are transposed into
llama.cpp's ``(n_out, n_in)``. ``c_attn``'s output columns are q, k, v in that order, each head a
consecutive block, which is exactly how llama.cpp splits ``attn_qkv``. Safetensors files are read
by a small parser of the format here (no extra dependency).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import gguf
import numpy as np

from models.gguf_writer import FILE_TYPES, Gpt2Config, Vocab, write_gpt2_gguf

log = logging.getLogger(__name__)


class ConversionError(ValueError):
    """The checkpoint is missing something, or is not a GPT-2 model llama.cpp can run."""


# HF name after "h.N." -> (GGUF name after "blk.N.", is a Conv1D weight stored (n_in, n_out))
_LAYER_NAMES = {
    "ln_1.weight": ("attn_norm.weight", False), "ln_1.bias": ("attn_norm.bias", False),
    "attn.c_attn.weight": ("attn_qkv.weight", True), "attn.c_attn.bias": ("attn_qkv.bias", False),
    "attn.c_proj.weight": ("attn_output.weight", True),
    "attn.c_proj.bias": ("attn_output.bias", False),
    "ln_2.weight": ("ffn_norm.weight", False), "ln_2.bias": ("ffn_norm.bias", False),
    "mlp.c_fc.weight": ("ffn_up.weight", True), "mlp.c_fc.bias": ("ffn_up.bias", False),
    "mlp.c_proj.weight": ("ffn_down.weight", True), "mlp.c_proj.bias": ("ffn_down.bias", False),
}
_GLOBAL_NAMES = {"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight",
                 "ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias"}
# Causal-mask buffers that older checkpoints saved alongside the weights: not parameters.
_BUFFER = re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)")

# ggml_gelu is the tanh approximation; these Hugging Face activations compute the same function.
_TANH_GELUS = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"}

_SAFETENSORS_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
                       "F64": np.dtype("<f8")}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """The tensors of one ``.safetensors`` file (F32/F16/BF16/F64), memory-mapped where possible.

    Format: 8-byte little-endian header length N, N bytes of JSON ``{name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": {...}}``, then the raw little-endian data, with
    offsets relative to the end of the header.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        (n_header,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n_header))
    data = np.memmap(path, np.uint8, mode="r", offset=8 + n_header)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__" or _BUFFER.fullmatch(name):
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ConversionError(f"{path.name}: tensor {name} has dtype {info['dtype']}; "
                                  f"supported: {', '.join(_SAFETENSORS_DTYPES)}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape)) * dtype.itemsize or end > data.size:
            raise ConversionError(f"{path.name}: tensor {name} has a corrupt byte range")
        array = data[begin:end].view(dtype).reshape(shape)
        if info["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array
    return tensors


def read_pytorch_bin(path: str | Path) -> dict[str, np.ndarray]:
    try:
        import torch  # optional (the train extra): only pytorch_model.bin checkpoints need it
    except ImportError as exc:
        raise ConversionError(f"{Path(path).name} is a PyTorch pickle: reading it needs torch "
                              "(pip install 'staged-chat[train]'), or supply "
                              "model.safetensors instead") from exc
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {name: t.detach().float().numpy() for name, t in state.items()
            if not _BUFFER.fullmatch(name)}


def read_state_dict(checkpoint: Path) -> dict[str, np.ndarray]:
    """All weights of the checkpoint, by their Hugging Face names."""
    if (checkpoint / "model.safetensors").is_file():
        return read_safetensors(checkpoint / "model.safetensors")
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, np.ndarray] = {}
        for shard in shards:
            state |= read_safetensors(checkpoint / shard)
        return state
    if (checkpoint / "pytorch_model.bin").is_file():
        return read_pytorch_bin(checkpoint / "pytorch_model.bin")
    raise ConversionError(f"{checkpoint}: no weights (model.safetensors, "
                          "model.safetensors.index.json or pytorch_model.bin)")


def read_config(checkpoint: Path) -> dict:
    path = checkpoint / "config.json"
    if not path.is_file():
        raise ConversionError(f"{checkpoint}: no config.json (is this a Hugging Face checkpoint?)")
    return json.loads(path.read_text())


def gpt2_config(config: Mapping, name: str = "checkpoint") -> Gpt2Config:
    """The GGUF hyperparameters of a Hugging Face ``config.json``; refuses what llama.cpp's GPT-2
    graph cannot compute."""
    model_type = config.get("model_type")
    if model_type != "gpt2":
        raise ConversionError(f"{name} is a {model_type!r} model; this converter only "
                              "handles GPT-2 (model_type 'gpt2')")
    act = config.get("activation_function", "gelu_new")
    if act not in _TANH_GELUS:
        raise ConversionError(f"activation {act!r}: llama.cpp's GPT-2 uses the tanh GELU "
                              f"({', '.join(sorted(_TANH_GELUS))})")
    if not config.get("scale_attn_weights", True) or config.get(
            "scale_attn_by_inverse_layer_idx", False):
        raise ConversionError("non-standard attention scaling: llama.cpp's GPT-2 always "
                              "divides by sqrt(head size)")
    try:
        return Gpt2Config(
            n_vocab=config["vocab_size"],
            n_ctx=config.get("n_positions") or config["n_ctx"],
            n_embd=config["n_embd"], n_layer=config["n_layer"], n_head=config["n_head"],
            n_ff=config.get("n_inner") or 0,  # None means 4 * n_embd
            layer_norm_eps=config.get("layer_norm_epsilon", 1e-5))
    except KeyError as exc:
        raise ConversionError(f"{name}: config.json has no {exc.args[0]!r}") from exc


def gguf_weights(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face GPT-2 weights -> GGUF names, Conv1D matrices transposed to (n_out, n_in)."""
    weights: dict[str, np.ndarray] = {}
    lm_head = None
    for hf_name, array in state.items():
        name = hf_name.removeprefix("transformer.")
        if name == "lm_head.weight":
            lm_head = array
        elif name in _GLOBAL_NAMES:
            weights[_GLOBAL_NAMES[name]] = array
        elif (m := re.fullmatch(r"h\.(\d+)\.(.+)", name)) and m[2] in _LAYER_NAMES:
            target, conv1d = _LAYER_NAMES[m[2]]
            weights[f"blk.{m[1]}.{target}"] = array.T if conv1d else array
        else:
            raise ConversionError(f"unexpected tensor {hf_name!r} for a GPT-2 model")
    if lm_head is not None and not np.array_equal(lm_head, weights.get("token_embd.weight")):
        weights["output.weight"] = lm_head  # untied: llama.cpp uses output.weight when present
    return weights


def _vocab_and_merges(checkpoint: Path) -> tuple[dict[str, int], list[str], set[str]]:
    """Token -> id, merges ("a b"), and the tokens marked special, from either tokenizer format."""
    special: set[str] = {"<|endoftext|>"}
    if (checkpoint / "vocab.json").is_file() and (checkpoint / "merges.txt").is_file():
        vocab = json.loads((checkpoint / "vocab.json").read_text(encoding="utf-8"))
        lines = (checkpoint / "merges.txt").read_text(encoding="utf-8").splitlines()
        merges = [ln for ln in lines if ln and not ln.startswith("#version")]
        tok_config = checkpoint / "tokenizer_config.json"
        if tok_config.is_file():
            added = json.loads(tok_config.read_text()).get("added_tokens_decoder", {})
            for id_, tok in added.items():
                vocab.setdefault(tok["content"], int(id_))
                if tok.get("special"):
                    special.add(tok["content"])
        return vocab, merges, special
    if (checkpoint / "tokenizer.json").is_file():
        spec = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
        model = spec.get("model", {})
        if model.get("type") != "BPE":
            raise ConversionError(f"tokenizer.json holds a {model.get('type')!r} tokenizer, "
                                  "not GPT-2's byte-level BPE")
        vocab = dict(model["vocab"])
        # older files store merges as "a b" strings, newer ones as ["a", "b"] pairs
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        for tok in spec.get("added_tokens", []):
            vocab.setdefault(tok["content"], tok["id"])
            if tok.get("special"):
                special.add(tok["content"])
        return vocab, merges, special
    raise ConversionError(f"{checkpoint}: no tokenizer (vocab.json + merges.txt, or "
                          "tokenizer.json)")


def read_tokenizer(checkpoint: Path, n_vocab: int, config: Mapping) -> Vocab:
    """The GGUF tokenizer: tokens in id order, padded to the embedding's ``n_vocab`` rows with
    unused ``[PAD<id>]`` tokens as llama.cpp's own converter does; bos/eos from ``config``."""
    vocab, merges, special = _vocab_and_merges(checkpoint)
    if max(vocab.values()) >= n_vocab:
        raise ConversionError(f"the tokenizer has ids up to {max(vocab.values())}, but the "
                              f"embedding only {n_vocab} rows")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [int(gguf.TokenType.UNUSED)] * n_vocab
    for token, id_ in vocab.items():
        tokens[id_] = token
        types[id_] = int(gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL)
    eot = vocab.get("<|endoftext|>", n_vocab - 1)
    bos, eos = config.get("bos_token_id"), config.get("eos_token_id")
    return Vocab(tokens=tokens, merges=merges, token_types=types,
                 bos_id=eot if bos is None else bos, eos_id=eot if eos is None else eos)


def convert(checkpoint: str | Path, out: str | Path, ftype: str = "f16") -> Path:
    """Write the GPT-2 checkpoint directory ``checkpoint`` as a GGUF file ``out``."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise ConversionError(f"{checkpoint}: not a directory")
    config = read_config(checkpoint)
    cfg = gpt2_config(config, checkpoint.name)
    vocab = read_tokenizer(checkpoint, cfg.n_vocab, config)
    weights = gguf_weights(read_state_dict(checkpoint))
    log.info("converting %s: %d layers, d=%d, %d heads, %d tokens -> %s (%s)", checkpoint.name,
             cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_vocab, out, ftype)
    try:
        return write_gpt2_gguf(out, cfg, weights, vocab, ftype, name=checkpoint.name)
    except ValueError as exc:  # shapes that disagree with config.json
        raise ConversionError(f"{checkpoint.name}: {exc}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.convert",
                                     description="Convert a Hugging Face GPT-2 checkpoint to GGUF.")
    parser.add_argument("checkpoint", type=Path, help="directory with config.json and weights")
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--type", dest="ftype", choices=sorted(FILE_TYPES), default="f16")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        convert(args.checkpoint, args.out, args.ftype)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
