"""Fixtures shared by the tests that run the engine on real llama.cpp."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculative.backend import LlamaModel
from speculative.ngram import KatzTrigram

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="session")
def corpus_ngram() -> KatzTrigram:
    """A trigram model of this project's own source, tokenized by the GPT-2 vocabulary."""
    with LlamaModel(ROOT / "models/vocab/ggml-vocab-gpt-2.gguf", vocab_only=True) as model:
        docs = [model.vocab.tokenize(p.read_text())
                for p in sorted((ROOT / "speculative").glob("*.py"))]
        return KatzTrigram.build(docs, model.vocab.n_vocab)
