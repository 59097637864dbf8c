"""``staged-chat bench``: every mode on the same prompts and models, side by side, in one run.

What is measured, and how it stays fair:

- **Interleaved**: for each repeat and prompt the modes run one after another, in an order that
  rotates from prompt to prompt (A B C, B C A, ...), so slow drifts of the machine (heat, other
  processes) hit every mode alike. One untimed warm-up run of every mode comes first.
- **Speed** is generation tokens / generation seconds (prefill excluded, ``RunStats``), pooled
  over the prompts of one repeat; each **speedup** is that over ``plain``'s in the same repeat,
  and the report gives the median and the spread (min-max) over repeats.
- **Sessions**: what each mode's engine learned (``engine.Learned``: ``auto``'s planner, with
  its step rates and budget, and the drafters' calibrations) lives across the prompts, as the
  app's engine lives across a chat's turns; the n-gram model starts afresh each run (it would
  learn earlier repeats' text).
- **Ceiling** (greedy only): the ``oracle`` drafter knows plain decoding's output and costs
  nothing, so it shows the best any drafter could do on this machine's verification cost curve;
  each mode's ``ceiling_share`` is its speedup over the oracle's.
- **identical**: at temperature 0 every mode's tokens are compared with ``plain``'s. Where one
  differs, ``speculative.divergence`` replays the target at the first differing token under
  several batch shapes: "+N ties" counts outputs that part where the target's own two best
  logits trade places between llama.cpp's batch shapes (not the algorithm's doing); any other
  difference is an error, counted in ``differ_not_tied``.
- **Degenerate outputs** (a token repeated, mostly whitespace, a handful of words: see
  ``models.evaluate.judge``) are counted and warned about: speed on such text means little.
- **Peers** (``--peers``): llama-cpp-python's own speculative path (``LlamaPromptLookupDecoding``)
  and plain path on the same target, each in a process of its own (``app.tools.peer``: a peer that
  crashes is reported, and the benchmark goes on), and with ``--native``, llama.cpp's C++
  ``llama-bench`` on the same target (built on demand: ``app/tools/native.py``). What cannot
  run is reported with the reason.
- **Native speculation** (``--native``): llama.cpp's ``llama-speculative`` (a chain of at most
  ``NATIVE_DRAFTS`` tokens a step) runs in each greedy cell beside the modes, on the same
  prompts, in the same rotation, with the same repetition control (``native.sampler_args``),
  so its speedup is over the same ``plain`` repeats as ours. Not when sampling: there it
  proposes the draft's most likely token and accepts it with probability min(1, p/q) as if it
  had been drawn from q, so its output does not follow the target's distribution
  (docs/results-log.md measures it), and its speed is not a lossless peer's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from app.prompting import describe_sampler
from app.tools import peer
from app.tools.native import (
    NativeResult,
    NativeUnavailable,
    native_tools,
    run_native_bench,
    run_native_speculative,
)
from speculative.backend import ContextConfig, default_threads, system_info
from speculative.costmodel import VerifyCost
from speculative.divergence import explain
from speculative.engine import CHECK_PASSES, Learned
from speculative.errors import PromptTooLong
from speculative.loading import ModelPair, open_pair
from speculative.oracle import OracleDrafter
from speculative.penalties import penalizer_for
from speculative.policies import Mode, SpecConfig
from speculative.sampling import SamplingParams
from speculative.stats import RunStats

ASSETS = Path(__file__).resolve().parents[2] / "assets"
PROMPT_SETS = {"code": ASSETS / "bench_prompts.txt", "chat": ASSETS / "chat_prompts.txt"}
SAMPLED = SamplingParams(temperature=1.0, top_k=50)  # the sampled setting the results report
NATIVE_DRAFTS = (4, 8)  # llama-speculative's draft lengths (--spec-draft-n-max) to run
PENALISED = "+penalties"  # a cell's sampling with repetition control on


def load_prompts(path: Path) -> list[str]:
    """Prompts separated by lines holding only ``---``."""
    text = path.read_text("utf-8")
    return [p.strip("\n") + "\n" for p in text.split("\n---\n") if p.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default="code",
                        help="code, chat, both, or a file of prompts separated by '---' lines")
    parser.add_argument("--sampling", choices=("greedy", "sampled", "both"), default="greedy",
                        help="greedy, or temperature 1 with top-k 50 (sampled), or both")
    parser.add_argument("--penalties", choices=("off", "on", "both"), default="off",
                        help="repetition control: off, on (the sampler options given, else the "
                             "code format's defaults), or both side by side: what the "
                             "penalties cost each mode")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-ceiling", action="store_true", help="skip the oracle ceiling")
    parser.add_argument("--peers", action="store_true",
                        help="also run llama-cpp-python's own plain and speculative paths")
    parser.add_argument("--native", action="store_true",
                        help="also run llama.cpp's C++ llama-bench and llama-speculative "
                             "(built on first use, minutes)")
    parser.add_argument("--chart", type=Path, help="save a PNG chart of the speedups")
    parser.add_argument("--emulate-pass-ms", type=float, default=0.0, metavar="MS",
                        help="add MS milliseconds to every target pass: emulates a host whose "
                             "cost curve is flat (a pass's cost barely grows with its batch: a "
                             "GPU, matrix units); the report says so, and its figures are not "
                             "this host's")
    parser.add_argument("--markdown", action="store_true",
                        help="print the results as Markdown tables (for the README)")


@dataclasses.dataclass(slots=True)
class Cell:
    """One (sampling, prompt set) block: each mode's runs, repeat by repeat."""

    sampling: str
    prompt_set: str
    runs: dict[str, list[list[RunStats]]]      # mode -> repeat -> prompt runs
    outputs: dict[str, list[list[list[int]]]]  # mode -> repeat -> prompt tokens
    texts: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    prompts: list[list[int]] = dataclasses.field(default_factory=list)  # tokens, by prompt
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    # llama-speculative by draft length: repeat -> prompt results (empty where it did not run)
    native: dict[int, list[list[NativeResult]]] = dataclasses.field(default_factory=dict)
    native_unavailable: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Native:
    """How to run llama-speculative on the bench's models (``--native``)."""

    target: Path
    draft: Path
    threads: int
    ctx: int
    flash_attn: bool
    tools: dict[str, Path]  # ``native_tools()``

    def run(self, prompt: str, n: int, draft_max: int, params: SamplingParams
            ) -> NativeResult:
        return run_native_speculative(self.target, self.draft, prompt, n, self.threads,
                                      draft_max, ctx=self.ctx, flash_attn=self.flash_attn,
                                      sampling=params, tools=self.tools)


