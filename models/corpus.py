"""The training corpus of the built-in models: the running interpreter's standard library source.

What goes in (``list_files``): every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``,
code and docstrings as-is, except
- ``site-packages/``: third-party code, different on every machine;
- test suites, i.e. any directory named ``test``, ``tests`` or ``idle_test`` (``test/``,
  ``ctypes/test``, ``idlelib/idle_test``, ``lib2to3/tests`` with its deliberately broken Python 2
  files, ``unittest/test``, ...): they are 60% of the stdlib by size and mostly fixtures, byte
  strings and odd syntax written to break parsers;
- generated data: ``encodings`` charmap tables (gencodec output, 256-entry escape tables) and
  ``pydoc_data/topics.py`` (one 750 kB string of rendered docs).

Validation is a fixed list of held-out modules (``HELD_OUT``, ~5% of the tokens), so it measures
code the model has never seen rather than other windows of files it trained on.

Each file is one document, tokenized with the real GPT-2 tokenizer exactly as llama.cpp does at
run time, and documents are joined by ``<|endoftext|>``. The token arrays are cached as uint16
``.npy`` under ``~/.cache/staged-chat`` (``$XDG_CACHE_HOME`` honoured), keyed by the Python
version and a hash of the file list and contents.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import platform
import sysconfig
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

import numpy as np

from models.gguf_writer import VOCAB_PATH

log = logging.getLogger(__name__)

HELD_OUT: tuple[str, ...] = (
    # A mix of packages and single modules, docstring-heavy and code-heavy: 5.1% of the bytes of
    # CPython 3.11's corpus. Entries are stdlib-relative module files or package directories.
    "json", "wsgiref", "argparse.py", "calendar.py", "csv.py", "difflib.py", "fractions.py",
    "heapq.py", "pathlib.py", "shlex.py", "statistics.py", "textwrap.py",
)
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test"})
SKIPPED_FILES = frozenset({"pydoc_data/topics.py"})
_CHARMAP_HEADER = '""" Python Character Mapping Codec'  # first line of gencodec's tables
_FORMAT = "1"  # bump when the selection or tokenization rules change: invalidates caches
EOT_TEXT = "<|endoftext|>"


@dataclasses.dataclass(frozen=True, slots=True)
class Corpus:
    train: np.ndarray               # uint16 tokens, documents separated by the EOT token
    valid: np.ndarray               # the held-out modules, same layout
    eot: int                        # id of <|endoftext|>
    train_files: tuple[str, ...]    # stdlib-relative posix paths, in corpus order
    valid_files: tuple[str, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "staged-chat"


def list_files(root: Path) -> list[str]:
    """The corpus files under ``root`` as sorted stdlib-relative posix paths."""
    files = []
    for path in root.rglob("*.py"):
        rel = PurePosixPath(path.relative_to(root).as_posix())
        if SKIPPED_DIRS & set(rel.parts[:-1]) or str(rel) in SKIPPED_FILES:
            continue
        if rel.parts[0] == "encodings" and _is_charmap_table(path):
            continue
        files.append(str(rel))
    return sorted(files)


def _is_charmap_table(path: Path) -> bool:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read(len(_CHARMAP_HEADER)) == _CHARMAP_HEADER


def is_held_out(rel: str, held_out: Sequence[str] = HELD_OUT) -> bool:
    return any(rel == m or rel.startswith(m + "/") for m in held_out)


def split_files(files: Sequence[str], held_out: Sequence[str] = HELD_OUT,
                ) -> tuple[list[str], list[str]]:
    """(training files, validation files); disjoint, each in the order given."""
    valid = [f for f in files if is_held_out(f, held_out)]
    train = [f for f in files if not is_held_out(f, held_out)]
    return train, valid


def tokenize_documents(texts: Sequence[str], eot: int, vocab_path: Path = VOCAB_PATH,
                       ) -> np.ndarray:
    """``doc0 EOT doc1 EOT ...`` as uint16, tokenized by llama.cpp's GPT-2 tokenizer."""
    from speculative.backend import LlamaModel  # the only way we reach llama.cpp

    parts = []
    with LlamaModel(vocab_path, vocab_only=True) as model:
        if model.vocab.n_vocab > 1 << 16:
            raise ValueError(f"{model.vocab.n_vocab} tokens do not fit uint16")
        for text in texts:
            # special=False: a literal "<|endoftext|>" inside a file stays ordinary text
            parts.append(np.asarray(model.vocab.tokenize(text), dtype=np.uint16))
            parts.append(np.asarray([eot], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.empty(0, np.uint16)


def eot_id(vocab_path: Path = VOCAB_PATH) -> int:
    """The id of ``<|endoftext|>`` (GPT-2: 50256), the document separator."""
    from speculative.backend import LlamaModel

    with LlamaModel(vocab_path, vocab_only=True) as model:
        ids = model.vocab.tokenize(EOT_TEXT, special=True)
    if len(ids) != 1:
        raise ValueError(f"{vocab_path.name} has no {EOT_TEXT} token")
    return ids[0]


def load_corpus(root: Path | None = None, cache_dir: Path | None = None,
                held_out: Sequence[str] = HELD_OUT, vocab_path: Path = VOCAB_PATH) -> Corpus:
    """Tokenized training and validation splits, from the cache when it is current."""
    root = root or stdlib_root()
    cache_dir = cache_dir or default_cache_dir()
    train_files, valid_files = split_files(list_files(root), held_out)
    texts = {f: (root / f).read_bytes().decode("utf-8") for f in train_files + valid_files}
    key = _cache_key(train_files, valid_files, texts, vocab_path)
    stem = f"corpus-{platform.python_version()}-{key}"
    paths = {split: cache_dir / f"{stem}-{split}.npy" for split in ("train", "valid")}
    eot = eot_id(vocab_path)
    if all(p.is_file() for p in paths.values()):
        log.info("corpus from cache %s", paths["train"].parent)
        arrays = {split: np.load(p) for split, p in paths.items()}
    else:
        log.info("tokenizing %d files under %s", len(texts), root)
        arrays = {"train": tokenize_documents([texts[f] for f in train_files], eot, vocab_path),
                  "valid": tokenize_documents([texts[f] for f in valid_files], eot, vocab_path)}
        cache_dir.mkdir(parents=True, exist_ok=True)
        for split, path in paths.items():
            tmp = path.with_suffix(".tmp.npy")  # write then rename: no half-written cache
            np.save(tmp, arrays[split])
            tmp.replace(path)
    return Corpus(train=arrays["train"], valid=arrays["valid"], eot=eot,
                  train_files=tuple(train_files), valid_files=tuple(valid_files))


def _cache_key(train_files: Sequence[str], valid_files: Sequence[str], texts: dict[str, str],
               vocab_path: Path) -> str:
    h = hashlib.sha256(_FORMAT.encode())
    h.update(hashlib.sha256(Path(vocab_path).read_bytes()).digest())
    for split, files in (("train", train_files), ("valid", valid_files)):
        for f in files:
            h.update(f"{split}\0{f}\0".encode())
            h.update(hashlib.sha256(texts[f].encode()).digest())
    return h.hexdigest()[:16]
