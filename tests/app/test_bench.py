"""``staged-chat bench`` on tiny generated models."""

from __future__ import annotations

import itertools
import json
import re
import sys

import pytest

from app.tools.bench import _drafting_free, _kinds, load_prompts
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
    # every step counted under the kind its policy took, plain's all the target alone
    assert set(modes["plain"]["kinds"]) == {"root"}
    for s in modes.values():
        kinds = s["kinds"].values()
        assert set(s["kinds"]) <= {"root", "guesses", "draft"}
        assert sum(k["tokens"] for k in kinds) / sum(k["steps"] for k in kinds) == (
            pytest.approx(s["tau"]))
        assert sum(k["seconds"] for k in kinds) == pytest.approx(sum(s["time"].values()))


def test_the_report_says_what_share_of_autos_steps_each_kind_took() -> None:
    """``auto``, where its steps were of more than one kind, gets a line: each kind's share of
    its steps, most first, and its milliseconds a token; a fixed mode gets none (its kinds
    name what happened, not a choice)."""
    cell = {"modes": {
        "staged": {"kinds": {"draft": {"steps": 10, "tokens": 30, "seconds": 1.5},
                             "guesses": {"steps": 1, "tokens": 2, "seconds": 0.1}}},
        "auto": {"kinds": {"root": {"steps": 10, "tokens": 10, "seconds": 0.6},
                           "draft": {"steps": 30, "tokens": 90, "seconds": 4.5}}}}}
    assert _kinds(cell) == ["  auto's steps by kind: draft's kind 75% (50.0 ms a token), "
                            "target alone 25% (60.0 ms a token)"]


def test_the_report_says_what_each_mode_would_reach_with_drafting_free() -> None:
    """A drafting mode's speedup over the share of its time left once drafting (the draft
    model's and the n-gram's) is taken out; modes that draft nothing get no figure."""
    cell = {"modes": {
        "plain": {"speedup": 1.0, "time": {"draft": 0.0, "stage2": 0.0, "verify": 8.0,
                                           "other": 0.0}},
        "staged": {"speedup": 1.5, "time": {"draft": 2.0, "stage2": 0.5, "verify": 7.0,
                                            "other": 0.5}},
        "oracle": {"speedup": 5.0, "time": {"draft": 0.0, "stage2": 0.0, "verify": 1.0,
                                            "other": 0.1}}}}
    assert _drafting_free(cell) == ["  with drafting free: staged 2.00x"]
    assert _drafting_free({"modes": {"plain": cell["modes"]["plain"]}}) == []
    # a run cut off before any pass was timed: no figure, and no division by zero
    only = {"speedup": 0.0, "time": {"draft": 1.0, "stage2": 0.0, "verify": 0.0, "other": 0.0}}
    assert _drafting_free({"modes": {"staged": only}}) == []


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


def fake_speculative(folder, code: int = 0):
    """A stand-in for llama-speculative (building the real one takes minutes): it logs its
    arguments, one JSON line per run, and prints what the real one prints for 20 tokens in
    0.5 s, 16 drafted and 12 accepted, after echoing the prompt."""
    script = folder / "llama-speculative"
    log = folder / "runs.jsonl"
    script.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"if {code}:\n    sys.stderr.write('error: failed to load model\\n'); sys.exit({code})\n"
        "prompt = sys.argv[sys.argv.index('-p') + 1]\n"
        "sys.stdout.write('\\n\\n' + prompt + ' x = 1' * 10 + '\\n\\n\\n\\n')\n"
        "sys.stderr.write('decoded   20 tokens in    0.500 seconds, speed:   40.000 t/s\\n'\n"
        "                 'n_draft   = 4\\nn_predict = 20\\nn_drafted = 16\\n'\n"
        "                 'n_accept  = 12\\naccept    = 75.000%\\n')\n")
    script.chmod(0o755)
    return script, log


