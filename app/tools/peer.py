"""One benchmark peer (llama-cpp-python's own ``Llama``) in a process of its own.

    python -m app.tools.peer --model T.gguf --prompts '[[464, 318], ...]' -n 64 --threads 2
                             --ctx 1024 [--prompt-lookup 10]

prints one line of JSON: ``{"tokens": N, "seconds": S}``, the tokens generated after each
prompt's first one and the seconds they took, summed over the prompts (``peer_generate``).

Why a process of its own: a peer is someone else's code on llama.cpp, and llama.cpp ends the
whole process on some failures (a crash in a CPU kernel, an assertion) instead of raising. The
benchmark runs each peer here and reports such an end as "peer failed on this host: ..." while
it goes on (``run_peer``).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

TAIL = 6  # lines of a failed peer's stderr quoted in its failure


class PeerFailed(RuntimeError):
    """The peer's process ended without a result; the message says how."""


def command(model: Path, prompts: Sequence[Sequence[int]], n_tokens: int, threads: int,
            n_ctx: int, prompt_lookup: int = 0, flash_attn: bool = True) -> list[str]:
    """The argv that runs one peer on ``prompts`` (token ids) in a child process."""
    return [sys.executable, "-m", "app.tools.peer", "--model", str(model),
            "--prompts", json.dumps([list(p) for p in prompts]), "-n", str(n_tokens),
            "--threads", str(threads), "--ctx", str(n_ctx), "--prompt-lookup", str(prompt_lookup),
            "--flash-attn", "on" if flash_attn else "off"]


def run_peer(argv: Sequence[str], timeout: float = 1800.0) -> dict[str, float]:
    """Run a peer's process; its result, or ``PeerFailed`` saying how it ended."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerFailed(f"no result after {timeout:.0f} s") from None
    if done.returncode == 0:
        try:
            result = json.loads(done.stdout.strip().splitlines()[-1])
            return {"tokens": int(result["tokens"]), "seconds": float(result["seconds"])}
        except (IndexError, KeyError, TypeError, ValueError):
            raise PeerFailed(f"it printed no result: {done.stdout[-200:]!r}") from None
    if done.returncode < 0:
        try:
            how = f"killed by {signal.Signals(-done.returncode).name}"
        except ValueError:
            how = f"killed by signal {-done.returncode}"
    else:
        how = f"exit status {done.returncode}"
    tail = [line for line in done.stderr.splitlines() if line.strip()][-TAIL:]
    raise PeerFailed(how + (": " + " | ".join(tail) if tail else ""))


def main(argv: Sequence[str] | None = None) -> int:
    from speculative.backend import peer_generate

    p = argparse.ArgumentParser(prog="python -m app.tools.peer", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("-n", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--ctx", type=int, required=True)
    p.add_argument("--prompt-lookup", type=int, default=0,
                   help="tokens LlamaPromptLookupDecoding proposes (0: plain decoding)")
    p.add_argument("--flash-attn", choices=["on", "off"], default="on")
    a = p.parse_args(argv)
    tokens, seconds = 0, 0.0
    for prompt in json.loads(a.prompts):
        out, sec = peer_generate(a.model, prompt, a.n, a.threads, a.ctx, a.prompt_lookup,
                                 a.flash_attn == "on")
        tokens, seconds = tokens + max(0, len(out) - 1), seconds + sec
    print(json.dumps({"tokens": tokens, "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
