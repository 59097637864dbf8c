"""The stage-2 n-gram builder's pieces (the full build runs on the real corpus by hand)."""

from __future__ import annotations

import numpy as np

from models.build_ngram import documents, next_token_accuracy
from speculative.ngram import KatzTrigram


def test_documents_split_at_end_of_text() -> None:
    tokens = np.array([5, 6, 9, 7, 9, 9, 8, 9], dtype=np.uint16)
    assert [d.tolist() for d in documents(tokens, eot=9)] == [[5, 6], [7], [8]]


def test_accuracy_of_a_model_that_knows_the_text() -> None:
    text = np.array([1, 2, 3, 4] * 20)
    knows = KatzTrigram.build([text.tolist()], n_vocab=10)
    blind = KatzTrigram.build([[7, 8, 9, 7, 8, 9]], n_vocab=10)
    assert next_token_accuracy(knows, text) == 1.0
    assert next_token_accuracy(blind, text) < 0.5
