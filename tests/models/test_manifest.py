"""The committed built-in artifacts match their manifest."""

from __future__ import annotations

import json

from models.manifest import MANIFEST, check, sha256


def test_committed_artifacts_match_the_manifest() -> None:
    assert MANIFEST.is_file()
    data = json.loads(MANIFEST.read_text())
    assert {"target-q8_0.gguf", "draft-q8_0.gguf", "ngram.npz"} <= set(data["files"])
    for entry in data["files"].values():
        assert entry["rebuild"].startswith("python -m models.")
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