def test_native_speculation_runs_beside_the_modes_with_the_same_sampler(
        tiny_models, tmp_path, capsys, monkeypatch) -> None:
    """llama-speculative takes its turns in each greedy cell's rotation, on every prompt and
    repeat, with the cell's repetition control; its speedup is over the same repeats' plain
    decoding. Not when sampling: its sampled output is not the target's distribution."""
    from app.tools import bench

    tool, log = fake_speculative(tmp_path)
    monkeypatch.setattr(bench, "native_tools", lambda progress=None: {
        "llama-speculative": tool, "llama-bench": tmp_path / "no-llama-bench"})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n---\nclass Point:\n")
    assert main(["bench", "--target", str(tiny_models["q8_0-target"]),
                 "--draft", str(tiny_models["q8_0-draft"]), "--prompts", str(prompts),
                 "-n", "8", "--ctx", "256", "--threads", "1", "--mode", "tree",
                 "--sampling", "both", "--penalties", "on", "--repeat-penalty", "1.05",
                 "--repeats", "2", "--no-ceiling", "--native", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    # the greedy cell: 2 repeats x 2 prompts x 2 draft lengths
    assert len(runs) == 8
    greedy = [dict(itertools.pairwise(a)) for a in runs]  # each argument -> the next
    for opts in greedy:  # the repetition penalty given, the format's DRY, then the argmax
        assert (opts["--sampling-seq"], opts["--top-k"]) == ("edk", "1")
        assert opts["--repeat-penalty"] == "1.05" and opts["--repeat-last-n"] == "64"
        assert opts["--dry-multiplier"] == "0.8" and opts["-c"] == "256" and opts["-n"] == "8"
    breakers = [b for a, b in itertools.pairwise(runs[0]) if a == "--dry-sequence-breaker"]
    assert breakers == ["\n", ":", "\"", "*"]
    assert sorted({o["-p"] for o in greedy}) == ["class Point:\n", "def add(a, b):\n"]
    greedy_cell, sampled_cell = report["cells"]
    assert "native" not in sampled_cell
    slow, fast = greedy_cell["modes"]["plain"]["tokens_per_second_range"]
    assert set(greedy_cell["native"]) == {"llama-speculative 4", "llama-speculative 8"}
    for s in greedy_cell["native"].values():
        assert s["tokens_per_second"] == pytest.approx(40.0)
        lo, hi = s["speedup_range"]  # over plain's speed in the same repeat
        assert (lo, hi) == (pytest.approx(40.0 / fast), pytest.approx(40.0 / slow))
        assert lo <= s["speedup"] <= hi
        assert s["accept"] == 0.75 and s["tau"] == pytest.approx(20 / 8)
        assert s["degenerate_outputs"] == "2/2"  # ' x = 1' ten times is a loop
    chart = tmp_path / "chart.png"
    from app.ui.bench_chart import bars, save_chart

    assert "native 4" in bars(greedy_cell) and "native 4" not in bars(sampled_cell)
    assert save_chart(report, chart).stat().st_size > 1000


def test_native_speculation_that_cannot_run_is_reported_once(tiny_models, tmp_path, capsys,
                                                             monkeypatch) -> None:
    from app.tools import bench

    tool, log = fake_speculative(tmp_path, code=1)
    monkeypatch.setattr(bench, "native_tools", lambda progress=None: {
        "llama-speculative": tool, "llama-bench": tmp_path / "no-llama-bench"})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("x = 1\n---\ny = 2\n")
    assert main(["bench", "--target", str(tiny_models["q8_0-target"]),
                 "--draft", str(tiny_models["q8_0-draft"]), "--prompts", str(prompts),
                 "-n", "8", "--ctx", "256", "--threads", "1", "--mode", "tree",
                 "--repeats", "1", "--no-ceiling", "--native"]) == 0
    out = capsys.readouterr().out
    assert len(log.read_text().splitlines()) == 1  # not tried again in the cell
    assert "native: could not run: llama-speculative failed (exit 1)" in out
    assert "error: failed to load model" in out
    assert re.search(r"^tree +[0-9.]+ +[0-9.]+x", out, re.M)


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


def test_an_emulated_flat_curve_is_measured_and_said(tiny_models, tmp_path, capsys,
                                                     monkeypatch) -> None:
    """``--emulate-pass-ms`` adds a fixed cost to every target pass: the curve the bench
    measures (not one cached from a run without it) prices it, the output stays the target's,
    and every report says the figures are emulated. llama.cpp's own tools are refused beside
    it (they would run at the host's speed)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n")
    args = ["bench", "--target", str(tiny_models["q8_0-target"]), "--draft",
            str(tiny_models["q8_0-draft"]), "--prompts", str(prompts), "-n", "6", "--ctx",
            "256", "--threads", "1", "--mode", "tree", "--repeats", "1", "--no-ceiling"]
    assert main([*args, "--json"]) == 0  # the host's own curve, cached
    host = json.loads(capsys.readouterr().out)
    assert "emulated_pass_ms" not in host
    assert host["cost_ms"]["target"]["1"] < 20.0  # a tiny model's pass: well under a ms
    assert main([*args, "--json", "--emulate-pass-ms", "20"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["emulated_pass_ms"] == 20.0
    assert report["cost_ms"]["target"]["1"] >= 20.0  # measured with the latency, not recalled
    assert report["cells"][0]["modes"]["tree"]["identical"] == "1/1"
    assert main([*args, "--emulate-pass-ms", "20"]) == 0
    assert "EMULATED: every target pass took 20 ms more" in capsys.readouterr().out
    assert main([*args, "--markdown", "--emulate-pass-ms", "20"]) == 0
    assert "EMULATED" in capsys.readouterr().out
    assert main([*args, "--native", "--emulate-pass-ms", "20"]) == 2
    assert "--emulate-pass-ms" in capsys.readouterr().err
