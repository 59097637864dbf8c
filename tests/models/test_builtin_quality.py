"""The committed built-in target writes code, not whitespace, with the repetition control the app
gives its replies (the code format's defaults: without them its greedy text loops).

Its predecessor answered every prompt with a run of spaces, and every speed figure measured on it
measured nothing. The whole held-out prompt set (none from the training corpus), greedy and
sampled, judged as ``python -m models.evaluate --samples`` judges it: if the target becomes
degenerate again, this fails and prints what it wrote. The bounds are looser than the goal the
committed pair meets (at most 10% degenerate, at least half plausible) so that another host's
floating-point rounding, which can flip a sample or two, does not fail it; the predecessor was
100% degenerate.
"""

from __future__ import annotations

from app.prompting import CODE
from models.catalog import builtin_pair
from models.evaluate import PROMPTS, format_samples, load_prompts, samples_report


def test_the_builtin_target_continues_held_out_prompts_with_code() -> None:
    target, _ = builtin_pair()
    prompts = load_prompts(PROMPTS)
    report = samples_report(target, prompts, max_tokens=48, threads=1, sampler=CODE.sampler)
    text = format_samples(report)
    for part in ("greedy", "sampled"):
        rows = report[part]["samples"]
        degenerate = sum(r["degenerate"] is not None for r in rows)
        plausible = sum(r["plausible"] for r in rows)
        assert degenerate <= 0.2 * len(rows), text
        assert plausible >= 0.4 * len(rows), text
