"""``python -m app.tools.load``: the local server under load, and what it adds to one request.

Starts ``staged-chat serve`` (the built-in pair unless told otherwise) on a free port, then:

- one request at a time, non-streamed, against ``staged-chat generate``'s loop
  (``cli.run_generation``) on the same prompt, mode, length and threads, run in this process
  on a warm engine as the server's is: what the server adds (HTTP, JSON, the handoffs between
  threads) is its latency outside the engine's time less generate's wall time outside it;
  and the ``staged-chat generate`` command itself, which loads the models for every prompt;
- 1, 4 and 16 clients at once, each sending streamed requests with its own prompt: tokens/s
  over the whole run, request latency (median, 90th percentile, worst) and time to the first
  token, and how many were turned away (503).

A report, not a test: figures on a shared machine are noisy. Plain HTTP from the standard
library, so it needs nothing beyond the server itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import math
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from app.tools import cli
from speculative.loading import open_pair

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [f"def {name}(items):\n    \"\"\"{doc}\"\"\"\n" for name, doc in [
    ("total", "Return the sum of items."), ("largest", "Return the largest item."),
    ("smallest", "Return the smallest item."), ("reverse", "Return items reversed."),
    ("unique", "Return the unique items in order."), ("count", "Count the items."),
    ("first", "Return the first item or None."), ("last", "Return the last item or None."),
    ("evens", "Return the even items."), ("odds", "Return the odd items."),
    ("squares", "Return the squares of items."), ("flatten", "Flatten a list of lists."),
    ("pairs", "Return adjacent pairs of items."), ("average", "Return the mean of items."),
    ("sort_items", "Return items sorted."), ("as_text", "Join items into a string.")]]


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """One request as its client saw it."""

    status: int
    latency: float       # seconds from sending to the last byte
    first_token: float   # seconds to the first text (streamed), else the latency
    tokens: int          # completion tokens (usage)
    engine: float        # seconds the server's engine spent (prefill and generation)
    text: str = ""


def host() -> str:
    """The CPU's model name and the cores this process may use."""
    name = platform.processor() or "unknown CPU"
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    name = next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("model name")), name)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def start_server(options: Sequence[str]) -> tuple[subprocess.Popen[str], str]:
    """``staged-chat serve --port 0 OPTIONS`` in its own process, and its address."""
    proc = subprocess.Popen([sys.executable, "-m", "app.tools.cli", "serve", "--port", "0",
                             *options], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline() if proc.stdout else ""),
                     daemon=True).start()
    line = lines.get(timeout=300)
    if not line.startswith("Serving "):
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split(" at ", 1)[1].split("/v1", 1)[0]


def request(address: str, body: dict[str, Any]) -> Outcome:
    """One completion request, streamed or not, timed by the client."""
    hostname, port = address.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(hostname, int(port), timeout=600)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            return Outcome(resp.status, time.perf_counter() - t0, 0.0, 0, 0.0)
        if not body.get("stream"):
            done = json.loads(resp.read())
            latency = time.perf_counter() - t0
            return Outcome(200, latency, latency, done["usage"]["completion_tokens"],
                           engine_seconds(done["speculation"]), done["choices"][0]["text"])
        return _streamed(resp, t0)
    finally:
        conn.close()


def _streamed(resp: http.client.HTTPResponse, t0: float) -> Outcome:
    first, text, last = None, [], {}
    for data in events(resp):
        if data.get("choices") and data["choices"][0].get("text"):
            first = first if first is not None else time.perf_counter() - t0
            text.append(data["choices"][0]["text"])
        last = data
    latency = time.perf_counter() - t0
    return Outcome(200, latency, first if first is not None else latency,
                   last["usage"]["completion_tokens"], engine_seconds(last["speculation"]),
                   "".join(text))


def events(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON of each server-sent event, until ``[DONE]``."""
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[6:])


def get_json(address: str, path: str) -> Any:
    hostname, port = address.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(hostname, int(port), timeout=60)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def engine_seconds(speculation: dict[str, Any]) -> float:
    return speculation["time"]["prefill"] + speculation["seconds"]


def command_wall(prompt: str, options: Sequence[str]) -> float:
    """Seconds the ``staged-chat generate`` command takes on ``prompt``, from starting Python
    to its answer (loading the models and measuring their costs included)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "app.tools.cli", "generate", "--json", "--prompt",
                    prompt, *options], cwd=ROOT, env=_env(), capture_output=True, check=True,
                   timeout=600)
    return time.perf_counter() - t0


def generate_loop(prompt: str, options: Sequence[str], repeats: int) -> list[dict[str, Any]]:
    """``staged-chat generate``'s loop on ``prompt``, ``repeats`` times on one warm engine
    (after one untimed run), in this process: each run's result with its ``wall`` seconds."""
    args = cli.build_parser().parse_args(["generate", *options])
    target, draft, ngram = cli.resolve_models(args, args.mode)
    spec, config = cli.engine_settings(args)
    with open_pair(target, draft, config, ngram=ngram, ngram_optional=True) as pair:
        engine = pair.engine(dataclasses.replace(spec, mode=args.mode[0]))
        tokens = pair.target.vocab.tokenize(prompt)
        runs = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            run = cli.run_generation(engine, pair.target.vocab, tokens, args.max_tokens,
                                     cli.generation_params(args), None)
            runs.append({**run, "wall": time.perf_counter() - t0})
    return runs[1:]


