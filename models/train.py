"""Train the built-in GPT-2 pair from scratch on the stdlib corpus and export it to GGUF.

    python -m models.train --which target --out models/builtin/target-q8_0.gguf --minutes 40

The model is GPT-2 as llama.cpp's ``gpt2`` graph computes it: pre-LN blocks, GELU (tanh
approximation), learned position embeddings, tied input/output embeddings, biases in every
linear layer and LayerNorm, eps 1e-5. The embedding table trained in torch is compacted to the
tokens the corpus uses (see ``Gpt2``); the exported GGUF has all 50257 rows and computes the same
softmax. Training uses bf16 autocast where the CPU computes bf16 natively (AMX or AVX512-BF16;
elsewhere it is emulated, ~6x slower than fp32), AdamW and a cosine schedule with linear warmup.
A run is deterministic given the seed and the step count; with
``--minutes`` the step count is fitted to the budget from the measured speed of the first steps
and written to the metrics, so ``--steps N`` reproduces it. The GGUF file is cross-checked
against the torch model through llama.cpp before the metrics are written beside it (``.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.corpus import load_corpus
from models.gguf_writer import Gpt2Config, Vocab, read_vocab, write_gpt2_gguf

log = logging.getLogger(__name__)

MODELS = {
    # Head size 64 throughout. The output layer (2 * d * rows FLOPs per token) costs about as
    # much as all six blocks, so depth is cheap. 1024 positions: GPT-2's own window, and a chat
    # with the built-in pair can run that long.
    "target": Gpt2Config(n_ctx=1024, n_embd=256, n_layer=6, n_head=4),
    # 2 x 198k non-embedding parameters against the target's 6 x 790k: 11.9x fewer.
    "draft": Gpt2Config(n_ctx=1024, n_embd=128, n_layer=2, n_head=2),
}


@dataclasses.dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int = 0               # 0: fit the step count to `minutes` (or derive it from `tokens`)
    minutes: float = 0.0
    tokens: int = 0
    batch_size: int = 4          # sequences of n_ctx tokens per step: 4096 tokens
    lr: float = 2e-3             # small models tolerate (and need, in few steps) a high rate
    min_lr_ratio: float = 0.1    # the schedule decays to lr * this
    warmup: int = 100            # steps; the step count is fitted during them (see `_fit_steps`)
    # "cosine": cosine decay over the whole run. "wsd" (warmup, stable, decay): constant rate,
    # then a linear decay over the last `decay_frac` of the steps. A wsd run's stable phase does
    # not depend on its length, so a run can be cut short by resuming a checkpoint taken before
    # the decay with fewer --steps: the result equals a fresh run of that length.
    schedule: str = "cosine"
    decay_frac: float = 0.15
    min_count: int = 1           # tokens seen fewer times in training share one embedding row
    distill: float = 0.0         # weight of KL(teacher || model) in the loss (with --teacher)
    # Loss weight of the positions where a line's indentation ends (see `indent_stop_weights`):
    # the one decision a code model must get right to stop writing spaces. At 1 the loss is the
    # plain mean; a trial at 1 left greedy decoding choosing "another space" where the stop's
    # probability was split over many first words of the line.
    indent_weight: float = 1.0
    pos_init: str = "normal"     # "sinusoidal": see `sinusoidal_positions_`
    # Short windows first: the first `short_steps` steps train on windows of `short_window`
    # tokens (as many tokens per step). A position-embedding row then gets n_ctx / short_window
    # times more updates, and the within-line positional patterns that counting indentation
    # needs were learned far sooner in trials here (n_ctx 256 vs 1024 at equal tokens).
    short_window: int = 0
    short_steps: int = 0
    heads: int = 0               # 0: the model's own head count (head size 64)
    layers: int = 0              # 0: the model's own depth
    width: int = 0               # 0: the model's own embedding size
    save_every: int = 0          # steps between resumable checkpoints (0: none)
    save_at: tuple[int, ...] = ()  # steps whose checkpoint is also kept as CHECKPOINT-stepN.pt
    weight_decay: float = 0.1    # matrices and embeddings only, not biases and norms
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    compile: bool = True         # torch.compile (inductor, C++): 1.4x (target), 3x (draft) here
    eval_every: int = 250        # steps between quick validation losses in the log
    # 0: every core this process may use. On a shared 2-core machine 1 thread can be 2x faster:
    # OpenMP threads spin at barriers while a core is busy elsewhere (or OMP_WAIT_POLICY=PASSIVE).
    threads: int = 0
    # bf16 autocast; None: where the CPU has bf16 instructions (``native_bf16``). A distillation
    # step of the draft took 1.1 s with AMX, 77 s emulated and 12 s in fp32 on an AVX2 EPYC.
    bf16: bool | None = None


def native_bf16() -> bool:
    """Whether this CPU computes bf16 matrix products natively (Linux: its cpuinfo flags)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


