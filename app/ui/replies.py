"""What a reply becomes on screen and in the history: pieces, footers, statistics. No widgets."""

from __future__ import annotations

from typing import Any

from app.history import Message
from app.ui.chat_view import ShownMessage, runs_of
from app.worker.messages import ReplyDone
from speculative.stats import RunStats, StepStats


def shown(m: Message) -> ShownMessage:
    if m.role == "assistant":
        runs = runs_of(m.text, m.stats.get("origin_runs", []))
        return ShownMessage(m.role, runs, footer(m.stats, m.mode, m.finish or ""), m.created)
    return ShownMessage(m.role, [(m.text, "target")], "", m.created)


def streamed_runs(done: ReplyDone) -> list[tuple[str, str]]:
    """(text, origin) runs of a finished reply, as streamed."""
    return [(t, o) for t, o in done.pieces if t]


def run_of(m: Message) -> RunStats:
    """A stored reply's statistics as a RunStats with one summary step (for display only)."""
    s = m.stats
    if not s.get("tokens"):
        return RunStats(mode=m.mode)
    t = s.get("time", {})
    origins = s.get("origins", {})
    step = StepStats(drafted=round(s.get("mean_drafted", 0) * s.get("target_passes", 1)),
                     accepted=round(s.get("mean_accepted", 0) * s.get("target_passes", 1)),
                     offered=0, emitted=int(s["tokens"]), origins=dict(origins),
                     draft_calls=0, stage2_proposed=0, stage2_used=0,
                     t_draft=t.get("draft", 0.0), t_stage2=t.get("stage2", 0.0),
                     t_verify=t.get("verify", 0.0), t_other=t.get("other", 0.0))
    return RunStats(mode=m.mode, steps=[step])


def footer(stats: dict[str, Any], mode: str, finish: str) -> str:
    """The compact statistics line kept under every reply."""
    if not stats.get("tokens"):
        return f"{mode} · {finish}" if mode else ""
    o = stats.get("origins", {})
    total = max(1, sum(o.values()))
    parts = [mode, f"{stats['tokens']} tokens", f"{stats.get('tokens_per_second', 0):.0f} tok/s"]
    if "estimated_speedup" in stats:
        parts.append(f"≈{stats['estimated_speedup']:.2f}× plain")
    parts.append(f"τ {stats.get('tau', 0):.2f}")
    parts.append(f"draft {o.get('draft', 0) / total:.0%} · n-gram {o.get('ngram', 0) / total:.0%}"
                 f" · target {o.get('target', 0) / total:.0%}")
    if finish and finish not in ("stop", "length"):
        parts.append(finish)
    return "  ·  ".join(parts)


