"""Build the stage-2 n-gram model from the built-in models' training corpus.

    python -m models.build_ngram --out models/builtin/ngram.npz

The Katz-backoff trigram (``speculative.ngram``) is counted over the training split of the
standard-library corpus (``models.corpus``), one sequence per file, so it sees exactly the text
the built-in models were trained on. Reports its next-token accuracy on the held-out modules.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from models.corpus import load_corpus
from speculative.ngram import KatzTrigram

log = logging.getLogger(__name__)


def documents(tokens: np.ndarray, eot: int) -> list[np.ndarray]:
    """Split a corpus array at its end-of-text separators (dropping them)."""
    cuts = np.flatnonzero(tokens == eot)
    parts = (part[part != eot] for part in np.split(tokens, cuts + 1))
    return [d for d in parts if d.size]


def next_token_accuracy(model: KatzTrigram, tokens: np.ndarray, limit: int = 50_000) -> float:
    """Share of positions where the model's greedy guess is the actual next token."""
    seq = tokens[:limit].tolist()
    hits = sum(model.greedy(seq[max(0, i - 2):i], 1)[0] == seq[i] for i in range(2, len(seq)))
    return hits / max(1, len(seq) - 2)


def build(out: Path, min_count: int = 1) -> dict:
    t0 = time.perf_counter()
    corpus = load_corpus()
    docs = documents(corpus.train, corpus.eot)
    model = KatzTrigram.build((d.tolist() for d in docs), n_vocab=50257)
    built = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out, min_count=min_count)
    valid = np.concatenate(documents(corpus.valid, corpus.eot))
    return {"file": out.name, "bytes": out.stat().st_size, "min_count": min_count,
            "train_tokens": int(corpus.train.size), "documents": len(docs),
            "build_seconds": round(built, 1),
            "valid_next_token_accuracy": round(next_token_accuracy(KatzTrigram.load(out),
                                                                   valid), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("models/builtin/ngram.npz"))
    parser.add_argument("--min-count", type=int, default=1,
                        help="drop trigrams seen fewer times (smaller file)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    report = build(args.out, args.min_count)
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
