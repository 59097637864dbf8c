"""Evaluate a target/draft pair through llama.cpp: held-out loss, agreement, and what it writes.

    python -m models.evaluate --target T.gguf --draft D.gguf [--tokens 20000]
    python -m models.evaluate --target T.gguf --samples [assets/eval_prompts.txt]

Scores: for each model, mean next-token cross-entropy (nats) and perplexity over the held-out
modules of the corpus (``models.corpus.HELD_OUT``), in windows of ``--window`` tokens, overall and
on the positions whose next token is not whitespace (42% of Python's GPT-2 tokens are single
spaces of indentation: a model can score well on them and still write nothing). For the pair:
*greedy agreement*, the share of positions where the draft's argmax equals the target's (which
bounds how often a chain draft is accepted at temperature 0), overall and where the target's
argmax is not whitespace.

Samples (``--samples``): the target alone continues each prompt of a prompt set (a function
signature and docstring, none taken from the corpus), greedily and sampled, and each
continuation is printed and judged (see ``judge``): *degenerate* (a loop: a sequence of up to 8
tokens repeated back to back over more than 12 tokens, such as one token 13 times or
``len(len(len(...``; more than 60% whitespace characters; or fewer than 4 distinct words) and
*plausible* (the prompt plus at least one new non-blank line parses as Python, cut at a line
boundary). Speed or acceptance measured on degenerate text means nothing.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from speculative.backend import ContextConfig, LlamaContext, LlamaModel, Vocabulary
from speculative.engine import Engine
from speculative.policies import Mode, SpecConfig
from speculative.sampling import SamplingParams

PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "eval_prompts.txt"
MAX_RUN = 12           # a loop over more than this many tokens is degenerate
MAX_PERIOD = 8         # ... a loop: a sequence of at most this many tokens, repeated
MAX_WHITESPACE = 0.6   # ... and so is text more than this share whitespace characters
MIN_WORDS = 4          # ... or with fewer distinct words


@dataclasses.dataclass(frozen=True, slots=True)
class PairEval:
    tokens: int                # positions scored
    target_loss: float         # mean cross-entropy, nats
    draft_loss: float
    greedy_agreement: float    # P(argmax draft == argmax target)
    target_loss_text: float = 0.0      # ... on positions whose next token is not whitespace
    draft_loss_text: float = 0.0
    greedy_agreement_text: float = 0.0  # ... where the target's argmax is not whitespace
    text_share: float = 0.0    # share of positions whose next token is not whitespace

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


def whitespace_tokens(vocab: Vocabulary) -> np.ndarray:
    """Boolean mask over the vocabulary: tokens whose text is only whitespace (" ", "\\n", ...)."""
    mask = np.zeros(vocab.n_vocab, dtype=bool)
    for t in range(vocab.n_vocab):
        piece = vocab.piece(t)
        mask[t] = bool(piece) and not piece.strip()
    return mask


def evaluate_pair(target: Path, draft: Path, tokens: np.ndarray, window: int = 256,
                  threads: int = 0) -> PairEval:
    """Score both models on ``tokens`` split into non-overlapping windows."""
    config = ContextConfig(n_ctx=window, n_batch=window, n_seq_max=1, n_threads=threads)
    nll_t, nll_d, agree, text = [], [], [], []
    with LlamaModel(target) as mt, LlamaModel(draft) as md, \
            LlamaContext(mt, config) as ct, LlamaContext(md, config) as cd:
        space = whitespace_tokens(mt.vocab)
        for start in range(0, len(tokens) - 1, window):
            chunk = tokens[start:start + window + 1]
            if len(chunk) < 2:
                break
            inputs, targets = chunk[:-1].tolist(), chunk[1:]
            lt, ld = _window_logits(ct, inputs), _window_logits(cd, inputs)
            nll_t.append(_nll(lt, targets))
            nll_d.append(_nll(ld, targets))
            agree.append((lt.argmax(axis=1) == ld.argmax(axis=1), ~space[lt.argmax(axis=1)]))
            text.append(~space[targets])
    t, d, is_text = np.concatenate(nll_t), np.concatenate(nll_d), np.concatenate(text)
    same = np.concatenate([a for a, _ in agree])
    target_text = np.concatenate([m for _, m in agree])
    return PairEval(len(t), float(t.mean()), float(d.mean()), float(same.mean()),
                    float(t[is_text].mean()), float(d[is_text].mean()),
                    float(same[target_text].mean()), float(is_text.mean()))


@dataclasses.dataclass(frozen=True, slots=True)
class IndentEval:
    """The decisions inside a line's leading spaces (GPT-2 spends one token per space)."""

    continue_accuracy: float  # next token is another space: the model's argmax says so
    stop_accuracy: float      # next token ends the indentation: the argmax is not a space
    continue_positions: int
    stop_positions: int