def _prompt_sets(arg: str) -> dict[str, list[str]]:
    if arg in PROMPT_SETS:
        return {arg: load_prompts(PROMPT_SETS[arg])}
    if arg == "both":
        return {name: load_prompts(path) for name, path in PROMPT_SETS.items()}
    return {Path(arg).stem: load_prompts(Path(arg))}


def bench(args: argparse.Namespace, target: Path, draft: Path | None, ngram_path: Path | None,
          spec: SpecConfig, config: ContextConfig, params: SamplingParams, out: TextIO) -> int:
    sets = _prompt_sets(str(args.prompts))
    modes = [m for m in args.mode if m is not Mode.PLAIN]
    bases = {"greedy": SamplingParams(), "sampled": SAMPLED}
    if args.temp > 0 and args.sampling == "greedy":  # --temp given: that setting instead
        bases["greedy"] = params.with_sampler(SamplingParams())
    samplings: dict[str, SamplingParams] = {}
    for name in ["greedy", "sampled"] if args.sampling == "both" else [args.sampling]:
        if args.penalties in ("off", "both"):
            samplings[name] = bases[name]
        if args.penalties in ("on", "both"):
            samplings[name + PENALISED] = bases[name].with_sampler(params)
    chosen = list(samplings)
    emulated = args.emulate_pass_ms
    if emulated and (args.native or args.peers):
        raise ValueError("--emulate-pass-ms slows only this engine's target passes: "
                         "llama.cpp's own tools (--native, --peers) would not be compared "
                         "like with like")
    report: dict[str, Any] = {"target": target.name, "draft": draft.name if draft else None,
                              "cells": []}
    if args.penalties != "off":
        report["penalties"] = describe_sampler(params)
    with open_pair(target, draft, config, (args.gpu_layers, args.draft_gpu_layers),
                   ngram_path, ngram_optional=args.ngram is None) as pair:
        if emulated:  # before the curves are measured: they price the emulated passes
            pair.target_ctx.emulate(emulated / 1000)
            report["emulated_pass_ms"] = emulated
        # flash attention as the target's context runs it (measured where the options say auto)
        config = dataclasses.replace(config, flash_attn=pair.target_ctx.flash_attn)
        report["host"] = host_info(config.n_threads, config.flash_attn,
                                   pair.draft_ctx.flash_attn if pair.draft_ctx else None)
        # where the machine chose: one token over the window with flash attention on and off
        report["host"]["flash_ms"] = {
            name: {"on": round(c.seconds_on * 1000, 2), "off": round(c.seconds_off * 1000, 2)}
            for name, c in pair.flash.items()}
        cost = pair.measure_costs(spec)
        report["cost_remeasured"] = _check_curve(pair, spec, next(iter(sets.values()))[0])
        cost = pair.costs or cost
        report["cost_ms"] = {"target": _ms(cost[0]), "draft": _ms(cost[1]) if cost[1] else None}
        report["cost_context"] = {"target": _context(cost[0]),
                                  "draft": _context(cost[1]) if cost[1] else None}
        native = None
        if args.native and draft is not None:
            try:
                tools = native_tools(progress=lambda msg: print(msg, file=sys.stderr))
                native = Native(target, draft, config.n_threads or default_threads(),
                                pair.target_ctx.n_ctx, bool(config.flash_attn), tools)
            except NativeUnavailable as exc:
                report["native_unavailable"] = str(exc)
        progress = Progress(sum(len(p) for p in sets.values()) * len(chosen) * args.repeats
                            * (len(modes) + 2 + (len(NATIVE_DRAFTS) if native else 0)))  # at most
        for sampling in chosen:
            for set_name, prompts in sets.items():
                cell = _run_cell(args, pair, spec, modes, sampling,
                                 samplings[sampling], set_name, prompts, progress, native)
                report["cells"].append(summarize(cell, pair))
        if args.peers or args.native:
            report["peers"] = run_peers(args, pair, target, sets, config)
    progress.done()
    if args.json:
        json.dump(report, out, indent=2)
        out.write("\n")
    elif args.markdown:
        out.write(format_markdown(report, args.repeats) + "\n")
    else:
        out.write(format_report(report, args.repeats) + "\n")
    if args.chart is not None:
        from app.ui.bench_chart import save_chart  # Qt, only when a chart is asked for

        save_chart(report, args.chart)
    return 0


