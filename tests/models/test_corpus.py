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
    c = corpus.load_corpus(corpus.CorpusSpec(fake_stdlib), cache)
    assert c.train.dtype == np.uint16 and c.eot == 50256
    with LlamaModel(VOCAB_PATH, vocab_only=True) as m:
        for tokens, files in ((c.train, c.train_files), (c.valid, c.valid_files)):
            docs = np.split(tokens, np.flatnonzero(tokens == c.eot) + 1)[:-1]
            assert len(docs) == len(files)  # one EOT per file: literal "<|endoftext|>" is text
            for doc, name in zip(docs, files, strict=True):
                assert doc[-1] == c.eot
                assert m.vocab.detokenize(doc[:-1].tolist()) == FAKE_STDLIB[
                    name.removeprefix("stdlib/")]
    assert len(list(cache.glob("corpus-*.npy"))) == 2

    def no_tokenizing(*_args: object, **_kw: object) -> np.ndarray:
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(corpus, "tokenize_documents", no_tokenizing)
    again = corpus.load_corpus(corpus.CorpusSpec(fake_stdlib), cache)
    assert np.array_equal(again.train, c.train) and np.array_equal(again.valid, c.valid)


def test_changed_file_invalidates_the_cache(fake_stdlib: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    corpus.load_corpus(corpus.CorpusSpec(fake_stdlib), cache)
    (fake_stdlib / "os.py").write_text("changed = True\n", encoding="utf-8")
    c = corpus.load_corpus(corpus.CorpusSpec(fake_stdlib), cache)
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


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def test_packages_are_capped_deduplicated_and_skip_tests_and_data(tmp_path: Path) -> None:
    site = tmp_path / "site"
    code = "def f(x):\n    return x + {}\n"
    table = "".join(f"    (0x{i:04x}, 'M', 'a'),\n" for i in range(200))
    _write(site, {
        **{f"big/m{i}.py": code.format(i) * 10 for i in range(20)},  # 20 files of ~260 bytes
        "big/tests/test_m.py": code.format(99),
        "big/data.py": "TABLE = (\n" + table + ")\n",
        "big/wide.py": "X = '" + "a" * 1000 + "'\n",
        "other/__init__.py": code.format(0) * 10,  # the same text as big/m0.py
        "single.py": "import os\n",
    })
    files = corpus.package_files(site, "big", cap=1000)
    size = sum((site / f).stat().st_size for f in files)
    assert 0 < size <= 1000 and len(files) == 3
    assert files == sorted(files) and all(f.startswith("big/m") for f in files)
    everything = corpus.package_files(site, "big", cap=10**9)
    assert len(everything) == 20  # no tests/, no lookup table, no 1000-character line
    assert corpus.package_files(site, "single") == ["single.py"]
    assert corpus.package_files(site, "missing") == []
    spec = corpus.CorpusSpec(None, site, ("big", "other", "single"), package_cap=10**9)
    train, valid = corpus.documents(spec)
    assert valid == {}
    assert "site/other/__init__.py" not in train  # a copy of big/m0.py, kept once
    assert len(train) == 21


def test_data_tables_are_not_code() -> None:
    assert corpus.looks_like_code("def f():\n    return 1\n" * 60)
    assert not corpus.looks_like_code("".join(f"    {i}: 'x{i}',\n" for i in range(150)))
    assert not corpus.looks_like_code("x = 1\n" + "y" * 500 + "\n")


def test_stdlib_topics_are_prose_from_a_literal(tmp_path: Path) -> None:
    _write(tmp_path, {"pydoc_data/topics.py": "# auto\ntopics = {'b': 'Bee text.', 'a': 'A.'}\n"})
    assert corpus.stdlib_topics(tmp_path) == {"a": "A.", "b": "Bee text."}
    assert corpus.stdlib_topics(tmp_path / "nowhere") == {}
    real = corpus.stdlib_topics(corpus.stdlib_root())
    assert len(real) > 50 and "assert" in real


def test_builtin_spec_reads_this_environment() -> None:
    spec = corpus.CorpusSpec.builtin()
    assert spec.prose and "numpy" in spec.packages
    assert "numpy" in corpus.package_versions(["numpy"])
    descriptions = corpus.distribution_descriptions(["numpy"])
    assert any(len(text) > 500 for text in descriptions.values())
