"""A reply's statistics as data (``app.replies``): stored whole, read back whole, shown as
stored."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from app import replies
from app.history import History
from app.replies import (
    continued,
    figures,
    footer,
    reply_stats,
    run_from_json,
    run_to_json,
    stored_run,
)
from speculative.stats import RunStats, StepStats


def _step(drafted: int, accepted: int, draft: int, ngram: int, seconds: float) -> StepStats:
    emitted = accepted + 1
    return StepStats(drafted=drafted, accepted=accepted, offered=min(drafted, 3),
                     emitted=emitted, origins={"draft": draft, "ngram": ngram,
                                               "target": emitted - draft - ngram},
                     draft_calls=2, stage2_proposed=3, stage2_used=1, t_draft=seconds / 3,
                     t_stage2=seconds / 10, t_verify=seconds / 2, t_other=seconds / 15)


def _run() -> RunStats:
    run = RunStats(mode="staged", prompt_tokens=12, t_prefill=0.004)
    for step in (_step(6, 2, 1, 1, 0.012), _step(8, 0, 0, 0, 0.009), _step(5, 4, 3, 1, 0.02)):
        run.add(step)
    return run


def test_a_run_round_trips_through_json_and_the_history(tmp_path: Path) -> None:
    run = _run()
    assert run_from_json(json.loads(json.dumps(run_to_json(run)))) == run
    stats = reply_stats(run, 0.01, [("ab", "draft"), ("c", "target")], "code")
    with History(tmp_path / "h.sqlite3") as history:
        c = history.create_conversation("t")
        m = history.add_message(c.id, "assistant", "abc", finish="stop", stats=stats,
                                mode="staged")
        again = history.message(m.id).stats
    assert stored_run(again) == run
    # the stored figures are the run's own, and the speedup the one estimated when written
    assert {k: again[k] for k in run.summary()} == json.loads(json.dumps(run.summary()))
    assert again["estimated_speedup"] == pytest.approx(run.estimated_speedup(0.01))
    assert again["origin_runs"] == [[2, "draft"], [1, "target"]] and again["format"] == "code"


@dataclasses.dataclass(frozen=True, slots=True)
class WiderStep(StepStats):
    """``StepStats`` as it may grow: a field added later, with a default."""

    t_sync: float = 0.0


def test_fields_added_to_step_stats_round_trip_without_code_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = run_to_json(_run())  # stored by the code of today
    monkeypatch.setattr(replies, "StepStats", WiderStep)
    read = run_from_json(before)
    assert [type(s) for s in read.steps] == [WiderStep] * 3
    assert [s.t_sync for s in read.steps] == [0.0] * 3  # not stored then: its default
    wide = RunStats(mode="auto", steps=[WiderStep(**{
        f.name: getattr(s, f.name) for f in dataclasses.fields(StepStats)}, t_sync=0.5)
        for s in _run().steps])
    data = json.loads(json.dumps(run_to_json(wide)))
    assert "t_sync" in data["fields"] and run_from_json(data) == wide
    monkeypatch.undo()
    narrow = run_from_json(data)  # read by older code: the field it does not know is dropped
    assert [type(s) for s in narrow.steps] == [StepStats] * 3


def test_a_reply_stored_before_steps_were_kept_has_no_run() -> None:
    legacy = {**_run().summary(), "estimated_speedup": 1.3, "origin_runs": []}
    assert stored_run(legacy) is None


def test_a_continued_reply_has_the_old_steps_then_the_new() -> None:
    old, new = _run(), RunStats(mode="tree", prompt_tokens=40, t_prefill=0.01,
                                steps=[_step(4, 1, 1, 0, 0.01)])
    both = continued(old, new)
    assert both.steps == [*old.steps, *new.steps] and both.mode == "tree"
    assert both.prompt_tokens == 12 and both.t_prefill == pytest.approx(0.014)
    assert continued(None, new) is new  # stored without steps: nothing is made up


def test_the_footer_shows_the_stored_figures() -> None:
    run = _run()
    stats = reply_stats(run, 0.01, [], "code")
    line = footer(stats, "staged", "stop")
    summary = figures(run, 0.01)
    assert line.startswith("staged  ·  9 tokens  ·  ")
    assert f"{summary['estimated_speedup']:.2f}" in line and f"{summary['tau']:.2f}" in line
    assert "stop" not in line  # how most replies end goes without saying
    assert footer(stats, "staged", "cancelled").endswith("cancelled")
    failed = reply_stats(run, 0.01, [], "code", error="the disk is full")
    assert footer(failed, "staged", "error").endswith("stopped by an error: the disk is full")
    assert footer({}, "tree", "cancelled") == "tree · cancelled"
    legacy = {"tokens": 196, "tokens_per_second": 50.0, "tau": 1.07,
              "origins": {"draft": 10, "ngram": 0, "target": 186}}
    assert "196 tokens" in footer(legacy, "auto", "length")
    assert "1.07" in footer(legacy, "auto", "length")
