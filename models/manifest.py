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
    "ngram.npz": "python -m models.build_ngram --out models/builtin/ngram.npz --min-count 3",
}
"""How artifacts without training metrics are made (from the repository root)."""


# TrainConfig fields that change what a run computes, with their command-line flags
_FLAGS = (("seed", "--seed"), ("batch_size", "--batch-size"), ("lr", "--lr"),
          ("warmup", "--warmup"), ("schedule", "--schedule"), ("decay_frac", "--decay-frac"),
          ("min_count", "--min-count"), ("pos_init", "--pos-init"),
          ("short_window", "--short-window"), ("short_steps", "--short-steps"),
          ("heads", "--heads"), ("layers", "--layers"), ("width", "--width"),
          ("distill", "--distill"), ("indent_weight", "--indent-weight"))


def _command(which: str, out: str, steps: int, run: dict[str, Any], *extra: str) -> str:
    """One deterministic training command: an exact step count (a time budget reaches a
    different step on a different machine) and every flag, defaults included."""
    flags = [f"{flag} {run[key]}" for key, flag in _FLAGS if key in run]
    if "threads" in run:
        flags.append(f"--threads {run['threads']}")
    if run.get("compile") is False:
        flags.append("--no-compile")
    return " ".join(["python -m models.train", f"--which {which}", f"--out {out}",
                     f"--steps {steps}", *flags, *extra])


def _train_commands(name: str, metrics: dict[str, Any]) -> list[str]:
    """The commands that rebuild a trained model, from the repository root: for a model
    started from another run's weights (``--init``) or distilled from a teacher
    (``--teacher``), the runs that make those checkpoints come first (into ``build/``)."""
    cfg = metrics["train_config"]
    before, extra = [], []
    for key, flag in (("teacher_run", "--teacher"), ("init_run", "--init")):
        origin = metrics.get(key)
        if not origin:
            continue
        ckpt = f"build/{origin['which']}-{origin['step']}.pt"
        before.append(_command(origin["which"], f"build/{origin['which']}.gguf",
                               origin["step"], origin["run"], f"--checkpoint {ckpt}"))
        extra.append(f"{flag} {ckpt}")
    own = _command(metrics["which"], f"models/builtin/{name}", metrics["steps"], cfg, *extra)
    return [*before, own]

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
            # a model made by more than one run (e.g. averaged) says how in its metrics
            commands = metrics.get("rebuild") or _train_commands(path.name, metrics)
            entry["rebuild"] = commands[0] if len(commands) == 1 else commands
            keep = ("config", "parameters", "seconds", "steps", "tokens", "tokens_per_s",
                    "valid_loss", "valid_perplexity", "held_out", "corpus_packages",
                    "python", "torch")
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
