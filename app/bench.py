"""``staged-chat bench``: every mode on the same prompts and models, side by side, in one run.

For each prompt the modes run one after another (so slow drifts of the machine hit every mode
alike), ``--repeats`` times. Speed is total tokens / total generation time per mode (prefill
excluded), and each speedup is that figure over ``plain``'s from the same run. At temperature 0
every mode's tokens are also compared with ``plain``'s ("same as plain": prompts with identical
output). A difference can only come from float noise at an exact near-tie of the target's top two
logits (a batch of n tokens sums in another order than n single tokens); the oracle test checks
that this is the only cause.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, TextIO

from speculative.backend import ContextConfig
from speculative.engine import Engine, Mode, SpecConfig
from speculative.loading import open_pair
from speculative.ngram import KatzTrigram
from speculative.sampling import SamplingParams
from speculative.stats import RunStats

PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "bench_prompts.txt"


def load_prompts(path: Path) -> list[str]:
    """Prompts separated by lines holding only ``---``."""
    text = path.read_text("utf-8")
    return [p.strip("\n") + "\n" for p in text.split("\n---\n") if p.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=Path, default=PROMPTS,
                        help="prompts separated by '---' lines")
    parser.add_argument("--repeats", type=int, default=1)


def bench(args: argparse.Namespace, target: Path, draft: Path | None, ngram_path: Path | None,
          spec: SpecConfig, config: ContextConfig, params: SamplingParams, out: TextIO) -> int:
    prompts = load_prompts(args.prompts)
    modes: list[Mode] = args.mode if Mode.PLAIN in args.mode else [Mode.PLAIN, *args.mode]
    runs: dict[Mode, list[RunStats]] = {m: [] for m in modes}
    same: dict[Mode, int] = dict.fromkeys(modes, 0)  # outputs identical to plain's
    with open_pair(target, draft, config) as pair:
        vocab = pair.target.vocab
        base = KatzTrigram.load(ngram_path) if ngram_path is not None else None
        cost = (None, None)  # target and draft costs, measured once, shared by every engine
        for _ in range(args.repeats):
            for text in prompts:
                prompt = vocab.tokenize(text)
                outputs = {}
                for mode in modes:
                    ngram = (KatzTrigram.load(ngram_path) if base is not None
                             else KatzTrigram.build([], vocab.n_vocab))
                    engine = Engine(pair.target_ctx, pair.draft_ctx, ngram,
                                    dataclasses.replace(spec, mode=mode))
                    engine.verify_cost, engine.draft_cost = cost
                    run = RunStats()
                    outputs[mode] = [t for step in engine.generate(
                        prompt, args.max_tokens, params, stop={vocab.eos}, run=run)
                        for t in step.tokens]
                    runs[mode].append(run)
                    cost = (engine.verify_cost, engine.draft_cost)
                for mode in modes:
                    same[mode] += outputs[mode] == outputs[Mode.PLAIN]
    report = summarize(runs, same if params.greedy else None, len(prompts) * args.repeats)
    if args.json:
        json.dump(report, out, indent=2)
        out.write("\n")
    else:
        out.write(format_report(report, pair_names=(target.name, draft.name if draft else "-"),
                                n_prompts=len(prompts), repeats=args.repeats) + "\n")
    return 0


def summarize(runs: dict[Mode, list[RunStats]], same: dict[Mode, int] | None,
              n_runs: int) -> dict[str, Any]:
    """Pool each mode's steps over all prompts and derive the figures from ``RunStats``."""
    pooled = {}
    for mode, rs in runs.items():
        total = RunStats(mode=mode.value, steps=[s for r in rs for s in r.steps],
                         t_prefill=sum(r.t_prefill for r in rs),
                         prompt_tokens=sum(r.prompt_tokens for r in rs))
        pooled[mode.value] = total.summary()
    plain_speed = pooled["plain"]["tokens_per_second"]
    for mode, s in pooled.items():
        s["speedup_vs_plain"] = s["tokens_per_second"] / plain_speed if plain_speed else 0.0
        if same is not None:
            s["identical_to_plain"] = f"{same[Mode(mode)]}/{n_runs}"
    return pooled


def format_report(report: dict[str, Any], pair_names: tuple[str, str], n_prompts: int,
                  repeats: int) -> str:
    head = (f"{'mode':<8}{'tokens':>8}{'passes':>8}{'tree':>6}{'tau':>7}{'tok/s':>9}{'speedup':>9}"
            f"{'draft calls/pass':>18}{'stage-2 hits':>14}  same as plain")
    lines = [f"target {pair_names[0]}, draft {pair_names[1]}; {n_prompts} prompts x {repeats}",
             head, "-" * len(head)]
    for mode, s in report.items():
        same = s.get("identical_to_plain", "-")
        lines.append(f"{mode:<8}{s['tokens']:>8}{s['target_passes']:>8}{s['mean_drafted']:>6.1f}"
                     f"{s['tau']:>7.2f}"
                     f"{s['tokens_per_second']:>9.1f}{s['speedup_vs_plain']:>8.2f}x"
                     f"{s['draft_calls_per_step']:>18.2f}{s['stage2_hit_rate']:>14.2f}  {same}")
    return "\n".join(lines)
