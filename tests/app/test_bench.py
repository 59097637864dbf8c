"""``staged-chat bench`` on tiny generated models."""

from __future__ import annotations

import json
import re
import sys

import pytest

from app.tools.bench import load_prompts
from app.tools.cli import main


def test_bench_reports_every_mode_against_plain_with_the_ceiling(tiny_models, tmp_path,
                                                                 capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n---\nclass Point:\n")
    assert len(load_prompts(prompts)) == 2
    code = main(["bench", "--target", str(tiny_models["q8_0-target"]),
                 "--draft", str(tiny_models["q8_0-draft"]), "--prompts", str(prompts),
                 "-n", "12", "--ctx", "256", "--threads", "1", "--mode", "tree,auto",
                 "--repeats", "2", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == tiny_models["q8_0-target"].name
    assert set(report["cost_ms"]["target"]) >= {"1", "2", "4"}
    (cell,) = report["cells"]
    assert cell["sampling"] == "greedy"
    modes = cell["modes"]
    assert set(modes) == {"plain", "tree", "auto", "oracle"}
    assert modes["plain"]["tau"] == 1.0 and modes["plain"]["speedup"] == 1.0
    for s in modes.values():
        assert s["identical"] == "4/4"  # 2 prompts x 2 repeats, every mode the target's text
        lo, hi = s["speedup_range"]
        assert lo <= s["speedup"] <= hi
    # the app's meter beside the measured speedup: plain is its own counterfactual
    assert modes["plain"]["estimated_speedup"] == pytest.approx(1.0, rel=1e-9)
    assert all(s["estimated_speedup"] > 0 for s in modes.values())
    oracle = modes["oracle"]
    assert oracle["ceiling_share"] == 1.0 and oracle["tau"] > 1.0
    assert modes["tree"]["ceiling_share"] == modes["tree"]["speedup"] / oracle["speedup"]


def test_bench_sampled_has_no_ceiling_and_prints_a_table(tiny_models, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n")
    chart = tmp_path / "chart.png"
    assert main(["bench", "--target", str(tiny_models["q8_0-target"]), "--mode", "ngram",
                 "--prompts", str(prompts), "-n", "8", "--ctx", "256", "--threads", "1",
                 "--sampling", "both", "--repeats", "1", "--chart", str(chart)]) == 0
    out = capsys.readouterr().out
    assert "== greedy" in out and "== sampled" in out and "oracle" in out
    sampled = out.split("== sampled")[1]
    assert "oracle" not in sampled and "ngram" in sampled
    assert chart.stat().st_size > 1000 and chart.read_bytes()[:4] == b"\x89PNG"


def test_bench_peers_run_llama_cpp_python_on_the_same_target(tiny_models, tmp_path,
                                                              capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("x = 1\n")
    assert main(["bench", "--target", str(tiny_models["q8_0-target"]), "--mode", "ngram",
                 "--prompts", str(prompts), "-n", "8", "--ctx", "256", "--threads", "1",
                 "--repeats", "1", "--no-ceiling", "--peers", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["peers"]["llama-cpp-python plain"]["tokens_per_second"] > 0
    assert report["peers"]["llama-cpp-python prompt lookup (10)"]["tokens_per_second"] > 0
    assert "oracle" not in report["cells"][0]["modes"]


def test_a_peer_that_crashes_is_reported_and_the_bench_goes_on(tiny_models, tmp_path, capsys,
                                                               monkeypatch) -> None:
    """A peer runs in a process of its own: when llama.cpp kills it (a crash in a CPU kernel),
    the report says so and the other peers and the modes are still measured."""
    from app.tools import bench, peer

    real = peer.command

    def command(model, prompts, n_tokens, threads, n_ctx, prompt_lookup=0, flash_attn=True):
        if prompt_lookup:  # this peer dies as a segfault in llama.cpp would end it
            return [sys.executable, "-c", "import os, signal, sys; sys.stderr.write('in "
                    "ggml_backend_amx_mul_mat\\n'); os.kill(os.getpid(), signal.SIGSEGV)"]
        return real(model, prompts, n_tokens, threads, n_ctx, prompt_lookup, flash_attn)

    monkeypatch.setattr(bench.peer, "command", command)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("x = 1\n")
    assert main(["bench", "--target", str(tiny_models["q8_0-target"]), "--mode", "ngram",
                 "--prompts", str(prompts), "-n", "8", "--ctx", "256", "--threads", "1",
                 "--repeats", "1", "--no-ceiling", "--peers"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"llama-cpp-python plain: [0-9.]+ tok/s", out)
    assert ("llama-cpp-python prompt lookup (10): could not run: peer failed on this host: "
            "killed by SIGSEGV: in ggml_backend_amx_mul_mat") in out
    assert re.search(r"^ngram +[0-9.]+ +[0-9.]+x", out, re.M)


def test_bench_markdown_table(tiny_models, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n")
    assert main(["bench", "--target", str(tiny_models["q8_0-target"]), "--mode", "ngram",
                 "--prompts", str(prompts), "-n", "8", "--ctx", "256", "--threads", "1",
                 "--repeats", "1", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| mode | tokens/s | speedup |" in out
    assert "| plain |" in out and "| ngram |" in out and "| oracle |" in out


def test_the_chart_reads_like_a_figure() -> None:
    """Round ticks from 0 past the highest whisker; speedups to two decimals."""
    from app.ui.bench_chart import column_order, nice_ticks, speedup_label

    assert nice_ticks(3.53) == [0, 1, 2, 3, 4]
    assert nice_ticks(1.31) == [0, 0.5, 1, 1.5]
    assert nice_ticks(0.94) == [0, 0.2, 0.4, 0.6, 0.8, 1]
    assert nice_ticks(12.3) == [0, 5, 10, 15]
    assert speedup_label(0.937702) == "0.94\u00d7"
    assert column_order(["sampled+penalties", "greedy+penalties", "sampled+penalties"]) == [
        "greedy+penalties", "sampled+penalties"]  # greedy on the left, penalties or not
    assert column_order(["sampled", "greedy"]) == ["greedy", "sampled"]


def test_a_cached_curve_that_prices_one_token_too_dear_is_measured_again_first(
        tiny_models, tmp_path, capsys, monkeypatch) -> None:
    """The bench checks the cached target curve against plain decoding before timing
    anything: a curve three times too dear (as if timed in a slow moment) is measured again,
    the report says so and prices by the new one; a curve cheaper than decoding is let be (a
    busy moment makes passes dearer, never cheaper: whether a curve measured afresh reads a
    little dear on a tiny model's sub-millisecond passes is the moment's luck)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ["bench", "--target", str(tiny_models["q8_0-target"]), "--draft",
            str(tiny_models["q8_0-draft"]), "--prompts", "code", "-n", "4", "--ctx", "256",
            "--threads", "1", "--mode", "tree", "--repeats", "1", "--no-ceiling", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)  # (its fresh curve checked too: the luck)
    costs = tmp_path / "cache" / "staged-chat" / "costs.json"
    entries = json.loads(costs.read_text())
    dear = {k: v for k, v in entries.items() if isinstance(v.get("seconds"), list)
            and round(v["seconds"][0] * 1000, 3) == first["cost_ms"]["target"]["1"]}
    assert len(dear) == 1
    for entry in dear.values():
        entry["seconds"] = [3 * t for t in entry["seconds"]]
    costs.write_text(json.dumps(entries))
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["cost_remeasured"] is True
    assert second["cost_ms"]["target"]["1"] < 2 * first["cost_ms"]["target"]["1"]
    entries = json.loads(costs.read_text())
    cheap = {k: v for k, v in entries.items() if isinstance(v.get("seconds"), list)
             and round(v["seconds"][0] * 1000, 3) == second["cost_ms"]["target"]["1"]}
    assert len(cheap) == 1
    for entry in cheap.values():
        entry["seconds"] = [t / 2 for t in entry["seconds"]]
    costs.write_text(json.dumps(entries))
    assert main(args) == 0
    third = json.loads(capsys.readouterr().out)
    assert third["cost_remeasured"] is False
    assert third["cost_ms"]["target"]["1"] == pytest.approx(
        second["cost_ms"]["target"]["1"] / 2, abs=1e-3)
