"""``subspec serve``: an OpenAI-compatible HTTP server with a web chat page (see :mod:`subspec.server`)."""
from __future__ import annotations

import os
import signal

from .options import add_model_options, add_sampling_options, build_options, load_planned, say, sampling_params


def add_parser(sub, common) -> None:
    p = sub.add_parser("serve", parents=[common], help="serve the model over an OpenAI-compatible HTTP API",
                       description="Serve the model over HTTP: /v1/chat/completions, /v1/completions and /v1/models "
                                   "(OpenAI's API, streaming with Server-Sent Events), /health, /metrics "
                                   "(Prometheus) and a chat page at /. One request runs at a time; others wait in "
                                   "a FIFO queue (429 when it is full). A request that continues the conversation "
                                   "the engine holds prefills only its new tokens. Ctrl-C or SIGTERM stops cleanly.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    g.add_argument("--api-key", metavar="KEY", default=os.environ.get("SUBSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SUBSPEC_API_KEY, else no key)")
    g.add_argument("--max-queue", type=int, default=16, metavar="N",
                   help="requests that may wait behind the running one; more are answered 429 (default: %(default)s)")
    g.add_argument("--model-name", metavar="NAME", help="the model id shown by /v1/models (default: the file name)")
    add_model_options(p)
    add_sampling_options(p, "max_tokens of a request that does not set it (lowered to the room left in the context)")
    p.set_defaults(run=run)


def _check(args) -> None:
    """Bad server options and missing packages, before anything is loaded."""
    import importlib.util
    import socket

    from ..errors import SubspecError

    missing = [m for m in ("fastapi", "uvicorn", "sse_starlette", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise SubspecError(f"serve needs {', '.join(missing)}: pip install 'subspec[serve]'")
    if not 0 < args.port < 65536:
        raise SubspecError(f"--port must be in 1..65535 (got {args.port})")
    if args.max_queue < 0:
        raise SubspecError(f"--max-queue must be >= 0 (got {args.max_queue})")
    if args.api_key is not None and not args.api_key.strip():
        raise SubspecError("--api-key is empty: give a key or leave the option out")
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((args.host, args.port))
    except OSError as e:
        raise SubspecError(f"cannot listen on {args.host}:{args.port} ({e.strerror}): pick another --port or "
                           f"--host") from None


def run(args) -> int:
    from pathlib import Path

    _check(args)
    defaults = sampling_params(args)
    opts = build_options(args)
    import uvicorn

    from ..server.app import ServerSettings, create_app

    rt = load_planned(opts)
    try:
        name = args.model_name or Path(opts.model).name.removesuffix(".gguf")
        settings = ServerSettings(model_name=name, api_key=args.api_key, max_queue=args.max_queue, defaults=defaults)
        app = create_app(rt, settings)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info" if args.debug else "warning",
                                access_log=args.debug, timeout_graceful_shutdown=10)
        if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
            say(f"warning: listening on {args.host} without --api-key: anyone who can reach it can use it")
        say(f"serving {name} ({rt.placement.summary()}) at http://{args.host}:{args.port}/ (chat page), API at "
            f"/v1; Ctrl-C stops")
        signals = _serve(uvicorn.Server(config))
    finally:
        rt.close()
    say("server stopped" + (f" ({signal.Signals(signals[0]).name})" if signals else ""))
    return 0


def _serve(server) -> list[int]:
    """Run uvicorn until Ctrl-C or SIGTERM; return the signals that stopped it.

    uvicorn shuts down gracefully (streams are cancelled, the engine worker stops within one round) and then raises
    the signal again for the previous handler: these handlers take it, so the command ends normally (exit 0, the
    tier closed) instead of being killed by its own SIGTERM.
    """
    caught: list[int] = []
    old = {s: signal.signal(s, lambda sig, frame: caught.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return caught
