"""Opening the app's models: the pair its settings name (or the built-in one) with the built-in
n-gram model, this machine's plain decoding timed, and which drafts fit a target.

Plain functions, run on the engine's thread by ``EngineWorker``; the diagnostics open models the
same way.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

from app.settings import AppSettings
from app.worker.messages import ModelInfo
from models.catalog import BUILTIN_NGRAM, builtin_pair
from speculative.backend import LlamaModel, system_info
from speculative.engine import Engine
from speculative.errors import ContextOverflow, IncompatibleModels, LlamaError
from speculative.loading import ModelPair, check_compatible, open_pair
from speculative.policies import Mode
from speculative.stats import RunStats

# A sample of plain decoding, timed when models load: the basis of the estimated speedup for
# steps without a counterfactual of their own. Its prompt is longer than the context the cost
# curve is timed after, so that its passes are also single tokens the meter's correction for
# drafted passes compares with (``PassLoads``): a first reply that drafts every step has no
# others.
_CALIBRATION_PROMPT = ("import sys\n\n\ndef read_numbers(path):\n"
                       '    """Return the numbers in the file at path, one per line."""\n'
                       "    numbers = []\n    with open(path) as f:\n        for line in f:\n"
                       "            line = line.strip()\n            if line:\n"
                       "                numbers.append(float(line))\n    return numbers\n\n\n"
                       "def main():\n")
_CALIBRATION_TOKENS = 24


def app_threads(cores: int | None = None) -> tuple[int, ...]:
    """The llama.cpp thread counts the app chooses among for each model when the user has not
    chosen: all cores, or all but one for the window, which streams text and redraws the chart
    while the engine runs. llama.cpp's threads spin at barriers, and one that shares its core
    with the busy GUI thread stalls the barrier. Each model gets the count that decodes it
    fastest, measured once on this machine (``speculative.loading.threads_choice``), every
    core's time counted ``WINDOW_STALL`` more per pass: a small model's short passes go faster
    on a core fewer, a large model's long ones on every core (they need every core's share of
    the memory bandwidth, and lose little to a stall). Measure the policy with ``staged-chat
    app --throughput-check``."""
    if cores is None:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
    return tuple(sorted({max(1, cores - 1), cores}))


# what a pass on every core loses to the window drawing a streaming reply, about: the time a
# pass took in the window beyond the command line's in ``--throughput-check`` runs
# (docs/results-log.md)
WINDOW_STALL = 0.005


def window_handicap(counts: tuple[int, ...]) -> dict[int, float] | None:
    """``threads_choice``'s handicap for the app's ``counts``: every core pays the stall."""
    return {max(counts): WINDOW_STALL} if len(counts) > 1 else None


@dataclasses.dataclass(slots=True)
class Loaded:
    """Models open on the engine's thread, the engine that runs on them, and what the GUI is
    told about them."""

    pair: ModelPair
    engine: Engine
    settings: AppSettings
    info: ModelInfo


def open_models(settings: AppSettings, threads: int | None = None,
                status: Callable[[str], None] | None = None) -> ModelPair:
    """The pair the settings name (the built-in one by default), with the built-in n-gram model
    where the target's vocabulary is GPT-2's (it counts GPT-2 token ids); ``status`` hears of
    a first measurement of this machine. Each model decodes with ``threads`` threads, or the
    settings' count, or, where neither says, the app's choice (``app_threads``)."""
    target, draft = model_paths(settings)
    threads = threads or settings.threads
    counts = app_threads() if not threads else ()
    return open_pair(target, draft, settings.context(threads or max(counts)),
                     (settings.gpu_layers, settings.draft_gpu_layers),
                     ngram=BUILTIN_NGRAM if BUILTIN_NGRAM.is_file() else None,
                     ngram_optional=True, measuring=status, threads=counts,
                     threads_handicap=window_handicap(counts) if counts else None)


def load(settings: AppSettings, status: Callable[[str], None]) -> Loaded:
    """Open the models, measure this machine's cost curves and plain decoding speed."""
    t0 = time.perf_counter()
    pair = open_models(settings, status=status)
    try:
        status("Measuring this machine's speed…")
        pair.measure_costs(settings.spec())
        engine = pair.engine(settings.spec())
        pair.recall(engine)  # what the last run on these models learned of this machine
        plain = time_plain(engine, pair)
    except BaseException:
        pair.close()
        raise
    cost = engine.verify_cost
    target, draft = model_paths(settings)
    info = ModelInfo(
        target=pair.target.name, draft=pair.draft.name if pair.draft else None,
        target_path=str(target), draft_path=str(draft) if draft else None,
        builtin=is_builtin(settings.target_path), n_ctx=pair.target_ctx.n_ctx,
        threads=(pair.target_ctx.n_threads,
                 pair.draft_ctx.n_threads if pair.draft_ctx is not None else None),
        has_ngram=pair.ngram_path is not None, plain_seconds_per_token=plain,
        flash_attn=(pair.target_ctx.flash_attn,
                    pair.draft_ctx.flash_attn if pair.draft_ctx is not None else None),
        verify_ms={n: t * 1000 for n, t in zip(cost.sizes, cost.seconds, strict=True)}
        if cost else {}, load_seconds=time.perf_counter() - t0, system=system_info())
    return Loaded(pair, engine, settings, info)


