"""How a conversation becomes a prompt, and where a reply stops. No Qt, no llama.cpp.

GPT-2 models are not instruction-tuned, so each model gets the format it can continue:

- ``code`` (the built-in pair, trained on Python): the conversation is one growing source file.
  Each message is appended as it is, and the reply continues the code; it stops where a new
  top-level statement would begin (the function or class is complete).
- ``transcript`` (real GPT-2 models, trained on web text): a plain transcript, a one-line header
  and ``User:`` / ``Assistant:`` turns; the reply stops where the model starts the user's next turn.

When the conversation outgrows the context window, the oldest turns are dropped (the header
stays) until the prompt and room for the reply fit; the caller tells the user how many went.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from speculative.errors import PromptTooLong
from speculative.sampling import SamplingParams

Tokenizer = Callable[[str], list[int]]


@dataclasses.dataclass(frozen=True, slots=True)
class PromptFormat:
    name: str
    label: str                 # what the UI calls it
    header: str                # always kept at the start of the prompt
    user_prefix: str
    assistant_prefix: str
    turn_suffix: str
    stops: tuple[str, ...]     # the reply ends before the first of these
    monospace: bool            # replies are code: show them in a monospace block
    # repetition control and min-p for replies in this format (``SamplingParams.with_sampler``)
    sampler: SamplingParams = dataclasses.field(default_factory=SamplingParams)

    def render(self, messages: Sequence[tuple[str, str]], continuing: bool) -> list[str]:
        """The prompt's parts: the header, then one string per message; the last part opens
        the reply (or holds the reply being continued)."""
        parts = [self.header]
        for i, (role, text) in enumerate(messages):
            last = i == len(messages) - 1
            if role == "assistant":
                body = self.assistant_prefix + text
                parts.append(body if last and continuing else body + self.turn_suffix)
            else:
                parts.append(self.user_prefix + text + self.turn_suffix)
        if not continuing:
            parts[-1] += self.assistant_prefix
        return parts


CODE = PromptFormat(
    name="code", label="Code completion", header="", user_prefix="", assistant_prefix="",
    turn_suffix="", stops=("\n\n\n", "\ndef ", "\nclass ", "\nasync def ", "\nif __name__",
                           "\n@"),
    monospace=True,
    # chosen by ``python -m app.diagnostics.sampler --tune`` on assets/eval_prompts.txt and
    # reported on the held-out prompts (README); only the newline breaks DRY's sequences, so
    # a repeated "):" or quote does not reset a loop
    sampler=SamplingParams(min_p=0.05, repeat_penalty=1.05, repeat_last_n=64,
                           dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2,
                           dry_breakers=("\n",)))
TRANSCRIPT = PromptFormat(
    name="transcript", label="Chat transcript",
    header="A conversation between a curious user and a knowledgeable, friendly assistant.\n\n",
    user_prefix="User: ", assistant_prefix="Assistant:", turn_suffix="\n",
    stops=("\nUser:", "\nUser ", "\n\n\n"), monospace=False,
    # DRY's published defaults and llama.cpp's min-p; no chat model here to tune them on
    sampler=SamplingParams(min_p=0.05, dry_multiplier=0.8, dry_base=1.75,
                           dry_allowed_length=2))
FORMATS = {f.name: f for f in (CODE, TRANSCRIPT)}


def describe_sampler(p: SamplingParams) -> str:
    """Repetition control and min-p in a few words, for the UI and reports."""
    parts = []
    if p.repeat_penalty != 1.0 and p.repeat_last_n:
        parts.append(f"repeat penalty {p.repeat_penalty:g} over {p.repeat_last_n} tokens")
    if (p.presence_penalty or p.frequency_penalty) and p.repeat_last_n:
        parts.append(f"presence {p.presence_penalty:g}, frequency {p.frequency_penalty:g}")
    if p.dry_multiplier:
        breakers = " ".join(repr(b)[1:-1] for b in p.dry_breakers) or "none"
        parts.append(f"DRY {p.dry_multiplier:g} (base {p.dry_base:g}, allowed "
                     f"{p.dry_allowed_length}, breakers {breakers})")
    if p.min_p:
        parts.append(f"min-p {p.min_p:g}")
    return ", ".join(parts) or "off"


def format_for(builtin: bool) -> PromptFormat:
    """The format a model pair starts with: code for the built-in code models."""
    return CODE if builtin else TRANSCRIPT


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    tokens: list[int]
    dropped: int        # oldest messages left out so that the prompt fits


def build_prompt(fmt: PromptFormat, messages: Sequence[tuple[str, str]], tokenize: Tokenizer,
                 n_ctx: int, reply_room: int, continuing: bool = False) -> Prompt:
    """Tokens of the conversation in ``fmt``, leaving ``reply_room`` tokens for the reply.

    Older messages are dropped first; the newest message always stays. If the header and the
    newest message alone exceed the window, ``PromptTooLong`` says by how much.
    """
    if not messages:
        raise ValueError("nothing to reply to")
    budget = max(1, n_ctx - reply_room)
    parts = fmt.render(messages, continuing)
    lengths = [len(tokenize(p)) if p else 0 for p in parts]
    first = 1  # parts[0] is the header
    while first < len(parts) - 1 and sum(lengths[:1] + lengths[first:]) > budget:
        first += 1
    # tokenize the kept text as one string: BPE merges across part boundaries
    tokens = tokenize("".join(parts[:1] + parts[first:]))
    if len(tokens) > n_ctx - 1:  # at least one token of reply must fit
        raise PromptTooLong(len(tokens), n_ctx)
    return Prompt(tokens, first - 1)


def chat_prompt(format_name: str, messages: Sequence[tuple[str, str]], tokenize: Tokenizer,
                n_ctx: int, max_tokens: int, continuing: bool = False) -> Prompt:
    """The prompt the app decodes for a chat: ``build_prompt`` in the named format, leaving the
    reply its ``max_tokens``, but never more than half the window."""
    return build_prompt(FORMATS[format_name], messages, tokenize, n_ctx,
                        min(max_tokens, n_ctx // 2), continuing)
