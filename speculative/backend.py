"""The only module that talks to llama.cpp (through llama-cpp-python's ctypes layer).

Everything else sees ``LlamaModel`` (weights + tokenizer) and ``LlamaContext`` (a KV cache you
decode token batches into), which satisfy ``speculative.protocols.Context``. llama.cpp *aborts the
process* on some misuse (a batch over ``n_batch``, a sequence id over ``n_seq_max``), so every such
precondition is checked here first and raised as a Python exception.

Why the context parameters are what they are (see ``../shared/PLATFORM-NOTES.md``):
- ``kv_unified=True``: a token tree shares its ancestors' KV cells across sequences; only the
  unified cache lets one cell belong to several sequences.
- ``n_ubatch == n_batch``: a tree batch must not be split into micro-batches.
- flash attention on, off, or (``ContextConfig.flash_attn = None``, resolved when a pair is
  opened: ``speculative.loading``) whichever this machine decodes faster over the window. With
  it on, its CPU kernel computes each query row on its own, so a row's logits no longer depend
  on how many tokens share its batch (without it the attention's matrix products take another
  code path for one token than for several, and round differently); but that kernel walks the
  cached context row by row, and on some CPUs a pass then grows several times faster with the
  context than with it off, batches most (README). What moves a logit either way is the order
  of the KV cells it attends to (``speculative.divergence``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import math
import os
import platform
import struct
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import (
    BatchTooLarge,
    ContextOverflow,
    ContextTooLarge,
    LlamaError,
    ModelLoadError,
    TooManySequences,
)
from .penalties import breaker_tokens

log = logging.getLogger(__name__)

# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continues the last line)
_GGML_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_llama_log = logging.getLogger("llama.cpp")
_last_level = logging.DEBUG
_recent_errors: list[str] = []


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # Route llama.cpp's chatter into logging (it prints to stderr otherwise) and keep the last
    # errors so a failed load can say *why*. Level 5 continues the previous message.
    global _last_level
    lvl = _last_level if level == 5 else _GGML_LEVELS.get(level, logging.DEBUG)
    _last_level = lvl
    msg = text.decode("utf-8", "replace").rstrip()
    if lvl >= logging.WARNING and msg:
        _recent_errors.append(msg)
        del _recent_errors[:-8]
    # llama.cpp's INFO is a flood (every tensor on load): keep it at DEBUG for us.
    _llama_log.log(logging.DEBUG if lvl == logging.INFO else lvl, "%s", msg)


llama_cpp.llama_backend_init()
llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


def _take_errors() -> str:
    msg = "; ".join(m for m in _recent_errors if m)
    _recent_errors.clear()
    return msg


def _has_amx() -> bool:
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    return "AMX_INT8 = 1" in info


# Q8_0 crashes (SIGSEGV in ggml_backend_amx_mul_mat) in the AMX repacked kernels that llama.cpp
# keeps in its extra buffer types; elsewhere (e.g. ARM) those buffers hold the fast kernels, so
# they are turned off only on x86 CPUs with AMX. Read at every load (tests set it).
_AMX = platform.machine().lower() in {"x86_64", "amd64"} and _has_amx()
_llama_model_default_params = llama_cpp.llama_cpp.llama_model_default_params


def host_model_params() -> llama_cpp.llama_model_params:
    """llama.cpp's default model parameters with this host's rules applied: the starting point
    of every model load, ours (``LlamaModel``) and the benchmark's peers (``peer_generate``)."""
    params = _llama_model_default_params()
    if _AMX:
        _with_fields(params, use_extra_bufts=False)
    return params


@contextlib.contextmanager
def _high_level_loads_with_host_rules() -> Iterator[None]:
    """llama-cpp-python's ``Llama`` builds its model parameters from
    ``llama_model_default_params()`` and has no argument for the extra buffer types: while this
    is open, that function hands it ``host_model_params()``."""
    module = llama_cpp.llama_cpp
    module.llama_model_default_params = host_model_params
    try:
        yield
    finally:
        module.llama_model_default_params = _llama_model_default_params


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count() or 1)


