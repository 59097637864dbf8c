"""The stdlib corpus: which files, which split, and a lossless tokenization (no torch needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from models import corpus
from models.gguf_writer import VOCAB_PATH
from speculative.backend import LlamaModel

FAKE_STDLIB = {
    "os.py": "import sys\n\n\ndef fspath(p):\n    \"\"\"Return p.\"\"\"\n    return p\n",
    "csv.py": "QUOTE_ALL = 1  # held out\n",
    "json/__init__.py": "from .decoder import JSONDecoder\n",
    "json/decoder.py": "class JSONDecoder:\n    pass\n",
    "jsonish.py": "# not the json package: a prefix is not a match\n",
    "email/utils.py": "def quote(s):\n    return s.replace('\\\\', '\\\\\\\\')\n",
    "encodings/utf_8.py": "\"\"\" Python 'utf-8' Codec\n\"\"\"\n",
    "encodings/cp1252.py": "\"\"\" Python Character Mapping Codec cp1252 generated\n\"\"\"\n",
    "pydoc_data/topics.py": "topics = {'assert': 'The assert statement'}\n",
    "test/test_os.py": "import unittest\n",
    "idlelib/idle_test/test_x.py": "import unittest\n",
    "lib2to3/tests/data/py2.py": "print 'hello'\n",
    "site-packages/foo/__init__.py": "x = 1\n",
    "unittest/case.py": ("class TestCase:\n"
                         "    \"\"\"A framework, not a suite. <|endoftext|>\"\"\"\n"),
}
KEPT = ["csv.py", "email/utils.py", "encodings/utf_8.py", "json/__init__.py", "json/decoder.py",
        "jsonish.py", "os.py", "unittest/case.py"]


@pytest.fixture()
def fake_stdlib(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    for rel, text in FAKE_STDLIB.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


def test_file_selection_skips_tests_third_party_and_generated_tables(fake_stdlib: Path) -> None:
    assert corpus.list_files(fake_stdlib) == KEPT


def test_held_out_split_is_disjoint_and_complete(fake_stdlib: Path) -> None:
    files = corpus.list_files(fake_stdlib)
    train, valid = corpus.split_files(files)
    assert valid == ["csv.py", "json/__init__.py", "json/decoder.py"]
    assert not set(train) & set(valid)
    assert sorted(train + valid) == files


def test_tokenization_round_trips_and_is_cached(fake_stdlib: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    c = corpus.load_corpus(fake_stdlib, cache)
    assert c.train.dtype == np.uint16 and c.eot == 50256
    with LlamaModel(VOCAB_PATH, vocab_only=True) as m:
        for tokens, files in ((c.train, c.train_files), (c.valid, c.valid_files)):
            docs = np.split(tokens, np.flatnonzero(tokens == c.eot) + 1)[:-1]
            assert len(docs) == len(files)  # one EOT per file: literal "<|endoftext|>" is text
            for doc, rel in zip(docs, files, strict=True):
                assert doc[-1] == c.eot
                assert m.vocab.detokenize(doc[:-1].tolist()) == FAKE_STDLIB[rel]
    assert len(list(cache.glob("corpus-*.npy"))) == 2

    def no_tokenizing(*_args: object, **_kw: object) -> np.ndarray:
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(corpus, "tokenize_documents", no_tokenizing)
    again = corpus.load_corpus(fake_stdlib, cache)
    assert np.array_equal(again.train, c.train) and np.array_equal(again.valid, c.valid)


def test_changed_file_invalidates_the_cache(fake_stdlib: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    corpus.load_corpus(fake_stdlib, cache)
    (fake_stdlib / "os.py").write_text("changed = True\n", encoding="utf-8")
    c = corpus.load_corpus(fake_stdlib, cache)
    assert len(list(cache.glob("corpus-*.npy"))) == 4
    with LlamaModel(VOCAB_PATH, vocab_only=True) as m:
        assert "changed = True\n" in m.vocab.detokenize(c.train.tolist())


def test_held_out_modules_exist_in_this_stdlib_and_are_about_5_percent() -> None:
    root = corpus.stdlib_root()
    files = corpus.list_files(root)
    for module in corpus.HELD_OUT:
        assert any(corpus.is_held_out(f, [module]) for f in files), module
    _, valid = corpus.split_files(files)
    size = {f: (root / f).stat().st_size for f in files}
    share = sum(size[f] for f in valid) / sum(size.values())
    assert 0.03 < share < 0.08
