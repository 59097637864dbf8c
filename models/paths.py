"""Where the built-in models live (committed under ``models/builtin/``)."""

from __future__ import annotations

from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
BUILTIN_FILES = {
    "target": "target-q8_0.gguf",  # GPT-2 architecture, trained here on the standard library
    "draft": "draft-q8_0.gguf",    # same tokenizer, >= 10x fewer non-embedding parameters
    "ngram": "ngram.npz",          # Katz-backoff trigram over GPT-2 token ids (stage 2)
}


class MissingModel(FileNotFoundError):
    """A built-in model file is not there."""


def builtin_path(kind: str) -> Path:
    return BUILTIN_DIR / BUILTIN_FILES[kind]


def require_builtin(kind: str) -> Path:
    path = builtin_path(kind)
    if not path.is_file():
        raise MissingModel(f"the built-in {kind} model ({path}) is not installed; pass "
                           f"--{kind} PATH.gguf")
    return path
