"""``staged-chat bench`` on tiny generated models."""

from __future__ import annotations

import json

from app.bench import load_prompts
from app.cli import main


def test_bench_reports_every_mode_against_plain(tiny_models, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n---\nclass Point:\n")
    assert len(load_prompts(prompts)) == 2
    code = main(["bench", "--target", str(tiny_models["q8_0-target"]),
                 "--draft", str(tiny_models["q8_0-draft"]), "--prompts", str(prompts),
                 "-n", "12", "--ctx", "256", "--threads", "1", "--mode", "tree,staged",
                 "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"plain", "tree", "staged"}
    assert report["plain"]["tau"] == 1.0
    assert report["plain"]["speedup_vs_plain"] == 1.0
    for s in report.values():
        assert s["tokens"] == 24
        assert s["identical_to_plain"].endswith("/2")
    assert report["tree"]["target_passes"] <= 24


def test_bench_table(tiny_models, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n")
    assert main(["bench", "--target", str(tiny_models["q8_0-target"]), "--mode", "ngram",
                 "--prompts", str(prompts), "-n", "8", "--ctx", "256", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "plain" in out and "ngram" in out and "1.00x" in out
