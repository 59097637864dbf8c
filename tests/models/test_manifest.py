"""The committed built-in artifacts match their manifest."""

from __future__ import annotations

import json

from models.manifest import MANIFEST, _train_commands, check, sha256


def test_committed_artifacts_match_the_manifest() -> None:
    assert MANIFEST.is_file()
    data = json.loads(MANIFEST.read_text())
    assert {"target-q8_0.gguf", "draft-q8_0.gguf", "ngram.npz"} <= set(data["files"])
    for entry in data["files"].values():
        commands = entry["rebuild"] if isinstance(entry["rebuild"], list) else [entry["rebuild"]]
        assert all(c.startswith(("python -m models.", "cp build/")) for c in commands)
    assert check() == []


def test_check_notices_a_changed_file(tmp_path) -> None:
    artifact = tmp_path / "a.bin"
    artifact.write_bytes(b"model")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"files": {"a.bin": {"bytes": 5, "sha256": sha256(artifact)},
                                              "gone.bin": {"bytes": 1, "sha256": "0" * 64}}}))
    assert check(manifest) == ["gone.bin: missing"]
    artifact.write_bytes(b"mode1")
    assert check(manifest) == ["a.bin: differs from the manifest", "gone.bin: missing"]


def test_a_distilled_model_is_rebuilt_with_the_runs_it_came_from() -> None:
    run = {"seed": 0, "batch_size": 4, "lr": 0.002, "warmup": 200, "schedule": "wsd",
           "decay_frac": 0.15, "min_count": 4, "pos_init": "sinusoidal", "short_window": 256,
           "short_steps": 100, "heads": 8, "layers": 0, "width": 0, "distill": 0.0}
    metrics = {"which": "draft", "steps": 50, "train_config": {**run, "distill": 0.7,
                                                               "threads": 1},
               "teacher_run": {"which": "target", "step": 300, "run": run},
               "init_run": {"which": "draft", "step": 200, "run": {**run, "layers": 3}}}
    teacher, init, own = _train_commands("draft-q8_0.gguf", metrics)
    assert teacher.startswith("python -m models.train --which target ")
    assert "--steps 300 " in teacher and teacher.endswith("--checkpoint build/target-300.pt")
    assert "--layers 3 " in init and init.endswith("--checkpoint build/draft-200.pt")
    assert "--out models/builtin/draft-q8_0.gguf --steps 50 " in own
    assert "--distill 0.7 --threads 1 " in own
    assert own.endswith("--teacher build/target-300.pt --init build/draft-200.pt")
    assert "--schedule wsd --decay-frac 0.15 --min-count 4 --pos-init sinusoidal" in own