def _check_curve(pair: ModelPair, spec: SpecConfig, text: str) -> bool:
    """Check the target's curve (cached, perhaps, from a slow moment) against untimed plain
    decoding of ``text``, as the app does between replies (``ModelPair.check_curve``), before
    anything is timed by it; whether it was measured again."""
    engine = pair.engine(dataclasses.replace(spec, mode=Mode.PLAIN))
    prompt = pair.target.vocab.tokenize(text)
    # passes count from the context the curve was timed after (the first follows the prompt)
    timed_after = pair.costs[0].context if pair.costs is not None else 0
    n = max(timed_after - len(prompt), 0) + CHECK_PASSES + 2
    n = min(n, pair.target_ctx.n_ctx - len(prompt) - 1)
    try:
        for _ in engine.generate(prompt, n):
            pass
    except PromptTooLong:
        return False  # (the timed runs report it)
    return pair.check_curve(engine)


def _run_cell(args: argparse.Namespace, pair: ModelPair, spec: SpecConfig,
              modes: list[Mode], sampling: str,
              params: SamplingParams, set_name: str, prompts: list[str],
              progress: Progress, native: Native | None = None) -> Cell:
    vocab = pair.target.vocab
    greedy = params.greedy
    order = [Mode.PLAIN, *modes] + ([Mode.ORACLE] if greedy and not args.no_ceiling else [])
    cell = Cell(sampling, set_name, {m.value: [] for m in order},
                {m.value: [] for m in order}, params=params)
    # llama-speculative's runs (by draft length) take their turns in the rotation too; greedy
    # only (see the module docstring)
    natives = NATIVE_DRAFTS if native is not None and greedy else ()
    lineup: list[Mode | int] = [*order, *natives]
    cell.native = {n: [] for n in natives}
    tokens = cell.prompts = [vocab.tokenize(p) for p in prompts]
    answers: dict[int, list[int]] = {}
    # what each mode's engine learned (auto's planner, the drafters' calibrations) lives across
    # the prompts, as in the app, where the engine lives across turns; the n-gram model does
    # not (it would learn the answers of the earlier repeats)
    learned: dict[Mode, Learned] = {}
    for m in order:  # warm-up: every mode once, untimed (graphs built, caches warm)
        _one(pair, spec, m, tokens[0], min(16, args.max_tokens), params,
             answers.get(0), learned)
        if m is Mode.PLAIN and greedy:
            answers[0] = _one(pair, spec, m, tokens[0], args.max_tokens,
                              params, None, learned)[0]
    for r in range(args.repeats):
        for m in order:
            cell.runs[m.value].append([])
            cell.outputs[m.value].append([])
        for results in cell.native.values():
            results.append([])
        for i, prompt in enumerate(tokens):
            rotation = (r * len(tokens) + i) % len(lineup)
            # plain first when the oracle needs its answer; the rest rotate
            ordered = lineup[rotation:] + lineup[:rotation]
            if Mode.ORACLE in ordered:
                ordered.remove(Mode.PLAIN)
                ordered.insert(0, Mode.PLAIN)
            for m in ordered:
                seeded = dataclasses.replace(params, seed=1000 * r + i) if not greedy else params
                if isinstance(m, int):
                    progress.tick(f"{sampling} {set_name} repeat {r + 1} prompt {i + 1}: "
                                  f"llama-speculative {m}")
                    _one_native(cell, native, prompts[i], args.max_tokens, m, seeded, r)
                    continue
                progress.tick(f"{sampling} {set_name} repeat {r + 1} prompt {i + 1}: {m.value}")
                out, run = _one(pair, spec, m, prompt, args.max_tokens,
                                seeded, answers.get(i), learned)
                if m is Mode.PLAIN and greedy:
                    answers[i] = out
                cell.runs[m.value][r].append(run)
                cell.outputs[m.value][r].append(out)
    cell.texts = {m: [vocab.detokenize(t) for t in outs[0]] for m, outs in cell.outputs.items()}
    return cell


