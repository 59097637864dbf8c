"""The race: plain decoding, then the current speculation, on the same prompt, each timed step
by step. One after the other: run at once they would share the cores and slow each other down.
Both run to the same length (the end-of-text token does not stop them: sampled, each run is its
own draw and would stop elsewhere), and the verdict compares the time each took for the tokens
both wrote.

Plain Python, run on the engine's thread by ``EngineWorker``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

from app.prompting import FORMATS
from app.worker.messages import ChatRequest, RaceResult, RaceRun
from app.worker.replying import LiveSettings, prompt_for, steps
from speculative.divergence import explain
from speculative.engine import Engine, Step
from speculative.loading import ModelPair
from speculative.penalties import penalizer_for
from speculative.policies import Mode
from speculative.stats import RunStats
from speculative.text import TextStream

Progress = Callable[[str, int], None]  # mode, tokens so far


class RaceStopped(Exception):
    """Stop was pressed during the race."""


def race(engine: Engine, pair: ModelPair, request: ChatRequest, live: LiveSettings,
         cancelled: Callable[[], bool], progress: Progress,
         status: Callable[[str], None]) -> RaceResult:
    """Both runs, and where their greedy texts part (whether the target's own logits tie
    there). The engine's settings are the request's again afterwards."""
    prompt = prompt_for(pair, engine, request)
    runs = []
    try:
        for mode in (Mode.PLAIN, engine.config.mode):
            engine.config = dataclasses.replace(request.settings.spec(), mode=mode)
            status(f"Race: {mode.value}…")
            run = RunStats()
            with contextlib.closing(steps(engine, pair, request, prompt, live, cancelled,
                                          run, stop_at_end_of_text=False)) as timed:
                runs.append(_timed_run(mode.value, timed, pair, run, progress))
    finally:
        engine.config = request.settings.spec()
    why = None
    params = request.settings.sampling(request.seed, FORMATS[request.format])
    if params.greedy and runs[0].tokens != runs[1].tokens:
        vocab = pair.target.vocab
        why = explain(engine.target.ctx, prompt.tokens, runs[0].tokens, runs[1].tokens,
                      penalizer_for(params, vocab.n_vocab, vocab.tokens_containing))
        engine.target.reset()  # the replays used its cache
    return RaceResult(request.request_id, *runs, why, request.settings.temperature)


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
