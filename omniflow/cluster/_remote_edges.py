"""Bytes between processes per edge (``/metrics``: ``omniflow_edge_bytes_total``): what the
front counts of the runs it sends, and what workers report of their forwards.

An edge is (graph, producer node(s) ``|``-joined or ``"<input>"``, field, consumer node).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from omniflow.cluster._launch import EDGES_KEY

if TYPE_CHECKING:
    from omniflow.runtime.callcore._core import CallCore

__all__ = ["count_run", "totals"]

Edges = dict[tuple[str, str, str, str], int]


def count_run(
    eb: Edges | None,
    graph: str,
    core: CallCore,
    node: str,
    kwargs: dict[str, Any],
    frames: Any,
    n: int,
) -> None:
    """Count the encoded bytes of a run sent to ``n`` replicas on the edges into ``node`` (a
    run of several inputs: shared evenly among them, as one message cannot be split)."""
    assert eb is not None
    size = n * sum(len(memoryview(b).cast("B")) for b in frames)
    producers = core.c.plan.producers
    share, extra = divmod(size, len(kwargs) or 1)
    for f in kwargs:
        srcs = producers.get(f, ())
        key = (graph, "|".join(srcs) if srcs else "<input>", f, node)
        eb[key] = eb.get(key, 0) + share + extra
        extra = 0


def totals(eb: Edges | None, replicas: Iterable[Any]) -> Edges:
    """The front's counts plus what each live worker's last heartbeat said it forwarded (a
    worker lost takes its counts along)."""
    out = dict(eb or {})
    for rep in replicas:
        rows = rep.batches.get(EDGES_KEY) if rep.batches else None
        for row in rows or ():
            if type(row) is list and len(row) == 5 and type(row[4]) is int:
                key = (str(row[0]), str(row[1]), str(row[2]), str(row[3]))
                out[key] = out.get(key, 0) + row[4]
    return out
