"""Exceptions the engine raises; none needs llama.cpp to be importable."""

from __future__ import annotations


class LlamaError(RuntimeError):
    """llama.cpp refused an operation."""


class ModelLoadError(LlamaError):
    """A GGUF file could not be loaded (missing, corrupt, or not a GPT-2 model)."""


class IncompatibleModels(ValueError):
    """Target and draft do not share a tokenizer, so draft tokens would mean other text."""


class BatchTooLarge(ValueError):
    """More tokens in one batch than the context's ``n_batch`` (llama.cpp would abort)."""


class ContextOverflow(ValueError):
    """Tokens would land beyond the context window."""


class ContextTooLarge(ContextOverflow):
    """A window beyond the model's trained context (GPT-2 has no positions past it)."""


class PromptTooLong(ContextOverflow):
    """The prompt alone does not fit the context window."""

    def __init__(self, n_tokens: int, n_ctx: int) -> None:
        super().__init__(f"the prompt is {n_tokens} tokens but the context holds {n_ctx}; "
                         f"shorten it or start a new conversation")
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx


class TooManySequences(ValueError):
    """A sequence id at or over the context's ``n_seq_max`` (llama.cpp would abort)."""
