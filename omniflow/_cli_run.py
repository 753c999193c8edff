"""``omniflow run``: run one call of a graph in this process and print its frames as they come.

    $ omniflow run graphs/chat.py --input 'messages=[{"role": "user", "content": "a b c"}]'
    text[0] from reverser.generate: c
    text[1] from reverser.generate:  b
    text[2] from reverser.generate:  a
    $ omniflow run graphs/fig3.py --input request=@request.json --json     # NDJSON, as HTTP

``--input NAME=VALUE``: VALUE is read as JSON and, when it is not JSON, taken as a plain
string (``--input prompt=hello``); ``NAME=@FILE`` reads the JSON in FILE. JSON values use the
server's encoding (``{"$bytes": ...}``, ``{"$tensor": ...}``). Human output writes a str value
as is and anything else as compact JSON.

Exit status: 0 the call ended ok, 1 it ended in error (errors on stderr, or in the done line
with ``--json``), 2 a usage error (bad ``--input``, missing file, unknown graph, missing input).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import GraphError, InputError

if TYPE_CHECKING:
    from omniflow.cli import Subparsers
    from omniflow.dsl import Graph
    from omniflow.runtime import Frame

__all__ = ["parse_input", "register", "run"]


def register(subparsers: Subparsers) -> None:
    """Add ``omniflow run`` to the command line."""
    p = subparsers.add_parser(
        "run",
        help="run one call of a graph here and print its frames as they come",
        description="Load the graphs of a .py file (or importable module), run one call "
        "in-process and print every frame as it arrives.",
    )
    p.add_argument("target", metavar="GRAPH_FILE", help="a .py file or module name")
    p.add_argument(
        "--graph", "-g", metavar="NAME", help="the graph to call (needed when the file has several)"
    )
    p.add_argument(
        "--input",
        "-i",
        dest="inputs",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a Placeholder value: JSON (a plain string if it is not JSON), or NAME=@FILE.json; "
        "repeat for each Placeholder",
    )
    p.add_argument("--session", "-s", help="run the call in this session")
    p.add_argument(
        "--json", action="store_true", help="print NDJSON lines, as POST /v1/graphs/{name}/call"
    )
    p.set_defaults(handler=run)


def parse_input(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` / ``NAME=@FILE`` -> ``(name, value)``; InputError says what to fix."""
    from omniflow.serve import ValueDecodingError, loads

    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise InputError(
            f"--input {text!r}: expected NAME=VALUE (VALUE is JSON or a plain string) or "
            "NAME=@FILE.json"
        )
    if raw.startswith("@"):
        path = Path(raw[1:])
        if not path.is_file():
            what = "is not a file" if path.exists() else "does not exist"
            raise InputError(f"--input {name}=@{path}: '{path}' {what}", field=name)
        try:
            return name, loads(path.read_bytes())
        except ValueDecodingError as exc:
            raise InputError(f"--input {name}=@{path}: {exc}", field=name) from exc
    try:
        return name, loads(raw)
    except ValueDecodingError as exc:
        if isinstance(exc.__cause__, json.JSONDecodeError):
            return name, raw  # not JSON: a plain string
        raise InputError(f"--input {name}=...: {exc}", field=name) from exc


def _pick(graphs: list[Graph], target: str, name: str | None) -> Graph:
    names = [g.name for g in graphs]
    if name is None:
        if len(graphs) > 1:
            raise GraphError(
                f"'{target}' defines several graphs ({', '.join(names)}); pick one with --graph"
            )
        return graphs[0]
    for g in graphs:
        if g.name == name:
            return g
    raise GraphError(
        f"'{target}' defines no graph named '{name}'; its graphs are "
        f"{', '.join(repr(n) for n in names)} (pass one of them to --graph)"
    )


def run(args: argparse.Namespace) -> int:
    from omniflow._loader import load_graphs
    from omniflow.transport import run_loop

    inputs: dict[str, Any] = {}
    for text in args.inputs:
        name, value = parse_input(text)
        if name in inputs:
            raise InputError(f"--input {name} given twice; pass each Placeholder once")
        inputs[name] = value
    graphs = load_graphs(args.target)
    graph = _pick(graphs, args.target, args.graph)
    placeholders = [p.name for p in graph.inputs]
    missing = [p for p in placeholders if p not in inputs]
    if missing:
        hint = " ".join(f"--input {m}=..." for m in missing)
        raise InputError(
            f"graph '{graph.name}' needs {', '.join(repr(m) for m in missing)}; add {hint}"
        )
    return run_loop(_call(graphs, graph.name, inputs, args.session, args.json))


def _human(frame: Frame) -> str:
    from omniflow.serve import ValueEncodingError, dumps

    value = frame.value
    if isinstance(value, str):
        text = value
    else:
        try:
            text = dumps(value).decode()
        except ValueEncodingError:
            text = repr(value)
    return f"{frame.field}[{frame.seq}] from {frame.node}: {text}\n"


async def _call(
    graphs: list[Graph], name: str, inputs: dict[str, Any], session: str | None, as_json: bool
) -> int:
    from omniflow.runtime import Runtime
    from omniflow.serve import ValueEncodingError, dumps
    from omniflow.serve._stream import call_status, done_line, encoding_error, frame_line

    out = sys.stdout
    extra: list[dict[str, Any]] = []
    async with Runtime(*graphs) as rt:
        call = rt.call(name, inputs, session=session)
        async for frame in call:
            if not as_json:
                out.write(_human(frame))
            else:
                try:
                    line = frame_line(frame, dumps(frame.value))
                except ValueEncodingError as exc:
                    extra.append(encoding_error(frame, exc))
                    continue
                out.write(line.decode())
            out.flush()
    status, errors = call_status(call, extra)
    if as_json:
        out.write(done_line(call, extra).decode())
        out.flush()
    else:
        for e in errors:
            print(
                f"omniflow run: {e['kind']} in node '{e['node']}': {e['message']}", file=sys.stderr
            )
        if status != "ok":
            print(f"omniflow run: the call ended with status '{status}'", file=sys.stderr)
    return 0 if status == "ok" else 1