def one_request(address: str, body: dict[str, Any], gen_options: Sequence[str],
                repeats: int) -> dict[str, Any]:
    """Median figures of one request at a time through the server and through generate's
    loop; the generate command once."""
    served = [request(address, body) for _ in range(repeats)]
    runs = generate_loop(body["prompt"], gen_options, repeats)
    return {
        "tokens": served[0].tokens,
        "same_text": all(s.text == r["text"] for s, r in zip(served, runs, strict=True)),
        "server_latency": statistics.median(s.latency for s in served),
        "server_engine": statistics.median(s.engine for s in served),
        "generate_wall": statistics.median(r["wall"] for r in runs),
        "generate_engine": statistics.median(r["stats"]["time"]["prefill"]
                                             + r["stats"]["seconds"] for r in runs),
        # each side's time outside the engine's steps and prefill: the engines themselves,
        # one per process, may learn and run at different speeds (auto)
        "server_adds": (statistics.median(s.latency - s.engine for s in served)
                        - statistics.median(r["wall"] - r["stats"]["time"]["prefill"]
                                            - r["stats"]["seconds"] for r in runs)),
        "command_wall": command_wall(body["prompt"], gen_options),
    }


def concurrent(address: str, clients: int, per_client: int, body: dict[str, Any]
               ) -> dict[str, Any]:
    """``clients`` threads, each sending ``per_client`` streamed requests one after another,
    each client with its own prompts."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def client(i: int) -> None:
        barrier.wait()
        for k in range(per_client):
            prompt = PROMPTS[(i * per_client + k) % len(PROMPTS)]
            got = request(address, {**body, "prompt": prompt, "stream": True,
                                    "stream_options": {"include_usage": True}})
            with lock:
                outcomes.append(got)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [o for o in outcomes if o.status == 200]
    latencies = sorted(o.latency for o in ok)
    tokens = sum(o.tokens for o in ok)
    return {
        "clients": clients, "requests": len(outcomes), "answered": len(ok),
        "refused": sum(o.status == 503 for o in outcomes), "tokens": tokens,
        "wall_seconds": wall, "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "latency_p50": statistics.median(latencies) if latencies else 0.0,
        "latency_p90": latencies[min(len(latencies) - 1, math.ceil(0.9 * len(latencies)) - 1)]
        if latencies else 0.0,
        "latency_max": latencies[-1] if latencies else 0.0,
        "first_token_p50": statistics.median(o.first_token for o in ok) if ok else 0.0,
    }


def report(result: dict[str, Any]) -> str:
    one, s = result["one"], result["settings"]
    lines = [
        f"Local server load: {s['model']}, mode {s['mode']}, {s['max_tokens']} tokens per "
        f"request, greedy, {s['threads']} llama.cpp threads",
        f"host: {result['host']} (shared: figures are noisy)",
        "",
        f"one request at a time (median of {s['repeats']}, {one['tokens']} tokens, "
        f"text {'identical' if one['same_text'] else 'DIFFERENT'} to generate's):",
        f"  generate's loop, warm engine: {one['generate_wall'] * 1000:.1f} ms "
        f"(engine steps and prefill {one['generate_engine'] * 1000:.1f} ms)",
        f"  server, non-streamed: latency {one['server_latency'] * 1000:.1f} ms (engine "
        f"{one['server_engine'] * 1000:.1f} ms)",
        f"  the server adds {one['server_adds'] * 1000:+.1f} ms (its time outside the engine "
        f"less generate's: HTTP, JSON, handing the request to the engine's thread and the "
        f"answer back)",
        f"  the staged-chat generate command: {one['command_wall']:.1f} s (starting Python, "
        f"loading the models: what a running server saves each request)",
        "",
        f"{'clients':>7}{'requests':>9}{'503':>5}{'tokens':>8}{'wall s':>8}{'tokens/s':>10}"
        f"{'latency p50':>12}{'p90':>7}{'max':>7}{'first token p50':>16}",
    ]
    for r in result["levels"]:
        lines.append(
            f"{r['clients']:>7}{r['requests']:>9}{r['refused']:>5}{r['tokens']:>8}"
            f"{r['wall_seconds']:>8.2f}{r['tokens_per_second']:>10.1f}"
            f"{r['latency_p50']:>11.2f}s{r['latency_p90']:>6.2f}s{r['latency_max']:>6.2f}s"
            f"{r['first_token_p50']:>15.2f}s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.tools.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,4,16", help="concurrency levels")
    parser.add_argument("--requests", type=int, default=16,
                        help="requests per level at least (spread over its clients)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mode", default="auto", help="speculation mode")
    parser.add_argument("--threads", type=int, default=0, help="llama.cpp threads (0: all)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="single requests timed against generate")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.clients.split(",")]
    model_options = ["--threads", str(args.threads), "--mode", args.mode]
    server, address = start_server([*model_options, "--queue", str(max(32, *levels))])
    try:
        body = {"model": "", "prompt": PROMPTS[0], "max_tokens": args.max_tokens,
                "temperature": 0}
        body["model"] = get_json(address, "/v1/models")["data"][0]["id"]
        request(address, body)  # warm-up
        one = one_request(address, body, [*model_options, "-n", str(args.max_tokens)],
                          args.repeats)
        results = [concurrent(address, c, math.ceil(args.requests / c), body) for c in levels]
    finally:
        server.terminate()
        server.communicate(timeout=60)  # its last words, and the pipe closed
    result = {"host": host(), "one": one, "levels": results,
              "settings": {"model": body["model"], "mode": args.mode,
                           "max_tokens": args.max_tokens, "threads": args.threads or "all",
                           "repeats": args.repeats}}
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
