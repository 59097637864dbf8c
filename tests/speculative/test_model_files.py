"""Bad model files: truncated, corrupt header, random bytes, not GGUF, another
architecture, a draft with another vocabulary, a context above the trained one, the file removed
or replaced while loaded. Each must raise a clear Python exception naming the problem; the
process must survive and an already loaded model must still decode exactly as before.

llama.cpp aborts the whole process on some malformed files (e.g. ``gpt2.block_count = 0``, one
value per attention head, a negative layer-norm epsilon) and a memory-mapped file overwritten in
place kills it with SIGBUS, so every case runs in one worker subprocess
(``model_file_worker.py``): a crash there fails these tests instead of killing pytest."""

from __future__ import annotations

import json
import os
import random
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from models.gguf_writer import Gpt2Config, Vocab, random_gpt2
from speculative import backend
from speculative.backend import read_gguf_header
from speculative.errors import ModelLoadError

ROOT = Path(__file__).parents[2]

EXPECTED: dict[str, tuple[str | None, str]] = {
    # truncated: a download or copy cut short, at every part of the file
    "empty": ("ModelLoadError", r"not a GGUF file \(it starts with b''"),
    "magic-only": ("ModelLoadError", r"corrupt or truncated GGUF file: the file ends inside"),
    "counts-only": ("ModelLoadError", r"corrupt or truncated GGUF file: the header claims"),
    "cut-in-vocabulary": ("ModelLoadError", r"corrupt or truncated GGUF file: array "
                                            r"'tokenizer\.ggml\.tokens'"),
    "cut-in-tensor-data": ("ModelLoadError", r"corrupt or truncated GGUF file: the file is "
                                             r"\d+ bytes but its tensor data runs to byte \d+"),
    "last-byte-missing": ("ModelLoadError", r"tensor data runs to byte"),
    # corrupt header
    "version-99": ("ModelLoadError", r"GGUF version 99 is not supported"),
    "key-count-huge": ("ModelLoadError", r"corrupt or truncated GGUF file: the header claims "
                                         r"1152921504606846976 keys"),
    "key-length-huge": ("ModelLoadError", r"a key at byte 32 claims \d+ bytes, past the end"),
    "value-type-unknown": ("ModelLoadError", r"key 'general\.architecture' has unknown value "
                                             r"type 99"),
    "tensor-type-unknown": ("ModelLoadError", r"tensor 'token_embd\.weight' has unknown type 999"),
    "tensor-dims-99": ("ModelLoadError", r"tensor 'token_embd\.weight' has 99 dimensions"),
    "tensor-offset-huge": ("ModelLoadError", r"tensor data runs to byte"),
    "position-rows-mismatch": ("ModelLoadError", r"llama\.cpp could not load it: .*"
                                                 r"position_embd\.weight"),
    # llama.cpp asserts (aborting the process) on these three: guarded in Python
    "block-count-0": ("ModelLoadError", r"gpt2\.block_count is 0; llama\.cpp takes 1 to 512"),
    "block-count-513": ("ModelLoadError", r"gpt2\.block_count is 513"),
    "one-value-per-head": ("ModelLoadError", r"64 attention heads of 64 values"),
    "layer-norm-eps-negative": ("ModelLoadError", r"layer_norm_epsilon is -1\.0"),
    "layer-norm-eps-nan": ("ModelLoadError", r"layer_norm_epsilon is nan"),
    # random bytes, not GGUF
    "random-bytes": ("ModelLoadError", r"not a GGUF file"),
    "random-after-magic": ("ModelLoadError", r"GGUF version \d+ is not supported"),
    "random-after-counts": ("ModelLoadError", r"corrupt or truncated GGUF file"),
    "python-source": ("ModelLoadError", r"not a GGUF file \(it starts with b'def '"),
    "numpy-archive": ("ModelLoadError", r"ngram\.npz: not a GGUF file \(it starts with b'PK"),
    "directory": ("ModelLoadError", r"not a file"),
    "missing": ("ModelLoadError", r"no such file"),
    # another architecture
    "llama-architecture": ("ModelLoadError", r"llama\.gguf is a 'llama' model; Staged Chat "
                                             r"runs gpt2 models"),
    "architecture-not-first": ("ModelLoadError", r"is a 'llama' model"),
    "no-architecture": ("ModelLoadError", r"names no architecture"),
    # pairs
    "draft-other-tokens": ("IncompatibleModels", r"draft other-tokens\.gguf does not share the "
                                                 r"tokenizer of target .*: token 100 is"),
    "draft-other-size": ("IncompatibleModels", r"50258 tokens instead of 50257"),
    "draft-truncated": ("ModelLoadError", r"corrupt or truncated"),
    # context windows
    "context-above-trained": ("ContextTooLarge", r"a context of 512 tokens was asked for, but "
                                                 r"target-q8_0\.gguf was trained on 256"),
    "pair-context-above-trained": ("ContextTooLarge", r"a context of 300 tokens"),
    "context-above-trained-fitted": (None, ""),  # the default shrinks the window instead
    # the live model's own file, while it is loaded
    "overwrite-live": ("ModelLoadError", r"live\.gguf: not a GGUF file"),
    "replace-live": (None, ""),  # the new file loads; the loaded model is untouched
    "remove-live": ("ModelLoadError", r"live\.gguf: no such file"),
}
FUZZ_SEEDS = range(16)


