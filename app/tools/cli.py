"""``staged-chat``: the command line. ``generate`` streams text and prints the statistics;
with several modes (``--mode plain,tree,staged`` or ``--mode all``) it runs each on the same prompt
and prints them side by side, with speedups measured against ``plain`` in the same run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from app.prompting import format_for
from app.tools.bench import add_arguments as add_bench_arguments
from app.tools.bench import bench
from models.catalog import BUILTIN_NGRAM, builtin_pair
from speculative.backend import ContextConfig
from speculative.divergence import explain
from speculative.drafting import TreeBudget
from speculative.engine import Engine
from speculative.errors import ContextOverflow, IncompatibleModels, LlamaError
from speculative.loading import open_pair
from speculative.penalties import Penalizer, penalizer_for
from speculative.policies import Mode, SpecConfig
from speculative.sampling import SAMPLER_FIELDS, SamplingParams
from speculative.stats import RunStats
from speculative.text import TextStream

log = logging.getLogger(__name__)


DEFAULT_PROMPT = ('def is_palindrome(text: str) -> bool:\n'
                  '    """Return True if text reads the same forwards and backwards, ignoring '
                  'case."""\n')


def _modes(text: str) -> list[Mode]:
    if text == "all":
        return Mode.selectable()
    try:
        return [Mode(m.strip()) for m in text.split(",") if m.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc}; choose from {', '.join(m.value for m in Mode.selectable())} or 'all'",
        ) from None


_BUDGET, _SPEC = TreeBudget(), SpecConfig()


def _common() -> argparse.ArgumentParser:
    """Options shared by ``generate``, ``bench`` and ``serve``: models, sampling, tree budget,
    contexts and threads."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", type=Path, help="target GGUF (default: the built-in one)")
    common.add_argument("--draft", type=Path, help="draft GGUF (default: the built-in one)")
    common.add_argument("--ngram", type=Path, help="n-gram model .npz (default: built-in)")
    common.add_argument("-n", "--max-tokens", type=int, default=200)
    common.add_argument("--temp", type=float, default=0.0, help="0 = greedy (default)")
    common.add_argument("--top-k", type=int, default=0)
    common.add_argument("--top-p", type=float, default=1.0)
    common.add_argument("--seed", type=int, default=0)
    add_sampler_arguments(common)
    common.add_argument("--max-nodes", type=int, default=_BUDGET.max_nodes)
    common.add_argument("--max-depth", type=int, default=_BUDGET.max_depth)
    common.add_argument("--max-children", type=int, default=_BUDGET.max_children)
    common.add_argument("--chain-length", type=int, default=_SPEC.chain_length)
    common.add_argument("--lookahead", type=int, default=_SPEC.lookahead)
    common.add_argument("--fixed-size", action="store_true",
                        help="always verify --max-nodes nodes (default: size each tree by the "
                             "measured cost of verifying it)")
    common.add_argument("--ctx", type=int, default=1024, help="context window in tokens")
    common.add_argument("--threads", type=int, default=0, help="0 = all cores")
    common.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto",
                        help="flash attention: on (a row's logits then do not depend on its "
                             "batch's size), off, or auto (default): whichever decodes faster "
                             "on this machine over the window, measured once per model")
    common.add_argument("--gpu-layers", type=int, default=0,
                        help="target layers offloaded to a GPU (-1: all; needs llama-cpp-python "
                             "built with a GPU backend)")
    common.add_argument("--draft-gpu-layers", type=int, default=0,
                        help="draft layers offloaded to a GPU (-1: all)")
    common.add_argument("--json", action="store_true", help="print JSON instead")
    return common


def add_sampler_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampler settings beyond temperature, top-k and top-p; unset ones take the prompt
    format's defaults (``sampling_params``)."""
    g = parser.add_argument_group(
        "repetition control and min-p (default: the prompt format's; 0 or 1 switches one off)")
    g.add_argument("--min-p", type=float,
                   help="drop tokens less likely than this times the most likely one")
    g.add_argument("--repeat-penalty", type=float,
                   help="divide the logits of recent tokens by this (1: off)")
    g.add_argument("--repeat-last-n", type=int,
                   help="how many recent tokens the repeat, presence and frequency penalties see")
    g.add_argument("--presence-penalty", type=float,
                   help="subtract this from the logit of every recent token (0: off)")
    g.add_argument("--frequency-penalty", type=float,
                   help="subtract this times a recent token's count from its logit (0: off)")
    g.add_argument("--dry-multiplier", type=float,
                   help="DRY: penalise extending a repeat of earlier text (0: off)")
    g.add_argument("--dry-base", type=float, help="DRY: growth of the penalty per repeated token")
    g.add_argument("--dry-allowed-length", type=int,
                   help="DRY: repeats this long or shorter go unpunished")
    g.add_argument("--dry-last-n", type=int, help="DRY: tokens looked back over (0: all)")
    g.add_argument("--dry-breakers", type=json.loads,
                   help='DRY: JSON list of strings no repeat runs across, e.g. \'["\\n", ":"]\'')


