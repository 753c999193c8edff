"""Runtime metrics: per-node activations, errors and latency histograms, calls and frames.

Off by default (``Runtime(metrics=True)`` turns it on); the server renders it as Prometheus
text. Recording is a few integer updates per activation; nothing is allocated per event.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["LATENCY_BUCKETS", "NodeMetrics", "RuntimeMetrics"]

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


@dataclass(slots=True)
class NodeMetrics:
    """Counters of one (graph, node)."""

    activations: int = 0
    errors: int = 0
    cancelled: int = 0
    #: Histogram counts per LATENCY_BUCKETS bound, plus one for +Inf.
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds


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

    def node(self, graph: str, node: str) -> NodeMetrics:
        m = self.nodes.get((graph, node))
        if m is None:
            m = self.nodes[(graph, node)] = NodeMetrics()
        return m
