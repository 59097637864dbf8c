"""The server's parts without a server: request checks, the Host rule, prompts from chat
messages, chunk shapes and the queue's counts."""

from __future__ import annotations

import pytest

from app.prompting import CODE, TRANSCRIPT
from app.server.admission import Admission
from app.server.errors import ApiError
from app.server.http import Security, host_name
from app.server.jobs import Finished, chat_text
from app.server.requests import parse
from app.server.responses import Answer, speculation
from speculative.stats import RunStats, StepStats

MODES = ("plain", "auto")


def _refusal(body: object, endpoint: str = "completions") -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, endpoint, MODES)
    assert info.value.status == 400
    return info.value


def test_a_request_takes_what_it_sets_and_leaves_the_rest_to_the_server() -> None:
    r = parse({"model": "m", "prompt": "x", "temperature": 0.5, "top_k": 3, "seed": -1,
               "stop": "\n", "user": "someone", "stream": True,
               "stream_options": {"include_usage": True, "include_origin": True},
               "speculation": {"mode": "plain"}}, "completions", MODES)
    assert dict(r.sampling) == {"temperature": 0.5, "top_k": 3, "seed": 2**64 - 1}
    assert (r.stop, r.stream, r.include_usage, r.include_origin, r.mode) == (
        ("\n",), True, True, True, "plain")
    assert r.max_tokens is None  # the server's default
    chat = parse({"model": "m", "messages": [{"role": "developer", "content": "Be brief."},
                                             {"role": "user", "content": [
                                                 {"type": "text", "text": "a"},
                                                 {"type": "text", "text": "b"}]}],
                  "max_completion_tokens": 5, "n": 1, "logprobs": False, "tools": []},
                 "chat", MODES)
    assert chat.messages == (("system", "Be brief."), ("user", "ab"))
    assert chat.max_tokens == 5
    assert parse({"model": "m", "prompt": [[1, 2, 3]]}, "completions", MODES).prompt == (1, 2, 3)
    penalties = parse({"model": "m", "prompt": "x", "presence_penalty": 0.5, "min_p": 0.1,
                       "repeat_penalty": 1.1, "dry_multiplier": 0.8, "dry_allowed_length": 3},
                      "completions", MODES)
    assert dict(penalties.sampling) == {"presence_penalty": 0.5, "min_p": 0.1,
                                        "repeat_penalty": 1.1, "dry_multiplier": 0.8,
                                        "dry_allowed_length": 3}


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x"}, "model"),
    ({"model": 4, "prompt": "x"}, "model"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stop": 5}, "stop"),
    ({"model": "m", "prompt": "x", "seed": 1.5}, "seed"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "n": 3}, "n"),
    ({"model": "m", "prompt": "x", "repeat_penalty": 0}, "repeat_penalty"),
    ({"model": "m", "prompt": "x", "dry_allowed_length": 0.5}, "dry_allowed_length"),
    ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
    ({"model": "m", "prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "suffix": "end"}, "suffix"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ({"model": "m", "prompt": "x", "speculation": {"mode": "oracle"}}, "speculation.mode"),
    ({"model": "m", "prompt": "x", "speculation": {"mode": "plain", "depth": 3}},
     "speculation.depth"),
])
def test_completions_refusals_name_the_field(body: dict, param: str) -> None:
    assert _refusal(body).param == param


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ([{"role": "tool", "content": "x", "tool_call_id": "1"}], "messages[0].role"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "assistant", "content": None, "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
])
def test_chat_refusals_name_the_field(messages: list, param: str) -> None:
    assert _refusal({"model": "m", "messages": messages}, "chat").param == param


@pytest.mark.parametrize("field", ["tools", "tool_choice", "response_format", "top_logprobs",
                                   "audio", "functions"])
def test_chat_features_it_lacks_are_refused_not_ignored(field: str) -> None:
    value = {"tools": [{"type": "function"}], "tool_choice": "auto",
             "response_format": {"type": "json_object"}, "top_logprobs": 2,
             "audio": {"voice": "x"}, "functions": [{"name": "f"}]}[field]
    error = _refusal({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      field: value}, "chat")
    assert error.param == field and error.code == "unsupported_parameter"


def test_the_body_must_be_an_object() -> None:
    assert "JSON object" in _refusal([1]).message


