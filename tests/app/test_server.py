"""``staged-chat serve`` as its users meet it: a real server on a free port of 127.0.0.1 with
the built-in pair, OpenAI's official client, and raw HTTP for what a client library would not
send."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from app.prompting import CODE
from app.tools import load
from speculative.stats import ORIGINS
from speculative.text import find_stop

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key"
ALLOWED_ORIGIN = "http://localhost:3000"
QUEUE = 16
MODEL = "staged-chat-target"
PROMPT = 'def is_even(n: int) -> bool:\n    """Return True if n is even."""\n'
START_S = 120


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``staged-chat ARGS`` from this tree, in its own process."""
    # one thread: the server's tests compare with these runs, and llama.cpp's spinning barriers
    # stall when the cores are shared with other work
    return subprocess.run([sys.executable, "-m", "app.tools.cli", *args, "--threads", "1"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
                          check=True)


@contextlib.contextmanager
def running_server(*extra: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``staged-chat serve --port 0 ...``: the address it printed, and its process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.tools.cli", "serve", "--port", "0", "--threads", "1",
         *extra], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        try:
            line = lines.get(timeout=START_S)
        except queue.Empty:
            pytest.fail("the server printed nothing")
        assert line.startswith("Serving "), line + proc.stderr.read()
        address = line.split(" at ", 1)[1].split("/v1", 1)[0]
        yield address, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_server("--api-key", KEY, "--queue", str(QUEUE), "--allow-origin",
                        ALLOWED_ORIGIN, "-n", "24") as (address, proc):
        yield address
        assert proc.poll() is None, "the server died"


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def raw(server: str, method: str, path: str, body: bytes | Any = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """One request with ``http.client``: status, headers (lower-case names), the body (parsed
    when JSON)."""
    host, port = server.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        sent = {"Authorization": f"Bearer {KEY}", **(headers or {})}
        data = json.dumps(body).encode() if isinstance(body, dict | list) else body
        conn.request(method, path, body=data, headers=sent)
        resp = conn.getresponse()
        payload = resp.read()
        got = {k.lower(): v for k, v in resp.getheaders()}
        is_json = got.get("content-type", "").startswith("application/json")
        return resp.status, got, json.loads(payload) if is_json else payload.decode()
    finally:
        conn.close()


def complete(client: openai.OpenAI, prompt: str, **kwargs: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=prompt, **{"temperature": 0, **kwargs})


def health(server: str) -> dict[str, Any]:
    return raw(server, "GET", "/health")[2]


def check_speculation(spec: dict[str, Any], completion_tokens: int, mode: str) -> None:
    """The speculation object is there and adds up."""
    assert spec["mode"] == mode
    assert spec["tokens"] == completion_tokens
    assert sum(spec["origins"][o] for o in ORIGINS) == completion_tokens
    assert spec["target_passes"] >= 1
    assert spec["tau"] == pytest.approx(completion_tokens / spec["target_passes"])
    assert all(0.0 <= a <= 1.0 for a in spec["depth_acceptance"])
    assert set(spec["time"]) == {"prefill", "draft", "stage2", "verify", "other"}
    assert spec["tokens_per_second"] > 0
    assert spec["estimated_speedup"] is None or spec["estimated_speedup"] > 0


# ---------------------------------------------------------------- answers equal generate's


MODES = ("plain", "staged", "auto")


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    """What ``staged-chat generate`` writes for PROMPT in each mode (24 tokens, greedy)."""
    out = cli("generate", "--json", "--mode", ",".join(MODES), "-n", "24", "--prompt", PROMPT)
    return {r["mode"]: r["text"] for r in json.loads(out.stdout)["runs"]}


@pytest.mark.parametrize("mode", MODES)
def test_completion_equals_generate(client: openai.OpenAI, generated: dict[str, str],
                                    mode: str) -> None:
    done = complete(client, PROMPT, max_tokens=24, extra_body={"speculation": {"mode": mode}})
    choice = done.choices[0]
    assert choice.text == generated[mode]
    assert choice.finish_reason in ("length", "stop")
    assert done.usage.prompt_tokens > 0
    check_speculation(done.model_extra["speculation"], done.usage.completion_tokens, mode)


def test_streamed_completion_equals_generate(client: openai.OpenAI,
                                             generated: dict[str, str]) -> None:
    chunks = list(complete(client, PROMPT, max_tokens=24, stream=True,
                           stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == generated["auto"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens > 0
    check_speculation(last.model_extra["speculation"], last.usage.completion_tokens, "auto")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_chat_completion_equals_generate_cut_at_the_formats_stops(
        client: openai.OpenAI, generated: dict[str, str]) -> None:
    """The built-in pair chats in the code format: the conversation is the file, and the reply
    ends where a new top-level statement would begin."""
    cut = find_stop(generated["staged"], CODE.stops)
    expected = generated["staged"][:cut] if cut is not None else generated["staged"]
    messages = [{"role": "user", "content": PROMPT}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                          temperature=0,
                                          extra_body={"speculation": {"mode": "staged"}})
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected
    check_speculation(done.model_extra["speculation"], done.usage.completion_tokens, "staged")
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_origin": True},
        extra_body={"speculation": {"mode": "staged"}})
    chunks = list(stream)
    content = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(c.delta.content for c in content) == expected
    assert all(c.model_extra["origin"] in ORIGINS for c in content)
    assert chunks[0].choices[0].delta.role == "assistant"
    # usage counts the tokens decoded, those past the stop string in the last step included:
    # how many that is follows the step's tree, which the cost model sizes by timings, so the
    # two runs' counts may differ; each adds up with its own speculation object
    check_speculation(chunks[-1].model_extra["speculation"], chunks[-1].usage.completion_tokens,
                      "staged")


def test_stop_strings_and_sampling_fields_are_honoured(client: openai.OpenAI,
                                                       generated: dict[str, str]) -> None:
    text = generated["plain"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    done = complete(client, PROMPT, max_tokens=24, stop=[stop])
    assert done.choices[0].text == text[:text.find(stop)]
    assert done.choices[0].finish_reason == "stop"
    kwargs = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 7,
              "extra_body": {"top_k": 20}}
    a, b = complete(client, PROMPT, **kwargs), complete(client, PROMPT, **kwargs)
    # a fixed seed and fixed trees (plain has none) draw the same text
    kwargs["extra_body"]["speculation"] = {"mode": "plain"}
    c, d = complete(client, PROMPT, **kwargs), complete(client, PROMPT, **kwargs)
    assert c.choices[0].text == d.choices[0].text
    assert a.usage.completion_tokens <= 16 and b.usage.completion_tokens <= 16


def test_models_and_health(client: openai.OpenAI, server: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, _, body = raw(server, "GET", "/health", headers={"Authorization": ""})
    assert status == 200 and body["status"] == "ok" and body["model"] == MODEL
    assert body["queue"]["limit"] == QUEUE


# ---------------------------------------------------------------- disconnects


def test_a_client_that_leaves_mid_stream_frees_the_engine(client: openai.OpenAI,
                                                          server: str) -> None:
    before = health(server)
    alone = complete(client, PROMPT, max_tokens=16).choices[0].text
    stream = complete(client, PROMPT, max_tokens=1000, stream=True,
                      extra_body={"speculation": {"mode": "plain"}})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received >= 2:
            break
    stream.close()  # the connection goes
    deadline = time.monotonic() + 30
    while (h := health(server))["cancelled"] == before["cancelled"] or h["queue"]["in_flight"]:
        assert time.monotonic() < deadline, f"the job went on: {h}"
        time.sleep(0.05)
    assert h["answered"] == before["answered"] + 1  # the one alone; not the abandoned one
    t0 = time.monotonic()
    again = complete(client, PROMPT, max_tokens=16)
    # answered at once, not after the abandoned 1000 tokens; the caches are intact
    assert again.choices[0].text == alone
    assert time.monotonic() - t0 < 30


# ---------------------------------------------------------------- many clients


def _concurrently(calls: list[Any]) -> list[Any]:
    """Run the calls at once, each on its own thread; their results (or exceptions)."""
    results: list[Any] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except Exception as exc:  # kept: the test looks at every outcome
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return results


def test_sixteen_clients_at_once_get_their_answers_alone(client: openai.OpenAI) -> None:
    assert len(load.PROMPTS) == QUEUE == 16
    alone = [complete(client, p, max_tokens=12).choices[0].text for p in load.PROMPTS]
    together = _concurrently([lambda p=p: complete(client, p, max_tokens=12)
                              for p in load.PROMPTS])
    assert all(not isinstance(r, Exception) for r in together), together
    assert [r.choices[0].text for r in together] == alone
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in together)


def test_over_the_queue_limit_requests_get_503_not_a_hang(client: openai.OpenAI,
                                                          server: str) -> None:
    # one long request holds the engine while the others arrive
    hold = complete(client, PROMPT, max_tokens=600, stream=True,
                    extra_body={"speculation": {"mode": "plain"}})
    next(iter(hold))
    try:
        results = _concurrently([lambda p=p: complete(client, p, max_tokens=4)
                                 for p in load.PROMPTS + load.PROMPTS[:4]])
    finally:
        hold.close()
    busy = [r for r in results if isinstance(r, openai.APIStatusError)]
    answered = [r for r in results if not isinstance(r, Exception)]
    assert len(busy) + len(answered) == len(results), results
    assert len(answered) >= 1 and len(busy) >= len(results) - (QUEUE - 1)
    for r in busy:
        assert r.status_code == 503
        assert int(r.response.headers["retry-after"]) >= 1
        assert "busy" in r.message
    assert complete(client, PROMPT, max_tokens=4).choices[0].text


# ---------------------------------------------------------------- bad input


def _refused(client: openai.OpenAI, status: int, fragment: str, prompt: str = PROMPT,
             **kwargs: Any) -> dict:
    with pytest.raises(openai.APIStatusError) as info:
        complete(client, prompt, **kwargs)
    assert info.value.status_code == status
    assert fragment in info.value.message
    return info.value.body  # the "error" object


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"n": 2}, "n"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"extra_body": {"temperature": "hot"}}, "temperature"),
    ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"extra_body": {"speculation": {"mode": "fastest"}}}, "speculation.mode"),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
])
def test_unsupported_or_wrongly_typed_fields_are_named(client: openai.OpenAI,
                                                       kwargs: dict, param: str) -> None:
    error = _refused(client, 400, param, **{"max_tokens": 4, **kwargs})
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_chat_refuses_tools_and_images(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, max_tokens=4, tools=[{"type": "function", "function": {"name": "f"}}],
            messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{
            "role": "user", "content": [{"type": "image_url",
                                         "image_url": {"url": "data:image/png;base64,AA=="}}]}])
    assert info.value.body["param"] == "messages[0].content[0].type"


