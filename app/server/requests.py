"""An OpenAI request body, checked field by field into a ``GenerationRequest``.

Every field is either used, ignored on purpose (``user`` and the other bookkeeping fields that
do not change the answer), or refused with a 400 that names it: a field this server cannot
honour (``n`` > 1, ``logprobs``, ``tools``, images) must never produce a quietly different
answer. Unknown fields are refused as OpenAI refuses them. Extensions: ``top_k``,
``speculation: {"mode": ...}`` and ``stream_options.include_origin``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from app.server.errors import ApiError, bad_field, unsupported

MAX_STOPS = 4  # OpenAI's limit on stop sequences
# bookkeeping fields that do not change the answer
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier",
                     "prompt_cache_key", "parallel_tool_calls"})
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One checked request; ``None`` fields take the server's defaults."""

    endpoint: str                             # "completions" or "chat"
    model: str
    prompt: str | tuple[int, ...] = ""        # completions: text or token ids
    messages: tuple[tuple[str, str], ...] = ()  # chat: (role, text); roles system/user/assistant
    max_tokens: int | None = None
    # SamplingParams fields the request sets (temperature, top_p, top_k, seed, penalties)
    sampling: tuple[tuple[str, Any], ...] = ()
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False               # stream_options.include_usage
    include_origin: bool = False              # stream_options.include_origin (extension)
    mode: str | None = None                   # speculation.mode (extension)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _type_name(value: Any) -> str:
    return {bool: "a boolean", str: "a string", int: "an integer", float: "a number",
            list: "an array", dict: "an object", type(None): "null"}.get(type(value),
                                                                     type(value).__name__)


