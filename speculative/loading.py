"""Opening the models an engine runs on: a target/draft pair with contexts sized for the
speculation settings, the n-gram model file, and the cost curves every engine on the pair
shares. The app's worker, the CLI, the benchmark and the diagnostics all open engines here.

A program that runs for a user (the app, the local server) also keeps what its engine learned
of these models on this machine (``ModelPair.remember``) and starts the next run's engine from
it (``ModelPair.recall``), beside the cost curves; benchmarks start fresh."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .backend import ContextConfig, LlamaContext, LlamaModel, fit_window, setting_key
from .costmodel import (
    FlashChoice,
    PassLoads,
    ThreadsChoice,
    VerifyCost,
    cache_dir,
    cached_flash_attn,
    cached_threads,
    read_cache,
    window_costs,
    write_cache,
)
from .engine import Engine, Learned
from .errors import IncompatibleModels
from .ngram import KatzTrigram
from .policies import Mode, SpecConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class ModelPair:
    """A target model and optionally a draft, each with its own context, and the n-gram model
    file; ``engine`` makes engines on them. Close when done."""

    target: LlamaModel
    target_ctx: LlamaContext
    draft: LlamaModel | None = None
    draft_ctx: LlamaContext | None = None
    ngram_path: Path | None = None  # the n-gram model each engine starts from (None: empty)
    # the target's and the draft's decode-cost curves, measured by the first engine that needs
    # them and handed to every later one
    costs: tuple[VerifyCost, VerifyCost | None] | None = None
    # where flash attention was left to the machine: what was measured, by "target" / "draft"
    flash: dict[str, FlashChoice] = dataclasses.field(default_factory=dict)
    # where the thread count was left to the machine: what was measured, by "target" / "draft"
    threads: dict[str, ThreadsChoice] = dataclasses.field(default_factory=dict)
    remeasured: bool = False  # the target's curve was measured again (``check_curve``)
    # the target's passes in decoding against its curve, shared by the pair's engines
    passes: PassLoads = dataclasses.field(default_factory=PassLoads)

    def new_ngram(self) -> KatzTrigram | None:
        """A fresh copy of the n-gram model (an engine teaches its own the conversation)."""
        return KatzTrigram.load(self.ngram_path) if self.ngram_path is not None else None

    def engine(self, spec: SpecConfig, learned: Learned | None = None,
               ngram: KatzTrigram | None = None) -> Engine:
        """An engine on these contexts with ``spec``, a fresh n-gram model (or ``ngram``), the
        pair's cost curves (measured now if this mode needs them and nobody has yet), and
        what an earlier engine ``learned``."""
        engine = Engine(self.target_ctx, self.draft_ctx,
                        ngram if ngram is not None else self.new_ngram(), spec,
                        self.target.vocab.tokens_containing)
        if self.costs is None and spec.mode is not Mode.PLAIN and (
                spec.adaptive or spec.mode is Mode.AUTO):
            self.measure_costs(spec)
        if self.costs is not None:
            engine.verify_cost, engine.draft_cost = self.costs
        engine.passes = self.passes
        if learned is not None:
            engine.adopt(learned)
        return engine

    def measure_costs(self, spec: SpecConfig, force: bool = False,
                      ) -> tuple[VerifyCost, VerifyCost | None]:
        """The cost curves, measured for the largest tree ``spec`` allows (``auto``'s)."""
        if self.costs is None or force:
            probe = Engine(self.target_ctx, self.draft_ctx, None,
                           dataclasses.replace(spec, mode=Mode.AUTO))
            probe.measure_cost(force)
            assert probe.verify_cost is not None
            self.costs = (probe.verify_cost, probe.draft_cost)
        return self.costs

    def check_curve(self, engine: Engine) -> bool:
        """``Engine.check_curve`` on an engine of this pair, between replies: a target curve
        measured again also becomes the one later engines start from; whether it was. Once
        per pair: a curve that, measured again, still disagreed with decoding would otherwise
        be measured between every two replies."""
        if not self.curve_due(engine) or not engine.check_curve():
            return False
        self.remeasured = True
        if self.costs is not None and engine.verify_cost is not None:
            self.costs = (engine.verify_cost, self.costs[1])
        return True

    def curve_due(self, engine: Engine) -> bool:
        """Whether ``check_curve`` would measure the target's curve again now."""
        return not self.remeasured and engine.curve_too_dear()

    def memory_key(self) -> str:
        """What an engine's memory depends on: both models' files, this machine, the contexts'
        settings (``LlamaContext.cost_key``) and the n-gram model's file."""
        ngram = "-"
        if self.ngram_path is not None:
            stat = self.ngram_path.stat()
            ngram = f"{self.ngram_path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}"
        draft = self.draft_ctx.cost_key if self.draft_ctx is not None else "-"
        key = f"{self.target_ctx.cost_key}||{draft}||{ngram}"
        return hashlib.sha256(key.encode()).hexdigest()[:24]

    def recall(self, engine: Engine, path: Path | None = None) -> bool:
        """Start ``engine`` (on this pair, its cost curves measured) from what an engine on
        these models learned in an earlier run (``remember``); whether there was something to
        recall. A memory that cannot be read is ignored."""
        if self.costs is None:
            return False
        entry = read_cache(path or learned_path()).get(self.memory_key())
        if not isinstance(entry, dict) or not isinstance(entry.get("memory"), dict):
            return False
        try:
            engine.recall(entry["memory"])
        except ValueError as exc:
            log.info("what an earlier run learned is not recalled: %s", exc)
            return False
        return True

    def remember(self, engine: Engine, path: Path | None = None) -> None:
        """Keep what ``engine`` learned for a later run's engine on these models
        (``recall``); a file that cannot be written is let be."""
        path = path or learned_path()
        entries = read_cache(path)
        entries[self.memory_key()] = {"memory": engine.memory(), "saved": time.time()}
        write_cache(path, entries)

    def close(self) -> None:
        for obj in (self.draft_ctx, self.draft, self.target_ctx, self.target):
            if obj is not None:
                obj.close()

    def __enter__(self) -> ModelPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def learned_path() -> Path:
    return cache_dir() / "learned.json"


def check_compatible(target: LlamaModel, draft: LlamaModel) -> None:
    """Refuse a draft whose tokens would mean different text to the target."""
    why = target.vocab.difference(draft.vocab)
    if why is not None:
        raise IncompatibleModels(f"draft {draft.path.name} does not share the tokenizer of "
                                 f"target {target.path.name}: {why}")


def check_ngram(path: Path, target: LlamaModel) -> None:
    """Refuse an n-gram model over other token ids than the target's."""
    n_vocab = KatzTrigram.vocabulary_size(path)
    if n_vocab != target.vocab.n_vocab:
        raise IncompatibleModels(f"n-gram model {path.name} covers {n_vocab} tokens; target "
                                 f"{target.path.name} has {target.vocab.n_vocab}")


def open_pair(target: str | Path, draft: str | Path | None, config: ContextConfig,
              gpu_layers: tuple[int, int] = (0, 0), ngram: str | Path | None = None,
              ngram_optional: bool = False,
              measuring: Callable[[str], None] | None = None,
              threads: Sequence[int] = (), threads_handicap: dict[int, float] | None = None,
              ) -> ModelPair:
    """Load both models, check they share a tokenizer, and create their contexts.

    Both contexts get the same window (the smaller trained context wins, or ``ContextTooLarge``
    if ``config.fit`` is off) so that a tree that fits one fits the other. ``ngram`` names the
    n-gram model file engines start from; one over other token ids than the target's is
    refused (``IncompatibleModels``), or with ``ngram_optional`` (the built-in GPT-2 n-gram
    beside a model of another vocabulary) left out. Flash attention left to the machine
    (``config.flash_attn`` None) is measured for each model the first time (``measuring`` is
    told, for a status line). Given several ``threads`` counts, each model decodes with the
    fewest that are as fast as any, measured the first time, each count's time plus its
    ``threads_handicap`` (``threads_choice``); otherwise with ``config.n_threads``.
    Whatever fails, what was loaded so far is freed, and models
    loaded elsewhere are untouched.
    """
    with contextlib.ExitStack() as stack:
        t_model = stack.enter_context(LlamaModel(target, gpu_layers=gpu_layers[0]))
        d_model = (stack.enter_context(LlamaModel(draft, gpu_layers=gpu_layers[1]))
                   if draft is not None else None)
        n_ctx = fit_window(config, t_model.n_ctx_train, t_model.path.name)
        if d_model is not None:
            check_compatible(t_model, d_model)
            n_ctx = fit_window(dataclasses.replace(config, n_ctx=n_ctx), d_model.n_ctx_train,
                               d_model.path.name)
        config = dataclasses.replace(config, n_ctx=n_ctx)
        configs, flash, counts = {}, {}, {}
        for name, model in (("target", t_model), ("draft", d_model)):
            if model is None:
                continue
            configs[name] = config
            if len(set(threads)) > 1:
                counts[name] = threads_choice(model, config, threads, threads_handicap,
                                              measuring)
                configs[name] = dataclasses.replace(config, n_threads=counts[name].threads)
            if config.flash_attn is None:
                flash[name] = flash_attn_choice(model, configs[name], measuring)
                configs[name] = dataclasses.replace(configs[name], flash_attn=flash[name].on)
        t_ctx = stack.enter_context(LlamaContext(t_model, configs["target"]))
        d_ctx = (stack.enter_context(LlamaContext(d_model, configs["draft"]))
                 if d_model is not None else None)
        ngram_path = Path(ngram) if ngram is not None else None
        if ngram_path is not None:
            try:
                check_ngram(ngram_path, t_model)
            except IncompatibleModels as exc:
                if not ngram_optional:
                    raise
                log.info("no n-gram model: %s", exc)
                ngram_path = None
        stack.pop_all()  # success: the pair owns them now
        return ModelPair(t_model, t_ctx, d_model, d_ctx, ngram_path, flash=flash,
                         threads=counts)


def threads_choice(model: LlamaModel, config: ContextConfig, counts: Sequence[int],
                   handicap: dict[int, float] | None = None,
                   measuring: Callable[[str], None] | None = None) -> ThreadsChoice:
    """How many of ``counts`` threads ``model`` decodes with: the fewest about as fast as the
    fastest over the window, each count's time plus its ``handicap`` (seconds a pass on that
    many threads loses where it runs), measured once per model file, machine and settings and
    remembered (``costmodel.cached_threads``; flash attention as ``config`` says, on where it
    leaves it to the machine). A small model's passes can be faster on fewer threads: they
    are too short to pay for waking and joining more; a large one's need every core's share
    of the memory bandwidth."""
    key = "|".join(str(x) for x in (setting_key(model, 0, config.n_batch), config.n_ctx,
                                    config.n_seq_max, config.flash_attn))

    def measure(candidates: Sequence[int]) -> list[float]:
        if measuring is not None:
            measuring(f"Timing {model.path.name} on {' and '.join(map(str, candidates))} "
                      "threads (once on this machine)…")
        with contextlib.ExitStack() as stack:
            contexts = [stack.enter_context(LlamaContext(model, dataclasses.replace(
                config, n_threads=n, flash_attn=config.flash_attn is not False)))
                for n in candidates]
            return window_costs(contexts)

    return cached_threads(key, counts, measure, handicap=handicap)


def resolve_flash_attn(model: LlamaModel, config: ContextConfig,
                       measuring: Callable[[str], None] | None = None) -> ContextConfig:
    """``config`` with flash attention on or off: as it says, or where it leaves it to the
    machine (None), as ``flash_attn_choice`` measured."""
    if config.flash_attn is not None:
        return config
    return dataclasses.replace(config,
                               flash_attn=flash_attn_choice(model, config, measuring).on)


def flash_attn_choice(model: LlamaModel, config: ContextConfig,
                      measuring: Callable[[str], None] | None = None) -> FlashChoice:
    """Whether flash attention decodes ``model`` faster over the window here, measured once
    per model file, machine and settings and remembered (``costmodel.cached_flash_attn``;
    ``measuring`` is told before a measurement, for a status line).

    Which is faster is not the same everywhere: the CPU flash-attention kernel makes a short
    context's pass cheaper, but it walks the cached context row by row, and on some CPUs a pass
    then grows with the context several times faster than without it (README)."""
    key = "|".join(str(x) for x in (setting_key(model, config.n_threads, config.n_batch),
                                    config.n_ctx, config.n_seq_max))

    def measure() -> tuple[float, float]:
        if measuring is not None:
            measuring(f"Timing {model.path.name} with and without flash attention (once on "
                      "this machine)…")
        with (LlamaContext(model, dataclasses.replace(config, flash_attn=True)) as on,
              LlamaContext(model, dataclasses.replace(config, flash_attn=False)) as off):
            seconds = window_costs([on, off])
        return seconds[0], seconds[1]

    return cached_flash_attn(key, measure)
