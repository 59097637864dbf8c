"""The training corpus of the built-in models: Python source and some English prose.

Three kinds of documents, each one file or one text (``Corpus.train_files`` names them):

- ``stdlib/...``: every ``.py`` file of the running interpreter's standard library, code and
  docstrings as-is, except test suites (directories named ``test``, ``tests``, ``idle_test``:
  fixtures and odd syntax written to break parsers), ``site-packages/``, and generated data
  (``encodings`` charmap tables).
- ``site/...``: the Python source of the third-party packages the project itself installs
  (``PACKAGES``: torch, sympy, numpy, pip, pygments, huggingface_hub, ...), at most
  ``PACKAGE_CAP`` bytes per package so that torch does not drown the rest, chosen by a hash of
  the path (deterministic, not the first files alphabetically). Skipped: test directories,
  files over ``MAX_FILE_BYTES``, and data disguised as code (lines over ``MAX_LINE`` characters,
  generated ``_pb2`` modules). The standard library alone (4.3M tokens) was too little for the
  first built-in target to learn to count indentation: it wrote runs of spaces forever.
- ``prose/...``: English, so that prose prompts meet sentences: the long descriptions in the
  installed distributions' metadata (their READMEs) and the standard library's
  ``pydoc_data/topics.py`` (the language reference as text), one document per topic.

Validation is a fixed list of held-out standard-library modules (``HELD_OUT``, ~5% of the
stdlib), so it measures code the model has never seen and stays comparable across corpus
versions. The third-party packages' versions are recorded (``Corpus.packages``): the corpus of
another environment differs, and ``models/builtin/manifest.json`` keeps the one used.

Each document is tokenized with the real GPT-2 tokenizer exactly as llama.cpp does at run time,
and documents are joined by ``<|endoftext|>``. The token arrays are cached as uint16 ``.npy``
under ``~/.cache/staged-chat`` (``$XDG_CACHE_HOME`` honoured), keyed by a hash of the documents.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.metadata
import logging
import os
import re
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
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "testing"})
SKIPPED_FILES = frozenset({"pydoc_data/topics.py"})  # prose: see `stdlib_topics`
PACKAGES: tuple[str, ...] = (
    # Top-level import names of what `pip install -e ".[test,train]"` brings, with Python source
    # worth learning from (compiled-only packages such as ruff and hf_xet have none).
    "torch", "torchgen", "sympy", "numpy", "networkx", "pip", "pygments", "huggingface_hub",
    "setuptools", "mpmath", "_pytest", "fsspec", "llama_cpp", "gguf", "anyio", "jinja2", "click",
    "urllib3", "httpx2", "httpcore2", "filelock", "packaging", "idna", "yaml", "requests",
    "charset_normalizer", "tqdm", "diskcache", "pluggy", "PySide6", "markupsafe", "h11",
    "truststore", "pytestqt", "typing_extensions", "iniconfig",
)
PACKAGE_CAP = 6_000_000   # bytes of source per package: torch alone has 46 MB
MAX_FILE_BYTES = 400_000  # larger files are generated tables and test matrices
MAX_LINE = 400            # a longer line is data (lookup tables, base64, minified code)
_CHARMAP_HEADER = '""" Python Character Mapping Codec'  # first line of gencodec's tables
_FORMAT = "2"  # bump when the selection or tokenization rules change: invalidates caches
EOT_TEXT = "<|endoftext|>"


@dataclasses.dataclass(frozen=True, slots=True)
class Corpus:
    train: np.ndarray               # uint16 tokens, documents separated by the EOT token
    valid: np.ndarray               # the held-out modules, same layout
    eot: int                        # id of <|endoftext|>
    train_files: tuple[str, ...]    # document names ("stdlib/os.py", "site/numpy/...", ...)
    valid_files: tuple[str, ...]
    packages: dict[str, str] = dataclasses.field(default_factory=dict)  # distribution: version


