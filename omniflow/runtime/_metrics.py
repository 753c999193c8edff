"""Runtime metrics: per-node activations, errors and latency histograms, calls and frames.

Off by default (``Runtime(metrics=True)`` turns it on); the server renders it as Prometheus
text. Recording is a few integer updates per activation; nothing is allocated per event.
Stage metrics (queue wait, time to first frame, activations started) are recorded by the
observed call core (``_observe.ObservedCore``), which the runtime uses only while metrics or
tracing are on.
"""

from __future__ import annotations

import bisect
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from omniflow.data._connectors import HOST
from omniflow.data._ref import refs_in

__all__ = [
    "FRONT_REF",
    "LATENCY_BUCKETS",
    "RECENT",
    "Histogram",
    "NodeMetrics",
    "RuntimeMetrics",
    "count_reads",
]

#: How the front's data plane names the producer of the inputs it puts in its pool for a
#: remote run (``FRONT_REF + node``); the front's edge totals name their producers instead.
FRONT_REF = "<front>->"

#: Upper bounds (seconds) of the latency histogram buckets; +Inf is implied.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.0005,
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.5,
    1.0,
    5.0,
    30.0,
)


#: Run times each node keeps for its live percentiles (``GET /ui``).
RECENT = 256


@dataclass(slots=True)
class Histogram:
    """Counts per LATENCY_BUCKETS bound (plus one for +Inf) and their sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds


@dataclass(slots=True)
class NodeMetrics:
    """Counters of one (graph, node)."""

    activations: int = 0
    errors: int = 0
    cancelled: int = 0
    #: Activations handed out to run (``activations`` of them ended; the rest are in flight).
    started: int = 0
    #: Histogram counts per LATENCY_BUCKETS bound, plus one for +Inf.
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    #: The last RECENT run times (seconds), for p50/p99 on the live page.
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    #: Queue wait: admitted (inputs complete) -> handed out to run (session order,
    #: max_concurrency, loop bounds hold activations back here).
    queue_wait: Histogram = field(default_factory=Histogram)

    def observe(self, seconds: float) -> None:
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds
        self.recent.append(seconds)


@dataclass(slots=True)
class RuntimeMetrics:
    """Everything the runtime counts while metrics are on."""

    #: (graph, node) -> counters.
    nodes: dict[tuple[str, str], NodeMetrics] = field(default_factory=dict)
    #: Calls started / finished by status.
    calls_started: int = 0
    calls_finished: dict[str, int] = field(default_factory=dict)
    #: Frames delivered to callers, per (graph, field).
    frames_out: dict[tuple[str, str], int] = field(default_factory=dict)
    #: Time from a call's start to its first frame of each output field, per (graph, field)
    #: (TTFT for a text field).
    first_frame: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    #: Time from a call's start to its first ``of.Audio`` frame of each field (time to first
    #: audio), per (graph, field).
    first_audio: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    #: Real-time factor of each call's ``of.Audio`` output field (call seconds per second of
    #: audio it carried; below 1: faster than real time), per (graph, field).
    audio_rtf: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    #: Bytes that crossed a process boundary per edge (graph, producer, field, consumer):
    #: what this process counted (``cluster._remote_edges``); workers report theirs.
    edge_bytes: dict[tuple[str, str, str, str], int] = field(default_factory=dict)

    def node(self, graph: str, node: str) -> NodeMetrics:
        m = self.nodes.get((graph, node))
        if m is None:
            m = self.nodes[(graph, node)] = NodeMetrics()
        return m


def count_reads(
    edges: dict[tuple[str, str, str, str], int], graph: str, dst: str, items: Iterable[Any]
) -> None:
    """Count the payload bytes of the data-plane refs that ``dst`` (a node, ``"<output>"``
    for the caller) reads in this process from another process's pool, one transfer per
    read, on the edge from each ref's producer node. ``items``: (field, value, ...) each."""
    pid = os.getpid()
    for item in items:
        for ref in refs_in(item[1]):
            if ref.pid != pid or ref.host != HOST:
                key = (graph, ref.key[0], item[0], dst)
                edges[key] = edges.get(key, 0) + ref.nbytes