def _value_at(data: bytes, key: str) -> int:
    """Offset of metadata ``key``'s value (after its length-prefixed name and u32 type)."""
    name = key.encode()
    return data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4


def _after_tensor_name(data: bytes, name: str) -> int:
    """Offset of a tensor info's ``n_dims`` (dims, type and offset follow)."""
    raw = name.encode()
    return data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)


def _patched(data: bytes, at: int, fmt: str, value: Any) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def _raw_gguf(keys: list[tuple[str, str]]) -> bytes:
    """A GGUF with string keys only and no tensors."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(keys))
    for key, value in keys:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", 8)
        out += struct.pack("<Q", len(value)) + value.encode()
    return out


def _llama_gguf(path: Path) -> Path:
    """A small model of another architecture, written with llama.cpp's own gguf package."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _bad_files(root: Path, good: Path) -> dict[str, bytes]:
    data = good.read_bytes()
    size = len(data)
    embd = _after_tensor_name(data, "token_embd.weight")
    rng = random.Random(0)
    files = {
        "empty": b"", "magic-only": data[:4], "counts-only": data[:24],
        "cut-in-vocabulary": data[:100_000], "cut-in-tensor-data": data[:size - 100_000],
        "last-byte-missing": data[:-1],
        "version-99": _patched(data, 4, "<I", 99),
        "key-count-huge": _patched(data, 16, "<Q", 1 << 60),
        "key-length-huge": _patched(data, 24, "<Q", 1 << 62),
        "value-type-unknown": _patched(data, _value_at(data, "general.architecture") - 4, "<I",
                                       99),
        "tensor-type-unknown": _patched(data, embd + 4 + 2 * 8, "<I", 999),
        "tensor-dims-99": _patched(data, embd, "<I", 99),
        "tensor-offset-huge": _patched(data, embd + 4 + 2 * 8 + 4, "<Q", 1 << 50),
        "position-rows-mismatch": _patched(data, _value_at(data, "gpt2.context_length"), "<I",
                                           512),
        "block-count-0": _patched(data, _value_at(data, "gpt2.block_count"), "<I", 0),
        "block-count-513": _patched(data, _value_at(data, "gpt2.block_count"), "<I", 513),
        "one-value-per-head": _patched(data, _value_at(data, "gpt2.attention.head_count"), "<I",
                                       64),
        "layer-norm-eps-negative": _patched(
            data, _value_at(data, "gpt2.attention.layer_norm_epsilon"), "<f", -1.0),
        "layer-norm-eps-nan": _patched(
            data, _value_at(data, "gpt2.attention.layer_norm_epsilon"), "<f", float("nan")),
        "random-bytes": rng.randbytes(100_000),
        "random-after-magic": b"GGUF" + rng.randbytes(100_000),
        "random-after-counts": data[:24] + rng.randbytes(100_000),
        "python-source": b"def f():\n    return 1\n",
        "architecture-not-first": _raw_gguf([("general.name", "x"),
                                             ("general.architecture", "llama")]),
        "no-architecture": _raw_gguf([("general.name", "x")]),
    }
    header_end = data.index(b"GGUF") + 1_700_000  # the header (vocabulary included) is ~1.77 MB
    for seed in FUZZ_SEEDS:
        fuzz = bytearray(data)
        r = random.Random(seed)
        for _ in range(r.randint(1, 4)):
            fuzz[r.randrange(4, header_end)] = r.randrange(256)
        files[f"fuzz-{seed}"] = bytes(fuzz)
    return files