def indentation_decisions(target: Path, tokens: np.ndarray, window: int = 256,
                          threads: int = 0) -> IndentEval:
    """How often the target's greedy choice inside leading indentation is right. A model that
    always says "another space" scores 100% / 0% and writes spaces forever."""
    config = ContextConfig(n_ctx=window, n_batch=window, n_seq_max=1, n_threads=threads)
    hits = {"continue": [0, 0], "stop": [0, 0]}
    with LlamaModel(target) as model, LlamaContext(model, config) as ctx:
        space, newline = model.vocab.tokenize(" ")[0], model.vocab.tokenize("\n")[0]
        for start in range(0, len(tokens) - window - 1, window):
            seq = tokens[start:start + window + 1].tolist()
            best = _window_logits(ctx, seq[:-1]).argmax(axis=1)
            inside = False  # in the run of spaces that starts a line
            for i, tok in enumerate(seq[:-1]):
                inside = tok == newline or (inside and tok == space)
                nxt = seq[i + 1]
                if not inside or nxt == newline:
                    continue
                kind = "continue" if nxt == space else "stop"
                hits[kind][0] += int((best[i] == space) == (kind == "continue"))
                hits[kind][1] += 1
    (c, nc), (st, ns) = hits["continue"], hits["stop"]
    return IndentEval(c / max(1, nc), st / max(1, ns), nc, ns)


def load_prompts(path: Path = PROMPTS) -> list[str]:
    """Prompts separated by lines holding only ``---``, each ending with a newline."""
    text = path.read_text("utf-8")
    return [p.strip("\n") + "\n" for p in text.split("\n---\n") if p.strip()]


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    degenerate: str | None  # why the continuation is degenerate, or None
    plausible: bool         # prompt + at least one new non-blank line parses


def judge(prompt: str, tokens: Sequence[int], text: str) -> Verdict:
    """Degenerate and plausible, as defined in the module docstring."""
    covered, period = longest_loop(tokens)
    words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text))
    space = sum(c.isspace() for c in text) / max(1, len(text))
    why = None
    if covered > MAX_RUN:
        why = (f"a token repeated {covered} times" if period == 1 else
               f"a loop of {period} tokens over {covered} tokens")
    elif space > MAX_WHITESPACE:
        why = f"{space:.0%} whitespace"
    elif len(words) < MIN_WORDS:
        why = f"{len(words)} distinct words"
    return Verdict(why, _parses_with_a_new_line(prompt, text))


def longest_loop(tokens: Sequence[int]) -> tuple[int, int]:
    """The most tokens covered by one sequence of at most ``MAX_PERIOD`` tokens repeated back
    to back, and that sequence's length (1: one token repeated)."""
    best = (1 if len(tokens) else 0, 1)
    for period in range(1, MAX_PERIOD + 1):
        run = 0  # positions i in a row with tokens[i] == tokens[i - period]
        for i in range(period, len(tokens)):
            run = run + 1 if tokens[i] == tokens[i - period] else 0
            if run and run + period > best[0]:
                best = (run + period, period)
    return best


def _parses_with_a_new_line(prompt: str, text: str) -> bool:
    lines = text.split("\n")
    for n in range(len(lines) - 1, 0, -1):  # cut after line n-1 (complete lines only)
        body = "\n".join(lines[:n])
        if not body.strip():
            continue
        try:
            ast.parse(prompt + body + "\n")
        except (SyntaxError, ValueError):
            continue
        return True
    return False


