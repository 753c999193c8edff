"""``omniflow serve``: serve every Graph of one or more graph files over HTTP.

    $ omniflow serve graphs/chat.py                          # http://127.0.0.1:8000
    $ omniflow serve graphs/fig3.py graphs/chat.py --port 0  # a free port, printed at start
    $ OMNIFLOW_API_KEY=s3cret omniflow serve graphs/chat.py --max-inflight 64
    $ omniflow serve graphs/chat.py --host 0.0.0.0 --allowed-host api.example.com \
          --max-body-mb 64 --session-ttl 600 --log-format json
    $ omniflow serve graphs/t2i.py --placement ray --ray-address auto --deploy deploy.yaml

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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from omniflow.cli import Subparsers

__all__ = ["placement_from_args", "register", "run"]

N = TypeVar("N", int, float)

#: Named placements (docs/contract.md §5, §6); a JSON object is an omniflow.Deploy spec.
PLACEMENTS = ("inproc", "process", "ray")
REGISTRY_SCHEMES = ("redis://", "rediss://", "unix://")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _number(text: str, kind: Callable[[str], N], noun: str) -> N:
    """``kind(text)``, or the argparse error saying ``text`` is not ``noun``."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None


def _port(text: str) -> int:
    port = _number(text, int, "a port number")
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not in 0..65535 (0 picks a free port)")
    return port


def _positive_int(text: str) -> int:
    n = _number(text, int, "an integer")
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _seconds(text: str) -> float:
    s = _number(text, float, "a number of seconds")
    if not s >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return s


def _positive_seconds(text: str) -> float:
    s = _seconds(text)
    if s <= 0 or s == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return s


def _megabytes(text: str) -> float:
    mb = _number(text, float, "a number of MiB")
    if not 0 <= mb < 2**20:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0 MiB, got {text}")
    return mb


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
            f"{text!r}: use 'inproc', 'process', 'ray', or a Deploy spec as a JSON object, e.g. "
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
        metavar="{inproc,process,ray,JSON}",
        help="where roles run: inproc (default, in the server process), process (each role in "
        "a worker process), ray (each replica a Ray actor: see --deploy, --ray-address), or an "
        "omniflow.Deploy spec as JSON, e.g. "
        '\'{"llm": {"replicas": 2, "process": "gpu0"}}\' (@FILE reads it from a file)',
    )
    p.add_argument(
        "--ray-address",
        metavar="ADDR",
        default=None,
        help="with --placement ray: the Ray cluster to join ('auto', 'ray://host:10001'); "
        "default: the local one, started if none runs",
    )
    p.add_argument(
        "--deploy",
        metavar="FILE",
        default=None,
        help="with --placement ray: the deploy map, YAML (.yaml/.yml) or JSON, e.g. "
        "'llm: {replicas: 2, num_gpus: 1}' and 'dit: {layer: 1, colocate: llm}'",
    )
    p.add_argument(
        "--registry", type=_registry, metavar="URL", help="service registry, redis://host:port/db"
    )
    p.add_argument(
        "--cluster-key-file",
        metavar="PATH",
        default=None,
        help="file holding the key that authenticates every message between processes and "
        "every registry record (default: $OMNIFLOW_CLUSTER_KEY, else one generated for the "
        "workers this server spawns; hand-started workers need the same key)",
    )
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
        help="export OpenTelemetry traces over OTLP/HTTP to URL/v1/traces (needs the otel "
        "extra; default: $OTEL_EXPORTER_OTLP_ENDPOINT; unset: no tracing)",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="server log level")
    p.add_argument("--access-log", action="store_true", help="log one line per request")
    _add_limit_options(p)
    p.set_defaults(handler=run)