@dataclasses.dataclass(frozen=True, slots=True)
class CorpusSpec:
    """Where the documents come from."""

    stdlib: Path | None                     # standard library root (validation comes from it)
    site_packages: Path | None = None       # where `packages` are looked up
    packages: tuple[str, ...] = ()
    package_cap: int = PACKAGE_CAP
    prose: bool = False                     # distribution descriptions and stdlib topics

    @classmethod
    def builtin(cls) -> CorpusSpec:
        """The built-in models' corpus in this environment."""
        return cls(stdlib_root(), Path(sysconfig.get_paths()["purelib"]), PACKAGES,
                   PACKAGE_CAP, prose=True)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "staged-chat"


def list_files(root: Path) -> list[str]:
    """The standard library's corpus files under ``root`` as sorted relative posix paths."""
    files = []
    for path in root.rglob("*.py"):
        rel = PurePosixPath(path.relative_to(root).as_posix())
        if SKIPPED_DIRS & set(rel.parts[:-1]) or str(rel) in SKIPPED_FILES:
            continue
        if rel.parts[0] == "encodings" and _is_charmap_table(path):
            continue
        text = _read(path)
        if text is None or not looks_like_code(text):
            continue
        files.append(str(rel))
    return sorted(files)


def _is_charmap_table(path: Path) -> bool:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read(len(_CHARMAP_HEADER)) == _CHARMAP_HEADER


# a line that starts with a literal: a hex or decimal number, or a short string followed by , : )
_DATA_LINE = re.compile(r"""^\s*[(\[{]?\s*"""
                        r"""(0x[0-9a-fA-F]+|-?\d|[bru]{0,2}['"][^'"]{0,40}['"]\s*[,:)\]])""")