def _other_vocab_drafts(root: Path, vocab: Vocab) -> tuple[Path, Path]:
    cfg = Gpt2Config(n_ctx=128, n_embd=64, n_layer=1, n_head=2)
    tokens = list(vocab.tokens)
    tokens[100], tokens[101] = tokens[101], tokens[100]
    swapped = Vocab(tokens, vocab.merges, vocab.token_types, vocab.bos_id, vocab.eos_id)
    bigger = Vocab([*vocab.tokens, "<|pad|>"], vocab.merges, [*vocab.token_types, 3],
                   vocab.bos_id, vocab.eos_id)
    return (random_gpt2(root / "other-tokens.gguf", cfg, vocab=swapped, ftype="f16"),
            random_gpt2(root / "other-size.gguf", Gpt2Config(n_vocab=50258, n_ctx=128,
                        n_embd=64, n_layer=1, n_head=2), vocab=bigger, ftype="f16"))


def _cases(root: Path, target: Path, draft: Path, vocab: Vocab) -> list[dict[str, Any]]:
    cases = []
    for name, content in _bad_files(root, target).items():
        path = root / f"{name}.gguf"
        path.write_bytes(content)
        cases.append({"name": name, "op": "model", "path": str(path)})
    (root / "a-directory.gguf").mkdir()
    other_tokens, other_size = _other_vocab_drafts(root, vocab)
    truncated = root / "truncated-draft.gguf"
    truncated.write_bytes(draft.read_bytes()[:-1000])
    replacement = root / "replacement.gguf"
    replacement.write_bytes(draft.read_bytes())
    cases += [
        {"name": "numpy-archive", "op": "model", "path": str(ROOT / "models/builtin/ngram.npz")},
        {"name": "directory", "op": "model", "path": str(root / "a-directory.gguf")},
        {"name": "missing", "op": "model", "path": str(root / "missing.gguf")},
        {"name": "llama-architecture", "op": "model",
         "path": str(_llama_gguf(root / "llama.gguf"))},
        {"name": "draft-other-tokens", "op": "pair", "target": str(target),
         "draft": str(other_tokens)},
        {"name": "draft-other-size", "op": "pair", "target": str(target),
         "draft": str(other_size)},
        {"name": "draft-truncated", "op": "pair", "target": str(target), "draft": str(truncated)},
        {"name": "context-above-trained", "op": "context", "path": str(target),
         "config": {"n_ctx": 512, "fit": False}},
        {"name": "pair-context-above-trained", "op": "pair", "target": str(target),
         "draft": str(draft), "config": {"n_ctx": 300, "fit": False}},
        {"name": "context-above-trained-fitted", "op": "context", "path": str(target),
         "config": {"n_ctx": 512}},
        # last: these change the live model's own file
        {"name": "overwrite-live", "op": "overwrite-live"},
        {"name": "replace-live", "op": "replace-live", "path": str(replacement)},
        {"name": "remove-live", "op": "remove-live"},
    ]
    return cases


