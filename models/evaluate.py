"""Evaluate a target/draft pair through llama.cpp on held-out text.

    python -m models.evaluate --target T.gguf --draft D.gguf [--tokens 20000]

For each model: mean next-token cross-entropy (nats) and perplexity over the held-out modules of
the corpus (``models.corpus.HELD_OUT``), in windows of ``--window`` tokens. For the pair: *greedy
agreement*, the share of positions where the draft's argmax equals the target's, which bounds
how often a chain draft is accepted at temperature 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from speculative.backend import ContextConfig, LlamaContext, LlamaModel


@dataclasses.dataclass(frozen=True, slots=True)
class PairEval:
    tokens: int                # positions scored
    target_loss: float         # mean cross-entropy, nats
    draft_loss: float
    greedy_agreement: float    # P(argmax draft == argmax target)

    @property
    def target_perplexity(self) -> float:
        return float(np.exp(self.target_loss))

    @property
    def draft_perplexity(self) -> float:
        return float(np.exp(self.draft_loss))


def _window_logits(ctx: LlamaContext, window: list[int]) -> np.ndarray:
    ctx.clear()
    n = len(window)
    return ctx.decode(window, list(range(n)), [[0]] * n, True)


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=1))
    return log_norm - z[np.arange(len(targets)), targets]


def evaluate_pair(target: Path, draft: Path, tokens: np.ndarray, window: int = 256,
                  threads: int = 0) -> PairEval:
    """Score both models on ``tokens`` split into non-overlapping windows."""
    config = ContextConfig(n_ctx=window, n_batch=window, n_seq_max=1, n_threads=threads)
    nll_t, nll_d, agree, count = 0.0, 0.0, 0, 0
    with LlamaModel(target) as mt, LlamaModel(draft) as md, \
            LlamaContext(mt, config) as ct, LlamaContext(md, config) as cd:
        for start in range(0, len(tokens) - 1, window):
            chunk = tokens[start:start + window + 1]
            if len(chunk) < 2:
                break
            inputs, targets = chunk[:-1].tolist(), chunk[1:]
            lt, ld = _window_logits(ct, inputs), _window_logits(cd, inputs)
            nll_t += float(_nll(lt, targets).sum())
            nll_d += float(_nll(ld, targets).sum())
            agree += int((lt.argmax(axis=1) == ld.argmax(axis=1)).sum())
            count += len(targets)
    return PairEval(count, nll_t / count, nll_d / count, agree / count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=20_000, help="held-out tokens to score")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    from models.corpus import load_corpus  # the stdlib corpus (tokenizes on first use)

    valid = load_corpus().valid[: args.tokens + 1].astype(np.int64)
    result = evaluate_pair(args.target, args.draft, valid, args.window, args.threads)
    json.dump({**dataclasses.asdict(result), "target_perplexity": result.target_perplexity,
               "draft_perplexity": result.draft_perplexity}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