def looks_like_code(text: str) -> bool:
    """False for data disguised as a module: very long lines, or a long file whose lines are
    mostly literals (lookup tables such as Unicode data or a lexer's list of builtins)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if any(len(line) > MAX_LINE for line in lines):
        return False
    if len(lines) < 100:
        return True
    return sum(bool(_DATA_LINE.match(line)) for line in lines) <= 0.75 * len(lines)


def package_files(site: Path, package: str, cap: int = PACKAGE_CAP) -> list[str]:
    """Up to ``cap`` bytes of ``package``'s source under ``site``, as site-relative paths.

    Files are taken in the order of a hash of their path, which spreads the cap over the whole
    package instead of its alphabetically first subpackages; the result is sorted.
    """
    top = site / package
    candidates = [top] if not top.is_dir() else sorted(top.rglob("*.py"))
    if not top.is_dir():
        candidates = [site / f"{package}.py"] if (site / f"{package}.py").is_file() else []
    chosen, total = [], 0
    for path in sorted(candidates, key=lambda p: _hash(p.relative_to(site).as_posix())):
        rel = PurePosixPath(path.relative_to(site).as_posix())
        size = path.stat().st_size
        if (SKIPPED_DIRS & set(rel.parts[:-1]) or size > MAX_FILE_BYTES or size == 0
                or rel.name.endswith("_pb2.py") or total + size > cap):
            continue
        text = _read(path)
        if text is None or not looks_like_code(text):
            continue
        chosen.append(str(rel))
        total += size
    return sorted(chosen)


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _read(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def stdlib_topics(root: Path) -> dict[str, str]:
    """The language reference as prose: ``pydoc_data/topics.py``'s dict, one text per topic."""
    path = root / "pydoc_data" / "topics.py"
    if not path.is_file():
        return {}
    tree = ast.parse(path.read_text("utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            topics = ast.literal_eval(node.value)  # a literal: nothing is executed
            return {str(k): str(v) for k, v in sorted(topics.items())}
    return {}


def distribution_descriptions(packages: Sequence[str]) -> dict[str, str]:
    """Each installed distribution's long description (usually its README), by name."""
    out = {}
    for dist in sorted(_distributions(packages)):
        meta = importlib.metadata.metadata(dist)
        body = meta.get_payload() if hasattr(meta, "get_payload") else None
        body = body or meta.get("Description") or ""
        if len(body) >= 500:
            out[dist] = body.strip() + "\n"
    return out


def _distributions(packages: Sequence[str]) -> set[str]:
    """Distribution names that provide the top-level ``packages``."""
    providers = importlib.metadata.packages_distributions()
    return {d for p in packages for d in providers.get(p, [])}


def package_versions(packages: Sequence[str]) -> dict[str, str]:
    return {d: importlib.metadata.version(d) for d in sorted(_distributions(packages))}


def is_held_out(rel: str, held_out: Sequence[str] = HELD_OUT) -> bool:
    return any(rel == m or rel.startswith(m + "/") for m in held_out)


def split_files(files: Sequence[str], held_out: Sequence[str] = HELD_OUT,
                ) -> tuple[list[str], list[str]]:
    """(training files, validation files); disjoint, each in the order given."""
    valid = [f for f in files if is_held_out(f, held_out)]
    train = [f for f in files if not is_held_out(f, held_out)]
    return train, valid


def documents(spec: CorpusSpec, held_out: Sequence[str] = HELD_OUT,
              ) -> tuple[dict[str, str], dict[str, str]]:
    """(training documents, validation documents) by name, in corpus order."""
    train: dict[str, str] = {}
    valid: dict[str, str] = {}
    if spec.stdlib is not None:
        train_files, valid_files = split_files(list_files(spec.stdlib), held_out)
        for files, out in ((train_files, train), (valid_files, valid)):
            for f in files:
                out[f"stdlib/{f}"] = (spec.stdlib / f).read_bytes().decode("utf-8")
    if spec.site_packages is not None:
        # vendored copies (pip/_vendor/requests, ...) are kept once: the first one in order
        seen = {_hash(t) for t in (*train.values(), *valid.values())}
        for package in spec.packages:
            for f in package_files(spec.site_packages, package, spec.package_cap):
                text = _read(spec.site_packages / f)
                if text is not None and _hash(text) not in seen:
                    seen.add(_hash(text))
                    train[f"site/{f}"] = text
    if spec.prose:
        for dist, text in distribution_descriptions(spec.packages).items():
            train[f"prose/{dist}"] = text
        if spec.stdlib is not None:
            for topic, text in stdlib_topics(spec.stdlib).items():
                train[f"prose/topics/{topic}"] = text
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


def load_corpus(spec: CorpusSpec | None = None, cache_dir: Path | None = None,
                held_out: Sequence[str] = HELD_OUT, vocab_path: Path = VOCAB_PATH) -> Corpus:
    """Tokenized training and validation splits, from the cache when it is current."""
    spec = spec or CorpusSpec.builtin()
    cache_dir = cache_dir or default_cache_dir()
    train, valid = documents(spec, held_out)
    key = _cache_key(train, valid, vocab_path)
    paths = {split: cache_dir / f"corpus-{key}-{split}.npy" for split in ("train", "valid")}
    eot = eot_id(vocab_path)
    if all(p.is_file() for p in paths.values()):
        log.info("corpus from cache %s", paths["train"].parent)
        arrays = {split: np.load(p) for split, p in paths.items()}
    else:
        log.info("tokenizing %d documents", len(train) + len(valid))
        arrays = {"train": tokenize_documents(list(train.values()), eot, vocab_path),
                  "valid": tokenize_documents(list(valid.values()), eot, vocab_path)}
        cache_dir.mkdir(parents=True, exist_ok=True)
        for split, path in paths.items():
            tmp = path.with_suffix(".tmp.npy")  # write then rename: no half-written cache
            np.save(tmp, arrays[split])
            tmp.replace(path)
    return Corpus(train=arrays["train"], valid=arrays["valid"], eot=eot,
                  train_files=tuple(train), valid_files=tuple(valid),
                  packages=package_versions(spec.packages) if spec.site_packages else {})


def _cache_key(train: dict[str, str], valid: dict[str, str], vocab_path: Path) -> str:
    h = hashlib.sha256(_FORMAT.encode())
    h.update(hashlib.sha256(Path(vocab_path).read_bytes()).digest())
    for split, docs in (("train", train), ("valid", valid)):
        for name, text in docs.items():
            h.update(f"{split}\0{name}\0".encode())
            h.update(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
    return h.hexdigest()[:16]
