"""Training a microscopic GPT-2: loss falls, runs repeat exactly, and llama.cpp computes the
same function from the exported GGUF (the oracle for the export's names and orientations)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the optional `train` extra

from models.corpus import eot_id, tokenize_documents  # noqa: E402
from models.gguf_writer import Gpt2Config, Vocab, read_vocab  # noqa: E402
from models.train import (  # noqa: E402
    MODELS,
    TrainConfig,
    build,
    check_gguf,
    check_sequences,
    export,
    frequent_tokens,
    lr_at,
    param_counts,
    state_from_gguf,
    train,
)

TINY = Gpt2Config(n_ctx=64, n_embd=64, n_layer=2, n_head=2)  # Q8_0 needs rows of 32k
# bf16 on every host (emulated where the CPU lacks it): these runs' numbers do not follow the host
STEPS = TrainConfig(steps=30, batch_size=4, lr=1e-2, warmup=5, compile=False, eval_every=0,
                    threads=2, bf16=True)


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    # real code, tokenized as the corpus is: this repository's GGUF writer and corpus modules
    root = Path(__file__).resolve().parents[2] / "models"
    texts = [(root / name).read_text(encoding="utf-8") for name in ("gguf_writer.py", "corpus.py")]
    return tokenize_documents(texts, eot_id())


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return read_vocab()  # a few seconds: read it once


def trained(tokens: np.ndarray, cfg: TrainConfig = STEPS, seed: int = 0) -> tuple:
    torch.set_num_threads(cfg.threads)
    model = build(TINY, seed, seen=tokens)
    return model, train(model, tokens, dataclasses.replace(cfg, seed=seed), progress=False)


def test_loss_decreases(tokens: np.ndarray) -> None:
    _, stats = trained(tokens)
    assert stats["steps"] == STEPS.steps
    assert np.mean(stats["losses"][-5:]) < stats["first_loss"] - 1.0


def test_same_seed_same_weights(tokens: np.ndarray) -> None:
    cfg = dataclasses.replace(STEPS, steps=5)
    a, _ = trained(tokens, cfg)
    b, _ = trained(tokens, cfg)
    c, _ = trained(tokens, cfg, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["token_embd.weight"], sc["token_embd.weight"])


def test_compact_table_gives_the_full_vocabulary_loss(tokens: np.ndarray) -> None:
    model, _ = trained(tokens, dataclasses.replace(STEPS, steps=3))
    unseen = int(np.setdiff1d(np.arange(TINY.n_vocab), tokens)[0])
    x = torch.from_numpy(tokens[None, :TINY.n_ctx].astype(np.int64))
    y = torch.from_numpy(tokens[None, 1:TINY.n_ctx + 1].astype(np.int64))
    y[0, ::7] = unseen  # targets never trained on still get their full-softmax probability
    with torch.no_grad():
        full = torch.nn.functional.cross_entropy(model.logits(x).double()[0], y[0])
        assert model(x, y).item() == pytest.approx(full.item(), abs=1e-4)


def test_gguf_computes_the_torch_function(tokens: np.ndarray, vocab: Vocab,
                                          tmp_path: Path) -> None:
    model, _ = trained(tokens)
    seqs = check_sequences(tokens, TINY.n_ctx, count=2)
    f32 = check_gguf(model, export(model, tmp_path / "m-f32.gguf", "f32", vocab), seqs)
    assert f32["max_abs_diff"] < 2e-3 * max(1.0, f32["logit_std"])
    assert f32["argmax_agree"] == 1.0
    assert f32["llama_loss"] == pytest.approx(f32["torch_loss"], abs=1e-3)
    q8 = check_gguf(model, export(model, tmp_path / "m-q8_0.gguf", "q8_0", vocab), seqs)
    assert q8["argmax_agree"] > 0.9
    assert q8["llama_loss"] == pytest.approx(q8["torch_loss"], abs=0.05)


def test_a_gguf_file_imports_as_the_checkpoint_it_was_written_from(tokens: np.ndarray,
                                                                    vocab: Vocab,
                                                                    tmp_path: Path) -> None:
    model, _ = trained(tokens, dataclasses.replace(STEPS, steps=5))
    state = state_from_gguf(export(model, tmp_path / "m-f32.gguf", "f32", vocab))
    assert state["model_config"] == dataclasses.asdict(TINY)
    mine = model.state_dict()
    assert set(state["model"]) == set(mine)
    for name, value in mine.items():  # the compact rows and their shared row come back too
        assert torch.equal(state["model"][name], value), name
    copy = build(TINY, 1, seen=np.arange(TINY.n_vocab))
    with pytest.raises(RuntimeError):  # a full table is another row layout
        copy.load_state_dict(state["model"])


def test_draft_has_ten_times_fewer_non_embedding_parameters() -> None:
    seen = np.arange(64)  # table size does not enter the non-embedding count
    target = param_counts(build(MODELS["target"], 0, seen))
    draft = param_counts(build(MODELS["draft"], 0, seen))
    assert target["non_embedding"] >= 10 * draft["non_embedding"]
    assert MODELS["target"].n_embd // MODELS["target"].n_head == 64
    assert MODELS["draft"].n_embd // MODELS["draft"].n_head == 64


def test_a_resumed_run_equals_an_uninterrupted_one(tokens: np.ndarray, tmp_path: Path) -> None:
    cfg = dataclasses.replace(STEPS, steps=6, save_every=3, schedule="wsd", decay_frac=0.5)
    torch.set_num_threads(cfg.threads)
    whole = build(TINY, 0, seen=tokens)
    train(whole, tokens, cfg, progress=False)
    ckpt = tmp_path / "run.pt"
    first = build(TINY, 0, seen=tokens)
    train(first, tokens, dataclasses.replace(cfg, steps=3), progress=False, checkpoint=ckpt)
    resumed = build(TINY, 0, seen=tokens)  # a new process: fresh weights, state from the file
    stats = train(resumed, tokens, cfg, progress=False, checkpoint=ckpt)
    assert stats["steps"] == 6 and len(stats["losses"]) == 6
    a, b = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = dataclasses.replace(cfg, lr=cfg.lr / 2)
    with pytest.raises(ValueError, match="another run"):
        train(build(TINY, 0, seen=tokens), tokens, other, progress=False, checkpoint=ckpt)


def test_wsd_schedule_is_flat_then_decays_and_independent_of_length() -> None:
    cfg = TrainConfig(lr=1.0, warmup=10, schedule="wsd", decay_frac=0.2, min_lr_ratio=0.1)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1)
    assert lr_at(10, cfg, 100) == lr_at(79, cfg, 100) == 1.0
    assert lr_at(80, cfg, 100) == 1.0 and lr_at(90, cfg, 100) == pytest.approx(0.55)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)
    # the stable phase is the same whatever the run's length
    assert [lr_at(s, cfg, 200) for s in range(80)] == [lr_at(s, cfg, 100) for s in range(80)]


def test_frequent_tokens_are_the_compact_rows() -> None:
    tokens = np.array([5, 5, 5, 7, 9, 9], dtype=np.uint16)
    assert frequent_tokens(tokens, 2).tolist() == [5, 9]
    assert frequent_tokens(tokens, 1).tolist() == [5, 7, 9]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_distillation_pulls_the_student_towards_the_teacher(tokens: np.ndarray,
                                                            bf16: bool) -> None:
    """KL(teacher || student) over every window of the corpus, after 15 steps with the
    distillation loss and, from the same start, 15 steps of cross-entropy alone; both numeric
    paths (bf16 autocast is taken by default on CPUs with bf16 instructions). Summed over two
    student seeds: one 64-token window of one run of 15 steps at this learning rate is mostly
    noise (its ratio ranged 0.29-1.99 over seeds on one host)."""
    cfg = dataclasses.replace(STEPS, bf16=bf16)
    torch.set_num_threads(cfg.threads)
    teacher, _ = trained(tokens, cfg)
    n = len(tokens) // TINY.n_ctx
    windows = torch.from_numpy(tokens[:n * TINY.n_ctx].reshape(n, TINY.n_ctx).astype(np.int64))

    def kl_to_teacher(student) -> float:
        with torch.no_grad():
            t = teacher.row_log_probs(windows)
            s = torch.log_softmax(student.row_logits(windows).float(), dim=-1)
            return float((t.exp() * (t - s)).sum(-1).mean())

    distill = dataclasses.replace(cfg, steps=15, distill=1.0)
    plain_kl = student_kl = 0.0
    for seed in (3, 4):
        plain = build(TINY, seed, seen=tokens)
        train(plain, tokens, dataclasses.replace(distill, distill=0.0), progress=False)
        student = build(TINY, seed, seen=tokens)
        train(student, tokens, distill, progress=False, teacher=teacher)
        plain_kl, student_kl = plain_kl + kl_to_teacher(plain), student_kl + kl_to_teacher(student)
    assert student_kl < 0.8 * plain_kl
    other_rows = build(TINY, 3, seen=tokens[:50])
    with pytest.raises(ValueError, match="same embedding rows"):
        train(other_rows, tokens, distill, progress=False, teacher=teacher)


def test_sinusoidal_positions_are_rotations_at_gpt2_scale() -> None:
    model = build(TINY, 0, seen=np.arange(64), pos_init="sinusoidal")
    table = model.position_embd.weight.detach().double()
    assert abs(float(table.std()) - 0.02) < 0.004
    # each (sin, cos) pair at p + k is the pair at p rotated by the same angle for every p
    a, b = table[:, 0::2], table[:, 1::2]
    angle = torch.atan2(a[5:] * b[:-5] - b[5:] * a[:-5], a[5:] * a[:-5] + b[5:] * b[:-5])
    assert torch.allclose(angle, angle[0:1].expand_as(angle), atol=1e-6)
    normal = build(TINY, 0, seen=np.arange(64))
    assert not torch.allclose(normal.position_embd.weight, model.position_embd.weight)


def test_short_windows_first_then_full_ones_and_resume_across_the_switch(tokens: np.ndarray,
                                                                         tmp_path: Path) -> None:
    cfg = dataclasses.replace(STEPS, steps=6, short_window=16, short_steps=3, save_every=2)
    torch.set_num_threads(cfg.threads)
    shapes = []
    model = build(TINY, 0, seen=tokens)
    original = model.forward

    def record(x, y, *rest, **options):
        shapes.append(tuple(x.shape))
        return original(x, y, *rest, **options)

    model.forward = record
    train(model, tokens, cfg, progress=False)
    n = STEPS.batch_size * TINY.n_ctx  # tokens per step, the same in both phases
    assert shapes == [(n // 16, 16)] * 3 + [(STEPS.batch_size, TINY.n_ctx)] * 3
    whole = build(TINY, 0, seen=tokens)
    train(whole, tokens, cfg, progress=False)
    ckpt = tmp_path / "run.pt"
    train(build(TINY, 0, seen=tokens), tokens, dataclasses.replace(cfg, steps=4),
          progress=False, checkpoint=ckpt)
    resumed = build(TINY, 0, seen=tokens)
    train(resumed, tokens, cfg, progress=False, checkpoint=ckpt)
    a, b = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rows_come_from_the_checkpoint_not_from_the_corpus(tokens: np.ndarray,
                                                          tmp_path: Path) -> None:
    from models.train import rows_of

    for seen in (tokens, np.arange(TINY.n_vocab)):  # with a shared row, and without one
        model = build(TINY, 0, seen=seen)
        state = {"model": model.state_dict()}
        assert np.array_equal(rows_of(state), np.unique(seen))


def test_indentation_stops_are_the_weighted_positions() -> None:
    from models.train import NEWLINE, SPACE, indent_stop_weights

    # "x\n   if ...\n  \n" : the newline, three spaces, then "if" ends the indentation
    idx = torch.tensor([[11, NEWLINE, SPACE, SPACE, SPACE, 500, SPACE, NEWLINE, SPACE]])
    nxt = torch.tensor([[NEWLINE, SPACE, SPACE, SPACE, 500, SPACE, NEWLINE, SPACE, NEWLINE]])
    w = indent_stop_weights(idx, nxt, 4.0)
    # only input position 4 (the third space, next "if") is a stop; the space after "if" is
    # not indentation, and a blank line's newline is not a stop
    assert w.tolist() == [[1, 1, 1, 1, 4, 1, 1, 1, 1]]
    assert indent_stop_weights(idx[:, 1:], nxt[:, 1:], 4.0).tolist() == [[1, 1, 1, 4, 1, 1, 1, 1]]


def test_averaged_weights_are_the_mean_and_need_one_architecture() -> None:
    from models.train import average_states

    def state(value: float, rows: list[int]) -> dict:
        return {"step": 7, "model_config": {"n_embd": 2},
                "model": {"w": torch.full((2, 2), value), "row_of": torch.tensor(rows)}}

    mean = average_states([state(1.0, [0, 1]), state(3.0, [0, 1]), state(8.0, [0, 1])])
    assert torch.equal(mean["model"]["w"], torch.full((2, 2), 4.0))
    assert torch.equal(mean["model"]["row_of"], torch.tensor([0, 1])) and mean["step"] == 7
    with pytest.raises(ValueError, match="one row table"):
        average_states([state(1.0, [0, 1]), state(1.0, [1, 0])])


def test_save_at_keeps_the_checkpoints_of_those_steps(tokens: np.ndarray, tmp_path: Path) -> None:
    cfg = dataclasses.replace(STEPS, steps=4, save_every=4, save_at=(2,), schedule="wsd")
    torch.set_num_threads(cfg.threads)
    train(build(TINY, 0, seen=tokens), tokens, cfg, progress=False, checkpoint=tmp_path / "r.pt")
    assert torch.load(tmp_path / "r-step2.pt", weights_only=False)["step"] == 2
    assert torch.load(tmp_path / "r.pt", weights_only=False)["step"] == 4
