"""The model catalog: GPT-2 family GGUF files on the Hugging Face hub, the built-in pair, and
recommended target/draft pairs, loaded from ``catalog.json`` into frozen dataclasses.

A hub entry names a repository, a file and a pinned commit; ``models/download.py`` fetches it.
A built-in entry names a file inside this package (``models/builtin/``) that ships with the app.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CATALOG_PATH = Path(__file__).resolve().parent / "catalog.json"
BUILTIN_NGRAM = Path(__file__).resolve().parent / "builtin" / "ngram.npz"
"""The stage-2 n-gram model for the built-in pair (``python -m models.build_ngram``)."""

_SHA256 = re.compile(r"[0-9a-f]{64}")
_FORMAT = 1


class CatalogError(ValueError):
    """``catalog.json`` is malformed or refers to something it does not define."""


class ModelNotAvailableError(FileNotFoundError):
    """A built-in model file is not on disk."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelEntry:
    id: str
    description: str
    quantization: str
    parameters: int | None        # None: not known (the built-in models until they are trained)
    approx_size_bytes: int | None  # the hub's rounded display size; exact size comes at download
    sha256: str | None             # lower-case hex; None: not known, never guessed
    repo_id: str | None = None     # hub entries: repository, file and pinned commit
    filename: str | None = None
    revision: str | None = None
    local_path: Path | None = None  # built-in entries: absolute path of the shipped file
    verified: tuple[str, ...] = ()  # fields checked against `source`
    source: str = ""

    @property
    def is_builtin(self) -> bool:
        return self.local_path is not None

    def require_local(self) -> Path:
        """The built-in file's path; ``ModelNotAvailableError`` if it is missing."""
        if self.local_path is None:
            raise ValueError(f"{self.id} is a hub model: download it with models.download")
        if not self.local_path.is_file():
            raise ModelNotAvailableError(
                f"built-in model '{self.id}' is missing: expected {self.local_path}. It is made by "
                "the project's training step (python -m models.train) and shipped inside the "
                "package; without it, pick a hub model pair (python -m models.download --list) "
                "or open a GGUF file directly."
            )
        return self.local_path


@dataclasses.dataclass(frozen=True, slots=True)
class ModelPair:
    id: str
    target: str  # ModelEntry ids
    draft: str
    description: str


@dataclasses.dataclass(frozen=True, slots=True)
class Catalog:
    models: tuple[ModelEntry, ...]
    pairs: tuple[ModelPair, ...]
    default_pair: str

    def model(self, model_id: str) -> ModelEntry:
        for entry in self.models:
            if entry.id == model_id:
                return entry
        known = ", ".join(m.id for m in self.models)
        raise KeyError(f"no model '{model_id}' in the catalog (known: {known})")

    def pair(self, pair_id: str) -> ModelPair:
        for pair in self.pairs:
            if pair.id == pair_id:
                return pair
        known = ", ".join(p.id for p in self.pairs)
        raise KeyError(f"no pair '{pair_id}' in the catalog (known: {known})")

    def pair_models(self, pair_id: str) -> tuple[ModelEntry, ModelEntry]:
        """(target, draft) of a pair."""
        pair = self.pair(pair_id)
        return self.model(pair.target), self.model(pair.draft)


def load_catalog(path: Path = CATALOG_PATH) -> Catalog:
    """Read and check a catalog; built-in paths resolve relative to the catalog's folder."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CatalogError(f"cannot read model catalog {path}: {e}") from e
    if raw.get("format") != _FORMAT:
        raise CatalogError(f"{path}: unsupported catalog format {raw.get('format')!r}")
    base = Path(path).resolve().parent
    models = tuple(_parse_model(m, base) for m in raw.get("models", []))
    pairs = tuple(_parse_pair(p) for p in raw.get("pairs", []))
    catalog = Catalog(models=models, pairs=pairs, default_pair=raw.get("default_pair", ""))
    _check_references(catalog)
    return catalog


_FIELDS = {f.name for f in dataclasses.fields(ModelEntry)} - {"local_path"} | {"path"}


def _parse_model(raw: Mapping[str, Any], base: Path) -> ModelEntry:
    model_id = raw.get("id", "?")
    unknown = set(raw) - _FIELDS
    if unknown:
        raise CatalogError(f"model '{model_id}': unknown fields {sorted(unknown)}")
    is_hub = raw.get("repo_id") is not None
    if is_hub == (raw.get("path") is not None):
        raise CatalogError(f"model '{model_id}': give either repo_id/filename or path, not both")
    if is_hub and not (raw.get("filename") and raw.get("revision")):
        raise CatalogError(f"model '{model_id}': a hub entry needs filename and revision")
    sha = raw.get("sha256")
    if sha is not None and not _SHA256.fullmatch(sha):
        raise CatalogError(f"model '{model_id}': sha256 must be 64 lower-case hex digits")
    verified = tuple(raw.get("verified", ()))
    if not set(verified) <= _FIELDS:
        raise CatalogError(f"model '{model_id}': 'verified' names unknown fields")
    try:
        return ModelEntry(
            id=raw["id"],
            description=raw["description"],
            quantization=raw["quantization"],
            parameters=raw.get("parameters"),
            approx_size_bytes=raw.get("approx_size_bytes"),
            sha256=sha,
            repo_id=raw.get("repo_id"),
            filename=raw.get("filename"),
            revision=raw.get("revision"),
            local_path=None if is_hub else base / raw["path"],
            verified=verified,
            source=raw.get("source", ""),
        )
    except KeyError as e:
        raise CatalogError(f"model '{model_id}': missing field {e}") from e


def _parse_pair(raw: Mapping[str, Any]) -> ModelPair:
    try:
        return ModelPair(raw["id"], raw["target"], raw["draft"], raw.get("description", ""))
    except KeyError as e:
        raise CatalogError(f"pair {raw.get('id', '?')!r}: missing field {e}") from e


def _check_references(catalog: Catalog) -> None:
    model_ids = [m.id for m in catalog.models]
    pair_ids = [p.id for p in catalog.pairs]
    for kind, ids in (("model", model_ids), ("pair", pair_ids)):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise CatalogError(f"duplicate {kind} ids: {duplicates}")
    for pair in catalog.pairs:
        for role, ref in (("target", pair.target), ("draft", pair.draft)):
            if ref not in model_ids:
                raise CatalogError(f"pair '{pair.id}': {role} '{ref}' is not a catalog model")
        if pair.target == pair.draft:
            raise CatalogError(f"pair '{pair.id}': target and draft are the same model")
    if catalog.default_pair not in pair_ids:
        raise CatalogError(f"default_pair '{catalog.default_pair}' is not a catalog pair")


def builtin_pair() -> tuple[Path, Path]:
    """Paths of the catalog's default (built-in) target and draft; raises if either is missing."""
    catalog = load_catalog()
    target, draft = catalog.pair_models(catalog.default_pair)
    return target.require_local(), draft.require_local()