@pytest.mark.parametrize(("header", "bound", "allowed"), [
    ("127.0.0.1:8080", "127.0.0.1", True),
    ("localhost:8080", "127.0.0.1", True),
    ("LOCALHOST.", "127.0.0.1", True),
    ("app.localhost", "127.0.0.1", True),
    ("[::1]:8080", "127.0.0.1", True),
    ("", "127.0.0.1", True),
    ("attacker.example:8080", "127.0.0.1", False),
    ("127.0.0.1.attacker.example", "127.0.0.1", False),
    ("192.168.1.5:8080", "127.0.0.1", False),   # not where it listens
    ("192.168.1.5:8080", "0.0.0.0", True),      # listening everywhere: any address
    ("attacker.example", "0.0.0.0", False),     # ... but still no foreign name
    ("box.lan:8080", "box.lan", True),          # the name it was told to listen on
])
def test_the_host_header_must_name_this_server(header: str, bound: str, allowed: bool) -> None:
    assert Security(bound_host=bound).host_allowed(header) is allowed


def test_host_names() -> None:
    assert host_name("[::1]:80") == "::1"
    assert host_name("Example.COM:80") == "example.com"
    assert host_name("::1") == "::1"


def test_system_messages_replace_the_header() -> None:
    messages = [("system", "You answer in French."), ("user", "Hi"), ("assistant", "Salut"),
                ("user", "Bye")]
    assert chat_text(TRANSCRIPT, messages) == (
        "You answer in French.\n\nUser: Hi\nAssistant:Salut\nUser: Bye\nAssistant:")
    assert chat_text(TRANSCRIPT, messages[1:2]).startswith(TRANSCRIPT.header + "User: Hi\n")
    assert chat_text(CODE, [("system", "# utils.py\n"), ("user", "def f():\n")]) == (
        "# utils.py\ndef f():\n")


def _run(origins: dict[str, int]) -> RunStats:
    run = RunStats(mode="staged")
    n = sum(origins.values())
    run.add(StepStats(drafted=4, accepted=n - 1, offered=n - 1, emitted=n, origins=origins,
                      draft_calls=1, stage2_proposed=0, stage2_used=0, t_draft=0.001,
                      t_stage2=0.0, t_verify=0.002, t_other=0.0, batch=5, t_plain=0.004))
    return run


def test_streamed_chunks_say_where_their_tokens_came_from() -> None:
    answer = Answer("chat", "m")
    chunks = answer.pieces([("a", "draft"), ("b", "draft"), ("c", "ngram"), ("", "target"),
                            ("d", "target")], with_origin=True)
    assert [(c["choices"][0]["delta"]["content"], c["choices"][0]["origin"]) for c in chunks] \
        == [("ab", "draft"), ("c", "ngram"), ("d", "target")]
    assert [c["choices"][0]["delta"]["content"]
            for c in answer.pieces([("a", "draft"), ("b", "target")], with_origin=False)] == ["ab"]
    assert answer.pieces([("", "target")], with_origin=False) == []
    done = Finished("abcd", "context", _run({"draft": 2, "ngram": 1, "target": 1}), 7)
    closing = answer.closing(done, include_usage=True)
    assert closing[0]["choices"][0]["finish_reason"] == "length"  # the window's end
    assert "speculation" not in closing[0] and closing[-1]["choices"] == []
    assert closing[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 4,
                                    "total_tokens": 11}
    assert closing[-1]["speculation"]["origins"] == {"draft": 2, "ngram": 1, "target": 1}
    assert speculation(done.run)["estimated_speedup"] == pytest.approx(0.004 / 0.003)
    assert speculation(RunStats())["estimated_speedup"] is None


def test_the_queue_admits_up_to_its_limit_and_counts() -> None:
    seen = []
    queue = Admission(2, on_change=seen.append)
    assert queue.enter() is None and queue.enter() is None
    assert queue.enter() == 2  # full: retry after the two ahead, a second each at first
    queue.leave("answered", seconds=1.0)
    assert queue.enter() is None
    queue.leave("cancelled")
    queue.leave("failed")
    c = queue.counts
    assert (c.in_flight, c.answered, c.cancelled, c.failed, c.refused) == (0, 1, 1, 1, 1)
    assert seen[-1] == c
    with pytest.raises(ValueError):
        Admission(0)
