"""``omniflow serve``: serve every Graph of one or more graph files over HTTP.

    $ omniflow serve graphs/chat.py                          # http://127.0.0.1:8000
    $ omniflow serve graphs/fig3.py graphs/chat.py --port 0  # a free port, printed at start
    $ OMNIFLOW_API_KEY=s3cret omniflow serve graphs/chat.py --max-inflight 64

Prints ``omniflow serve: serving <graphs> on http://HOST:PORT`` on stdout once it accepts
connections. SIGTERM or Ctrl-C drains (new calls get 503, in-flight ones get
``--drain-timeout`` seconds, the rest are cancelled), runs role teardown and exits 0.
Routes and encoding: ``omniflow.serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omniflow.cli import Subparsers

__all__ = ["register", "run"]

#: Named placements (CONTRACT §5); a JSON object is an omniflow.Deploy spec.
PLACEMENTS = ("inproc", "process")
REGISTRY_SCHEMES = ("redis://", "rediss://", "unix://")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not in 0..65535 (0 picks a free port)")
    return port


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not s >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return s


def _placement(text: str) -> str | dict[str, Any]:
    """``inproc``, ``process``, or a Deploy spec as JSON (``@FILE`` reads it from a file)."""
    if text in PLACEMENTS:
        return text
    source = text
    if text.startswith("@"):
        try:
            source = Path(text[1:]).read_text()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]!r}: {exc.strerror}") from None
    try:
        spec = json.loads(source)
    except ValueError:
        spec = None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r}: use 'inproc', 'process', or a Deploy spec as a JSON object, e.g. "
            '\'{"llm": {"replicas": 2, "process": "gpu0"}}\' (or @deploy.json)'
        )
    return spec


def _registry(text: str) -> str:
    if not text.startswith(REGISTRY_SCHEMES):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a registry URL; expected redis://host:port/db "
            f"(schemes: {', '.join(REGISTRY_SCHEMES)})"
        )
    return text


def register(subparsers: Subparsers) -> None:
    """Add ``omniflow serve`` to the command line."""
    p = subparsers.add_parser(
        "serve",
        help="serve the graphs of graph files over HTTP (NDJSON streaming, OpenAI-compatible chat)",
        description="Serve every module-level omniflow.Graph of the given .py files (or "
        "importable modules) over HTTP: GET /v1/graphs, POST /v1/graphs/{name}/call, "
        "GET /healthz, GET /metrics, and POST /v1/chat/completions for graphs with a "
        "'messages' Placeholder and a 'text' output.",
    )
    p.add_argument("targets", nargs="+", metavar="GRAPH_FILE", help="a .py file or module name")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=_port, default=8000, help="TCP port (default: 8000; 0: a free one)"
    )
    p.add_argument(
        "--max-inflight",
        type=_positive_int,
        metavar="N",
        help="answer 429 (with Retry-After) beyond N concurrent calls (default: no limit)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("OMNIFLOW_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' or 'X-API-Key: KEY' on every route but "
        "/healthz (default: $OMNIFLOW_API_KEY; unset: open)",
    )
    p.add_argument(
        "--drain-timeout",
        type=_seconds,
        metavar="S",
        default=30.0,
        help="on SIGTERM/SIGINT, seconds in-flight calls get to finish before they are "
        "cancelled (default: 30)",
    )
    p.add_argument(
        "--placement",
        type=_placement,
        default="inproc",
        metavar="{inproc,process,JSON}",
        help="where roles run: inproc (default, in the server process), process (each role in "
        "a worker process), or an omniflow.Deploy spec as JSON, e.g. "
        '\'{"llm": {"replicas": 2, "process": "gpu0"}}\' (@FILE reads it from a file)',
    )
    p.add_argument(
        "--registry", type=_registry, metavar="URL", help="service registry, redis://host:port/db"
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="server log level")
    p.add_argument("--access-log", action="store_true", help="log one line per request")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from omniflow.runtime import Deploy
    from omniflow.serve import create_app, serve

    placement = Deploy(args.placement) if isinstance(args.placement, dict) else args.placement
    app = create_app(
        args.targets,
        max_inflight=args.max_inflight,
        api_key=args.api_key,
        drain_timeout=args.drain_timeout,
        placement=placement,
        registry=args.registry,
    )
    names = ", ".join(app.state.omniflow.runtime.plans)

    def announce(url: str) -> None:
        print(f"omniflow serve: serving {names} on {url}", flush=True)
        auth = " (API key required)" if args.api_key else ""
        print(f"  try: curl {url}/v1/graphs{auth}", file=sys.stderr, flush=True)

    return serve(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        announce=announce,
    )