def _one_native(cell: Cell, native: Native | None, prompt: str, n: int, draft_max: int,
                params: SamplingParams, repeat: int) -> None:
    """One llama-speculative run into ``cell``; where it cannot run, the cell says why and
    runs it no more."""
    if native is None or cell.native_unavailable is not None:
        return
    try:
        cell.native[draft_max][repeat].append(native.run(prompt, n, draft_max, params))
    except NativeUnavailable as exc:
        cell.native_unavailable = str(exc)


def _one(pair: ModelPair, spec: SpecConfig, mode: Mode,
         prompt: list[int], n: int, params: SamplingParams, answer: list[int] | None,
         learned: dict[Mode, Learned]) -> tuple[list[int], RunStats]:
    # a fresh n-gram model per run, so that no mode learns from another's output
    engine = pair.engine(dataclasses.replace(spec, mode=mode), learned.get(mode))
    if mode is Mode.ORACLE:
        engine.oracle = OracleDrafter(answer or [], len(prompt), pair.target.vocab.n_vocab)
    run = RunStats()
    out = [t for step in engine.generate(prompt, n, params, stop={pair.target.vocab.eos},
                                         run=run) for t in step.tokens]
    learned[mode] = engine.learned()
    return out, run


def summarize(cell: Cell, pair: ModelPair) -> dict[str, Any]:
    """Each mode's figures, derived from ``RunStats`` only."""
    from models.evaluate import judge

    greedy = not cell.sampling.startswith("sampled")
    vocab = pair.target.vocab
    penalizer = penalizer_for(cell.params, vocab.n_vocab, vocab.tokens_containing)
    plain_speed = [_pooled(rs).tokens_per_second for rs in cell.runs["plain"]]
    modes: dict[str, Any] = {}
    for mode, repeats in cell.runs.items():
        pooled = [_pooled(rs) for rs in repeats]
        speeds = [p.tokens_per_second for p in pooled]
        ups = [s / b if b else 0.0 for s, b in zip(speeds, plain_speed, strict=True)]
        everything = _pooled([r for rs in repeats for r in rs])
        same = ties = 0
        for outs, plains in zip(cell.outputs[mode], cell.outputs["plain"], strict=True):
            for prompt, o, p in zip(cell.prompts, outs, plains, strict=True):
                if o == p:
                    same += 1
                elif greedy:  # a tie of the target's own logits, or not
                    why = explain(pair.target_ctx, prompt, p, o, penalizer)
                    ties += why is not None and why.tie
        # the app's meter (each step's own counterfactual plain time), pooled like the speedup:
        # how far it is from the speedup measured side by side in the same run
        estimates = [p.estimated_speedup() for p in pooled]
        total = sum(len(outs) for outs in cell.outputs[mode])
        degenerate = sum(judge("", toks, pair.target.vocab.detokenize(toks)).degenerate
                         is not None for toks in cell.outputs[mode][0])
        modes[mode] = {
            "tokens_per_second": statistics.median(speeds),
            "tokens_per_second_range": [min(speeds), max(speeds)],
            "speedup": statistics.median(ups), "speedup_range": [min(ups), max(ups)],
            "estimated_speedup": statistics.median(estimates) if all(estimates) else None,
            "tau": everything.tau, "mean_drafted": everything.mean_drafted,
            "draft_calls_per_step": everything.draft_calls_per_step,
            "draft_ms_per_accepted": 1000 * everything.draft_seconds_per_accepted,
            "stage2_hit_rate": everything.stage2_hit_rate,
            "depth_acceptance": everything.depth_acceptance()[:8],
            "origins": everything.origins(), "time": everything.time_split(),
            "kinds": everything.kinds(),
            "identical": (f"{same}/{total}" + (f" +{ties} ties" if ties else "")
                          if greedy else None),
            "ties": ties if greedy else None,
            "differ_not_tied": total - same - ties if greedy else None,
            "penalty_ms_per_token": 1000 * sum(s.t_penalties for s in everything.steps)
            / max(1, everything.tokens),
            "steered": everything.steered,
            "degenerate_outputs": f"{degenerate}/{len(cell.outputs[mode][0])}",
        }
    ceiling = modes.get("oracle", {}).get("speedup")
    for s in modes.values():
        s["ceiling_share"] = s["speedup"] / ceiling if ceiling else None
    out = {"sampling": cell.sampling, "prompts": cell.prompt_set, "modes": modes,
           "sample_text": {m: t[0][:160] for m, t in cell.texts.items() if t}}
    native = _summarize_native(cell, plain_speed, pair)
    if native or cell.native_unavailable:
        out["native"] = native
    if cell.native_unavailable:
        out["native_unavailable"] = cell.native_unavailable
    return out