@pytest.fixture(scope="module")
def worker(tiny_models, vocab, tmp_path_factory) -> dict[str, Any]:
    """Run every case in one subprocess; its results by case name, and how it ended."""
    root = tmp_path_factory.mktemp("bad-models")
    live = root / "live.gguf"
    live.write_bytes(Path(tiny_models["q8_0-target"]).read_bytes())
    cases = _cases(root, Path(tiny_models["q8_0-target"]), Path(tiny_models["q8_0-draft"]), vocab)
    spec = root / "spec.json"
    spec.write_text(json.dumps({"live": str(live), "cases": cases}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.speculative.model_file_worker", str(spec)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    # an abort also prints ggml's backtrace on stdout: keep only the worker's result lines
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"name": ')]
    results = {r["name"]: r for r in map(json.loads, lines)}
    return {"cases": [c["name"] for c in cases], "results": results,
            "returncode": proc.returncode, "stderr": proc.stderr[-3000:]}


def _result(worker: dict[str, Any], name: str) -> dict[str, Any]:
    if name not in worker["results"]:
        done = len(worker["results"])
        crashed_at = worker["cases"][done] if done < len(worker["cases"]) else "?"
        pytest.fail(f"the worker died (exit code {worker['returncode']}) at case "
                    f"{crashed_at!r}, before reaching {name!r}:\n{worker['stderr']}")
    return worker["results"][name]


def test_the_worker_survives_every_case(worker) -> None:
    assert worker["returncode"] == 0, worker["stderr"]
    assert sorted(worker["results"]) == sorted(worker["cases"])
    assert set(EXPECTED) | {f"fuzz-{s}" for s in FUZZ_SEEDS} == set(worker["cases"])


@pytest.mark.parametrize("name", list(EXPECTED))
def test_bad_model_gives_a_clear_error_and_the_loaded_model_stays_usable(worker, name) -> None:
    result = _result(worker, name)
    kind, pattern = EXPECTED[name]
    if kind is None:
        assert result["error"] is None
    else:
        assert result["error"] is not None, f"{name} loaded without complaint"
        assert result["error"]["type"] == kind, result["error"]
        assert re.search(pattern, result["error"]["message"]), result["error"]["message"]
    assert result["usable"], "the model loaded before no longer decodes as it did"


def test_fuzzed_headers_never_crash(worker) -> None:
    """Random byte changes in the header either load (a changed token string is still a valid
    file) or raise ModelLoadError; nothing else, and the loaded model stays usable."""
    refused = 0
    for seed in FUZZ_SEEDS:
        result = _result(worker, f"fuzz-{seed}")
        if result["error"] is not None:
            assert "ModelLoadError" in result["error"]["bases"], result["error"]
            refused += 1
        assert result["usable"]
    assert refused > 0  # the walk does catch what the bytes broke


# --- the header walk itself, in process (no llama.cpp involved) --------------------------------


def test_header_of_a_good_file(tiny_models) -> None:
    path = Path(tiny_models["q8_0-target"])
    header = read_gguf_header(path)
    assert (header.version, header.architecture, header.context_length) == (3, "gpt2", 256)
    assert header.size_needed == path.stat().st_size  # the data ends exactly at the file's end
    assert header.n_tensors == 4 + 12 * 3
    assert header.metadata["gpt2.block_count"] == 3
    assert header.metadata["tokenizer.ggml.tokens"] is None  # arrays are skipped, not read


def test_header_of_a_vocab_only_file() -> None:
    header = read_gguf_header(ROOT / "models/vocab/ggml-vocab-gpt-2.gguf")
    assert header.n_tensors == 0 and header.architecture == "gpt2"
    assert header.size_needed == (ROOT / "models/vocab/ggml-vocab-gpt-2.gguf").stat().st_size


@pytest.mark.parametrize("first_read", [100, 4096, 1 << 20])
def test_header_read_in_growing_pieces_is_the_same(tiny_models, monkeypatch, first_read) -> None:
    """The header is read in a growing prefix (not memory-mapped); wherever the first read
    ends, inside a key, a string array or the tensor infos, the result is the same."""
    paths = [Path(tiny_models["q8_0-target"]), ROOT / "models/vocab/ggml-vocab-gpt-2.gguf"]
    whole = [read_gguf_header(p) for p in paths]
    monkeypatch.setattr(backend, "_HEADER_FIRST_READ", first_read)
    assert [read_gguf_header(p) for p in paths] == whole


def test_every_truncation_of_a_small_file_is_refused(tmp_path: Path) -> None:
    """Cut a whole small model at every 97th byte: each prefix is refused, in Python."""
    data = _llama_gguf(tmp_path / "small.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in range(0, len(data), 97):
        cut.write_bytes(data[:n])
        with pytest.raises(ModelLoadError, match="GGUF file"):
            read_gguf_header(cut)
    assert read_gguf_header(tmp_path / "small.gguf").architecture == "llama"


def test_a_pair_opened_with_flash_attention_left_to_the_machine_measures_it_once(
        tiny_models, tmp_path, monkeypatch) -> None:
    """``flash_attn=None``: each model's context gets the setting measured faster here (real
    llama.cpp contexts, both settings timed once), remembered for the next opening; a context
    asked for directly must say on or off."""
    from speculative import costmodel
    from speculative.backend import ContextConfig, LlamaContext, LlamaModel
    from speculative.loading import open_pair

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []
    real = costmodel.window_costs
    monkeypatch.setattr("speculative.loading.window_costs",
                        lambda ctxs: measured.append(real(ctxs, rounds=1)) or measured[-1])
    config = ContextConfig(n_ctx=128, n_batch=32, n_seq_max=64, n_threads=1, flash_attn=None)
    with open_pair(tiny_models["q8_0-target"], tiny_models["q8_0-draft"], config) as pair:
        assert len(measured) == 2  # the target's and the draft's, each on and off
        for ctx, (on, off) in ((pair.target_ctx, measured[0]), (pair.draft_ctx, measured[1])):
            assert on > 0 and off > 0
            assert ctx.flash_attn is (not off < (1 - costmodel.SAME_SPEED) * on)
            assert ctx.seq_pos_max(0) == -1  # the pair starts empty
        assert pair.flash["target"].seconds_on == measured[0][0]  # what decided it
        chosen = pair.target_ctx.flash_attn
    with open_pair(tiny_models["q8_0-target"], None, config) as pair:
        assert len(measured) == 2 and pair.target_ctx.flash_attn is chosen  # remembered
    with LlamaModel(tiny_models["q8_0-target"]) as model, pytest.raises(ValueError):
        LlamaContext(model, config)


def test_a_pair_given_thread_counts_measures_each_model_once_and_takes_the_fastest(
        tiny_models, tmp_path, monkeypatch) -> None:
    """``threads=(1, 2)``: each model's context runs on the count measured fastest here, its
    time plus the count's handicap (real llama.cpp contexts, both counts timed once),
    remembered for the next opening; the handicap decides again from what was remembered."""
    from speculative import costmodel
    from speculative.backend import ContextConfig
    from speculative.loading import open_pair

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []
    real = costmodel.window_costs
    monkeypatch.setattr("speculative.loading.window_costs",
                        lambda ctxs: measured.append(real(ctxs, rounds=1)) or measured[-1])
    config = ContextConfig(n_ctx=128, n_batch=32, n_seq_max=64, flash_attn=False)
    with open_pair(tiny_models["q8_0-target"], tiny_models["q8_0-draft"], config,
                   threads=(2, 1)) as pair:
        assert len(measured) == 2  # the target's and the draft's, each on 1 and 2 threads
        for ctx, (one, two) in ((pair.target_ctx, measured[0]), (pair.draft_ctx, measured[1])):
            assert one > 0 and two > 0
            assert ctx.n_threads == costmodel.choose_threads({1: one, 2: two})
        assert pair.threads["target"].seconds == {1: measured[0][0], 2: measured[0][1]}
    slow_two = {2: 10.0}  # every core loses far more than any pass takes: one thread
    with open_pair(tiny_models["q8_0-target"], None, config, threads=(1, 2),
                   threads_handicap=slow_two) as pair:
        assert len(measured) == 2 and pair.target_ctx.n_threads == 1  # remembered
    with open_pair(tiny_models["q8_0-target"], None, config) as pair:
        assert pair.threads == {}  # one count: nothing to choose


def test_the_fewest_threads_about_as_fast_as_the_fastest_are_chosen() -> None:
    from speculative.costmodel import choose_threads

    assert choose_threads({1: 0.100, 2: 0.070}) == 2  # a large model: every core pays
    assert choose_threads({1: 0.0054, 2: 0.0042}) == 2
    assert choose_threads({1: 0.0054, 2: 0.0042}, handicap={2: 0.005}) == 1  # in a window
    assert choose_threads({1: 0.100, 2: 0.070}, handicap={2: 0.005}) == 2
    assert choose_threads({1: 0.0100, 2: 0.0099}) == 1  # as fast: leave a core free