# -- server limits, Host checks, sessions, logging (docs/contract.md §4) ---------------------------


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits and request checks")
    g.add_argument(
        "--max-body-mb",
        type=_megabytes,
        default=16.0,
        metavar="MB",
        help="largest request body in MiB; larger ones get 413 before they are read (default: 16)",
    )
    g.add_argument(
        "--header-timeout",
        type=_positive_seconds,
        default=10.0,
        metavar="S",
        help="close a connection whose request headers take longer than S (default: 10)",
    )
    g.add_argument(
        "--body-timeout",
        type=_positive_seconds,
        default=60.0,
        metavar="S",
        help="answer 408 when a request body takes longer than S to arrive (default: 60)",
    )
    g.add_argument(
        "--idle-timeout",
        type=_positive_seconds,
        default=5.0,
        metavar="S",
        help="close a connection idle for S between requests (default: 5)",
    )
    g.add_argument(
        "--ws-idle-timeout",
        type=_positive_seconds,
        default=60.0,
        metavar="S",
        help="close a realtime WebSocket with no client event for S while no response runs "
        "(default: 60)",
    )
    g.add_argument(
        "--max-connections",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="open connections; at N a new one evicts the oldest idle one, or gets 503 when "
        "none is idle (default: 1024)",
    )
    g.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host is NAME (repeatable; '*' any). Default: the "
        "loopback names when bound to loopback, the bound address otherwise",
    )
    g.add_argument(
        "--session-ttl",
        type=_positive_seconds,
        metavar="S",
        help="close sessions idle for S seconds (default: the Runtime's)",
    )
    g.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text lines, or one JSON object per line (default: text)",
    )


def allowed_hosts(bind: str, extra: list[str]) -> list[str]:
    """The Host names served when bound to ``bind``: loopback names for a loopback bind, the
    bound address for a specific one, any (with a warning) for a wildcard bind without
    ``--allowed-host``; plus ``extra``."""
    from omniflow.serve._limits import LOOPBACK_HOSTS, is_loopback

    hosts = list(LOOPBACK_HOSTS)
    if bind.strip("[]") in ("0.0.0.0", "::", ""):
        if not extra:
            print(
                f"omniflow serve: bound to {bind} with no --allowed-host: any Host header is "
                "answered (name the hosts clients use with --allowed-host to guard against "
                "DNS rebinding)",
                file=sys.stderr,
            )
            return ["*"]
    elif not is_loopback(bind):
        hosts.append(bind.strip("[]").lower())
    return hosts + [h.lower() for h in extra]


def placement_from_args(args: argparse.Namespace) -> Any:
    """The Runtime's ``placement`` for ``--placement`` (with ``--deploy``, ``--ray-address``)."""
    from omniflow._exceptions import OmniflowError
    from omniflow.cluster import Deploy, Ray

    if args.placement == "ray":
        from omniflow.cluster._ray_plan import load_deploy

        deploy = load_deploy(args.deploy) if args.deploy is not None else {}
        return Ray(deploy, address=args.ray_address)
    if args.deploy is not None or args.ray_address is not None:
        raise OmniflowError("--deploy and --ray-address go with --placement ray")
    return Deploy(args.placement) if isinstance(args.placement, dict) else args.placement


def run(args: argparse.Namespace) -> int:
    from omniflow.serve import create_app, serve
    from omniflow.serve._limits import Limits

    placement = placement_from_args(args)
    if args.cluster_key_file is not None:
        from omniflow.transport._auth import KEY_ENV, load_key_file

        # Through this process's environment (never argv): the Runtime reads it there and
        # hands it to the workers it spawns.
        os.environ[KEY_ENV] = load_key_file(args.cluster_key_file).decode()
    app = create_app(
        args.targets,
        max_inflight=args.max_inflight,
        api_key=args.api_key,
        drain_timeout=args.drain_timeout,
        placement=placement,
        registry=args.registry,
        session_ttl=args.session_ttl,
        limits=Limits(
            max_body_bytes=int(args.max_body_mb * 2**20),
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            idle_timeout=args.idle_timeout,
            ws_idle_timeout=args.ws_idle_timeout,
            max_connections=args.max_connections,
        ),
        allowed_hosts=allowed_hosts(args.host, args.allowed_host),
        otlp_endpoint=args.otlp_endpoint,
    )
    names = ", ".join(app.state.omniflow.runtime.plans)

    def announce(url: str) -> None:
        print(f"omniflow serve: serving {names} on {url}", flush=True)
        if args.log_format == "text":  # stderr holds only JSON lines otherwise
            auth = " (API key required)" if args.api_key else ""
            print(f"  try: curl {url}/v1/graphs{auth}", file=sys.stderr, flush=True)

    return serve(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        announce=announce,
        log_format=args.log_format,
    )