def _summarize_native(cell: Cell, plain_speed: list[float], pair: ModelPair
                      ) -> dict[str, Any]:
    """llama-speculative's figures in a cell, by draft length: its own decoding speed (tokens
    over decoding time, prompt excluded, as ours), pooled over the prompts of a repeat, over
    ``plain``'s in the same repeat."""
    from models.evaluate import judge

    vocab = pair.target.vocab
    out: dict[str, Any] = {}
    for draft_max, repeats in cell.native.items():
        if not repeats or any(len(rs) != len(cell.prompts) for rs in repeats):
            continue  # it stopped running: no pooled figure
        speeds = [sum(x.tokens for x in rs) / max(sum(x.seconds for x in rs), 1e-9)
                  for rs in repeats]
        ups = [s / b if b else 0.0 for s, b in zip(speeds, plain_speed, strict=True)]
        drafted = sum(x.n_drafted or 0 for rs in repeats for x in rs)
        accepted = sum(x.n_accept or 0 for rs in repeats for x in rs)
        tokens = sum(x.tokens for rs in repeats for x in rs)
        # each of its steps is one target pass emitting the accepted tokens and one more
        passes = max(tokens - accepted, 1)
        degenerate = sum(judge("", vocab.tokenize(x.text or ""), x.text or "").degenerate
                         is not None for x in repeats[0])
        out[f"llama-speculative {draft_max}"] = {
            "draft_max": draft_max,
            "tokens_per_second": statistics.median(speeds),
            "speedup": statistics.median(ups), "speedup_range": [min(ups), max(ups)],
            "accept": accepted / drafted if drafted else None,
            "tau": tokens / passes, "mean_drafted": drafted / passes,
            "degenerate_outputs": f"{degenerate}/{len(repeats[0])}",
            "sample_text": (repeats[0][0].text or "")[:160]}
    return out


def _pooled(runs: list[RunStats]) -> RunStats:
    return RunStats(steps=[s for r in runs for s in r.steps],
                    t_prefill=sum(r.t_prefill for r in runs))


# llama-cpp-python's own generation on the same target: plain, and its speculative path with
# LlamaPromptLookupDecoding proposing 10 tokens (each in a process of its own: app.tools.peer)
PEERS = (("llama-cpp-python plain", 0), ("llama-cpp-python prompt lookup (10)", 10))


def run_peers(args: argparse.Namespace, pair: ModelPair, target: Path,
              sets: dict[str, list[str]], config: ContextConfig) -> dict[str, Any]:
    """llama-cpp-python's plain and prompt-lookup paths and llama.cpp's ``llama-bench`` on the
    same target, greedy: tokens/s, and what could not run (``llama-speculative`` runs in the
    cells, beside the modes)."""
    vocab = pair.target.vocab
    threads = config.n_threads or default_threads()
    prompts = [p for ps in sets.values() for p in ps][:4]
    # flash attention as the engine runs the target (where it was left to the machine, as
    # measured): llama.cpp's own default would be "on" whatever decodes faster here
    flash = pair.target_ctx.flash_attn
    peers: dict[str, Any] = {}
    if args.peers:
        token_prompts = [vocab.tokenize(p) for p in prompts]
        for name, lookup in PEERS:
            argv = peer.command(target, token_prompts, args.max_tokens, threads,
                                pair.target_ctx.n_ctx, lookup, flash)
            try:
                result = peer.run_peer(argv)
            except peer.PeerFailed as exc:
                peers[name] = {"unavailable": f"peer failed on this host: {exc}"}
                continue
            seconds = result["seconds"]
            peers[name] = {"tokens_per_second": result["tokens"] / seconds if seconds else 0.0}
    if args.native:
        try:
            tools = native_tools(progress=lambda msg: print(msg, file=sys.stderr))
            peers["llama.cpp llama-bench"] = {"tokens_per_second": run_native_bench(
                target, args.max_tokens, threads, flash, tools=tools).tokens_per_second}
        except NativeUnavailable as exc:
            peers["llama.cpp"] = {"unavailable": str(exc)}
    return peers