def test_unknown_model_and_wrong_key(client: openai.OpenAI, server: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and "gpt-4" in info.value.message
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    status, _, body = raw(server, "GET", "/v1/models", headers={"Authorization": ""})
    assert status == 401 and "API key" in body["error"]["message"]


def test_a_prompt_longer_than_the_window(client: openai.OpenAI) -> None:
    error = _refused(client, 400, "context window is 1024 tokens", max_tokens=4,
                     prompt="word " * 1500)
    assert error["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": "word " * 1500}])


def test_malformed_json_and_oversized_bodies(server: str) -> None:
    status, _, body = raw(server, "POST", "/v1/completions", b'{"model": "x", "prompt": ')
    assert status == 400 and "could not parse the JSON" in body["error"]["message"]
    status, _, body = raw(server, "POST", "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    big = json.dumps({"model": MODEL, "prompt": "x" * (1 << 20)}).encode()
    status, _, body = raw(server, "POST", "/v1/completions", big)
    assert status == 413 and "over 1048576 bytes" in body["error"]["message"]
    # the same without a length: chunked, counted as it arrives
    status, _, body = raw(server, "POST", "/v1/completions",
                          iter([big[i:i + 65536] for i in range(0, len(big), 65536)]))
    assert status == 413


def test_a_foreign_host_header_is_refused(server: str) -> None:
    """DNS rebinding: a page on attacker.example, whose name now resolves to 127.0.0.1."""
    status, _, body = raw(server, "POST", "/v1/completions",
                          {"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                          headers={"Host": "attacker.example:8080"})
    assert status == 403 and "attacker.example" in body["error"]["message"]
    port = server.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]"):
        assert raw(server, "GET", "/v1/models", headers={"Host": host})[0] == 200


def test_web_pages_get_no_cors_unless_their_origin_is_allowed(server: str) -> None:
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    status, headers, body = raw(server, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 403 and "access-control-allow-origin" not in headers
    assert "evil.example" in body["error"]["message"]
    # a simple cross-origin POST (no preflight) is refused too: it would run the engine
    status, headers, _ = raw(server, "POST", "/v1/completions",
                             {"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                             headers={"Origin": "http://evil.example"})
    assert status == 403 and "access-control-allow-origin" not in headers
    status, headers, _ = raw(server, "OPTIONS", "/v1/chat/completions",
                             headers={**preflight, "Origin": ALLOWED_ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    status, headers, _ = raw(server, "GET", "/v1/models", headers={"Origin": ALLOWED_ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    status, headers, _ = raw(server, "GET", "/v1/models")
    assert status == 200 and "access-control-allow-origin" not in headers


def test_the_server_keeps_serving_after_refusals(client: openai.OpenAI, server: str) -> None:
    raw(server, "POST", "/v1/completions", b"{")
    raw(server, "POST", "/v1/completions", {"model": MODEL}, headers={"Host": "evil.example"})
    assert complete(client, PROMPT, max_tokens=4).choices[0].text
    assert health(server)["status"] == "ok"


# ---------------------------------------------------------------- the defaults


def test_it_binds_loopback_by_default_and_says_so(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "app.tools.cli", "serve", "--help"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, check=True)
    assert "default 127.0.0.1" in proc.stdout
    with running_server("--target", str(ROOT / "models" / "builtin" / "target-q8_0.gguf"),
                        "--mode", "ngram") as (address, _proc):
        assert address.startswith("http://127.0.0.1:")
        plain_client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
        done = plain_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert done.model_extra["speculation"]["mode"] == "ngram"
        with pytest.raises(openai.BadRequestError) as info:  # no draft model: no tree mode
            plain_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                            extra_body={"speculation": {"mode": "tree"}})
        assert info.value.body["param"] == "speculation.mode"


def test_ctrl_c_ends_open_streams_and_the_server() -> None:
    with running_server("-n", "1000") as (address, proc):
        client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
        stream = complete(client, PROMPT, stream=True,
                          extra_body={"speculation": {"mode": "plain"}})
        next(iter(stream))
        proc.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="server is stopping"):
            for _ in stream:
                pass
        assert proc.wait(30) == 0


def test_the_load_command_reports(capsys) -> None:
    """``python -m app.tools.load``, as small as it goes (its figures are a report, not a
    test)."""
    assert load.main(["--clients", "1,2", "--requests", "2", "--repeats", "1",
                      "--max-tokens", "8", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "text identical to generate's" in out and "the server adds" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [("1", "2", "0"), ("2", "2", "0")]

