"""Opening a target/draft pair with contexts sized for the speculation settings."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

from .backend import ContextConfig, LlamaContext, LlamaModel, fit_window
from .errors import IncompatibleModels

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class ModelPair:
    """A target model and optionally a draft, each with its own context. Close when done."""

    target: LlamaModel
    target_ctx: LlamaContext
    draft: LlamaModel | None = None
    draft_ctx: LlamaContext | None = None

    def close(self) -> None:
        for obj in (self.draft_ctx, self.draft, self.target_ctx, self.target):
            if obj is not None:
                obj.close()

    def __enter__(self) -> ModelPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_compatible(target: LlamaModel, draft: LlamaModel) -> None:
    """Refuse a draft whose tokens would mean different text to the target."""
    why = target.vocab.difference(draft.vocab)
    if why is not None:
        raise IncompatibleModels(f"draft {draft.path.name} does not share the tokenizer of "
                                 f"target {target.path.name}: {why}")


def open_pair(target: str | Path, draft: str | Path | None, config: ContextConfig,
              gpu_layers: tuple[int, int] = (0, 0)) -> ModelPair:
    """Load both models, check they share a tokenizer, and create their contexts.

    Both contexts get the same window (the smaller trained context wins, or ``ContextTooLarge``
    if ``config.fit`` is off) so that a tree that fits one fits the other. Whatever fails, what
    was loaded so far is freed, and models loaded elsewhere are untouched.
    """
    with contextlib.ExitStack() as stack:
        t_model = stack.enter_context(LlamaModel(target, gpu_layers=gpu_layers[0]))
        d_model = (stack.enter_context(LlamaModel(draft, gpu_layers=gpu_layers[1]))
                   if draft is not None else None)
        n_ctx = fit_window(config, t_model.n_ctx_train, t_model.path.name)
        if d_model is not None:
            check_compatible(t_model, d_model)
            n_ctx = fit_window(dataclasses.replace(config, n_ctx=n_ctx), d_model.n_ctx_train,
                               d_model.path.name)
        config = dataclasses.replace(config, n_ctx=n_ctx)
        t_ctx = stack.enter_context(LlamaContext(t_model, config))
        d_ctx = (stack.enter_context(LlamaContext(d_model, config))
                 if d_model is not None else None)
        stack.pop_all()  # success: the pair owns them now
        return ModelPair(t_model, t_ctx, d_model, d_ctx)