def _on(host: dict[str, Any]) -> str:
    """Whether the run had flash attention on (reports from before it was recorded: off), and
    the draft's setting where it differs."""
    target = "on" if host.get("flash_attn") else "off"
    draft = host.get("draft_flash_attn")
    if draft is None or draft == host.get("flash_attn"):
        return target
    return f"{target} (draft {'on' if draft else 'off'})"


def host_info(threads: int, flash_attn: bool, draft_flash_attn: bool | None = None
              ) -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "threads": threads or "all", "flash_attn": flash_attn,
            "draft_flash_attn": draft_flash_attn,
            "llama.cpp": system_info()}


def _ms(cost: VerifyCost) -> dict[str, float]:
    return {str(n): round(t * 1000, 3) for n, t in zip(cost.sizes, cost.seconds, strict=True)}


CONTEXT_STEP = 256  # tokens of context the report states the curve's growth per


def _context(cost: VerifyCost) -> dict[str, Any]:
    """The context the curve was timed after, and what each further 256 tokens add (ms) to a
    batch of each measured size."""
    a, b = cost.per_context
    return {"after": cost.context, f"ms_per_{CONTEXT_STEP}": {
        str(n): round(CONTEXT_STEP * max(a + b * n, 0.0) * 1000, 3) for n in cost.sizes}}


class Progress:
    """One line on stderr: how far the benchmark is."""

    def __init__(self, total: int) -> None:
        self.total, self.n, self.t0 = max(total, 1), 0, time.perf_counter()
        self.live = sys.stderr.isatty()

    def tick(self, what: str) -> None:
        self.n += 1
        if self.live:
            eta = (time.perf_counter() - self.t0) / self.n * (self.total - self.n)
            sys.stderr.write(f"\r[{self.n}/{self.total}] {what:<60} ~{eta:.0f} s left ")
            sys.stderr.flush()

    def done(self) -> None:
        if self.live:
            sys.stderr.write("\r" + " " * 100 + "\r")


def _emulated(report: dict[str, Any]) -> str:
    return (f"EMULATED: every target pass took {report['emulated_pass_ms']:g} ms more "
            "(--emulate-pass-ms, a flat cost curve): these figures are not this host's.")


