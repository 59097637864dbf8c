"""Shared fixtures: tiny GPT-2 GGUF models written by the tests themselves."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# caches (decode-cost curves, ...) of this test session only, never the user's
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="staged-chat-test-cache-")

from models.gguf_writer import Gpt2Config, random_gpt2_weights, read_vocab, write_gpt2_gguf

atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

TINY = Gpt2Config(n_ctx=256, n_embd=64, n_layer=3, n_head=2)
"""A GPT-2 with the real 50257-token vocabulary, small enough to decode in ~0.5 ms."""

SCALE = 4.0  # sharpens random models' next-token distributions, so argmax ties are rare


def tiny_pair_weights(seed: int = 1) -> tuple[dict, dict]:
    """A target and a draft that agree often: the draft keeps the target's embeddings and first
    layer only (as a shallow model trained on the same data would roughly do)."""
    target = random_gpt2_weights(TINY, seed=seed, scale=SCALE)
    draft = {k: v for k, v in target.items() if not k.startswith(("blk.1.", "blk.2."))}
    return target, draft


@pytest.fixture(scope="session")
def vocab():
    return read_vocab()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, vocab) -> dict[str, Path]:
    """``{f16,q8_0}-{target,draft}`` paths."""
    root = tmp_path_factory.mktemp("tiny")
    target, draft = tiny_pair_weights()
    draft_cfg = Gpt2Config(n_ctx=TINY.n_ctx, n_embd=TINY.n_embd, n_layer=1, n_head=TINY.n_head)
    paths = {}
    for ftype in ("f16", "q8_0"):
        paths[f"{ftype}-target"] = write_gpt2_gguf(root / f"target-{ftype}.gguf", TINY, target,
                                                   vocab, ftype, name="tiny-target")
        paths[f"{ftype}-draft"] = write_gpt2_gguf(root / f"draft-{ftype}.gguf", draft_cfg, draft,
                                                  vocab, ftype, name="tiny-draft")
    return paths