def sampling_params(args: argparse.Namespace,
                    defaults: SamplingParams | None = None) -> SamplingParams:
    """The sampling the options ask for: temperature, top-k, top-p and seed as given; each
    sampler option not given keeps its value in ``defaults`` (a prompt format's)."""
    given = {name: getattr(args, name) for name in SAMPLER_FIELDS
             if getattr(args, name, None) is not None}
    return dataclasses.replace(defaults or SamplingParams(), temperature=args.temp,
                               top_k=args.top_k,
                               top_p=args.top_p, seed=args.seed, **given)


def generation_params(args: argparse.Namespace) -> SamplingParams:
    """``generate``'s sampling: unset sampler options take the defaults of the prompt format
    the app would chat in with these models (code for the built-in pair)."""
    return sampling_params(args, format_for(args.target is None).sampler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="staged-chat", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    sub = parser.add_subparsers(dest="command")
    common = _common()
    gen = sub.add_parser("generate", parents=[common], help="generate text from a prompt")
    gen.add_argument("--mode", type=_modes, default=[Mode.AUTO],
                     help="auto (default), plain, chain, tree, staged, ngram; a comma list "
                          "or 'all' compares them")
    src = gen.add_mutually_exclusive_group()
    # the kind of prompt the built-in target was judged on (models.evaluate --samples): a
    # signature and a docstring, which say what the body is to do
    src.add_argument("--prompt", default=DEFAULT_PROMPT)
    src.add_argument("--prompt-file", type=Path)
    bench = sub.add_parser("bench", parents=[common],
                           help="every mode on a set of prompts, speedups vs plain")
    bench.add_argument("--mode", type=_modes, default=Mode.selectable(),
                       help="modes to compare with plain (default: all)")
    add_bench_arguments(bench)
    serve = sub.add_parser("serve", parents=[common],
                           help="serve the models over a local OpenAI-compatible HTTP API")
    _serve_arguments(serve)
    gui = sub.add_parser("app", help="open the desktop app (the default without a command)")
    _app_arguments(gui)
    return parser


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=[m.value for m in Mode.selectable()],
                        default=Mode.AUTO.value,
                        help="speculation mode of requests that do not name one (default auto)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; "
                             "0.0.0.0 lets other machines connect)")
    parser.add_argument("--port", type=int, default=8080, help="0: any free port")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="let web pages from this origin (e.g. http://localhost:3000) call "
                             "the server, with CORS headers; repeatable (default: none)")
    parser.add_argument("--queue", type=int, default=32,
                        help="requests waiting or running at most; more get 503 (default 32)")
    parser.add_argument("--chat-format", choices=["code", "transcript"],
                        help="how chat messages become a prompt (default: code for the "
                             "built-in pair, transcript for other models)")
    # a fresh draw per request unless --seed or the request's seed says otherwise
    parser.set_defaults(seed=None)


