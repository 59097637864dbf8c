"""The ``staged-chat`` command on tiny generated models."""

from __future__ import annotations

import json

import pytest

from app.tools.cli import main
from models.gguf_writer import Gpt2Config, random_gpt2


def _run(capsys, *args: str) -> tuple[int, str, str]:
    # one thread: tiny models gain nothing from two, and llama.cpp's spinning thread barriers
    # stall when the cores are shared with other work
    code = main([*args, "--threads", "1"] if args and args[0] == "generate" else list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_compares_modes(tiny_models, capsys) -> None:
    code, out, _ = _run(capsys, "generate", "--target", str(tiny_models["q8_0-target"]),
                        "--draft", str(tiny_models["q8_0-draft"]), "--mode", "plain,tree,staged",
                        "--prompt", "def add(a, b):", "-n", "20", "--ctx", "256", "--json")
    assert code == 0
    data = json.loads(out)
    runs = {r["mode"]: r for r in data["runs"]}
    assert set(runs) == {"plain", "tree", "staged"}
    for r in runs.values():
        assert len(r["tokens"]) == 20
        assert r["identical_to_plain"] is True
        assert r["stats"]["tokens"] == 20
        assert r["stats"]["target_passes"] <= 20
        assert r["speedup_vs_plain"] > 0
    assert runs["plain"]["stats"]["tau"] == 1.0


def test_generate_streams_text_then_statistics(tiny_models, capsys) -> None:
    code, out, _ = _run(capsys, "generate", "--target", str(tiny_models["f16-target"]),
                        "--draft", str(tiny_models["f16-draft"]), "--mode", "staged",
                        "--prompt", "import os", "-n", "12", "--ctx", "256", "--temp", "0.8",
                        "--top-k", "20", "--seed", "3")
    assert code == 0
    assert out.startswith("import os")
    assert "tau (tokens per target pass)" in out
    assert "acceptance by depth" in out


def test_errors_are_reported_not_raised(tiny_models, tmp_path, capsys) -> None:
    code, _, err = _run(capsys, "generate", "--target", str(tmp_path / "nope.gguf"),
                        "--mode", "plain")
    assert code == 2 and "no such file" in err
    long_prompt = "word " * 400
    code, _, err = _run(capsys, "generate", "--target", str(tiny_models["q8_0-target"]),
                        "--mode", "plain", "--ctx", "128", "--prompt", long_prompt)
    assert code == 2 and "context holds 128" in err
    other = random_gpt2(tmp_path / "small-vocab.gguf", Gpt2Config(n_vocab=50257, n_ctx=64,
                        n_embd=32, n_layer=1, n_head=1), ftype="f32")
    code, _, err = _run(capsys, "generate", "--target", str(tiny_models["q8_0-target"]),
                        "--draft", str(other), "--mode", "tree", "--ctx", "256")
    assert code == 0  # same tokenizer, different shape: fine
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--mode", "bogus"])
    assert exit_info.value.code == 2
    assert "choose from plain, chain, tree, staged, ngram" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--max-nodes", "--max-depth", "--max-children"])
def test_bad_budget_is_a_clear_error(tiny_models, capsys, flag) -> None:
    code, _, err = _run(capsys, "generate", "--target", str(tiny_models["q8_0-target"]),
                        "--draft", str(tiny_models["q8_0-draft"]), flag, "0")
    assert code == 2 and ">= 1" in err


def test_builtin_models_run_without_model_arguments(capsys) -> None:
    """The README's first command: no --target/--draft/--ngram, the committed built-in pair."""
    code, out, _ = _run(capsys, "generate", "--mode", "plain,staged", "-n", "24", "--json",
                        "--prompt", "def read_lines(path):\n")
    assert code == 0
    runs = {r["mode"]: r for r in json.loads(out)["runs"]}
    assert runs["staged"]["identical_to_plain"] is True
    assert len(runs["staged"]["tokens"]) == 24
    assert runs["staged"]["stats"]["target_passes"] < 24  # the trained draft is accepted
