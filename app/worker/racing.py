"""The race: plain decoding, then the current speculation, on the same prompt, each timed step
by step. One after the other: run at once they would share the cores and slow each other down.
Both run to the same length (the end-of-text token does not stop them: sampled, each run is its
own draw and would stop elsewhere), and the verdict compares the time each took for the tokens
both wrote.

A short race is repeated: on a fast model a run takes a fraction of a second, and the machine's
jitter (another program, the CPU's clock, a thread waking) moves such a run by a quarter, as
much as speculation changes it, and a run of a few seconds on a shared machine still moves by
more than the meter is asked to agree with the race (README: races of identical work). While
either side's pooled time is under ``RACE_SECONDS``, both run again, the order alternating
(speculation first, then plain first, ...) so that a warm-up or a drift favours neither; the
verdict pools every round's time for the same tokens. The replay shows the first round.

The race measures the reply it races, as the meter estimated it: every run starts from what
the engine had learned when that reply began (``Engine.learned``, a snapshot the worker keeps),
in an engine of its own on the pair's contexts with a fresh copy of the n-gram model that
learns only this prompt. Run on the app's engine, the race's speculation would know the
answer (the n-gram model learns every text the engine writes: the reply's, then each round's,
the same text again when greedy), and ``auto`` would run the later rounds on what the earlier
ones taught it: faster than the reply ran, and each round another measure. The app's engine
learns nothing from a race either: many runs of one prompt would tilt what it knows of chat in
general. Settings changed during a race apply to the next reply, not to the race's runs.

Plain Python, run on the engine's thread by ``EngineWorker``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator

from app.prompting import FORMATS
from app.worker.messages import ChatRequest, RaceResult, RaceRun
from app.worker.replying import LiveSettings, prompt_for, steps
from speculative.divergence import explain
from speculative.engine import Engine, Learned, Step
from speculative.loading import ModelPair
from speculative.penalties import penalizer_for
from speculative.policies import Mode
from speculative.stats import RunStats
from speculative.text import TextStream

Progress = Callable[[str, int], None]  # mode, tokens so far

RACE_SECONDS = 5.0  # each side's pooled generation time the verdict should rest on, at least
MAX_ROUNDS = 24     # extra rounds at most (a very short reply stays a short measure)


class RaceStopped(Exception):
    """Stop was pressed during the race."""


def race(engine: Engine, pair: ModelPair, request: ChatRequest, start: Learned,
         cancelled: Callable[[], bool], progress: Progress,
         status: Callable[[str], None]) -> RaceResult:
    """Both runs, each from ``start`` (what ``engine`` had learned when the raced reply began;
    left as it is), and where their greedy texts part (whether the target's own logits tie
    there). ``engine``'s caches keep the prompt only afterwards: the race's engines used their
    contexts."""
    prompt = prompt_for(pair, engine, request)
    runs = []
    spec = request.settings.spec()
    modes = (Mode.PLAIN, spec.mode)
    rounds: list[tuple[float, float]] = []
    ngram = pair.new_ngram()  # each run's copy of it learns only this prompt and its own text

    def run_once(mode: Mode, run: RunStats) -> Iterator[Step]:
        racer = pair.engine(dataclasses.replace(spec, mode=mode), start.copy(),
                            copy.deepcopy(ngram))
        return steps(racer, pair, request, prompt, LiveSettings(), cancelled, run,
                     stop_at_end_of_text=False)

    try:
        for mode in modes:
            status(f"Race: {mode.value}…")
            run = RunStats()
            with contextlib.closing(run_once(mode, run)) as timed:
                runs.append(_timed_run(mode.value, timed, pair, run, progress))
        n = min(len(runs[0].tokens), len(runs[1].tokens))
        pooled = [r.run.seconds_until(n) for r in runs]
        while n and min(pooled) < RACE_SECONDS and len(rounds) < MAX_ROUNDS:
            status(f"Race: round {len(rounds) + 2}, for a steadier measure…")
            seconds = [0.0, 0.0]  # plain's, speculation's (the modes may be the same)
            for side in ((1, 0) if len(rounds) % 2 == 0 else (0, 1)):
                run = RunStats()
                with contextlib.closing(run_once(modes[side], run)) as timed:
                    for step in timed:
                        if step.finish == "cancelled":
                            raise RaceStopped
                seconds[side] = run.seconds_until(n)
            rounds.append((seconds[0], seconds[1]))
            pooled = [p + s for p, s in zip(pooled, seconds, strict=True)]
    except RaceStopped:  # between steps: the contexts are as the last step left them
        _keep(engine, prompt.tokens)
        raise
    except BaseException:  # maybe mid-step: nothing in the contexts is sure
        for cache in (engine.target, engine.draft):
            if cache is not None:
                cache.reset()
        raise
    _keep(engine, prompt.tokens)
    why = None
    params = request.settings.sampling(request.seed, FORMATS[request.format])
    if params.greedy and runs[0].tokens != runs[1].tokens:
        vocab = pair.target.vocab
        why = explain(engine.target.ctx, prompt.tokens, runs[0].tokens, runs[1].tokens,
                      penalizer_for(params, vocab.n_vocab, vocab.tokens_containing))
        engine.target.reset()  # the replays used its context
    return RaceResult(request.request_id, *runs, why, request.settings.temperature,
                      tuple(rounds))


def _keep(engine: Engine, prompt: list[int]) -> None:
    """The race's engines decoded the prompt from the start, then text of their own, into the
    contexts ``engine``'s caches describe: they keep the prompt (the next turn reads it again)
    and forget the rest."""
    for cache in (engine.target, engine.draft):
        if cache is not None:
            cache.keep(prompt)


def _timed_run(mode: str, timed: Iterator[Step], pair: ModelPair, run: RunStats,
               progress: Progress) -> RaceRun:
    """One run, with when each step's text arrived."""
    text = TextStream(pair.target.vocab.piece)
    timeline: list[tuple[float, str]] = []
    tokens: list[int] = []
    elapsed = 0.0
    for step in timed:
        if step.finish == "cancelled":
            raise RaceStopped
        elapsed += step.stats.seconds  # generation time only, as RunStats counts it
        pieces = text.feed(step.tokens, final=step.finish is not None)
        timeline.append((elapsed, "".join(t for t, _ in pieces)))
        tokens += step.tokens
        progress(mode, len(tokens))
    return RaceRun(mode, text.text, tokens, timeline, run)
