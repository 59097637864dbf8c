"""A reply's statistics as data: what the history stores with it, and the footer shown under it
in the window and in exports. No Qt.

A stored reply's ``stats`` hold ``RunStats.summary()`` (the figures, for exports and for
whoever reads the JSON), the app's own figures (``estimated_speedup``, and ``error`` for a reply
a failure cut short), how its text splits by origin (``origin_runs``), its prompt format, and
under ``"run"`` the whole ``RunStats`` with every ``StepStats``: the window shows a reopened
reply's statistics and chart from these, exactly as they were written. Replies stored before
the steps were kept have no ``"run"``: their stored figures are shown as they are, and no steps
are made up for them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from speculative.stats import RunStats, StepStats

RUN = "run"  # the key of the stored RunStats in a reply's stats
Run = tuple[str, str]  # (text, origin)


def run_to_json(run: RunStats) -> dict[str, Any]:
    """``run`` as JSON data: its own fields, and its steps as rows under their field names, so
    that fields added to ``StepStats`` are stored without this code changing."""
    names = [f.name for f in dataclasses.fields(StepStats)]
    data: dict[str, Any] = {f.name: getattr(run, f.name) for f in dataclasses.fields(RunStats)
                            if f.name != "steps"}
    data["fields"] = names
    data["steps"] = [[getattr(step, n) for n in names] for step in run.steps]
    return data


def run_from_json(data: dict[str, Any]) -> RunStats:
    """The ``RunStats`` that ``run_to_json`` stored. A step field stored that ``StepStats`` no
    longer has is dropped; one it has gained since takes its default."""
    known = {f.name for f in dataclasses.fields(StepStats)}
    names = data["fields"]
    steps = [StepStats(**{n: v for n, v in zip(names, row, strict=True) if n in known})
             for row in data["steps"]]
    own = {f.name for f in dataclasses.fields(RunStats)} - {"steps"}
    return RunStats(**{k: v for k, v in data.items() if k in own}, steps=steps)


def stored_run(stats: dict[str, Any]) -> RunStats | None:
    """A stored reply's ``RunStats``, or None for a reply stored without its steps."""
    return run_from_json(stats[RUN]) if RUN in stats else None


def figures(run: RunStats, plain_seconds_per_token: float) -> dict[str, Any]:
    """The figures shown for a reply: ``RunStats.summary()``, and its speed over plain decoding
    as ``RunStats.estimated_speedup`` estimates it (each step's own counterfactual; for steps
    without one, plain decoding's seconds per token timed when the models loaded; no estimate
    without either)."""
    out = run.summary()
    fallback = plain_seconds_per_token if plain_seconds_per_token > 0 else None
    speedup = run.estimated_speedup(fallback) if run.steps else 0.0
    if speedup > 0:
        out["estimated_speedup"] = speedup
    return out


def reply_stats(run: RunStats, plain_seconds_per_token: float, runs: list[Run],
                prompt_format: str, error: str = "") -> dict[str, Any]:
    """What the history stores as a reply's ``stats`` (see the module docstring)."""
    stats = {**figures(run, plain_seconds_per_token), "origin_runs": origin_runs(runs),
             "format": prompt_format, RUN: run_to_json(run)}
    if error:
        stats["error"] = error
    return stats


def continued(before: RunStats | None, after: RunStats) -> RunStats:
    """A continued reply's statistics: the steps it had (none for a reply stored without
    them), then the continuation's, with the prompt it first answered and both prefills."""
    if before is None:
        return after
    return dataclasses.replace(after, prompt_tokens=before.prompt_tokens,
                               t_prefill=before.t_prefill + after.t_prefill,
                               steps=[*before.steps, *after.steps])


def footer(stats: dict[str, Any], mode: str, finish: str) -> str:
    """The compact statistics line under a reply, in the window and in exports, from its
    stored figures (never recomputed)."""
    error = stats.get("error")
    ending = f"stopped by an error: {error}" if error else (
        finish if finish not in ("stop", "length") else "")
    if not stats.get("tokens"):
        return " · ".join(p for p in (mode, ending or finish) if p) if mode else ""
    o = stats.get("origins", {})
    total = max(1, sum(o.values()))
    parts = [mode, f"{stats['tokens']} tokens", f"{stats.get('tokens_per_second', 0):.0f} tok/s"]
    if "estimated_speedup" in stats:
        parts.append(f"≈{stats['estimated_speedup']:.2f}× plain")
    parts.append(f"τ {stats.get('tau', 0):.2f}")
    parts.append(f"draft {o.get('draft', 0) / total:.0%} · n-gram {o.get('ngram', 0) / total:.0%}"
                 f" · target {o.get('target', 0) / total:.0%}")
    steered = stats.get("penalties", {}).get("steered", 0)
    if steered:
        parts.append(f"penalties steered {steered}")
    if ending:
        parts.append(ending)
    return "  ·  ".join(p for p in parts if p)


def runs_of(text: str, stored: list[list]) -> list[Run]:
    """Split a stored reply into (text, origin) runs from its ``[[chars, origin], ...]``."""
    out, i = [], 0
    for length, origin in stored:
        out.append((text[i:i + int(length)], str(origin)))
        i += int(length)
    if i < len(text):
        out.append((text[i:], "target"))
    return out


def origin_runs(runs: list[Run]) -> list[list]:
    """The compact form stored with a reply: consecutive pieces of one origin merged."""
    out: list[list] = []
    for text, origin in runs:
        if not text:
            continue
        if out and out[-1][1] == origin:
            out[-1][0] += len(text)
        else:
            out.append([len(text), origin])
    return out
