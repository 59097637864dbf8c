"""The only module that talks to llama.cpp (through llama-cpp-python's ctypes layer).

Everything else sees ``LlamaModel`` (weights + tokenizer) and ``LlamaContext`` (a KV cache you
decode token batches into), which satisfy ``speculative.protocols.Context``. llama.cpp *aborts the
process* on some misuse (a batch over ``n_batch``, a sequence id over ``n_seq_max``), so every such
precondition is checked here first and raised as a Python exception.

Why the context parameters are what they are (see ``../shared/PLATFORM-NOTES.md``):
- ``kv_unified=True``: a token tree shares its ancestors' KV cells across sequences; only the
  unified cache lets one cell belong to several sequences.
- ``n_ubatch == n_batch``: a tree batch must not be split into micro-batches.
- flash attention off by default: with it off, Q8_0 tree logits equal sequential decoding exactly.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import platform
import struct
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np

from .errors import (
    BatchTooLarge,
    ContextOverflow,
    LlamaError,
    ModelLoadError,
    TooManySequences,
)

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


_AMX = platform.machine().lower() in {"x86_64", "amd64"} and _has_amx()


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count() or 1)


def _peek_architecture(path: Path) -> str | None:
    """``general.architecture`` from the GGUF header, read before llama.cpp sees the file (it
    is the first key in files written by llama.cpp's tools; None if it is not there)."""
    with open(path, "rb") as fh:
        head = fh.read(4096)
    if head[:4] != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic)")
    try:
        n_kv = struct.unpack_from("<Q", head, 16)[0]
        if n_kv == 0:
            return None
        (klen,) = struct.unpack_from("<Q", head, 24)
        key = head[32:32 + klen]
        (vtype,) = struct.unpack_from("<I", head, 32 + klen)
        if key != b"general.architecture" or vtype != 8:  # 8: GGUF string
            return None
        (vlen,) = struct.unpack_from("<Q", head, 36 + klen)
        return head[44 + klen:44 + klen + vlen].decode("utf-8", "replace")
    except struct.error:
        return None  # too short to tell: llama.cpp will say what is wrong


class Vocabulary:
    """A model's tokenizer. Valid while its ``LlamaModel`` is open."""

    def __init__(self, vocab_ptr: llama_cpp.llama_vocab_p, owner: LlamaModel) -> None:
        self._vocab = vocab_ptr
        self._owner = owner  # keeps the model (which owns the vocab) alive
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(vocab_ptr)
        self.bos: int = llama_cpp.llama_vocab_bos(vocab_ptr)
        self.eos: int = llama_cpp.llama_vocab_eos(vocab_ptr)

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
                 architectures: Sequence[str] | None = ("gpt2",)) -> None:
        self._model: llama_cpp.llama_model_p | None = None
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such file")
        arch = _peek_architecture(self.path)
        if architectures is not None and arch is not None and arch not in architectures:
            raise ModelLoadError(f"{self.path.name} is a {arch!r} model; Staged Chat runs "
                                 f"{', '.join(architectures)} models")
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = vocab_only
        # Q8_0 crashes in the AMX repacked kernels on this CPU family; elsewhere (e.g. ARM)
        # the extra buffer types hold the fast kernels, so only turn them off where needed.
        if _AMX:
            params.use_extra_bufts = False
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
    n_ctx: int = 1024        # capped at the model's trained context (GPT-2: learned positions)
    n_batch: int = 128       # max tokens per decode: a whole tree, or a prompt chunk
    n_seq_max: int = 64      # max sequence ids: one per tree leaf (llama.cpp allows <= 256)
    n_threads: int = 0       # 0: every core this process may use
    flash_attn: bool = False  # off: Q8_0 tree logits then equal sequential decoding exactly


class LlamaContext:
    """A KV cache plus compute buffers for one model; decodes batches of (token, pos, seq ids)."""

    def __init__(self, model: LlamaModel, config: ContextConfig = ContextConfig()) -> None:
        if not 1 <= config.n_seq_max <= 256:
            raise ValueError(f"n_seq_max must be in 1..256 (llama.cpp's limit), "
                             f"got {config.n_seq_max}")
        self._ctx: llama_cpp.llama_context_p | None = None
        self.model = model
        self.n_vocab = model.vocab.n_vocab
        n_ctx = min(config.n_ctx, model.n_ctx_train) if model.n_ctx_train > 0 else config.n_ctx
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = config.n_batch
        params.n_seq_max = config.n_seq_max
        # llama.cpp reserves outputs for one token per sequence and asserts (aborting the
        # process) if that exceeds n_outputs_max, whose default is n_batch
        params.n_outputs_max = max(config.n_batch, config.n_seq_max)
        threads = config.n_threads or default_threads()
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.no_perf = True
        _take_errors()
        ptr = llama_cpp.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise LlamaError(f"could not create a context for {model.path.name}: "
                             f"{_take_errors() or 'unknown error'}")
        self._ctx = ptr
        self._mem = llama_cpp.llama_get_memory(ptr)
        # llama.cpp may pad its cache beyond what was asked; positions past the request (and past
        # GPT-2's learned position embeddings) are refused here
        self.n_ctx: int = min(llama_cpp.llama_n_ctx(ptr), n_ctx)
        self.n_batch: int = llama_cpp.llama_n_batch(ptr)
        self.n_seq_max: int = llama_cpp.llama_n_seq_max(ptr)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, self.n_seq_max)
        # numpy views over the batch's C arrays: filling them is ~100x faster than ctypes indexing
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
