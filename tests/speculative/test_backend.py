"""The llama.cpp boundary: tree batches, guards that keep llama.cpp from aborting, bad files."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import numpy as np
import pytest

from models.gguf_writer import Gpt2Config, Vocab, random_gpt2
from speculative.backend import ContextConfig, LlamaContext, LlamaModel, _with_fields
from speculative.errors import (
    BatchTooLarge,
    ContextOverflow,
    ContextTooLarge,
    IncompatibleModels,
    LlamaError,
    ModelLoadError,
    TooManySequences,
)
from speculative.kvtree import COMMIT, KVTree
from speculative.loading import open_pair


@pytest.fixture
def ctx(tiny_models):
    config = ContextConfig(n_threads=1, n_ctx=128, n_batch=16, n_seq_max=8)
    with LlamaModel(tiny_models["q8_0-target"]) as model, LlamaContext(model, config) as c:
        yield c


def test_tree_batch_logits_equal_sequential_decoding(ctx) -> None:
    """Root r with children a (which has child b) and c: each path's logits must be those of
    decoding that path alone."""
    prefix = [464, 2068, 7586, 21831]
    r, a, b, c = 625, 11, 257, 290
    kv = KVTree(ctx)
    kv.prepare([*prefix, r], max_pending=1)
    slots, tree = kv.decode([r, a, b, c], [COMMIT, 0, 1, 0])
    assert [s.pos for s in slots] == [4, 5, 6, 5]
    for path, row in (([r], 0), ([r, a], 1), ([r, a, b], 2), ([r, c], 3)):
        ctx.clear()
        seq = prefix + path
        alone = ctx.decode(seq, list(range(len(seq))), [[0]] * len(seq))[-1]
        assert np.abs(alone - tree[row]).max() < 1e-3, path


def test_commit_keeps_only_the_accepted_path(ctx) -> None:
    kv = KVTree(ctx)
    kv.prepare([1, 2, 3], max_pending=1)
    slots, _ = kv.decode([3, 10, 11, 12], [COMMIT, 0, 1, 0])
    kv.commit(slots[2], [10, 11])
    assert kv.tokens == [1, 2, 3, 10, 11]
    assert ctx.seq_pos_max(0) == 4
    assert all(ctx.seq_pos_max(s) == -1 for s in range(1, 8))
    # the cache now continues exactly like a fresh decode of the same text
    _, out = kv.decode([5], [COMMIT])
    ctx2 = LlamaContext(ctx.model, ContextConfig(n_threads=1, n_ctx=128, n_batch=16, n_seq_max=1))
    ref = ctx2.decode([1, 2, 3, 10, 11, 5], list(range(6)), [[0]] * 6)[-1]
    ctx2.close()
    assert np.abs(out[-1] - ref).max() < 1e-3


def test_guards_raise_instead_of_aborting(ctx) -> None:
    with pytest.raises(BatchTooLarge, match="n_batch is 16"):
        ctx.decode(list(range(17)), list(range(17)), [[0]] * 17)
    with pytest.raises(ContextOverflow, match="context of 128"):
        ctx.decode([1], [128], [[0]])
    with pytest.raises(TooManySequences):
        ctx.decode([1], [0], [[8]])
    with pytest.raises(TooManySequences):
        ctx.decode([1], [0], [list(range(9))])
    with pytest.raises(TooManySequences):
        ctx.seq_cp(0, 99)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ctx.decode([50257], [0], [[0]])
    for latency in (-0.001, float("nan")):
        with pytest.raises(ValueError, match="emulated latency"):
            ctx.emulate(latency)
    assert ctx.pass_latency == 0.0
    # still alive and correct after all that
    out = ctx.decode([1, 2], [0, 1], [[0], [0]])
    assert out.shape == (2, 50257) and np.isfinite(out).all()


def test_tree_with_more_leaves_than_sequences_is_refused(ctx) -> None:
    kv = KVTree(ctx)
    kv.prepare([1, 2], max_pending=1)
    with pytest.raises(TooManySequences):
        kv.decode([2, *range(10, 20)], [COMMIT] + [0] * 10)  # 10 leaves, n_seq_max 8
    kv.rollback()
    _, out = kv.decode([2], [COMMIT])
    assert np.isfinite(out).all()


def _write_gguf_header(path: Path, arch: str) -> None:
    """A GGUF that only declares its architecture (what a non-GPT-2 file looks like first)."""
    key = b"general.architecture"
    with open(path, "wb") as fh:
        fh.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1))
        fh.write(struct.pack("<Q", len(key)) + key + struct.pack("<I", 8))
        fh.write(struct.pack("<Q", len(arch)) + arch.encode())


def test_bad_files_give_clear_errors(tmp_path: Path, tiny_models) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        LlamaModel(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        LlamaModel(junk)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(Path(tiny_models["q8_0-target"]).read_bytes()[:200_000])
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF file"):
        LlamaModel(truncated)
    llama = tmp_path / "llama.gguf"
    _write_gguf_header(llama, "llama")
    with pytest.raises(ModelLoadError, match="'llama' model"):
        LlamaModel(llama)


def test_draft_with_another_vocabulary_is_refused(tmp_path: Path, tiny_models, vocab) -> None:
    tokens = list(vocab.tokens)
    tokens[100], tokens[101] = tokens[101], tokens[100]
    other = Vocab(tokens, vocab.merges, vocab.token_types, vocab.bos_id, vocab.eos_id)
    cfg = Gpt2Config(n_ctx=128, n_embd=64, n_layer=1, n_head=2)
    draft = random_gpt2(tmp_path / "other.gguf", cfg, vocab=other, ftype="f16")
    with pytest.raises(IncompatibleModels, match="token 100"):
        open_pair(tiny_models["q8_0-target"], draft, ContextConfig(n_threads=1, n_ctx=128))
    # and the target is still usable afterwards
    with open_pair(tiny_models["q8_0-target"], None, ContextConfig(n_threads=1, n_ctx=128)) as pair:
        assert pair.target.vocab.tokenize("hello") == [31373]


def test_context_window_beyond_the_trained_one(tiny_models) -> None:
    """By default the window shrinks to the model's trained context (GPT-2 has no positions
    beyond it); with ``fit=False`` it is refused. (More bad cases: test_model_files.py.)"""
    with LlamaModel(tiny_models["q8_0-target"]) as model:
        assert model.n_ctx_train == 256
        with LlamaContext(model, ContextConfig(n_threads=1, n_ctx=1000, n_batch=16)) as c:
            assert c.n_ctx == 256
        with pytest.raises(ContextTooLarge, match="1000 tokens was asked for, but target-q8_0"):
            LlamaContext(model, ContextConfig(n_threads=1, n_ctx=1000, fit=False))


@pytest.mark.parametrize("bad", [{"n_ctx": 0}, {"n_batch": 0}, {"n_threads": -1},
                                 {"n_seq_max": 0}, {"n_seq_max": 257}])
def test_context_config_refuses_values_llama_cpp_would_reinterpret(bad) -> None:
    with pytest.raises(ValueError, match=r">= 1|1\.\.256"):
        ContextConfig(**bad)


def test_parameter_structs_refuse_unknown_fields() -> None:
    """ctypes structs accept any attribute silently: ``use_mmap`` (gone from llama.cpp's model
    parameters, now ``load_mode``) would have been ignored without a word."""

    class Params(ctypes.Structure):
        _fields_ = [("load_mode", ctypes.c_int)]

    params = Params()
    params.use_mmap = False  # what ctypes alone allows
    with pytest.raises(LlamaError, match="Params has no field 'use_mmap'"):
        _with_fields(params, use_mmap=False)
    assert _with_fields(params, load_mode=7).load_mode == 7


def test_every_load_turns_extra_buffer_types_off_on_amx_hosts(tiny_models, monkeypatch) -> None:
    """Q8_0 crashes in llama.cpp's AMX kernels unless the extra buffer types are off. Every
    path that loads a model (ours, llama-cpp-python's high-level peer) must pass the host's
    rule to llama.cpp; the rule is forced on here, so this runs on every host, and a load
    that would crash an AMX host is refused before llama.cpp sees it."""
    from speculative import backend

    loads: list[tuple[str, bool]] = []
    modules = (backend.llama_cpp, backend.llama_cpp.llama_cpp)
    real = backend.llama_cpp.llama_cpp.llama_model_load_from_file

    def load(path: bytes, params):  # what llama.cpp is asked to load, and how
        loads.append((Path(path.decode()).name, bool(params.use_extra_bufts)))
        if params.use_extra_bufts and not params.vocab_only:
            raise AssertionError(f"{path!r} loaded with extra buffer types on an AMX host")
        return real(path, params)

    for module in modules:
        monkeypatch.setattr(module, "llama_model_load_from_file", load)
    monkeypatch.setattr(backend, "_AMX", True)
    target = tiny_models["q8_0-target"]
    with open_pair(target, tiny_models["q8_0-draft"], ContextConfig(n_threads=1, n_ctx=64)):
        pass
    LlamaModel(target, vocab_only=True).close()
    out, _ = backend.peer_generate(target, [464, 2068], 3, 1, 64)
    out_lookup, _ = backend.peer_generate(target, [464, 2068], 3, 1, 64, prompt_lookup=2)
    assert out and out_lookup == out
    assert [name for name, _ in loads] == [target.name, tiny_models["q8_0-draft"].name,
                                           target.name, target.name, target.name]
    assert not any(extra for _, extra in loads)
    # the high-level loader's defaults are llama.cpp's own again after a peer ran
    assert backend.llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts
    # off an AMX host the extra buffer types stay on (they hold other CPUs' fast kernels)
    monkeypatch.setattr(backend, "_AMX", False)
    assert backend.host_model_params().use_extra_bufts


def test_the_pair_refuses_an_ngram_model_of_other_token_ids(tiny_models, tmp_path) -> None:
    """An n-gram model over other token ids than the target's is refused when asked for, and
    left out when optional (the built-in GPT-2 n-gram beside another vocabulary)."""
    from speculative.ngram import KatzTrigram

    small = tmp_path / "small.npz"
    KatzTrigram.build([[1, 2, 3, 1, 2]], 100).save(small)
    config = ContextConfig(n_threads=1, n_ctx=64)
    target, draft = tiny_models["q8_0-target"], tiny_models["q8_0-draft"]
    with pytest.raises(IncompatibleModels, match=r"small\.npz covers 100 tokens"):
        open_pair(target, draft, config, ngram=small)
    with open_pair(target, draft, config, ngram=small, ngram_optional=True) as pair:
        assert pair.ngram_path is None and pair.new_ngram() is None


def test_engines_of_one_pair_share_its_cost_curves(tiny_models, corpus_ngram, tmp_path) -> None:
    from speculative.policies import Mode, SpecConfig

    path = tmp_path / "code.npz"
    corpus_ngram.save(path)
    config = ContextConfig(n_threads=1, n_ctx=128, n_batch=32, n_seq_max=32)
    with open_pair(tiny_models["q8_0-target"], tiny_models["q8_0-draft"], config,
                   ngram=path) as pair:
        plain = pair.engine(SpecConfig(mode=Mode.PLAIN))
        assert pair.costs is None and plain.verify_cost is None  # plain needs no curve
        tree = pair.engine(SpecConfig(mode=Mode.TREE))
        assert pair.costs is not None and tree.verify_cost is pair.costs[0]
        auto = pair.engine(SpecConfig(mode=Mode.AUTO))
        assert (auto.verify_cost, auto.draft_cost) == pair.costs
        assert auto.ngram is not tree.ngram  # each engine teaches its own n-gram model
        assert auto.ngram.n_vocab == pair.target.vocab.n_vocab