def integer(param: str, value: Any, low: int, high: int | None = None) -> int:
    if not _is_int(value):
        raise bad_field(param, f"expected an integer, got {_type_name(value)}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise bad_field(param, f"must be {bound}, got {value}")
    return int(value)


def number(param: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if not _is_number(value):
        raise bad_field(param, f"expected a number, got {_type_name(value)}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise bad_field(param, f"must be in {bracket}{low:g}, {high:g}], got {value}")
    return float(value)


def boolean(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_field(param, f"expected a boolean, got {_type_name(value)}")
    return value


def obj(param: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise bad_field(param, f"expected an object, got {_type_name(value)}")
    return value


def stops(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_field("stop", "expected a string or an array of strings")
    if len(items) > MAX_STOPS:
        raise bad_field("stop", f"at most {MAX_STOPS} stop sequences, got {len(items)}")
    if any(s == "" for s in items):
        raise bad_field("stop", "stop sequences must not be empty")
    return tuple(items)


def prompt(value: Any) -> str | tuple[int, ...]:
    """A completion's prompt: a string or token ids; an array of one of them is the same."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad_field("prompt", "the prompt is empty")
        return value
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(
            isinstance(p, str | list) for p in value):
        raise unsupported("prompt", "one prompt per request (an array of several prompts "
                                    "asks for several completions)")
    raise bad_field("prompt", "expected a non-empty string or an array of token ids")


def message_text(i: int, content: Any) -> str:
    """A message's text: a string, or an array of text parts (other parts are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(f"messages[{i}].content",
                        f"expected a string or an array of parts, got {_type_name(content)}")
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        part = obj(where, part)
        if part.get("type") != "text":
            raise unsupported(f"{where}.type", f"only text parts are supported, not "
                                               f"{part.get('type')!r} (these models read text)")
        if not isinstance(part.get("text"), str):
            raise bad_field(f"{where}.text", "expected a string")
        texts.append(part["text"])
    return "".join(texts)


def messages(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise bad_field("messages", "expected a non-empty array of messages")
    out = []
    for i, m in enumerate(value):
        m = obj(f"messages[{i}]", m)
        role = m.get("role")
        if role in ("tool", "function"):
            raise unsupported(f"messages[{i}].role", "tool and function messages are not "
                                                     "supported (no tool calling)")
        if role not in ROLES:
            raise bad_field(f"messages[{i}].role",
                            f"expected one of {', '.join(ROLES)}, got {role!r}")
        for key in m:
            if key in ("tool_calls", "function_call", "audio"):
                raise unsupported(f"messages[{i}].{key}", "not supported")
            if key not in ("role", "content", "name", "refusal"):
                raise bad_field(f"messages[{i}].{key}", "unrecognized message field")
        if "content" not in m or m["content"] is None:
            raise bad_field(f"messages[{i}].content", "a message needs its content")
        out.append((ROLES[role], message_text(i, m["content"])))
    return tuple(out)


def speculation_mode(value: Any, modes: tuple[str, ...]) -> str:
    spec = obj("speculation", value)
    for key in spec:
        if key != "mode":
            raise bad_field(f"speculation.{key}", "unrecognized field (only 'mode')")
    mode = spec.get("mode")
    if mode not in modes:
        raise bad_field("speculation.mode", f"expected one of {', '.join(modes)}, got {mode!r}")
    return mode


def stream_options(value: Any) -> tuple[bool, bool]:
    """(include_usage, include_origin)."""
    options = obj("stream_options", value)
    usage = origin = False
    for key, v in options.items():
        if key == "include_usage":
            usage = boolean("stream_options.include_usage", v)
        elif key == "include_origin":
            origin = boolean("stream_options.include_origin", v)
        elif key != "include_obfuscation":  # padding against side channels; nothing to pad
            raise bad_field(f"stream_options.{key}", "unrecognized field")
    return usage, origin


def _refuse_if(param: str, value: Any, allowed: Callable[[Any], bool], why: str) -> None:
    if not allowed(value):
        raise unsupported(param, why)


# Fields a request may carry only with their no-op value: anything else would ask for an answer
# this server does not give.
_NO_OP: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "common": {
        "logit_bias": (lambda v: v in ({}, None), "logit biases are not supported"),
        "n": (lambda v: v in (1, None) and not isinstance(v, bool),
              "only n = 1 is supported (one completion per request)"),
    },
    "completions": {
        "logprobs": (lambda v: v is None, "log probabilities are not supported"),
        "echo": (lambda v: v in (False, None), "echo is not supported"),
        "best_of": (lambda v: v in (1, None) and not isinstance(v, bool),
                    "only best_of = 1 is supported"),
        "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not supported"),
    },
    "chat": {
        "logprobs": (lambda v: v in (False, None), "log probabilities are not supported"),
        "top_logprobs": (lambda v: v is None, "log probabilities are not supported"),
        "tools": (lambda v: v in (None, []), "tool calling is not supported"),
        "functions": (lambda v: v in (None, []), "function calling is not supported"),
        "tool_choice": (lambda v: v in (None, "none"), "tool calling is not supported"),
        "function_call": (lambda v: v in (None, "none"), "function calling is not supported"),
        "response_format": (lambda v: v in (None, {"type": "text"}),
                            "only plain text responses are supported"),
        "modalities": (lambda v: v in (None, ["text"]), "only text output is supported"),
        "audio": (lambda v: v is None, "audio output is not supported"),
        "prediction": (lambda v: v is None, "predicted outputs are not supported"),
        "reasoning_effort": (lambda v: v is None, "these models do not reason"),
        "verbosity": (lambda v: v is None, "not supported"),
        "web_search_options": (lambda v: v is None, "web search is not supported"),
    },
}
_SAMPLING = {
    # field: (SamplingParams field, checker)
    "temperature": ("temperature", lambda v: number("temperature", v, 0.0, 2.0)),
    "top_p": ("top_p", lambda v: number("top_p", v, 0.0, 1.0, low_open=True)),
    "top_k": ("top_k", lambda v: integer("top_k", v, 0)),
    "seed": ("seed", lambda v: integer("seed", v, -(2**63), 2**64 - 1) % 2**64),
    "presence_penalty": ("presence_penalty", lambda v: number("presence_penalty", v, -2.0, 2.0)),
    "frequency_penalty": ("frequency_penalty",
                          lambda v: number("frequency_penalty", v, -2.0, 2.0)),
    # extensions, named as llama.cpp's server names them (repetition control, min-p)
    "min_p": ("min_p", lambda v: number("min_p", v, 0.0, 0.99)),
    "repeat_penalty": ("repeat_penalty", lambda v: number("repeat_penalty", v, 0.5, 3.0)),
    "repeat_last_n": ("repeat_last_n", lambda v: integer("repeat_last_n", v, 0, 4096)),
    "dry_multiplier": ("dry_multiplier", lambda v: number("dry_multiplier", v, 0.0, 10.0)),
    "dry_base": ("dry_base", lambda v: number("dry_base", v, 1.0, 4.0)),
    "dry_allowed_length": ("dry_allowed_length",
                           lambda v: integer("dry_allowed_length", v, 1, 32)),
}
_USED = {"common": {"model", "max_tokens", "stop", "stream", "stream_options", "speculation",
                    *_SAMPLING},
         "completions": {"prompt"}, "chat": {"messages", "max_completion_tokens"}}


def parse(body: Any, endpoint: str, modes: tuple[str, ...]) -> GenerationRequest:
    """Check a request body for ``endpoint`` ("completions" or "chat"); ``modes``: the
    speculation modes the served models can run. Raises ``ApiError`` naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {_type_name(body)}")
    no_op = {**_NO_OP["common"], **_NO_OP[endpoint]}
    used = _USED["common"] | _USED[endpoint]
    for key, value in body.items():
        if key in no_op:
            _refuse_if(key, value, *no_op[key])
        elif key not in used and key not in IGNORED:
            raise ApiError(400, f"Unrecognized request argument supplied: {key}", param=key)
    given = {k: v for k, v in body.items() if v is not None}
    model = given.get("model")
    if model is None or model == "":
        raise bad_field("model", "the model to use is required (see GET /v1/models)")
    if not isinstance(model, str):
        raise bad_field("model", f"expected a string, got {_type_name(model)}")
    stream = boolean("stream", given.get("stream", False))
    usage, origin = False, False
    if "stream_options" in given:
        if not stream:
            raise bad_field("stream_options", "only allowed when stream is true")
        usage, origin = stream_options(given["stream_options"])
    limit = given.get("max_completion_tokens", given.get("max_tokens"))
    limit_name = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
    return GenerationRequest(
        endpoint=endpoint, model=model,
        prompt=prompt(body.get("prompt")) if endpoint == "completions" else "",
        messages=messages(body.get("messages")) if endpoint == "chat" else (),
        max_tokens=integer(limit_name, limit, 1) if limit is not None else None,
        sampling=tuple((field, check(given[name])) for name, (field, check) in _SAMPLING.items()
                       if name in given),
        stop=stops(given["stop"]) if "stop" in given else (),
        stream=stream, include_usage=usage, include_origin=origin,
        mode=speculation_mode(given["speculation"], modes) if "speculation" in given else None)