def sample_continuations(target: Path, prompts: Sequence[str], params: SamplingParams,
                         max_tokens: int = 48, threads: int = 0) -> list[dict[str, Any]]:
    """The target alone (plain decoding) continuing each prompt, judged."""
    config = ContextConfig(n_ctx=512, n_batch=512, n_seq_max=1, n_threads=threads)
    out = []
    with LlamaModel(target) as model, LlamaContext(model, config) as ctx:
        vocab = model.vocab
        for i, prompt in enumerate(prompts):
            engine = Engine(ctx, config=SpecConfig(mode=Mode.PLAIN, adaptive=False),
                            breakers=vocab.tokens_containing)
            # one seed per prompt: with the same seed every prompt would get the same random
            # draws, and one unlucky draw at the same step would repeat across the whole set
            each = dataclasses.replace(params, seed=(params.seed or 0) + i)
            tokens, steered = [], 0
            for step in engine.generate(vocab.tokenize(prompt), max_tokens, each,
                                        stop={vocab.eos}):
                tokens += step.tokens
                steered += step.stats.steered
            text = vocab.detokenize(tokens)
            verdict = judge(prompt, tokens, text)
            out.append({"prompt": prompt, "text": text, "degenerate": verdict.degenerate,
                        "plausible": verdict.plausible, "tokens": len(tokens),
                        "steered": steered})
    return out


def samples_report(target: Path, prompts: Sequence[str], max_tokens: int = 48,
                   threads: int = 0, seed: int = 0,
                   sampler: SamplingParams | None = None) -> dict[str, Any]:
    """Greedy and sampled (temperature 0.8, top-p 0.95) continuations with their rates;
    ``sampler``: repetition control and min-p for both (``SamplingParams.with_sampler``)."""
    report = {}
    for name, params in (("greedy", SamplingParams()),
                         ("sampled", SamplingParams(0.8, 0, 0.95, seed))):
        if sampler is not None:
            params = params.with_sampler(sampler)
        rows = sample_continuations(target, prompts, params, max_tokens, threads)
        report[name] = {"degenerate": sum(r["degenerate"] is not None for r in rows) / len(rows),
                        "plausible": sum(r["plausible"] for r in rows) / len(rows),
                        "samples": rows}
    return report


def format_samples(report: dict[str, Any]) -> str:
    lines = []
    for name, part in report.items():
        lines.append(f"=== {name}: degenerate {part['degenerate']:.0%}, "
                     f"plausible {part['plausible']:.0%} of {len(part['samples'])}")
        for r in part["samples"]:
            tag = f"DEGENERATE ({r['degenerate']})" if r["degenerate"] else (
                "plausible" if r["plausible"] else "does not parse")
            lines += [f"--- {tag}", r["prompt"] + r["text"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, help="draft GGUF: scores and agreement")
    parser.add_argument("--tokens", type=int, default=20_000, help="held-out tokens to score")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--samples", type=Path, nargs="?", const=PROMPTS,
                        help="print and judge the target's continuations of these prompts")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per sample")
    parser.add_argument("--json", action="store_true", help="samples as JSON")
    args = parser.parse_args(argv)
    if args.samples is not None:
        report = samples_report(args.target, load_prompts(args.samples), args.max_tokens,
                                args.threads)
        if args.json:
            json.dump(report, sys.stdout, indent=1)
        else:
            print(format_samples(report))
    if args.draft is None:
        return 0
    from models.corpus import load_corpus  # the corpus (tokenizes on first use)

    valid = load_corpus().valid[: args.tokens + 1].astype(np.int64)
    result = evaluate_pair(args.target, args.draft, valid, args.window, args.threads)
    indent = indentation_decisions(args.target, valid, args.window, args.threads)
    json.dump({**dataclasses.asdict(result), "target_perplexity": result.target_perplexity,
               "draft_perplexity": result.draft_perplexity,
               "target_indentation": dataclasses.asdict(indent)}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