def model_paths(settings: AppSettings) -> tuple[Path, Path | None]:
    """The target and draft files the settings name; empty names mean the built-in pair."""
    if settings.target_path:
        target = Path(settings.target_path)
        draft = Path(settings.draft_path) if settings.draft_path else None
        if draft is None and Mode(settings.mode).needs_draft:
            raise ValueError(f"the mode {settings.mode!r} needs a draft model: choose one in "
                             f"Models, or pick the n-gram or off mode")
        return target, draft
    target, draft = builtin_pair()
    return target, Path(settings.draft_path) if settings.draft_path else draft


def is_builtin(target: str) -> bool:
    """The built-in code target, chosen by default or by its file."""
    if not target:
        return True
    try:
        return Path(target).resolve() == builtin_pair()[0].resolve()
    except OSError:
        return False


def time_plain(engine: Engine, pair: ModelPair) -> float:
    """Seconds per token of plain decoding on this machine (a short greedy sample)."""
    saved = engine.config
    engine.config = dataclasses.replace(saved, mode=Mode.PLAIN)
    run = RunStats()
    try:
        prompt = pair.target.vocab.tokenize(_CALIBRATION_PROMPT)
        room = engine.target.ctx.n_ctx - _CALIBRATION_TOKENS - 1  # the window, less the sample
        prompt = prompt[-max(1, room):]
        for _ in engine.generate(prompt, _CALIBRATION_TOKENS, run=run):
            pass
    finally:
        engine.config = saved
    return run.seconds / max(1, run.tokens)


def check_drafts(target: str, drafts: list[str]) -> dict[str, str | None]:
    """Which drafts share the target's tokenizer: {draft path: None, or why not}. Loads
    vocabularies only, which is fast."""
    verdicts: dict[str, str | None] = {}
    try:
        with LlamaModel(Path(target) if target else builtin_pair()[0], vocab_only=True) as t:
            for d in drafts:
                try:
                    with LlamaModel(d, vocab_only=True) as m:
                        check_compatible(t, m)
                    verdicts[d] = None
                except (LlamaError, IncompatibleModels, OSError) as exc:
                    verdicts[d] = reason(exc)
    except (LlamaError, OSError) as exc:
        verdicts = dict.fromkeys(drafts, f"target: {reason(exc)}")
    return verdicts


def reason(exc: BaseException) -> str:
    """A message for the user: the exception's own words, with its kind where that helps."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ContextOverflow | IncompatibleModels | LlamaError | ValueError | OSError):
        return text
    return f"{type(exc).__name__}: {text}"
