"""``staged-chat serve``: the models behind a local OpenAI-compatible HTTP API (``app.server``).

The same model, speculation, sampling, context and thread options as ``generate``; the options
set the defaults of requests that do not say. One engine thread decodes the requests in
arrival order.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import time
from typing import TextIO

from app.prompting import FORMATS, format_for
from app.server.admission import Admission
from app.server.engine_thread import EngineThread
from app.server.http import Api, Security
from app.server.jobs import Defaults, ModelCard
from app.server.running import bind, is_loopback, serve_forever, url
from app.tools.cli import engine_settings, resolve_models, sampling_params
from speculative.loading import ModelPair, open_pair
from speculative.policies import Mode, SpecConfig

log = logging.getLogger(__name__)


def card_for(pair: ModelPair, spec: SpecConfig, defaults: Defaults, chat_format: str
             ) -> ModelCard:
    """What the server offers on ``pair``: the modes it can run (those needing a draft only
    with one)."""
    modes = tuple(m.value for m in Mode.selectable()
                  if pair.draft is not None or not m.needs_draft)
    return ModelCard(name=pair.target.name, n_ctx=pair.target_ctx.n_ctx, modes=modes,
                     chat_format=chat_format, defaults=dataclasses.replace(defaults, spec=spec),
                     created=int(time.time()))


def serve(args: argparse.Namespace, out: TextIO) -> int:
    mode = Mode(args.mode)
    target, draft, ngram = resolve_models(args, [mode])
    spec, config = engine_settings(args)
    spec = dataclasses.replace(spec, mode=mode)
    chat_format = args.chat_format or format_for(args.target is None).name
    # unset sampler options: the chat format's defaults, as in the app and generate
    defaults = Defaults(spec, sampling_params(args, FORMATS[chat_format].sampler),
                        args.max_tokens)
    security = Security(args.host, args.api_key, tuple(args.allow_origin))
    admission = Admission(args.queue)
    sock = bind(args.host, args.port)  # before loading: a port in use fails at once
    try:
        with open_pair(target, draft, config, (args.gpu_layers, args.draft_gpu_layers), ngram,
                       ngram_optional=args.ngram is None) as pair:
            pair.measure_costs(spec)  # every mode a request may ask for sizes its trees by them
            engine = pair.engine(spec)
            pair.recall(engine)  # what an earlier run of the app or server learned
            card = card_for(pair, spec, defaults, chat_format)
            engine_thread = EngineThread(pair, engine, card)
            try:
                out.write(started_message(card, url(sock), args) + "\n")
                out.flush()
                api = Api(engine_thread, admission, security)
                with contextlib.suppress(KeyboardInterrupt):  # how it is meant to stop
                    # uvicorn stops on Ctrl+C, then raises it again for the caller
                    serve_forever(api.app, api.stop, sock, args.verbose)
                n = admission.counts.answered
                out.write(f"Stopped after answering {n} request{'s' if n != 1 else ''}.\n")
            finally:
                engine_thread.close()
    finally:
        sock.close()
    return 0


def started_message(card: ModelCard, address: str, args: argparse.Namespace) -> str:
    reach = ("only this machine can connect" if is_loopback(args.host) else
             f"listening on {args.host}: other machines can connect")
    key = "an API key is required" if args.api_key else "no API key"
    return (f"Serving {card.name} at {address}/v1 (OpenAI-compatible; {reach}; {key}; "
            f"speculation {card.defaults.spec.mode.value}, {card.chat_format} chat format, "
            f"{card.n_ctx}-token window). Ctrl+C stops.")
