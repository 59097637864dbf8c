"""What repetition control does to what the target writes: degenerate and plausible shares with
the penalties off and with a prompt format's defaults, on a prompt set (judged as
``models.evaluate`` judges), and a grid search that chose those defaults.

    python -m app.diagnostics.sampler [--prompts assets/heldout_prompts.txt] [--format code]
    python -m app.diagnostics.sampler --tune [--prompts assets/eval_prompts.txt]

The defaults were tuned on one prompt set (``--tune``, ``assets/eval_prompts.txt``) and are
reported on another that tuning never saw (``assets/heldout_prompts.txt``). Greedy: the target
alone, so the figures are about the text, not speed (``staged-chat bench --penalties`` measures
what the penalties cost each mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.prompting import FORMATS, describe_sampler
from models.catalog import builtin_pair
from models.evaluate import load_prompts, sample_continuations
from speculative.sampling import SamplingParams

ASSETS = Path(__file__).resolve().parents[2] / "assets"
HELD_OUT = ASSETS / "heldout_prompts.txt"
TUNING = ASSETS / "eval_prompts.txt"


def rates(target: Path, prompts: Sequence[str], params: SamplingParams, max_tokens: int,
          threads: int) -> dict[str, Any]:
    rows = sample_continuations(target, prompts, params, max_tokens, threads)
    n = len(rows)
    return {"degenerate": sum(r["degenerate"] is not None for r in rows) / n,
            "plausible": sum(r["plausible"] for r in rows) / n,
            "steered": sum(r["steered"] for r in rows) / max(1, sum(r["tokens"] for r in rows)),
            "samples": rows}


def grid() -> list[SamplingParams]:
    """The settings ``--tune`` tries: DRY's strength and allowed length, with and without a
    mild repetition penalty, and the sequence breakers with and without the colon (code
    repeats ``self.x`` and ``):`` on purpose)."""
    out = []
    for mult, allowed, rep, breakers in itertools.product(
            (0.0, 0.4, 0.8, 1.5), (2, 3, 4), (1.0, 1.05, 1.1),
            (("\n",), ("\n", ":", '"', "*"))):
        if mult == 0.0 and (allowed, breakers) != (2, ("\n",)):
            continue  # DRY off: its other settings do not matter
        out.append(SamplingParams(dry_multiplier=mult, dry_allowed_length=allowed,
                                  repeat_penalty=rep, dry_breakers=breakers))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, help="target GGUF (default: the built-in one)")
    parser.add_argument("--prompts", type=Path, help="prompt set (default: held out; with "
                        "--tune: the tuning set)")
    parser.add_argument("--format", choices=sorted(FORMATS), default="code",
                        help="whose defaults to compare with the penalties off")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--tune", action="store_true", help="try the grid of settings instead")
    parser.add_argument("--show", action="store_true", help="print every continuation")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    target = args.target or builtin_pair()[0]
    prompts = load_prompts(args.prompts or (TUNING if args.tune else HELD_OUT))
    greedy = SamplingParams()
    if args.tune:
        settings = [(describe_sampler(p), p) for p in grid()]
    else:
        settings = [("off", greedy),
                    (f"{args.format} defaults ({describe_sampler(FORMATS[args.format].sampler)})",
                     greedy.with_sampler(FORMATS[args.format].sampler))]
    results = []
    for name, params in settings:
        r = rates(target, prompts, params, args.max_tokens, args.threads)
        results.append({"setting": name, "params": dataclasses.asdict(params), **r})
        if not args.json:
            print(f"{r['degenerate']:>6.0%} {r['plausible']:>6.0%} {r['steered']:>6.1%}  "
                  f"{name}", flush=True)
    if args.json:
        json.dump({"prompts": len(prompts), "max_tokens": args.max_tokens, "results": results},
                  sys.stdout, indent=1)
        return 0
    print(f"(degenerate, plausible, share of tokens the penalties steered; {len(prompts)} "
          f"prompts, greedy, {args.max_tokens} tokens)")
    if args.show:
        for res in results:
            print(f"\n===== {res['setting']}")
            for row in res["samples"]:
                tag = row["degenerate"] or ("plausible" if row["plausible"] else "no parse")
                print(f"--- {tag}\n{row['prompt']}{row['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
