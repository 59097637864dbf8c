"""Run by ``test_model_files.py`` in a subprocess, so that a llama.cpp abort fails that test
instead of killing pytest: ``python -m tests.speculative.model_file_worker SPEC.json``.

It loads a good model (the "live" one) and decodes a probe, then tries each case of the spec
(loading a bad file, a bad pair, a too large context, or changing the live model's file on disk)
and prints one JSON line per case: the exception raised (type, its bases, message) or None, and
whether the live model still decodes the probe to the same logits."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from speculative.backend import ContextConfig, LlamaContext, LlamaModel
from speculative.loading import open_pair

PROBE = [464, 2068, 7586, 21831]  # "The quick brown fox"


def _config(**kw: Any) -> ContextConfig:
    return ContextConfig(**{"n_ctx": 64, "n_batch": 16, "n_seq_max": 4, "n_threads": 1, **kw})


def _probe(ctx: LlamaContext) -> np.ndarray:
    ctx.clear()
    n = len(PROBE)
    return ctx.decode(PROBE, list(range(n)), [[0]] * n, [False] * (n - 1) + [True])[-1]


def _attempt(case: dict[str, Any], live: Path) -> None:
    op = case["op"]
    if op == "model":
        LlamaModel(case["path"]).close()
    elif op == "context":
        with LlamaModel(case["path"]) as model:
            LlamaContext(model, _config(**case.get("config", {}))).close()
    elif op == "pair":
        open_pair(case["target"], case.get("draft"), _config(**case.get("config", {}))).close()
    elif op == "overwrite-live":  # rewritten in place, as `cp other live` does
        with open(live, "r+b") as fh:
            fh.truncate(0)
            fh.write(b"#!/bin/sh\necho this is not a model\n")
        LlamaModel(live).close()
    elif op == "replace-live":  # another file renamed over it, as a finished download does
        os.replace(case["path"], live)
        LlamaModel(live).close()
    elif op == "remove-live":
        live.unlink()
        LlamaModel(live).close()
    else:
        raise ValueError(f"unknown op {op!r}")


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    live = Path(spec["live"])
    with LlamaModel(live) as model, LlamaContext(model, _config()) as ctx:
        before = _probe(ctx)
        for case in spec["cases"]:
            error = None
            try:
                _attempt(case, live)
            except Exception as exc:  # what the test checks: which exception, and its message
                error = {"type": type(exc).__name__, "message": str(exc),
                         "bases": [c.__name__ for c in type(exc).__mro__]}
            usable = bool(np.array_equal(_probe(ctx), before))
            print(json.dumps({"name": case["name"], "error": error, "usable": usable}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
