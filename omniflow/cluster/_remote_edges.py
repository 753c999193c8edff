"""Bytes between processes per edge (``/metrics``: ``omniflow_edge_bytes_total``).

An edge is (graph, producer node(s) ``|``-joined or ``"<input>"``, field, consumer node(s)
``|``-joined, ``"<output>"`` for the caller). What it counts is what its values weigh where
they cross a process boundary (docs/serving.md, *Stage metrics*):

- a value inside a message (a run the front sends, a forward between workers, a frame or a
  done a worker sends the front): its encoded size (``wire_size``), once per message and
  receiving replica; the envelope (ids, routing, trace context) is no edge's;
- a value moved through the data plane: its payload bytes (``DataRef.nbytes``), counted where
  the consumer reads it from another process's pool (``runtime._metrics.count_reads``), once
  per read; the ``DataRef`` in the message, a handle, is envelope.

The front counts its runs and the frames and dones it receives, and its own reads; each worker
counts its forwards and reads and says so in its heartbeats (``totals``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from omniflow.cluster._launch import EDGES_KEY
from omniflow.data._ref import DataRef
from omniflow.runtime._metrics import FRONT_REF
from omniflow.transport._codec import encode

if TYPE_CHECKING:
    from omniflow.plan._plan import StaticPlan
    from omniflow.runtime._call import Call
    from omniflow.runtime._executor import OnFrame
    from omniflow.runtime.callcore._core import Activation, CallCore

__all__ = ["Consumers", "count_frame", "count_run", "counting", "totals", "wire_size"]

Edges = dict[tuple[str, str, str, str], int]


def wire_size(value: Any) -> int:
    """The encoded bytes of ``value`` on its own (header and out-of-band buffers, as the
    worker protocol encodes it); 0 for a ``DataRef`` (its payload is counted where it is
    read). Big buffers are not copied to be measured: they go out of band as views."""
    if type(value) is DataRef:
        return 0
    try:
        frames = encode(value, pickle=True)
    except Exception:  # (a value that was decoded but will not encode again: a metric never
        return 0  # fails the frame it is counting; what it weighed cannot be known)
    return sum(memoryview(b).nbytes for b in frames)


def count_run(
    eb: Edges, graph: str, core: CallCore, node: str, kwargs: dict[str, Any], n: int
) -> None:
    """Count the values of a run sent to ``n`` replicas on the edges into ``node``."""
    producers = core.c.plan.producers
    for f, v in kwargs.items():
        size = wire_size(v)
        if size:
            srcs = producers.get(f, ())
            key = (graph, "|".join(srcs) if srcs else "<input>", f, node)
            eb[key] = eb.get(key, 0) + n * size


class Consumers:
    """The consumer label of each (graph, producer, field) whose values reach the front:
    the nodes the plan feeds with it and ``"<output>"`` for the caller, sorted and
    ``|``-joined (computed once per edge)."""

    __slots__ = ("_labels",)

    def __init__(self) -> None:
        self._labels: dict[tuple[str, str, str], str] = {}

    def of(self, plan: StaticPlan, graph: str, node: str, field: str) -> str:
        key = (graph, node, field)
        label = self._labels.get(key)
        if label is None:
            dsts = {d for d, _g in plan.consumers(node, field)}
            if field in plan.outputs and node in plan.output_producers.get(field, ()):
                dsts.add("<output>")
            label = self._labels[key] = "|".join(sorted(dsts)) or "<front>"
        return label


def count_frame(
    eb: Edges, labels: Consumers, graph: str, core: CallCore, node: str, frame: Any
) -> None:
    """Count the values of a frame (or a done's returned frame) that ``node``'s worker sent
    the front, on the edges out of ``node``."""
    if not isinstance(frame, dict):
        return
    plan = core.c.plan
    for f, v in frame.items():
        size = wire_size(v)
        if size:
            key = (graph, node, f, labels.of(plan, graph, node, f))
            eb[key] = eb.get(key, 0) + size


def counting(eb: Edges, labels: Consumers, on_frame: OnFrame) -> OnFrame:
    """``on_frame`` (the shell's frame or return callback) counting each frame first."""

    def counted(call: Call, core: CallCore, act: Activation, frame: Any) -> None:
        count_frame(eb, labels, call.graph, core, act.node, frame)
        on_frame(call, core, act, frame)

    return counted


def totals(eb: Edges | None, replicas: Iterable[Any], plans: Mapping[str, StaticPlan]) -> Edges:
    """The front's counts plus what each live worker's last heartbeat said it counted (a
    worker lost takes its counts along). A worker names an input the front put in its own
    pool by that pool's key (``FRONT_REF``): its producers come from the plan."""
    out = dict(eb or {})
    for rep in replicas:
        rows = rep.batches.get(EDGES_KEY) if rep.batches else None
        for row in rows or ():
            if type(row) is list and len(row) == 5 and type(row[4]) is int:
                g, src, f, dst = str(row[0]), str(row[1]), str(row[2]), str(row[3])
                if src.startswith(FRONT_REF):
                    plan = plans.get(g)
                    srcs = plan.producers.get(f, ()) if plan is not None else ()
                    src = "|".join(srcs) if srcs else "<input>"
                key = (g, src, f, dst)
                out[key] = out.get(key, 0) + row[4]
    return out