def _app_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", help="send this message once the models are loaded")
    parser.add_argument("--screenshot", type=Path, help="save a PNG of the window, then quit")
    parser.add_argument("--at-tokens", type=int, default=0,
                        help="take the screenshot after this many reply tokens (mid-generation)")
    parser.add_argument("--race", action="store_true",
                        help="after the reply, race plain decoding against the speculation")
    parser.add_argument("--theme", choices=("system", "light", "dark"))
    parser.add_argument("--mode", choices=[m.value for m in Mode.selectable()],
                        help="speculation mode")
    parser.add_argument("--temp", type=float, help="sampling temperature (0: greedy)")
    parser.add_argument("--max-tokens", type=int, help="tokens per reply at most")
    parser.add_argument("--throughput-check", action="store_true",
                        help="measure tokens/s streamed into the window against the command "
                             "line on the same settings (the thread policy), then quit")
    parser.add_argument("--repeats", type=int, default=3, help="with --throughput-check")
    parser.add_argument("--check-target", type=Path, default=None,
                        help="with --throughput-check: the target GGUF (default: built-in)")
    parser.add_argument("--check-draft", type=Path, default=None,
                        help="with --throughput-check: the draft GGUF (default: built-in)")
    parser.add_argument("--data-dir", type=Path,
                        help="keep settings and history here instead of the user's folders")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command in (None, "app"):
        if args.command is None:
            args = parser.parse_args(["app"])
        if args.throughput_check:
            from app.diagnostics.perf import run as check

            return check(args)
        from app.main import run as run_app

        return run_app(args)
    try:
        if args.command == "serve":
            from app.tools.serve import serve  # the HTTP stack, for this command only

            return serve(args, sys.stdout)
        return generate(args, sys.stdout)
    except (LlamaError, IncompatibleModels, ContextOverflow, ValueError, OSError) as exc:
        # OSError covers missing files, including a missing built-in model
        print(f"staged-chat: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstaged-chat: interrupted", file=sys.stderr)
        return 130


def resolve_models(args: argparse.Namespace,
                   modes: Sequence[Mode]) -> tuple[Path, Path | None, Path | None]:
    """The models to run ``modes`` on: those given, else the built-in pair and n-gram model."""
    needs_draft = any(m.needs_draft or m is Mode.AUTO for m in modes)  # auto uses one
    if args.target is None or (needs_draft and args.draft is None):
        builtin_target, builtin_draft = builtin_pair()
    target = args.target or builtin_target
    draft = args.draft or (builtin_draft if needs_draft else None)
    ngram = args.ngram or (BUILTIN_NGRAM if BUILTIN_NGRAM.is_file() else None)
    return target, draft, ngram


def engine_settings(args: argparse.Namespace) -> tuple[SpecConfig, ContextConfig]:
    """The speculation the options ask for (mode auto), and contexts big enough for it."""
    budget = TreeBudget(args.max_nodes, args.max_depth, args.max_children)
    spec = SpecConfig(tree=budget, chain_length=args.chain_length, lookahead=args.lookahead,
                      adaptive=not args.fixed_size)
    batch = max(budget.max_nodes, spec.chain_length) + 1 + max(args.lookahead, 0)
    config = ContextConfig(n_ctx=args.ctx, n_batch=max(64, batch), n_seq_max=256,
                           n_threads=args.threads,
                           flash_attn={"auto": None, "on": True, "off": False}[args.flash_attn])
    return spec, config


def generate(args: argparse.Namespace, out: TextIO) -> int:
    target, draft, ngram_path = resolve_models(args, args.mode)
    spec, config = engine_settings(args)
    params = generation_params(args)
    if args.command == "bench":
        return bench(args, target, draft, ngram_path, spec, config, params, out)
    with open_pair(target, draft, config, (args.gpu_layers, args.draft_gpu_layers),
                   ngram_path, ngram_optional=args.ngram is None) as pair:
        vocab = pair.target.vocab
        text = (args.prompt_file.read_text("utf-8") if args.prompt_file else args.prompt)
        prompt = vocab.tokenize(text)
        if not prompt:
            raise ValueError("the prompt is empty")
        results = []
        for mode in args.mode:
            # a fresh n-gram per run, so that no mode learns from another's output; the cost
            # curves are measured once and shared by every engine
            engine = pair.engine(dataclasses.replace(spec, mode=mode))
            stream = out if not args.json and len(args.mode) == 1 else None
            results.append(run_generation(engine, vocab, prompt, args.max_tokens, params,
                                          stream))
        if params.greedy:
            _explain(results, pair.target_ctx, prompt,
                     penalizer_for(params, vocab.n_vocab, vocab.tokens_containing))
        _report(results, out, args.json, prompt_text=text)
    return 0


def run_generation(engine: Engine, vocab: Any, prompt: list[int], max_tokens: int,
                   params: SamplingParams, stream: TextIO | None) -> dict[str, Any]:
    """One ``generate`` run: its text written to ``stream`` as it comes (if given), and
    ``{mode, text, tokens, finish, stats}``."""
    run = RunStats()
    tokens: list[int] = []
    text = TextStream(vocab.piece)
    finish = None
    if stream is not None:
        stream.write(vocab.detokenize(prompt))
        stream.flush()
    for step in engine.generate(prompt, max_tokens, params, stop={vocab.eos}, run=run):
        tokens += step.tokens
        finish = step.finish
        pieces = text.feed(step.tokens, final=finish is not None)
        if stream is not None:
            stream.write("".join(t for t, _ in pieces))
            stream.flush()
    if stream is not None:
        stream.write("".join(t for t, _ in text.feed([], final=True)) + "\n")
    return {"mode": engine.config.mode.value, "text": vocab.detokenize(tokens),
            "tokens": tokens, "finish": finish or "length", "stats": run.summary()}