def format_report(report: dict[str, Any], repeats: int) -> str:
    host = report["host"]
    lines = [f"target {report['target']}, draft {report['draft']}; {host['cpu']}, "
             f"{host['threads']} threads, flash attention {_on(host)}; {repeats} repeats "
             "(median, min-max)"]
    if report.get("emulated_pass_ms"):
        lines.append(_emulated(report))
    for name, ms in (host.get("flash_ms") or {}).items():
        lines.append(f"{name}: one token over the window {ms['on']:.1f} ms with flash "
                     f"attention, {ms['off']:.1f} ms without (measured once on this machine)")
    t = report["cost_ms"]["target"]
    one = t["1"]
    lines.append("target cost(n) ms: " + "  ".join(
        f"{n}: {ms:.1f} ({ms / one:.2f})" for n, ms in t.items())
        + ("  (measured again: the cached curve priced one token above what plain "
           "decoding's took)" if report.get("cost_remeasured") else ""))
    grows = (report.get("cost_context") or {}).get("target")
    if grows:
        per = grows[f"ms_per_{CONTEXT_STEP}"]
        shown = ("1", "4", max(per, key=int))
        lines.append(f"target cost(n) timed after {grows['after']} tokens; each further "
                     f"{CONTEXT_STEP} add ms: "
                     + "  ".join(f"{n}: {ms:.1f}" for n, ms in per.items() if n in shown))
    if report["cost_ms"]["draft"]:
        d = report["cost_ms"]["draft"]
        lines.append("draft  cost(n) ms: " + "  ".join(f"{n}: {ms:.2f}" for n, ms in d.items()))
    for cell in report["cells"]:
        lines.append("")
        lines.append(f"== {cell['sampling']}, {cell['prompts']} prompts")
        head = (f"{'mode':<8}{'tok/s':>9}{'speedup':>9}{'range':>13}{'meter':>7}{'ceiling':>9}"
                f"{'tau':>6}{'tree':>6}{'draft/pass':>11}{'ms/acc':>8}  {'identical':<10}"
                "degenerate")
        lines += [head, "-" * len(head)]
        for mode, s in cell["modes"].items():
            lo, hi = s["speedup_range"]
            share = f"{s['ceiling_share']:.0%}" if s["ceiling_share"] is not None else "-"
            meter = s.get("estimated_speedup")
            meter = f"{meter:.2f}x" if meter is not None else "-"
            lines.append(f"{mode:<8}{s['tokens_per_second']:>9.1f}{s['speedup']:>8.2f}x"
                         f"{lo:>6.2f}-{hi:<5.2f}{meter:>7}{share:>9}{s['tau']:>6.2f}"
                         f"{s['mean_drafted']:>6.1f}{s['draft_calls_per_step']:>11.2f}"
                         f"{s['draft_ms_per_accepted']:>8.1f}  "
                         f"{s['identical'] or '-':<10}{s['degenerate_outputs']}")
        lines += _kinds(cell) + _drafting_free(cell)
        for s in (cell.get("native") or {}).values():
            lo, hi = s["speedup_range"]
            accept = f"accepts {s['accept']:.0%}" if s["accept"] is not None else ""
            lines.append(f"{'native ' + str(s['draft_max']):<8}{s['tokens_per_second']:>9.1f}"
                         f"{s['speedup']:>8.2f}x{lo:>6.2f}-{hi:<5.2f}{'-':>7}{'-':>9}"
                         f"{s['tau']:>6.2f}{s['mean_drafted']:>6.1f}  {accept:<27}"
                         f"{s['degenerate_outputs']}")
        if cell.get("native_unavailable"):
            lines.append(f"native: could not run: {cell['native_unavailable']}")
        bad = {m: s["degenerate_outputs"] for m, s in cell["modes"].items()
               if not s["degenerate_outputs"].startswith("0/")}
        if bad:
            counts = ", ".join(f"{m} {n}" for m, n in bad.items())
            lines.append(f"WARNING: degenerate outputs ({counts} of the first repeat): runs of "
                         "one token or of whitespace, and speed measured on them means little. "
                         "plain wrote: " + json.dumps(cell["sample_text"].get("plain", "")[:80]))
    lines += _penalty_cost(report)
    peers = report.get("peers")
    if report.get("native_unavailable"):
        lines += ["", f"llama-speculative could not run: {report['native_unavailable']}"]
    if peers:
        lines.append("")
        lines.append("peers (greedy, same target):")
        for name, p in peers.items():
            if "unavailable" in p:
                lines.append(f"  {name}: could not run: {p['unavailable']}")
            else:
                extra = f", acceptance {p['accept']:.0%}" if p.get("accept") is not None else ""
                lines.append(f"  {name}: {p['tokens_per_second']:.1f} tok/s{extra}")
    return "\n".join(lines)


# greedy, a step of the draft's kind may verify the n-gram's tree alone, or the root alone,
# where that was priced faster before running the draft (``AutoPolicy.without_draft``)
KIND_NAMES = {"draft": "draft's kind", "guesses": "n-gram's tree", "root": "target alone"}


def _kinds(cell: dict[str, Any]) -> list[str]:
    """Where ``auto`` took steps of more than one kind: the share of its steps each kind took,
    and its milliseconds a token where it ran (repeats pooled). Kinds run on different
    stretches of text, so their times compare the stretches as well as the kinds. (A fixed
    mode's steps have kinds too, in the JSON, but they name what happened, not a choice: a
    ``staged`` step whose tree needed no draft batch counts as the n-gram's.)"""
    lines = []
    for mode, s in cell["modes"].items():
        kinds = s.get("kinds") or {}
        if mode != "auto" or len(kinds) < 2:
            continue
        steps = sum(k["steps"] for k in kinds.values())
        parts = [f"{KIND_NAMES.get(name, name)} {k['steps'] / steps:.0%}"
                 + (f" ({1000 * k['seconds'] / k['tokens']:.1f} ms a token)" if k["tokens"]
                    else "")
                 for name, k in sorted(kinds.items(), key=lambda nk: -nk[1]["steps"])]
        lines.append(f"  {mode}'s steps by kind: " + ", ".join(parts))
    return lines


def _drafting_free(cell: dict[str, Any]) -> list[str]:
    """Each drafting mode's speedup with its drafting time (the draft model's and the
    n-gram's) taken out, its trees, passes and overhead as they ran: the most a drafter
    proposing the same trees at no cost could reach. Where a mode sits well below it, drafting
    is what holds it back; where near it, only trees the target accepts more of, or cheaper
    verification, can add speed. A mode that spent all its time drafting (no pass timed)
    gets no figure: nothing would be left to scale."""
    parts = []
    for mode, s in cell["modes"].items():
        split = s.get("time") or {}
        total = sum(split.values())
        drafting = split.get("draft", 0.0) + split.get("stage2", 0.0)
        if 0 < drafting < total:
            parts.append(f"{mode} {s['speedup'] / (1.0 - drafting / total):.2f}x")
    return ["  with drafting free: " + ", ".join(parts)] if parts else []