# GGUF metadata value types (gguf.GGUFValueType): struct formats of the fixed-size ones
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGML_MAX_DIMS = 4
_U64 = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True, slots=True)
class GgufHeader:
    """A GGUF file's header, walked and bounds-checked in Python before llama.cpp reads it."""

    version: int
    architecture: str | None
    context_length: int | None  # ``<architecture>.context_length``: the trained window
    n_tensors: int
    size_needed: int  # bytes the header and all tensor data span: at most the file's size
    metadata: dict[str, Any]  # scalar and string values by key (strings decoded; arrays: None)


class _Corrupt(Exception):
    """Where and how a GGUF header is malformed (turned into ``ModelLoadError``)."""


class _NeedMore(Exception):
    """The header goes on past the bytes read so far."""


_HEADER_FIRST_READ = 4 << 20  # bytes read first; more (doubling) if the header goes on
_HEADER_MAX = 256 << 20  # no real header comes near this (GPT-2's 50k-token vocabulary: 1.8 MB)


class _HeaderReader:
    """A cursor over the first bytes of a file that refuses to read past the file's end."""

    def __init__(self, buf: bytes, file_size: int) -> None:
        self.buf, self.pos, self.end = buf, 0, file_size

    def _need(self, n: int, what: str) -> None:
        if self.pos + n > self.end:
            raise _Corrupt(what)
        if self.pos + n > len(self.buf):
            raise _NeedMore

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size, f"the file ends inside its header (at byte {self.pos})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def skip(self, n: int, what: str) -> None:
        self._need(n, f"{what} at byte {self.pos} claims {n} bytes, past the end of the file")
        self.pos += n

    def string(self, what: str) -> bytes:
        n = self.unpack("<Q")
        start = self.pos
        self.skip(n, what)
        return bytes(self.buf[start:self.pos])

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        """The value (scalars and strings) or None (arrays, skipped)."""
        if vtype in _GGUF_SCALARS:
            return self.unpack(_GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            return self.string(f"string {key!r}")
        if vtype != _GGUF_ARRAY or depth > 2:
            raise _Corrupt(f"key {key!r} has unknown value type {vtype}")
        etype, count = self.unpack("<I"), self.unpack("<Q")
        if etype in _GGUF_SCALARS:
            self.skip(count * struct.calcsize(_GGUF_SCALARS[etype]), f"array {key!r}")
        elif etype == _GGUF_STRING:
            self._skip_strings(count, key)
        else:
            if count > self.end - self.pos:
                raise _Corrupt(f"array {key!r} claims {count} elements, more than the file holds")
            for _ in range(count):
                self.value(etype, key, depth + 1)
        return None

    def _skip_strings(self, count: int, key: str) -> None:
        # the tokenizer's strings: one tight loop, not one method call per string
        buf, pos, have, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        if count > (self.end - pos) // 8:
            raise _Corrupt(f"array {key!r} claims {count} strings, more than the file holds")
        done = 0
        while done < count and pos + 8 <= have:
            pos += 8 + unpack(buf, pos)[0]
            done += 1
        if done == count and pos <= have:
            self.pos = pos
            return
        if (pos if done == count else pos + 8) > self.end:
            raise _Corrupt(f"array {key!r} runs past the end of the file")
        raise _NeedMore


def read_gguf_header(path: Path) -> GgufHeader:
    """Walk the header of the GGUF file at ``path``, checking every length against the file size.

    llama.cpp is handed only files whose header is well formed and whose tensor data all lies
    inside the file: a truncated download, a corrupt header or random bytes get a
    ``ModelLoadError`` naming the problem here, in Python, instead of whatever llama.cpp makes
    of them.
    """
    name = path.name
    # plain reads of a growing prefix, not a memory map: a mapped file that someone truncates
    # while it is being read kills the process with SIGBUS
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        buf = fh.read(min(size, _HEADER_FIRST_READ))
        if buf[:4] != b"GGUF":
            raise ModelLoadError(f"{name}: not a GGUF file (it starts with {buf[:4]!r}, "
                                 f"not b'GGUF')")
        while True:
            try:
                return _walk(_HeaderReader(buf, size), name)
            except _Corrupt as exc:
                raise ModelLoadError(f"{name}: corrupt or truncated GGUF file: {exc}") from None
            except _NeedMore:
                if len(buf) >= min(size, _HEADER_MAX):
                    raise ModelLoadError(f"{name}: corrupt GGUF file: its header runs past "
                                         f"{len(buf)} bytes") from None
                buf += fh.read(min(size, _HEADER_MAX, 2 * len(buf)) - len(buf))


def _walk(r: _HeaderReader, name: str) -> GgufHeader:
    r.pos = 4
    version = r.unpack("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{name}: GGUF version {version} is not supported "
                             f"(llama.cpp reads versions 2 and 3)")
    n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
    if n_kv > r.end // 13 or n_tensors > r.end // 32:  # the smallest entries: 13 and 32 bytes
        raise _Corrupt(f"the header claims {n_kv} keys and {n_tensors} tensors, more than "
                       f"{r.end} bytes can hold")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string("a key").decode("utf-8", "replace")
        vtype = r.unpack("<I")
        value = r.value(vtype, key)
        meta[key] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    arch = meta.get("general.architecture")
    arch = arch if isinstance(arch, str) else None
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment is {alignment!r}, not a power of two")
    data_end = 0
    for _ in range(n_tensors):
        tensor = r.string("a tensor name").decode("utf-8", "replace")
        n_dims = r.unpack("<I")
        if n_dims > _GGML_MAX_DIMS:
            raise _Corrupt(f"tensor {tensor!r} has {n_dims} dimensions")
        dims = [r.unpack("<Q") for _ in range(n_dims)]
        ttype, offset = r.unpack("<I"), r.unpack("<Q")
        data_end = max(data_end, offset + _tensor_bytes(tensor, dims, ttype))
    # tensor data starts at the next multiple of the alignment (a file without tensors, such as
    # a vocab-only one, may end right after its header)
    needed = -(-r.pos // alignment) * alignment + data_end if n_tensors else r.pos
    if needed > r.end:
        raise _Corrupt(f"the file is {r.end} bytes but its tensor data runs to byte {needed} "
                       f"(a download or copy cut short?)")
    context = meta.get(f"{arch}.context_length")
    return GgufHeader(version, arch, context if isinstance(context, int) else None, n_tensors,
                      needed, meta)


_LLAMA_MAX_LAYERS = 512


def check_gpt2_hparams(header: GgufHeader, name: str) -> None:
    """Refuse GPT-2 hyperparameters on which llama.cpp asserts (aborting the whole process)
    instead of returning an error; each case below was seen to abort llama.cpp 0.3.36."""
    meta = header.metadata
    n_layer = meta.get("gpt2.block_count")
    if isinstance(n_layer, int) and not 1 <= n_layer <= _LLAMA_MAX_LAYERS:
        raise ModelLoadError(f"{name}: gpt2.block_count is {n_layer}; llama.cpp takes 1 to "
                             f"{_LLAMA_MAX_LAYERS} layers")
    n_embd, n_head = meta.get("gpt2.embedding_length"), meta.get("gpt2.attention.head_count")
    if isinstance(n_embd, int) and isinstance(n_head, int) and 0 < n_head <= n_embd < 2 * n_head:
        # one value per head: the attention graph's matrix shapes no longer fit
        raise ModelLoadError(f"{name}: {n_head} attention heads of {n_embd} values leave "
                             f"fewer than 2 values per head")
    eps = meta.get("gpt2.attention.layer_norm_epsilon")
    if isinstance(eps, float) and not (math.isfinite(eps) and eps >= 0.0):
        raise ModelLoadError(f"{name}: gpt2.attention.layer_norm_epsilon is {eps}; it must be "
                             f"a finite number >= 0")


def _tensor_bytes(name: str, dims: Sequence[int], ttype: int) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        raise _Corrupt(f"tensor {name!r} has unknown type {ttype}") from None
    n = math.prod(dims)
    if dims and dims[0] % block:
        raise _Corrupt(f"tensor {name!r}: row of {dims[0]} values is not a multiple of its "
                       f"block size {block}")
    return n // block * type_size


class Vocabulary:
    """A model's tokenizer. Valid while its ``LlamaModel`` is open."""

    def __init__(self, vocab_ptr: llama_cpp.llama_vocab_p, owner: LlamaModel) -> None:
        self._vocab = vocab_ptr
        self._owner = owner  # keeps the model (which owns the vocab) alive
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(vocab_ptr)
        self.bos: int = llama_cpp.llama_vocab_bos(vocab_ptr)
        self.eos: int = llama_cpp.llama_vocab_eos(vocab_ptr)
        self._containing: dict[tuple[str, ...], frozenset[int]] = {}

    def tokens_containing(self, strings: Sequence[str]) -> frozenset[int]:
        """Tokens whose text contains one of ``strings`` (scanned once per set of strings)."""
        key = tuple(strings)
        if key not in self._containing:
            self._containing[key] = breaker_tokens(key, self.n_vocab, self.piece)
        return self._containing[key]

    def tokenize(self, text: str | bytes, special: bool = False) -> list[int]:
        """Tokens of ``text``; ``special`` lets ``<|endoftext|>`` in the text become that token."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        cap = len(data) + 8
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, False, special)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, False, special)
        if n < 0:
            raise LlamaError(f"tokenization failed ({n})")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes of one token; concatenating pieces reproduces text exactly."""
        self.check_token(token)
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def token_text(self, token: int) -> bytes:
        """The token's entry in the GGUF vocabulary (byte-level BPE text, e.g. 'Ġthe')."""
        self.check_token(token)
        return llama_cpp.llama_vocab_get_text(self._vocab, token) or b""

    def difference(self, other: Vocabulary) -> str | None:
        """Why a draft with vocabulary ``other`` cannot draft for this one, or None."""
        if other.n_vocab != self.n_vocab:
            return f"{other.n_vocab} tokens instead of {self.n_vocab}"
        if (other.bos, other.eos) != (self.bos, self.eos):
            return f"BOS/EOS are {other.bos}/{other.eos} instead of {self.bos}/{self.eos}"
        for t in range(self.n_vocab):
            if self.token_text(t) != other.token_text(t):
                return (f"token {t} is {other.token_text(t)!r} instead of "
                        f"{self.token_text(t)!r}")
        return None

    def check_token(self, token: int) -> None:
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} outside the vocabulary (0..{self.n_vocab - 1})")


class LlamaModel:
    """GGUF weights loaded by llama.cpp. Use as a context manager or call ``close()``."""

    def __init__(self, path: str | Path, vocab_only: bool = False,
                 architectures: Sequence[str] | None = ("gpt2",), gpu_layers: int = 0) -> None:
        """``gpu_layers``: layers offloaded to a GPU when llama-cpp-python was built with a GPU
        backend (CUDA, Metal, Vulkan, ...); 0 keeps everything on the CPU, -1 offloads all."""
        self._model: llama_cpp.llama_model_p | None = None
        self.path = Path(path)
        self.gpu_layers = gpu_layers
        if not self.path.is_file():
            why = "not a file" if self.path.exists() else "no such file"
            raise ModelLoadError(f"{self.path}: {why}")
        self.header = read_gguf_header(self.path)
        arch = self.header.architecture
        if architectures is not None and arch not in architectures:
            what = (f"a {arch!r} model" if arch is not None
                    else "a GGUF file that names no architecture (no general.architecture key)")
            raise ModelLoadError(f"{self.path.name} is {what}; Staged Chat runs "
                                 f"{', '.join(architectures)} models")
        if arch == "gpt2":
            check_gpt2_hparams(self.header, self.path.name)
        params = _with_fields(
            host_model_params(), vocab_only=vocab_only,
            n_gpu_layers=gpu_layers if gpu_layers >= 0 else 1 << 30,
            # read the weights into memory rather than mapping the file (AUTO maps it): a mapped
            # file overwritten in place while loaded (a re-download, `cp` over it) kills the
            # process with SIGBUS at the next decode; a copy in memory does not care
            load_mode=llama_cpp.LLAMA_LOAD_MODE_NONE, lazy_mode=llama_cpp.LLAMA_LAZY_MODE_OFF)
        _take_errors()
        ptr = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not ptr:
            raise ModelLoadError(f"{self.path}: llama.cpp could not load it: "
                                 f"{_take_errors() or 'unknown error'}")
        self._model = ptr
        self.vocab = Vocabulary(llama_cpp.llama_model_get_vocab(ptr), self)
        self.architecture = self.meta("general.architecture") or "unknown"
        if architectures is not None and self.architecture not in architectures:
            self.close()
            raise ModelLoadError(f"{self.path.name} is a {self.architecture!r} model; Staged Chat "
                                 f"runs {', '.join(architectures)} models")
        self.n_ctx_train: int = llama_cpp.llama_model_n_ctx_train(ptr)
        self.n_params: int = llama_cpp.llama_model_n_params(ptr)
        self.size_bytes: int = llama_cpp.llama_model_size(ptr)
        self.name = self.meta("general.name") or self.path.stem

    @property
    def ptr(self) -> llama_cpp.llama_model_p:
        if self._model is None:
            raise LlamaError("model is closed")
        return self._model

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(512)
        n = llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def close(self) -> None:
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


@dataclasses.dataclass(frozen=True, slots=True)
class ContextConfig:
    n_ctx: int = 1024        # the window; never beyond the model's trained context (see fit)
    n_batch: int = 128       # max tokens per decode: a whole tree, or a prompt chunk
    n_seq_max: int = 64      # max sequence ids: one per tree leaf (llama.cpp allows <= 256)
    n_threads: int = 0       # 0: every core this process may use
    # on: a row's logits do not depend on its batch's size (see above); None: whichever this
    # machine decodes faster, measured when the pair is opened (``speculative.loading``)
    flash_attn: bool | None = True
    # a window beyond the model's trained context (GPT-2's learned positions end there):
    # True shrinks it to the model's, False refuses it with ContextTooLarge
    fit: bool = True

    def __post_init__(self) -> None:
        # llama.cpp reads n_ctx=0 as "the model's" and n_batch=0 as its default: say what you mean
        if self.n_ctx < 1 or self.n_batch < 1 or self.n_threads < 0:
            raise ValueError(f"n_ctx and n_batch must be >= 1 and n_threads >= 0: {self}")
        if not 1 <= self.n_seq_max <= 256:
            raise ValueError(f"n_seq_max must be in 1..256 (llama.cpp's limit), "
                             f"got {self.n_seq_max}")


def fit_window(config: ContextConfig, n_ctx_train: int, name: str) -> int:
    """The window a context gets: ``config.n_ctx``, at most the trained context ``n_ctx_train``
    (0: unknown), or ``ContextTooLarge`` if ``config.fit`` is off."""
    if n_ctx_train <= 0 or config.n_ctx <= n_ctx_train:
        return config.n_ctx
    if not config.fit:
        raise ContextTooLarge(f"a context of {config.n_ctx} tokens was asked for, but {name} "
                              f"was trained on {n_ctx_train}: it has no positions beyond them")
    log.info("%s: context of %d tokens shrunk to the %d it was trained on", name, config.n_ctx,
             n_ctx_train)
    return n_ctx_train


def _with_fields(params: Any, **values: Any) -> Any:
    """Set fields of a llama.cpp parameter struct. A ctypes struct takes *any* attribute name
    silently, so a field renamed between llama.cpp versions would be ignored: refuse it."""
    names = {name for name, *_ in type(params)._fields_}
    for name, value in values.items():
        if name not in names:
            raise LlamaError(f"{type(params).__name__} has no field {name!r} in this llama.cpp")
        setattr(params, name, value)
    return params


class LlamaContext:
    """A KV cache plus compute buffers for one model; decodes batches of (token, pos, seq ids)."""

    def __init__(self, model: LlamaModel, config: ContextConfig = ContextConfig()) -> None:
        self._ctx: llama_cpp.llama_context_p | None = None
        if config.flash_attn is None:
            raise ValueError("flash_attn None (measure it) is resolved when a pair is opened "
                             "(speculative.loading.open_pair); a context needs on or off")
        self.model = model
        self.n_vocab = model.vocab.n_vocab
        n_ctx = fit_window(config, model.n_ctx_train, model.path.name)
        threads = config.n_threads or default_threads()
        params = _with_fields(
            llama_cpp.llama_context_default_params(), n_ctx=n_ctx, n_batch=config.n_batch,
            n_ubatch=config.n_batch, n_seq_max=config.n_seq_max,
            # llama.cpp reserves outputs for one token per sequence and asserts (aborting the
            # process) if that exceeds n_outputs_max, whose default is n_batch
            n_outputs_max=max(config.n_batch, config.n_seq_max),
            n_threads=threads, n_threads_batch=threads, kv_unified=True, no_perf=True,
            flash_attn_type=(llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn
                             else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED))
        _take_errors()
        ptr = llama_cpp.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise LlamaError(f"could not create a context for {model.path.name}: "
                             f"{_take_errors() or 'unknown error'}")
        self._ctx = ptr
        self._mem = llama_cpp.llama_get_memory(ptr)
        # llama.cpp pads its cache to a multiple of 256 cells; positions past the request (and
        # past GPT-2's learned position embeddings) are refused here. The cells are shared by all
        # sequences (kv_unified), and n_ctx <= n_cells, so whoever keeps a tree within n_ctx
        # cells (speculative.kvtree) never meets "failed to find a memory slot".
        self.n_cells: int = llama_cpp.llama_n_ctx(ptr)
        self.n_ctx: int = min(self.n_cells, n_ctx)
        self.n_batch: int = llama_cpp.llama_n_batch(ptr)
        self.n_seq_max: int = llama_cpp.llama_n_seq_max(ptr)
        self.n_threads, self.flash_attn = threads, config.flash_attn
        # seconds every decode waits after llama.cpp's pass (benchmarks only: ``emulate``)
        self.pass_latency = 0.0
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, self.n_seq_max)
        # numpy views over the batch's C arrays: filling them costs far less than ctypes indexing
        b = self._batch
        self._tok = np.ctypeslib.as_array(b.token, (self.n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, (self.n_batch,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, (self.n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, (self.n_batch,))
        self._seqs = [np.ctypeslib.as_array(b.seq_id[i], (self.n_seq_max,))
                      for i in range(self.n_batch)]

    @property
    def ptr(self) -> llama_cpp.llama_context_p:
        if self._ctx is None:
            raise LlamaError("context is closed")
        return self._ctx

    @property
    def cost_key(self) -> str:
        """What a measured decode-cost curve depends on: the file, the machine, the settings
        (``speculative.costmodel`` caches curves under it), and an emulated latency."""
        key = "|".join(str(x) for x in (
            setting_key(self.model, self.n_threads, self.n_batch), self.flash_attn))
        return key + (f"|latency {self.pass_latency!r}" if self.pass_latency else "")

    def emulate(self, latency: float) -> None:
        """Make every decode take ``latency`` seconds more (0: none), as a pass with that fixed
        cost would: how the engine fares where the cost of a pass barely grows with its batch
        (a GPU, a memory-bound model on a CPU with matrix units) can then be measured on any
        host. For benchmarks only: the figures are not this host's."""
        if latency < 0 or not math.isfinite(latency):
            raise ValueError(f"an emulated latency must be >= 0 seconds, got {latency!r}")
        self.pass_latency = float(latency)

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               seq_ids: Sequence[Sequence[int]], logits: Sequence[bool] | bool = True,
               ) -> np.ndarray:
        """Decode one batch; returns the logits of the rows asked for, ``(n_out, n_vocab)``.

        Token ``i`` sits at ``positions[i]`` in every sequence of ``seq_ids[i]``; a token tree
        needs each node to carry the ids of all leaves below it (see ``speculative/kvtree.py``).
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("empty batch")
        if n > self.n_batch:
            raise BatchTooLarge(f"{n} tokens in one batch, but n_batch is {self.n_batch}")
        if len(positions) != n or len(seq_ids) != n:
            raise ValueError("tokens, positions and seq_ids differ in length")
        top = max(positions)
        if min(positions) < 0 or top >= self.n_ctx:
            raise ContextOverflow(f"position {top} does not fit a context of {self.n_ctx} tokens")
        want = [logits] * n if isinstance(logits, bool) else list(logits)
        for i, (tok, seqs) in enumerate(zip(tokens, seq_ids, strict=True)):
            if not 0 <= tok < self.n_vocab:
                raise ValueError(f"token id {tok} outside the vocabulary of {self.n_vocab}")
            if not seqs or len(seqs) > self.n_seq_max:
                raise TooManySequences(f"token {i} has {len(seqs)} sequence ids "
                                       f"(1..{self.n_seq_max} allowed)")
            k = len(seqs)
            self._seqs[i][:k] = seqs
            if min(seqs) < 0 or max(seqs) >= self.n_seq_max:
                raise TooManySequences(f"sequence id {max(seqs)} but n_seq_max is "
                                       f"{self.n_seq_max}")
            self._nseq[i] = k
        self._tok[:n] = tokens
        self._pos[:n] = positions
        self._out[:n] = want
        self._batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ptr, self._batch)
        if self.pass_latency:
            time.sleep(self.pass_latency)
        if rc != 0:
            raise LlamaError(f"llama_decode failed ({rc}): {_take_errors() or 'no message'}")
        n_out = sum(want)
        if n_out == 0:
            return np.empty((0, self.n_vocab), np.float32)
        block = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ptr), (n_out, self.n_vocab))
        return block.copy()  # llama.cpp reuses the buffer on the next decode

    # KV-cache operations on sequences; positions are half-open [p0, p1), -1 meaning "open end".
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._check_seq(src, dst)
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        self._check_seq(seq)
        llama_cpp.llama_memory_seq_keep(self._mem, seq)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self._check_seq(seq)
        if not llama_cpp.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise LlamaError(f"could not remove positions [{p0}, {p1}) of sequence {seq}")

    def seq_pos_max(self, seq: int) -> int:
        """The largest position held by ``seq``, or -1 when it is empty."""
        self._check_seq(seq)
        return llama_cpp.llama_memory_seq_pos_max(self._mem, seq)

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)

    def _check_seq(self, *seqs: int) -> None:
        for s in seqs:
            if not 0 <= s < self.n_seq_max:
                raise TooManySequences(f"sequence id {s} but n_seq_max is {self.n_seq_max}")

    def close(self) -> None:
        if self._ctx is not None:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> LlamaContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def setting_key(model: LlamaModel, threads: int, n_batch: int) -> str:
    """The file, the machine and the settings a measured decode cost depends on, but for flash
    attention (``LlamaContext.cost_key`` adds it)."""
    stat = model.path.stat()
    return "|".join(str(x) for x in (
        model.path.resolve(), stat.st_size, int(stat.st_mtime), threads or default_threads(),
        n_batch, model.gpu_layers, system_info()))


def system_info() -> str:
    """llama.cpp's build and the CPU features it uses (for the About box and benchmarks)."""
    return llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()


def peer_generate(model_path: str | Path, prompt: Sequence[int], n_tokens: int, n_threads: int,
                  n_ctx: int, prompt_lookup: int = 0, flash_attn: bool = True,
                  ) -> tuple[list[int], float]:
    """Greedy generation by llama-cpp-python's own high-level ``Llama`` (a benchmark peer):
    plain, or its speculative path with ``LlamaPromptLookupDecoding`` proposing
    ``prompt_lookup`` tokens. Returns the tokens and the seconds from the first token to the
    last (prefill excluded, as ``RunStats`` counts: ``n - 1`` tokens in that time);
    ``flash_attn`` as the engine it is compared with runs."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup) if prompt_lookup else None
    with _high_level_loads_with_host_rules():
        llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=n_ctx,
                              n_batch=max(64, n_ctx // 2), n_threads=n_threads,
                              n_threads_batch=n_threads, flash_attn=flash_attn, draft_model=draft,
                              verbose=False)
    try:
        out: list[int] = []
        t0 = 0.0
        eos = llm.token_eos()
        for token in llm.generate(list(prompt), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                  repeat_penalty=1.0):
            if not out:
                t0 = time.perf_counter()
            if token == eos:
                break
            out.append(int(token))
            if len(out) >= n_tokens or len(prompt) + len(out) >= n_ctx:
                break
        return out, time.perf_counter() - t0
    finally:
        llm.close()
