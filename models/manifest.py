"""The manifest of the committed built-in artifacts: what each file is, its size and sha256, and
the exact commands that rebuild it.

    python -m models.manifest            # rewrite models/builtin/manifest.json
    python -m models.manifest --check    # verify the files against it
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

BUILTIN = Path(__file__).resolve().parent / "builtin"
MANIFEST = BUILTIN / "manifest.json"

REBUILD = {
    "ngram.npz": "python -m models.build_ngram --out models/builtin/ngram.npz",
}
"""How artifacts without training metrics are made (from the repository root)."""


def _train_command(name: str, metrics: dict[str, Any]) -> str:
    """The deterministic rebuild of a trained model: its exact step count, not a time budget
    (a time budget reaches a different step on a different machine)."""
    cfg = metrics["train_config"]
    return (f"python -m models.train --which {metrics['which']} --out models/builtin/{name} "
            f"--steps {metrics['steps']} --seed {cfg['seed']} --batch-size {cfg['batch_size']} "
            f"--lr {cfg['lr']} --warmup {cfg['warmup']} --threads {cfg.get('threads', 0)}"
            + (" --no-compile" if not cfg.get("compile", True) else ""))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _metrics(path: Path) -> dict[str, Any]:
    """Training metrics written beside a model (``<name>.json``), or {}."""
    side = path.with_suffix(".json")
    return json.loads(side.read_text()) if side.is_file() else {}


def build(extra: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    files = {}
    for path in sorted(BUILTIN.glob("*.gguf")) + sorted(BUILTIN.glob("*.npz")):
        metrics = _metrics(path)
        entry: dict[str, Any] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
        if metrics:
            entry["rebuild"] = _train_command(path.name, metrics)
            keep = ("config", "parameters", "seconds", "steps", "tokens", "tokens_per_s",
                    "valid_loss", "valid_perplexity", "held_out", "python", "torch")
            entry |= {k: metrics[k] for k in keep if k in metrics}
        elif path.name in REBUILD:
            entry["rebuild"] = REBUILD[path.name]
        files[path.name] = entry | (extra or {}).get(path.name, {})
    return {"corpus_python": sys.version.split()[0], "files": files}


def check(manifest: Path = MANIFEST) -> list[str]:
    """Problems found: files missing or differing from the manifest."""
    data = json.loads(manifest.read_text())
    problems = []
    for name, entry in data["files"].items():
        path = manifest.parent / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != entry["bytes"] or sha256(path) != entry["sha256"]:
            problems.append(f"{name}: differs from the manifest")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--extra", type=Path, help="JSON {file: {key: value}} to merge in")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        print("\n".join(problems) or "ok")
        return 1 if problems else 0
    extra = json.loads(args.extra.read_text()) if args.extra else None
    manifest = build(extra)
    if MANIFEST.is_file():  # keep what was recorded beside the files (e.g. pair_evaluation)
        old = json.loads(MANIFEST.read_text())
        manifest = {k: v for k, v in old.items() if k not in manifest} | manifest
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    print(MANIFEST)
    return 0


if __name__ == "__main__":
    sys.exit(main())