class Block(nn.Module):
    def __init__(self, cfg: Gpt2Config) -> None:
        super().__init__()
        d, eps = cfg.n_embd, cfg.layer_norm_eps
        self.n_head = cfg.n_head
        self.attn_norm = nn.LayerNorm(d, eps=eps)
        self.attn_qkv = nn.Linear(d, 3 * d)      # rows: all of q, then k, then v (llama.cpp)
        self.attn_output = nn.Linear(d, d)
        self.ffn_norm = nn.LayerNorm(d, eps=eps)
        self.ffn_up = nn.Linear(d, cfg.ff)
        self.ffn_down = nn.Linear(cfg.ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn_qkv(self.attn_norm(x)).split(d, dim=2)
        # (B, T, d) -> (B, nh, T, hs): head h is columns h*hs..(h+1)*hs, as ggml reshapes them
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_output(y.transpose(1, 2).reshape(b, t, d))
        return x + self.ffn_down(F.gelu(self.ffn_up(self.ffn_norm(x)), approximate="tanh"))


class Gpt2(nn.Module):
    """GPT-2 whose embedding table holds only the tokens seen in training, plus one shared row.

    The corpus uses ~18k of GPT-2's 50257 tokens, and the output layer is most of the cost, so
    the table holds one row per ``seen`` token and, if any are left, one row shared by all the
    others. Exported, every unseen token gets the shared row (``gguf_weights``); to make the
    training softmax *equal* to the exported full-vocabulary one, the shared row's logit is
    offset by log(number of unseen tokens): that many identical logits add exactly that much
    to the partition function. Inputs and targets are token ids; ``row_of`` maps them to rows.
    """

    def __init__(self, cfg: Gpt2Config, seen: np.ndarray | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        seen = np.arange(cfg.n_vocab) if seen is None else np.unique(seen)
        n_unseen = cfg.n_vocab - len(seen)
        row_of = np.full(cfg.n_vocab, len(seen), np.int64)
        row_of[seen] = np.arange(len(seen))
        offset = np.zeros(len(seen) + (n_unseen > 0), np.float32)
        offset[len(seen):] = math.log(max(n_unseen, 1))  # log of how many tokens the row stands for
        self.register_buffer("row_of", torch.from_numpy(row_of))
        self.register_buffer("row_offset", torch.from_numpy(offset))
        self.token_embd = nn.Embedding(len(offset), cfg.n_embd)  # also the output layer (tied)
        self.position_embd = nn.Embedding(cfg.n_ctx, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.output_norm = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer) so the
        # residual stream's variance does not grow with depth; biases zero.
        for name, p in self.named_parameters():
            if "norm" in name:
                continue  # LayerNorm keeps weight 1, bias 0
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith(
                    ("attn_output.weight", "ffn_down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def _hidden(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.token_embd(self.row_of[idx]) + self.position_embd(
            torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.output_norm(x)  # (B, T, d)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor,
                teacher: torch.Tensor | None = None, distill: float = 0.0,
                indent_weight: float = 1.0) -> torch.Tensor:
        """Mean next-token loss (nats) of the full-vocabulary model; ``idx``, ``targets`` (B, T).

        With ``teacher`` (another model's ``row_log_probs`` of ``idx``, same rows), the loss is
        ``(1 - distill) * CE + distill * KL(teacher || self)``: a draft trained to match the
        target's whole distribution agrees with the target's choices more often than one
        trained on the text alone, and agreement is what speculative decoding is paid in.
        """
        logits = self.row_logits(idx)
        rows = self.row_of[targets].reshape(-1)
        # -log p(token) = CE over rows + the row's offset (the shared row's logit was raised by
        # log n_unseen, but the token is only one of those n_unseen)
        flat = logits.reshape(-1, logits.shape[-1]).float()
        nll = F.cross_entropy(flat, rows, reduction="none") + self.row_offset[rows]
        if indent_weight == 1.0:
            ce = nll.mean()
        else:
            w = indent_stop_weights(idx, targets, indent_weight).reshape(-1)
            ce = (nll * w).sum() / w.sum()
        if teacher is None or distill <= 0.0:
            return ce
        t = teacher.reshape(-1, teacher.shape[-1])
        kl = F.kl_div(F.log_softmax(flat, dim=-1), t, log_target=True, reduction="batchmean")
        return (1.0 - distill) * ce + distill * kl

    def row_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits over the compact rows (shared row offset included), ``(B, T, rows)``."""
        return F.linear(self._hidden(idx), self.token_embd.weight) + self.row_offset

    @torch.no_grad()
    def row_log_probs(self, idx: torch.Tensor) -> torch.Tensor:
        """log softmax of ``row_logits`` in fp32: a teacher's targets for distillation."""
        return F.log_softmax(self.row_logits(idx).float(), dim=-1)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``(B, T, n_vocab)``, what llama.cpp computes from the GGUF."""
        return F.linear(self._hidden(idx), self.token_embd.weight)[..., self.row_of]


SPACE, NEWLINE = 220, 198  # GPT-2's " " and "\n"


def indent_stop_weights(idx: torch.Tensor, targets: torch.Tensor, weight: float) -> torch.Tensor:
    """``weight`` where the input is inside a line's leading indentation (a newline, then only
    spaces) and the next token is the line's first non-space token, 1 elsewhere; ``(B, T)``."""
    pos = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
    last = torch.where(idx != SPACE, pos, -1).cummax(dim=1).values  # last non-space so far
    inside = (last >= 0) & (idx.gather(1, last.clamp(min=0)) == NEWLINE)
    stop = inside & (targets != SPACE) & (targets != NEWLINE)
    return torch.where(stop, weight, 1.0)


def param_counts(model: Gpt2) -> dict[str, int]:
    """Parameters of the exported model: embedding (token + position tables, 50257 rows) and
    non-embedding, as Kaplan et al. count them; the tied output layer is not counted twice.
    ``trained_embedding_rows`` is the compact table's size (see ``Gpt2``)."""
    cfg = model.cfg
    emb = (cfg.n_vocab + cfg.n_ctx) * cfg.n_embd
    non_emb = sum(p.numel() for n, p in model.named_parameters() if "embd" not in n)
    return {"embedding": emb, "non_embedding": non_emb, "total": emb + non_emb,
            "trained_embedding_rows": model.token_embd.num_embeddings}


def batch_starts(n_tokens: int, n_ctx: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Endless start offsets ``(B,)`` of training windows: every epoch visits each
    non-overlapping window once, in a seeded random order, from a seeded random offset."""
    rng = np.random.default_rng(seed)
    while True:
        offset = int(rng.integers(n_ctx))
        starts = offset + n_ctx * np.arange((n_tokens - offset - 1) // n_ctx)
        rng.shuffle(starts)
        for i in range(0, len(starts) - batch_size + 1, batch_size):
            yield starts[i:i + batch_size]


def batches(tokens: np.ndarray, n_ctx: int, batch_size: int, seed: int, skip: int = 0,
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(x, y)`` batches ``(B, n_ctx)``, deterministic given the seed; ``skip`` drops
    the first batches (a resumed run continues exactly where it stopped)."""
    starts = batch_starts(len(tokens), n_ctx, batch_size, seed)
    for _ in range(skip):
        next(starts)
    for batch in starts:
        rows = np.stack([tokens[s:s + n_ctx + 1] for s in batch])
        rows = torch.from_numpy(rows.astype(np.int64))
        yield rows[:, :-1], rows[:, 1:]


def lr_at(step: int, cfg: TrainConfig, total: int | None) -> float:
    """Linear warmup, then cosine or wsd (see ``TrainConfig.schedule``) down to
    lr * min_lr_ratio at step ``total``."""
    if step < cfg.warmup or total is None:
        return cfg.lr * (step + 1) / cfg.warmup
    low = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "wsd":
        decay_start = int(total * (1 - cfg.decay_frac))
        if step < decay_start:
            return cfg.lr
        frac = min(1.0, (step - decay_start) / max(1, total - decay_start))
        return cfg.lr - (cfg.lr - low) * frac
    frac = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return low + (cfg.lr - low) * 0.5 * (1 + math.cos(math.pi * frac))


def make_optimizer(model: Gpt2, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=cfg.betas, fused=True)


def _fit_steps(cfg: TrainConfig, step: int, elapsed: float, step_times: Sequence[float]) -> int:
    """Steps that fit the remaining time budget at the median speed of the recent steps."""
    per_step = float(np.median(step_times))
    return step + max(1, int((cfg.minutes * 60 - elapsed) / per_step))


def train(model: Gpt2, data: np.ndarray, cfg: TrainConfig, valid: np.ndarray | None = None,
          progress: bool = True, checkpoint: Path | None = None,
          teacher: Gpt2 | None = None) -> dict:
    """Train in place; returns the run's statistics (steps, tokens, seconds, losses).

    With ``checkpoint``, the run saves its whole state there every ``cfg.save_every`` steps and,
    if the file exists, resumes from it first (same batches, same rates: the result equals an
    uninterrupted run). With ``teacher``, the loss mixes in distillation (``cfg.distill``).
    """
    from tqdm import tqdm

    if teacher is not None:
        if not torch.equal(teacher.row_of, model.row_of):
            raise ValueError("teacher and student must have the same embedding rows")
        teacher.eval()

    n_ctx, tokens_per_step = model.cfg.n_ctx, cfg.batch_size * model.cfg.n_ctx
    total = cfg.steps or (math.ceil(cfg.tokens / tokens_per_step) if cfg.tokens else None)
    if total is None and cfg.minutes <= 0:
        raise ValueError("give steps, tokens or minutes")
    opt = make_optimizer(model, cfg)
    state = _resume(checkpoint, model, opt, cfg)
    step, total = state.get("step", 0), total or state.get("total")
    losses, evals = state.get("losses", []), state.get("evals", [])
    elapsed = state.get("seconds", 0.0)  # training time before this process
    step_fn = torch.compile(model) if cfg.compile else model
    bf16 = native_bf16() if cfg.bf16 is None else cfg.bf16
    log.info("bf16 autocast %s", "on" if bf16 else "off (fp32)")
    data_iter = _phase_batches(data, n_ctx, cfg, step)
    step_times: list[float] = []
    bar = tqdm(total=total, initial=step, disable=not progress,
               mininterval=1 if sys.stderr.isatty() else 30)
    start = time.perf_counter()
    while total is None or step < total:
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg, total)
        if step == cfg.short_steps and cfg.short_window:  # the short-window phase is over
            data_iter = _phase_batches(data, n_ctx, cfg, step)
        x, y = next(data_iter)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if teacher is None:
                loss = step_fn(x, y, indent_weight=cfg.indent_weight)
            else:
                loss = step_fn(x, y, teacher.row_log_probs(x), cfg.distill, cfg.indent_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        step_times.append(time.perf_counter() - t0)
        step += 1
        if total is None and step >= min(cfg.warmup, 40):  # first steps include compilation
            total = _fit_steps(cfg, step, time.perf_counter() - start, step_times[-20:])
            bar.total = total
            log.info("fitted %d steps (%.2f s/step) to %.1f minutes", total,
                     np.median(step_times[-20:]), cfg.minutes)
        bar.update()
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", lr=f"{lr_at(step, cfg, total):.1e}",
                        refresh=False)
        if valid is not None and cfg.eval_every and step % cfg.eval_every == 0:
            evals.append((step, evaluate(model, valid, max_windows=8, bf16=bf16)))
            log.info("step %d: train loss %.3f, quick valid loss %.3f", step,
                     np.mean(losses[-20:]), evals[-1][1])
        for path, due in ((checkpoint, cfg.save_every and step % cfg.save_every == 0),
                          (checkpoint and checkpoint.with_name(f"{checkpoint.stem}-step{step}.pt"),
                           step in cfg.save_at)):
            if path is not None and due:
                _save(path, model, opt, cfg, step=step, total=total, losses=losses,
                      evals=evals, seconds=elapsed + time.perf_counter() - start)
    bar.close()
    seconds = elapsed + time.perf_counter() - start
    return {"steps": step, "tokens": step * tokens_per_step, "seconds": round(seconds, 1),
            "tokens_per_s": round(step * tokens_per_step / seconds),
            "median_step_seconds": round(float(np.median(step_times or [0.0])), 3),
            "first_loss": losses[0], "final_train_loss": float(np.mean(losses[-20:])),
            "losses": losses, "quick_valid": evals}


def _phase_batches(data: np.ndarray, n_ctx: int, cfg: TrainConfig, step: int,
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches from ``step`` on: short windows first (``cfg.short_window``), then full."""
    if cfg.short_window and step < cfg.short_steps:
        per = cfg.batch_size * n_ctx // cfg.short_window
        return batches(data, cfg.short_window, per, cfg.seed, skip=step)
    done = cfg.short_steps if cfg.short_window else 0
    return batches(data, n_ctx, cfg.batch_size, cfg.seed + (1 if done else 0), skip=step - done)


# What must match for a checkpoint to continue a run (the step count may differ: see `schedule`)
_RUN_IDENTITY = ("batch_size", "lr", "min_lr_ratio", "warmup", "schedule", "decay_frac",
                 "weight_decay", "betas", "grad_clip", "seed", "min_count", "distill",
                 "indent_weight", "pos_init", "short_window", "short_steps", "heads", "layers",
                 "width")


def _save(path: Path, model: Gpt2, opt: torch.optim.Optimizer, cfg: TrainConfig,
          **progress: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "model_config": dataclasses.asdict(model.cfg),
                "run": {k: getattr(cfg, k) for k in _RUN_IDENTITY}, **progress}, tmp)
    tmp.replace(path)  # a crash while saving keeps the previous checkpoint


def _resume(path: Path | None, model: Gpt2, opt: torch.optim.Optimizer,
            cfg: TrainConfig) -> dict:
    """Load a checkpoint of the same run into ``model`` and ``opt``; its progress, or {}."""
    if path is None or not path.is_file():
        return {}
    state = torch.load(path, weights_only=False)
    run = {k: getattr(cfg, k) for k in _RUN_IDENTITY}
    defaults = TrainConfig()
    saved = {k: state["run"].get(k, getattr(defaults, k)) for k in _RUN_IDENTITY}  # older files
    if saved != run or state["model_config"] != dataclasses.asdict(model.cfg):
        raise ValueError(f"{path} is a checkpoint of another run: {state['run']} "
                         f"{state['model_config']}; delete it or change --checkpoint")
    if cfg.steps and cfg.steps < state["step"]:
        raise ValueError(f"{path} is at step {state['step']}, beyond --steps {cfg.steps}")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    log.info("resumed %s at step %d", path, state["step"])
    return state


@torch.no_grad()
def evaluate(model: Gpt2, tokens: np.ndarray, max_windows: int | None = None,
             bf16: bool = False, batch_size: int = 8) -> float:
    """Mean next-token loss (nats) over the non-overlapping ``n_ctx`` windows of ``tokens``;
    fp32 unless ``bf16`` (the quick estimates logged during training)."""
    model.eval()
    n_ctx = model.cfg.n_ctx
    n = (len(tokens) - 1) // n_ctx
    n = min(n, max_windows) if max_windows else n
    total, count = 0.0, 0
    for i in range(0, n, batch_size):
        rows = np.stack([tokens[s * n_ctx:(s + 1) * n_ctx + 1]
                         for s in range(i, min(n, i + batch_size))]).astype(np.int64)
        x, y = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)
        total += loss.item() * y.numel()
        count += y.numel()
    model.train()
    return total / count


def gguf_weights(model: Gpt2) -> dict[str, np.ndarray]:
    """The weights under llama.cpp's names. torch's Linear weight is ``(out, in)``, which is
    already llama.cpp's orientation (see ``models/gguf_writer.py``): no transposes."""
    # Module names were chosen to be the GGUF names: blocks.{i}.x -> blk.{i}.x
    weights = {name.replace("blocks.", "blk.", 1): p.detach().float().numpy().copy()
               for name, p in model.named_parameters()}
    # compact table -> one row per token id; unseen tokens all get the shared row
    weights["token_embd.weight"] = weights["token_embd.weight"][model.row_of.numpy()]
    return weights


def export(model: Gpt2, path: str | Path, ftype: str = "q8_0", vocab: Vocab | None = None,
           name: str = "gpt2") -> Path:
    return write_gpt2_gguf(path, model.cfg, gguf_weights(model), vocab or read_vocab(),
                           ftype=ftype, name=name)


def llama_logits(path: str | Path, tokens: Sequence[int]) -> np.ndarray:
    """Logits ``(n, n_vocab)`` of every position of ``tokens``, computed by llama.cpp."""
    from speculative.backend import ContextConfig, LlamaContext, LlamaModel

    n = len(tokens)
    with LlamaModel(path) as m, LlamaContext(m, ContextConfig(n_ctx=n, n_batch=n,
                                                              n_seq_max=1)) as ctx:
        return ctx.decode(list(tokens), list(range(n)), [[0]] * n)


def check_gguf(model: Gpt2, path: str | Path, seqs: np.ndarray) -> dict:
    """Compare llama.cpp's logits of ``path`` with the fp32 torch model on ``seqs`` ``(S, T+1)``.

    Reported: max and mean |difference| of the logits, the fraction of positions whose argmax
    agrees, and the mean next-token loss of each on these sequences.
    """
    x = torch.from_numpy(seqs[:, :-1].astype(np.int64))
    with torch.no_grad():
        ref = model.eval().logits(x).float().numpy()
    model.train()
    diffs, agree, loss_t, loss_l = [], [], [], []
    for i, seq in enumerate(seqs):
        got = llama_logits(path, seq[:-1].tolist())
        diffs.append(np.abs(got - ref[i]))
        agree.append(got.argmax(-1) == ref[i].argmax(-1))
        loss_t.append(_nll(ref[i], seq[1:]))
        loss_l.append(_nll(got, seq[1:]))
    d = np.concatenate(diffs)
    return {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
            "logit_std": float(ref.std()), "argmax_agree": float(np.concatenate(agree).mean()),
            "torch_loss": float(np.mean(loss_t)), "llama_loss": float(np.mean(loss_l)),
            "positions": int(d.shape[0])}


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets.astype(np.int64)].mean())


def check_sequences(tokens: np.ndarray, n_ctx: int, count: int = 4) -> np.ndarray:
    """``count`` evenly spaced windows of ``n_ctx + 1`` tokens (fixed, not random)."""
    starts = np.linspace(0, len(tokens) - n_ctx - 2, count).astype(np.int64)
    return np.stack([tokens[s:s + n_ctx + 1] for s in starts])


def build(cfg: Gpt2Config, seed: int, seen: np.ndarray | None = None,
          pos_init: str = "normal") -> Gpt2:
    torch.manual_seed(seed)
    model = Gpt2(cfg, seen)
    if pos_init == "sinusoidal":
        sinusoidal_positions_(model)
    return model


@torch.no_grad()
def sinusoidal_positions_(model: Gpt2) -> None:
    """Start the learned position table from Vaswani et al.'s sinusoids (still trained).

    Why: to stop indenting, a model of Python in GPT-2's tokens (one token per space) must count
    the spaces since the line began and compare with the line above, i.e. compute differences
    of positions. With sinusoids, the table at p - k is a fixed rotation of the table at p, so
    attending "k tokens back" or "to the last newline" is a linear map from the start; from a
    random table it has to be learned first. Scaled to GPT-2's init (std 0.02) so that positions
    do not drown the token embeddings.
    """
    n_ctx, d = model.position_embd.weight.shape
    pos = torch.arange(n_ctx, dtype=torch.float64)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float64) / d)
    table = torch.zeros(n_ctx, d, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    model.position_embd.weight.copy_((table * 0.02 * math.sqrt(2.0)).float())


def frequent_tokens(tokens: np.ndarray, min_count: int) -> np.ndarray:
    """Token ids seen at least ``min_count`` times: the rows of the compact table (see Gpt2)."""
    counts = np.bincount(tokens, minlength=1)
    return np.flatnonzero(counts >= max(min_count, 1))


def default_checkpoint(which: str, cfg: TrainConfig) -> Path:
    from models.corpus import default_cache_dir

    return default_cache_dir() / "train" / f"{which}-seed{cfg.seed}.pt"


def model_config(which: str, cfg: TrainConfig) -> Gpt2Config:
    """The architecture of ``which``, with the run's head count if it sets one."""
    base = MODELS[which]
    return dataclasses.replace(base, n_head=cfg.heads or base.n_head,
                               n_layer=cfg.layers or base.n_layer,
                               n_embd=cfg.width or base.n_embd)


def export_checkpoint(which: str, checkpoint: Path, out: Path, cfg: TrainConfig,
                      average: Sequence[Path] = ()) -> Path:
    """A checkpoint's weights as Q8_0 GGUF: a running training's (to read what it writes so
    far), or with ``average`` the mean of several runs' weights (see `average_states`)."""
    state = torch.load(checkpoint, weights_only=False)
    if average:
        state = average_states([state, *(torch.load(p, weights_only=False) for p in average)])
        torch.save(state, out.with_suffix(".pt"))  # e.g. a teacher to distil from
    model = build(Gpt2Config(**state["model_config"]), cfg.seed, seen=rows_of(state))
    model.load_state_dict(state["model"])
    log.info("%s at step %d%s", checkpoint, state["step"],
             f", averaged with {', '.join(map(str, average))}" if average else "")
    # an average is a finished model (named as `run` names one); a snapshot says its step
    name = f"staged-chat-{which}" if average else f"staged-chat-{which}-step{state['step']}"
    return export(model, out, "q8_0", name=name)


def average_states(states: Sequence[dict]) -> dict:
    """The element-wise mean of the weights of runs that share an architecture and embedding
    rows (a "model soup", Wortsman et al. 2022). Two runs continued from one checkpoint
    with different losses averaged here into a target better than either: greedy
    continuations degenerate 10% instead of 37% and 20%, on the held-out prompt set."""
    first = states[0]
    for other in states[1:]:
        if (other["model_config"] != first["model_config"]
                or not torch.equal(other["model"]["row_of"], first["model"]["row_of"])):
            raise ValueError("only runs of one architecture and one row table can be averaged")
    mean = {k: (torch.stack([s["model"][k].float() for s in states]).mean(0).to(v.dtype)
                if v.is_floating_point() else v) for k, v in first["model"].items()}
    return {**first, "model": mean}


def rows_of(state: dict) -> np.ndarray:
    """The token ids with rows of their own in a checkpoint's compact table (``Gpt2``): read
    from the checkpoint, not recomputed from the corpus, which changes with the installed
    packages (the corpus includes their source)."""
    row_of = state["model"]["row_of"].numpy()
    n_rows = state["model"]["token_embd.weight"].shape[0]
    if n_rows == len(row_of):  # every token seen: no shared row
        return np.arange(len(row_of))
    return np.flatnonzero(row_of < n_rows - 1)


def _origin(path: Path | None, which: str) -> dict | None:
    """The run that wrote a resumable checkpoint: its settings and step (None for none, or for a
    checkpoint without them, such as the end-of-run file of ``run``)."""
    if path is None or Path(path).suffix == ".gguf":
        return None
    state = torch.load(path, weights_only=False, map_location="cpu")
    if "run" not in state or "step" not in state:
        return None
    return {"which": which, "step": int(state["step"]), "run": state["run"]}


def load_state(path: Path) -> dict:
    """A checkpoint (``{"model": state_dict, "model_config": ...}``) from a ``.pt`` file, or
    from a GPT-2 GGUF (``state_from_gguf``): a shipped model can be trained further, or taught
    from, without the run that made it."""
    if Path(path).suffix == ".gguf":
        return state_from_gguf(path)
    return torch.load(path, weights_only=False)


def state_from_gguf(path: str | Path) -> dict:
    """The weights of a GPT-2 GGUF as a checkpoint of ``Gpt2``, its compact table rebuilt.

    ``gguf_weights`` gave every token without a row of its own the shared row, so the tokens
    that share the row most of them carry are the unseen ones (a file written from a model
    without a shared row has no two rows alike). The weights are the file's, dequantized: a
    Q8_0 file gives the Q8_0-rounded model, which is what llama.cpp runs."""
    from models.numpy_gpt2 import load_gguf_weights

    cfg, weights, _ = load_gguf_weights(path)
    table = weights["token_embd.weight"]
    _, which, counts = np.unique(table, axis=0, return_inverse=True, return_counts=True)
    which = which.reshape(-1)
    shared = int(counts.argmax())
    seen = np.flatnonzero(which != shared) if counts[shared] > 1 else np.arange(len(table))
    model = Gpt2(cfg, seen)
    state = model.state_dict()
    for name in state:
        if name in ("row_of", "row_offset"):
            continue
        key = name.replace("blocks.", "blk.", 1)
        if key not in weights:
            raise ValueError(f"{path}: no tensor {key}")
        state[name] = torch.from_numpy(np.ascontiguousarray(weights[key]))
    rows = [table[seen]]
    if len(seen) < len(table):
        rows.append(table[which == shared][:1])
    state["token_embd.weight"] = torch.from_numpy(np.concatenate(rows))
    return {"model": state, "model_config": dataclasses.asdict(cfg)}


def load_teacher(path: Path) -> Gpt2:
    """A trained model from a checkpoint (``run``'s, a resumable one or a GGUF) to distil from."""
    state = load_state(path)
    cfg = Gpt2Config(**state["model_config"])
    teacher = build(cfg, 0, rows_of(state))
    teacher.load_state_dict(state["model"])
    return teacher.eval()


def run(which: str, out: Path, cfg: TrainConfig, progress: bool = True,
        checkpoint: Path | None = None, teacher_path: Path | None = None,
        init: Path | None = None) -> dict:
    """Train ``which`` on the corpus (``models.corpus``), export Q8_0 GGUF to ``out`` and write
    metrics beside it. Resumes from the run's checkpoint if one is there."""
    torch.set_num_threads(cfg.threads or len(os.sched_getaffinity(0)))
    corpus = load_corpus()
    init_state = load_state(init) if init is not None else None
    # continuing another run: its rows (the corpus may have changed since: see rows_of)
    seen = (rows_of(init_state) if init_state is not None
            else frequent_tokens(corpus.train, cfg.min_count))
    model = build(model_config(which, cfg), cfg.seed, seen=seen, pos_init=cfg.pos_init)
    counts = param_counts(model)
    log.info("%s: %s parameters; corpus %d train / %d valid tokens", which, counts,
             len(corpus.train), len(corpus.valid))
    if init_state is not None:  # another run's weights (fresh optimizer and schedule)
        model.load_state_dict(init_state["model"])
        log.info("weights from %s (step %s)", init, init_state.get("step"))
    teacher = load_teacher(teacher_path) if teacher_path is not None else None
    stats = train(model, corpus.train, cfg, valid=corpus.valid, progress=progress,
                  checkpoint=checkpoint or default_checkpoint(which, cfg), teacher=teacher)
    ckpt = Path(tempfile.gettempdir()) / f"staged-chat-{which}-seed{cfg.seed}.pt"
    # export or checks failing must not cost the run; loadable as a teacher (`load_teacher`)
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.cfg)}, ckpt)
    log.info("trained in %.0f s; checkpoint %s; evaluating", stats["seconds"], ckpt)
    t0 = time.perf_counter()
    valid_loss = evaluate(model, corpus.valid)
    eval_seconds = time.perf_counter() - t0
    vocab = read_vocab()
    path = export(model, out, "q8_0", vocab, name=f"staged-chat-{which}")
    seqs = check_sequences(corpus.valid, model.cfg.n_ctx)
    with tempfile.TemporaryDirectory() as tmp:  # F32: the same function, to float noise
        f32 = export(model, Path(tmp) / "f32.gguf", "f32", vocab)
        check_f32 = check_gguf(model, f32, seqs)
    metrics = {
        "which": which, "config": dataclasses.asdict(model.cfg),
        "train_config": dataclasses.asdict(cfg), "parameters": counts,
        "teacher": str(teacher_path) if teacher_path else None,
        "init": str(init) if init else None,
        # what made those checkpoints, so the manifest can give the whole rebuild
        "teacher_run": _origin(teacher_path, "target"), "init_run": _origin(init, which),
        **{k: v for k, v in stats.items() if k != "losses"},
        "loss_every_100_steps": [round(float(np.mean(stats["losses"][i:i + 100])), 4)
                                 for i in range(0, len(stats["losses"]), 100)],
        "valid_loss": valid_loss, "valid_perplexity": math.exp(valid_loss),
        "valid_tokens": len(corpus.valid) - 1, "eval_seconds": round(eval_seconds, 1),
        "train_tokens_in_corpus": len(corpus.train),
        "epochs": stats["tokens"] / len(corpus.train),
        "gguf": {"path": path.name, "bytes": path.stat().st_size, "ftype": "q8_0"},
        "llama_check_q8_0": check_gguf(model, path, seqs), "llama_check_f32": check_f32,
        "held_out": list(corpus.valid_files), "corpus_packages": corpus.packages,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    path.with_suffix(".json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def parse_args(argv: Sequence[str] | None,
               ) -> tuple[str, Path, Path | None, list[Path] | None, Path | None, TrainConfig,
                          Path | None]:
    """which, out, checkpoint, export (None: train; else the checkpoints averaged in), teacher,
    the run's settings, init."""
    defaults = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m models.train", description=__doc__.split("\n")[0])
    p.add_argument("--which", choices=sorted(MODELS), required=True)
    p.add_argument("--out", type=Path, required=True, help="GGUF path (Q8_0); .json beside it")
    p.add_argument("--minutes", type=float, default=0.0, help="training time budget")
    p.add_argument("--tokens", type=int, default=0, help="training token budget")
    p.add_argument("--steps", type=int, default=0, help="exact step count (overrides budgets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--warmup", type=int, default=defaults.warmup)
    p.add_argument("--schedule", choices=("cosine", "wsd"), default=defaults.schedule)
    p.add_argument("--decay-frac", type=float, default=defaults.decay_frac)
    p.add_argument("--min-count", type=int, default=defaults.min_count,
                   help="tokens seen fewer times in training share one embedding row")
    p.add_argument("--save-every", type=int, default=100,
                   help="steps between resumable checkpoints (0: none)")
    p.add_argument("--save-at", type=int, nargs="+", default=[],
                   help="also keep the checkpoint of these steps (CHECKPOINT-stepN.pt), e.g. to "
                        "continue another run from there with --init")
    p.add_argument("--checkpoint", type=Path, help="resumable checkpoint file (default: "
                   "~/.cache/staged-chat/train/WHICH-seedN.pt); an existing one is resumed")
    p.add_argument("--pos-init", choices=("normal", "sinusoidal"), default=defaults.pos_init,
                   help="start of the position table (sinusoidal: counting indentation is easier)")
    p.add_argument("--init", type=Path,
                   help="start from this checkpoint's (.pt) or GGUF file's weights (e.g. to "
                        "distil a trained draft further)")
    p.add_argument("--layers", type=int, default=0, help="blocks (default: the model's)")
    p.add_argument("--width", type=int, default=0, help="embedding size (default: the model's)")
    p.add_argument("--short-window", type=int, default=0,
                   help="train the first --short-steps steps on windows of this many tokens")
    p.add_argument("--short-steps", type=int, default=0)
    p.add_argument("--heads", type=int, default=0,
                   help="attention heads (default: the model's, head size 64)")
    p.add_argument("--teacher", type=Path,
                   help="distil from this trained model's checkpoint (.pt) or GGUF file, "
                        "e.g. the target's")
    p.add_argument("--distill", type=float, default=0.0,
                   help="weight of KL(teacher || model) in the loss, 0..1 (with --teacher)")
    p.add_argument("--indent-weight", type=float, default=1.0,
                   help="loss weight where a line's indentation ends (see indent_stop_weights)")
    p.add_argument("--average", type=Path, nargs="+", default=[],
                   help="with --export-checkpoint: average these checkpoints' weights in")
    p.add_argument("--export-checkpoint", action="store_true",
                   help="only export the checkpoint's current weights to --out (no training)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                   help="bf16 autocast (auto: where the CPU has bf16 instructions)")
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args(argv)
    if a.export_checkpoint:
        a.steps = a.steps or 1
    elif not (a.minutes or a.tokens or a.steps):
        p.error("give --minutes, --tokens or --steps")
    if a.distill and a.teacher is None:
        p.error("--distill needs --teacher")
    if a.average and not a.export_checkpoint:
        p.error("--average goes with --export-checkpoint")
    export_list = list(a.average) if a.export_checkpoint else None
    return a.which, a.out, a.checkpoint, export_list, a.teacher, TrainConfig(
        steps=a.steps, minutes=a.minutes, tokens=a.tokens, batch_size=a.batch_size, lr=a.lr,
        warmup=a.warmup, seed=a.seed, compile=not a.no_compile, threads=a.threads,
        schedule=a.schedule, decay_frac=a.decay_frac, min_count=a.min_count,
        save_every=a.save_every, save_at=tuple(a.save_at), distill=a.distill, pos_init=a.pos_init,
        indent_weight=a.indent_weight,
        short_window=a.short_window, short_steps=a.short_steps, heads=a.heads,
        layers=a.layers, width=a.width,
        bf16={"auto": None, "on": True, "off": False}[a.bf16]), a.init


def main(argv: Sequence[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    which, out, checkpoint, export_only, teacher, cfg, init = parse_args(argv)
    if export_only is not None:
        path = export_checkpoint(which, checkpoint or default_checkpoint(which, cfg), out, cfg,
                                 average=export_only)
        print(path)
        return {}
    metrics = run(which, out, cfg, checkpoint=checkpoint, teacher_path=teacher, init=init)
    print(json.dumps({k: v for k, v in metrics.items() if k not in ("held_out", "quick_valid")},
                     indent=1))
    return metrics


if __name__ == "__main__":
    main()