def _penalty_cost(report: dict[str, Any]) -> list[str]:
    """Each mode's speedup with the penalties against without them, from the same run."""
    cells = {(c["sampling"], c["prompts"]): c for c in report["cells"]}
    lines = []
    for (sampling, prompts), on in cells.items():
        off = cells.get((sampling.removesuffix(PENALISED), prompts))
        if not sampling.endswith(PENALISED) or off is None:
            continue
        lines += ["", f"== penalties ({report.get('penalties', '')}): {off['sampling']}, "
                  f"{prompts} prompts: speedup over plain with the same settings",
                  f"{'mode':<8}{'off':>8}{'on':>8}{'on/off':>8}{'ms/token':>10}{'steered':>9}"]
        for mode, s in on["modes"].items():
            before = off["modes"].get(mode, {}).get("speedup")
            ratio = f"{s['speedup'] / before:>8.2f}" if before else f"{'-':>8}"
            lines.append(f"{mode:<8}{before or 0:>7.2f}x{s['speedup']:>7.2f}x{ratio}"
                         f"{s['penalty_ms_per_token']:>10.3f}{s['steered']:>9}")
    return lines


def format_markdown(report: dict[str, Any], repeats: int) -> str:
    """The same results as README tables."""
    host = report["host"]
    t = report["cost_ms"]["target"]
    curve = ", ".join(f"{n}: {ms / t['1']:.2f}" for n, ms in t.items() if n != "1")
    lines = [f"Target `{report['target']}`, draft `{report['draft']}`; {host['cpu']}, "
             f"{host['threads']} threads, flash attention {_on(host)}; target pass "
             f"{t['1']:.1f} ms for one token, "
             f"cost(n)/cost(1) {curve}"
             + ("" if not report.get("cost_remeasured") else
                " (measured again: the cached curve priced one token above what plain "
                "decoding's took)")
             + f"; median of {repeats} repeats (range)."
             + (f" {_emulated(report)}" if report.get("emulated_pass_ms") else "")
             + "".join(f" {name.capitalize()}: one token over the window {ms['on']:.1f} ms "
                       f"with flash attention, {ms['off']:.1f} ms without."
                       for name, ms in (host.get("flash_ms") or {}).items()), ""]
    for cell in report["cells"]:
        lines += [f"**{cell['sampling']}, {cell['prompts']} prompts**", "",
                  "| mode | tokens/s | speedup | meter | of ceiling | tau | nodes/pass "
                  "| draft calls/pass | draft ms/accepted | identical | degenerate |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for mode, s in cell["modes"].items():
            lo, hi = s["speedup_range"]
            share = f"{s['ceiling_share']:.0%}" if s["ceiling_share"] is not None else "-"
            meter = s.get("estimated_speedup")
            meter = f"{meter:.2f}x" if meter is not None else "-"
            lines.append(f"| {mode} | {s['tokens_per_second']:.1f} | {s['speedup']:.2f}x "
                         f"({lo:.2f}-{hi:.2f}) | {meter} | {share} | {s['tau']:.2f} | "
                         f"{s['mean_drafted']:.1f} | {s['draft_calls_per_step']:.2f} | "
                         f"{s['draft_ms_per_accepted']:.1f} | "
                         f"{s['identical'] or '-'} | {s['degenerate_outputs']} |")
        for name, s in (cell.get("native") or {}).items():
            lo, hi = s["speedup_range"]
            lines.append(f"| {name} | {s['tokens_per_second']:.1f} | {s['speedup']:.2f}x "
                         f"({lo:.2f}-{hi:.2f}) | - | - | {s['tau']:.2f} | "
                         f"{s['mean_drafted']:.1f} | - | - | - | {s['degenerate_outputs']} |")
        if cell.get("native_unavailable"):
            lines.append(f"| llama-speculative | could not run: {cell['native_unavailable']} "
                         "|||||||||| ")
        notes = _kinds(cell) + _drafting_free(cell)
        lines += ["", *(line.strip() for line in notes)] if notes else []
        lines.append("")
    for name, p in report.get("peers", {}).items():
        what = (f"could not run: {p['unavailable']}" if "unavailable" in p
                else f"{p['tokens_per_second']:.1f} tokens/s")
        lines.append(f"- {name}: {what}")
    return "\n".join(lines)