def _explain(results: list[dict[str, Any]], ctx: Any, prompt: list[int],
             penalizer: Penalizer | None = None) -> None:
    """Where a greedy run parts from plain's, whether batch-shape rounding explains it
    (``speculative.divergence``)."""
    plain = next((r for r in results if r["mode"] == "plain"), None)
    if plain is None:
        return
    for r in results:
        d = explain(ctx, prompt, plain["tokens"], r["tokens"], penalizer)
        if d is not None:
            r["divergence"] = {"index": d.index, "plain": d.a, "this": d.b,
                               "margins": d.margins, "tie": d.tie}
            r["divergence_text"] = d.describe()


def _report(results: list[dict[str, Any]], out: TextIO, as_json: bool, prompt_text: str) -> None:
    plain = next((r for r in results if r["mode"] == "plain"), None)
    for r in results:
        if plain is not None and plain["stats"]["tokens_per_second"] > 0:
            r["speedup_vs_plain"] = (r["stats"]["tokens_per_second"]
                                     / plain["stats"]["tokens_per_second"])
            r["identical_to_plain"] = r["tokens"] == plain["tokens"]
    if as_json:
        payload: Any = results[0] if len(results) == 1 else {"prompt": prompt_text,
                                                             "runs": results}
        json.dump(payload, out, indent=2)
        out.write("\n")
        return
    if len(results) == 1:
        out.write(format_stats(results[0]["stats"]) + "\n")
        return
    out.write(format_table(results) + "\n")


def format_stats(s: dict[str, Any]) -> str:
    t = s["time"]
    depth = " ".join(f"{r:.2f}" for r in s["depth_acceptance"]) or "-"
    o = s["origins"]
    return "\n".join([
        f"--- {s['mode']}: {s['tokens']} tokens in {s['target_passes']} target passes, "
        f"{s['seconds']:.2f} s ({s['tokens_per_second']:.1f} tokens/s), "
        f"prefill {t['prefill'] * 1000:.0f} ms",
        f"tau (tokens per target pass) {s['tau']:.2f}; mean accepted {s['mean_accepted']:.2f} "
        f"of {s['mean_drafted']:.1f} drafted; accepted/drafted {s['node_acceptance']:.2f}",
        f"acceptance by depth: {depth}",
        f"tokens from draft {o['draft']}, n-gram {o['ngram']}, target {o['target']}; "
        f"draft calls per pass {s['draft_calls_per_step']:.2f}; "
        f"stage-2 hit rate {s['stage2_hit_rate']:.2f}",
        f"time: draft {t['draft']:.2f} s, stage 2 {t['stage2']:.2f} s, "
        f"verify {t['verify']:.2f} s, other {t['other']:.2f} s",
    ])


def format_table(results: list[dict[str, Any]]) -> str:
    head = (f"{'mode':<8}{'tokens':>7}{'passes':>8}{'tau':>7}{'tok/s':>9}{'speedup':>9}"
            f"{'accept/depth':>30}  same as plain")
    rows = [head, "-" * len(head)]
    for r in results:
        s = r["stats"]
        depth = " ".join(f"{x:.2f}" for x in s["depth_acceptance"][:6]) or "-"
        speed = f"{r['speedup_vs_plain']:.2f}x" if "speedup_vs_plain" in r else "-"
        same = {True: "yes", False: "no"}.get(r.get("identical_to_plain"), "-")
        if "divergence" in r:
            d = r["divergence"]
            same = f"no: {'a tie' if d['tie'] else 'NOT a tie'} at token {d['index']}"
        rows.append(f"{r['mode']:<8}{s['tokens']:>7}{s['target_passes']:>8}{s['tau']:>7.2f}"
                    f"{s['tokens_per_second']:>9.1f}{speed:>9}{depth:>30}  {same}")
    notes = [f"{r['mode']} differs from plain at {r['divergence_text']}"
             for r in results if "divergence_text" in r]
    if notes:
        rows += ["", *notes, "(a tie: the target's own logits there change with llama.cpp's "
                 "batch shape; see speculative/divergence.py)"]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
