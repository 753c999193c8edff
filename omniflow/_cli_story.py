"""``omniflow story``: print what happened to a recent call of a running server.

    $ omniflow story c42 --url http://127.0.0.1:8000
    #1   start     inputs=['request']
    #2   frame     node=parse.run aid=1
    #2   bucket    node=llm.generate group=1 key=('parse.run', 1, 1) seq=...
    ...
    #14  finish    status=ok

The call id is the ``call_id`` of a call's done line (``POST /v1/graphs/{name}/call``). The
server answers from its runtime's bounded story log (``GET /v1/calls/{id}/story``), so a call
is found while it runs and for a while after (how long: ``Runtime(story_size=...)``). The
request sends the API key (``--api-key``, else ``$OMNIFLOW_API_KEY``) as a Bearer token.

Exit status: 0 the story was printed, 1 the server has none for that id or cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import OmniflowError

if TYPE_CHECKING:
    from omniflow.cli import Subparsers

__all__ = ["fetch_story", "format_story", "register", "run"]


def register(subparsers: Subparsers) -> None:
    """Add ``omniflow story`` to the command line."""
    p = subparsers.add_parser(
        "story",
        help="print a recent call's transition story from a running server",
        description="Ask a running 'omniflow serve' for the story of call CALL_ID (every "
        "stimulus and the transitions it caused: buckets, fires, errors, the end).",
    )
    p.add_argument("call_id", metavar="CALL_ID", help="the call_id of a call's done line")
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the server (default: http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("OMNIFLOW_API_KEY") or None,
        help="the server's API key (default: $OMNIFLOW_API_KEY)",
    )
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (default: 10)")
    p.set_defaults(handler=run)


def fetch_story(
    url: str, call_id: str, *, api_key: str | None = None, timeout: float = 10.0
) -> dict[str, Any]:
    """``GET {url}/v1/calls/{call_id}/story``; OmniflowError with the server's message when
    it has no story, refuses the key, or cannot be reached."""
    target = f"{url.rstrip('/')}/v1/calls/{urllib.parse.quote(call_id, safe='')}/story"
    request = urllib.request.Request(target, headers={"accept": "application/json"})
    if api_key:
        request.add_header("authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", exc.reason)
        except (ValueError, AttributeError):
            message = exc.reason
        raise OmniflowError(f"{target}: {exc.code} {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OmniflowError(f"cannot reach {url}: {reason}") from None


def format_story(story: list[dict[str, Any]]) -> str:
    """One line per record: ``#<stimulus> <event> key=value ...``."""
    lines = []
    for rec in story:
        fields = " ".join(f"{k}={v}" for k, v in rec.items() if k not in ("event", "stimulus"))
        lines.append(f"#{rec.get('stimulus', '?'):<4}{rec['event']:<10}{fields}".rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    answer = fetch_story(args.url, args.call_id, api_key=args.api_key, timeout=args.timeout)
    if args.json:
        print(json.dumps(answer))
    else:
        print(format_story(answer.get("story", [])))
    sys.stdout.flush()
    return 0
