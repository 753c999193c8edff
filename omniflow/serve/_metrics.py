"""``GET /metrics``: the runtime's and the server's counters in Prometheus text format 0.0.4.

Exposed through ``prometheus_client``: a collector builds the families at scrape time from
``rt.metrics``, ``rt.stats()`` and the server's counters (the values live in those structures,
which the hot path updates without a library call), and ``generate_latest`` writes them.

    omniflow_node_activations_total{graph,node}     counter   finished activations
    omniflow_node_errors_total{graph,node}          counter   activations that raised
    omniflow_node_cancelled_total{graph,node}       counter   activations cancelled
    omniflow_node_latency_seconds{graph,node}       histogram activation wall time (run time)
    omniflow_node_queue_wait_seconds{graph,node}    histogram admitted (inputs complete) ->
                                                              handed out to run
    omniflow_node_started_total{graph,node}         counter   activations handed out to run
    omniflow_first_audio_seconds{graph,field}       histogram call start -> its first of.Audio
    omniflow_audio_real_time_factor{graph,field}    histogram call seconds per second of audio
    omniflow_first_frame_seconds{graph,field}       histogram call start -> its first frame of
                                                              each output field (TTFT; the
                                                              hook for time to first audio)
    omniflow_calls_started_total                    counter
    omniflow_calls_finished_total{status}           counter   ok | error | cancelled
    omniflow_frames_total{graph,field}              counter   frames the runtime delivered
    omniflow_batches_total{node,replica}            counter   batches run by each batched node
    omniflow_batch_activations_total{node}          counter   activations run in those batches
    omniflow_batch_removed_total{node}              counter   activations cancelled while queued
    omniflow_batch_mean_size{node}                  gauge     activations per batch (mean)
    omniflow_batch_queued{node}, _running{node}     gauge     waiting activations, running batches
    omniflow_batch_wait_seconds_mean{node}, _max    gauge     how long a batch's first activation
                                                              waited (from rt.batch_stats(): the
                                                              nodes this process runs)
    omniflow_edge_bytes_total{graph,src,field,dst}  counter   bytes of each edge's values that
                                                              crossed a process boundary, both
                                                              ways, data-plane payloads at the
                                                              consumer's read (rt.edge_bytes();
                                                              multi-process; _remote_edges)
    omniflow_open_buckets                           gauge     from rt.stats()
    omniflow_inflight_activations                   gauge     from rt.stats()
    omniflow_active_calls                           gauge     from rt.stats()
    omniflow_data_plane_held_bytes                  gauge     bytes of data-plane blocks that
                                                              running calls hold (rt.stats())
    omniflow_data_pool_capacity_bytes               gauge     the front's buffer pool (0 until
                                                              it is first used; only a
                                                              multi-process placement has one),
                                                              from rt.data_plane_stats()
    omniflow_data_pool_used_bytes                   gauge     bytes of its live blocks
    omniflow_data_pool_live_blocks                  gauge     its live blocks
    omniflow_data_pool_fallbacks_total              counter   values too big for the pool that
                                                              rode the control message inline
    omniflow_http_requests_total{code}              counter   responses by status (499: the
                                                              client left before a response)
    omniflow_http_calls_inflight                    gauge     calls admitted and responding
    omniflow_http_calls_rejected_total{reason}      counter   max_inflight | draining
    omniflow_http_disconnects_total                 counter   calls cancelled because the
                                                              client went away
    omniflow_http_frames_out_total{graph}           counter   frames written to clients
    omniflow_http_bytes_out_total                   counter   response body bytes of calls
    omniflow_http_encoding_errors_total             counter   frame values with no JSON form
    omniflow_http_draining                          gauge     1 after SIGTERM
    omniflow_sessions                               gauge     sessions the runtime holds
    omniflow_wire_messages_accepted_total           counter   authenticated messages from replicas
    omniflow_wire_messages_dropped_total{reason}    counter   bad_mac | replay | malformed |
                                                              unknown_kind | foreign
    omniflow_registry_forged_records_total          counter   registry records with a bad signature
    omniflow_replica_restarts_total{role}           counter   spawned replicas respawned
    omniflow_live_replicas{role}                    gauge     replicas that can serve now
    omniflow_http_connections_open                  gauge     connections counted against
                                                              --max-connections (serve only)
    omniflow_http_connections_closed_total{reason}  counter   evicted (idle, at the cap) |
                                                              refused (cap, all busy) |
                                                              timeout (idle or header timeout)

The node and call series need ``Runtime(metrics=True)`` (what ``create_app`` builds); with a
Runtime given without it, they are simply absent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from omniflow.runtime import Runtime
from omniflow.runtime._metrics import LATENCY_BUCKETS

__all__ = ["CONTENT_TYPE", "HttpMetrics", "ServeCollector", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True)
class HttpMetrics:
    """What the HTTP layer counts (the runtime counts the rest)."""

    #: Responses by status code.
    requests: dict[int, int] = field(default_factory=dict)
    #: Calls refused before they started, by reason ("max_inflight", "draining",
    #: "body_too_large", "body_timeout").
    rejected: dict[str, int] = field(default_factory=dict)
    #: Calls cancelled because their client disconnected.
    disconnects: int = 0
    #: Frames written to clients, by graph.
    frames_out: dict[str, int] = field(default_factory=dict)
    #: Body bytes of call responses.
    bytes_out: int = 0
    #: Frame values dropped because they had no JSON form.
    encoding_errors: int = 0
    #: ``serve`` sets it: () -> (open connections, {reason: connections closed}).
    connections: Callable[[], tuple[int, dict[str, int]]] | None = None


def _family(
    kind: str, name: str, help_: str, samples: Iterable[tuple[dict[str, str], float]]
) -> Metric:
    """A counter or gauge family; a counter's ``name`` ends in ``_total`` as exposed."""
    items = list(samples)
    labels = sorted({k for lbl, _ in items for k in lbl})
    fam: CounterMetricFamily | GaugeMetricFamily
    if kind == "counter":
        fam = CounterMetricFamily(name.removesuffix("_total"), help_, labels=labels)
    else:
        fam = GaugeMetricFamily(name, help_, labels=labels)
    for lbl, value in items:
        fam.add_metric([lbl[k] for k in labels], value)
    return fam


def _buckets(bounds: list[str], counts: list[int]) -> list[tuple[str, float]]:
    """Cumulative histogram buckets."""
    cumulative, out = 0, []
    for le, count in zip(bounds, counts, strict=True):
        cumulative += count
        out.append((le, float(cumulative)))
    return out


def _runtime_families(rt: Runtime) -> Iterator[Metric]:
    m = rt.metrics
    if m is None:
        return
    nodes = sorted(m.nodes.items())
    for attr, name, help_ in (
        ("activations", "omniflow_node_activations_total", "Finished activations per node."),
        ("errors", "omniflow_node_errors_total", "Activations that raised, per node."),
        ("cancelled", "omniflow_node_cancelled_total", "Activations cancelled, per node."),
    ):
        samples = ((dict(graph=g, node=n), getattr(nm, attr)) for (g, n), nm in nodes)
        yield _family("counter", name, help_, samples)
    hist = HistogramMetricFamily(
        "omniflow_node_latency_seconds",
        "Wall time of activations, per node.",
        labels=["graph", "node"],
    )
    bounds = [*(repr(b) for b in LATENCY_BUCKETS), "+Inf"]
    for (g, n), nm in nodes:
        hist.add_metric([g, n], _buckets(bounds, nm.latency_counts), nm.latency_sum)
    yield hist
    yield _family("counter", "omniflow_node_started_total", "Activations handed out to run.",
                  ((dict(graph=g, node=n), nm.started) for (g, n), nm in nodes))  # fmt: skip
    wait = HistogramMetricFamily(
        "omniflow_node_queue_wait_seconds",
        "Time from an activation's admission (inputs complete) to its start, per node.",
        labels=["graph", "node"],
    )
    for (g, n), nm in nodes:
        wait.add_metric([g, n], _buckets(bounds, nm.queue_wait.counts), nm.queue_wait.total)
    yield wait
    for attr, name, help_ in (
        ("first_frame", "omniflow_first_frame_seconds",
         "Time from a call's start to its first frame of each output field."),
        ("first_audio", "omniflow_first_audio_seconds",
         "Time from a call's start to its first of.Audio frame of each output field."),
        ("audio_rtf", "omniflow_audio_real_time_factor",
         "Seconds a call took per second of of.Audio it produced, per output field."),
    ):  # fmt: skip
        fam = HistogramMetricFamily(name, help_, labels=["graph", "field"])
        for (g, f), h in sorted(getattr(m, attr).items()):
            fam.add_metric([g, f], _buckets(bounds, h.counts), h.total)
        yield fam
    yield _family("counter", "omniflow_calls_started_total", "Calls started.",
                  [({}, m.calls_started)])  # fmt: skip
    yield _family(
        "counter",
        "omniflow_calls_finished_total",
        "Calls finished, by status.",
        ((dict(status=s), c) for s, c in sorted(m.calls_finished.items())),
    )
    yield _family(
        "counter",
        "omniflow_frames_total",
        "Frames the runtime delivered to callers, per output field.",
        ((dict(graph=g, field=f), c) for (g, f), c in sorted(m.frames_out.items())),
    )


def _data_plane_families(rt: Runtime, stats: dict[str, int]) -> Iterator[Metric]:
    held = stats.get("data_plane_bytes", 0)
    yield _family("gauge", "omniflow_data_plane_held_bytes",
                  "Bytes of data-plane blocks held by running calls.", [({}, held)])  # fmt: skip
    pool = rt.data_plane_stats()
    for key, name, kind, help_ in (
        ("pool_capacity_bytes", "omniflow_data_pool_capacity_bytes", "gauge",
         "Capacity of this process's shared-memory buffer pool (0 until first used)."),
        ("pool_used_bytes", "omniflow_data_pool_used_bytes", "gauge",
         "Bytes of live blocks in this process's buffer pool."),
        ("pool_live_blocks", "omniflow_data_pool_live_blocks", "gauge",
         "Live blocks in this process's buffer pool."),
        ("pool_fallbacks", "omniflow_data_pool_fallbacks_total", "counter",
         "Values too big for the pool that rode the control message inline."),
    ):  # fmt: skip
        yield _family(kind, name, help_, [({}, pool[key])])


def _http_families(http: HttpMetrics, inflight: int, draining: bool) -> Iterator[Metric]:
    yield _family(
        "counter",
        "omniflow_http_requests_total",
        "HTTP responses by status code (499: the client left before a response).",
        ((dict(code=str(c)), n) for c, n in sorted(http.requests.items())),
    )
    yield _family("gauge", "omniflow_http_calls_inflight",
                  "Calls admitted over HTTP whose response is not finished.",
                  [({}, inflight)])  # fmt: skip
    yield _family(
        "counter",
        "omniflow_http_calls_rejected_total",
        "Calls refused before they started, by reason.",
        ((dict(reason=r), n) for r, n in sorted(http.rejected.items())),
    )
    for kind, name, help_, value in (
        ("counter", "omniflow_http_disconnects_total",
         "Calls cancelled because the client disconnected.", http.disconnects),
        ("counter", "omniflow_http_bytes_out_total", "Response body bytes of calls.",
         http.bytes_out),
        ("counter", "omniflow_http_encoding_errors_total",
         "Frame values dropped because they have no JSON form.", http.encoding_errors),
        ("gauge", "omniflow_http_draining",
         "1 once the server stopped admitting calls (shutdown).", int(draining)),
    ):  # fmt: skip
        yield _family(kind, name, help_, [({}, value)])
    yield _family(
        "counter",
        "omniflow_http_frames_out_total",
        "Frames written to HTTP clients, per graph.",
        ((dict(graph=g), n) for g, n in sorted(http.frames_out.items())),
    )
    if http.connections is not None:
        n_open, closed = http.connections()
        yield _family("gauge", "omniflow_http_connections_open",
                      "Connections counted against the connection cap.",
                      [({}, n_open)])  # fmt: skip
        yield _family(
            "counter",
            "omniflow_http_connections_closed_total",
            "Connections the server closed: evicted at the cap, refused, or timed out.",
            ((dict(reason=r), n) for r, n in sorted(closed.items())),
        )


class ServeCollector(Collector):
    """One scrape of a served app: the runtime's, the data plane's and the HTTP families.

    Register it with any ``prometheus_client`` registry to export the same series elsewhere:
    ``CollectorRegistry().register(ServeCollector(rt, http, lambda: (0, False)))``.
    """

    def __init__(
        self, rt: Runtime, http: HttpMetrics, status: Callable[[], tuple[int, bool]]
    ) -> None:
        self.rt = rt
        self.http = http
        #: () -> (calls in flight over HTTP, draining).
        self.status = status

    def collect(self) -> Iterator[Metric]:
        rt = self.rt
        yield from _runtime_families(rt)
        stats = rt.stats()
        for key, name, help_ in (
            ("open_buckets", "omniflow_open_buckets", "Buckets held by running calls."),
            ("inflight", "omniflow_inflight_activations", "Activations running now."),
            ("active_calls", "omniflow_active_calls", "Calls started or queued, not yet ended."),
        ):
            yield _family("gauge", name, help_, [({}, stats[key])])
        yield from _data_plane_families(rt, stats)
        inflight, draining = self.status()
        yield from _http_families(self.http, inflight, draining)
        yield _family("gauge", "omniflow_sessions", "Sessions whose state the runtime holds.",
                      [({}, len(rt.sessions()))])  # fmt: skip
        yield from _wire_families(rt.wire_stats())
        yield from _batch_families(rt.replica_batch_stats())
        edges = rt.edge_bytes()
        if edges:
            yield _family(
                "counter", "omniflow_edge_bytes_total",
                "Encoded bytes of values that crossed a process boundary, per edge.",
                ((dict(graph=g, src=s, field=f, dst=d), n)
                 for (g, s, f, d), n in sorted(edges.items())),
            )  # fmt: skip


def _batch_families(by_replica: dict[str, dict[str, dict[str, Any]]]) -> Iterator[Metric]:
    """The batchers of batched nodes (``batch=``), one series per node and replica: this
    process's (``"<front>"``) and each worker's, as its last heartbeat said."""
    if not by_replica:
        return
    items = sorted(((n, r), st) for r, nodes in by_replica.items() for n, st in nodes.items())
    for key, kind, name, help_ in (
        ("batches", "counter", "omniflow_batches_total", "Batches run, per batched node."),
        ("activations", "counter", "omniflow_batch_activations_total",
         "Activations run in batches, per batched node."),
        ("removed", "counter", "omniflow_batch_removed_total",
         "Activations that left a batch before it ran (cancelled calls)."),
        ("mean_size", "gauge", "omniflow_batch_mean_size", "Mean activations per batch."),
        ("queued", "gauge", "omniflow_batch_queued", "Activations waiting for their batch."),
        ("running", "gauge", "omniflow_batch_running", "Batches whose method runs now."),
        ("mean_wait_s", "gauge", "omniflow_batch_wait_seconds_mean",
         "Mean time a batch's first activation waited for the batch to run."),
        ("max_wait_s", "gauge", "omniflow_batch_wait_seconds_max",
         "Longest time a batch's first activation waited for the batch to run."),
    ):  # fmt: skip
        yield _family(kind, name, help_, ((dict(node=n, replica=r), s[key]) for (n, r), s in items))


def _wire_families(wire: dict[str, Any]) -> Iterator[Metric]:
    yield _family("counter", "omniflow_wire_messages_accepted_total",
                  "Authenticated messages taken from replicas.",
                  [({}, wire.get("accepted", 0))])  # fmt: skip
    dropped = [
        ({"reason": key.removeprefix("dropped_")}, value)
        for key, value in sorted(wire.items())
        if key.startswith("dropped_")
    ]
    yield _family("counter", "omniflow_wire_messages_dropped_total",
                  "Messages from replicas refused before decoding or dispatch, by reason.",
                  dropped)  # fmt: skip
    yield _family("counter", "omniflow_registry_forged_records_total",
                  "Registry records ignored for a missing or bad signature.",
                  [({}, wire.get("forged_records", 0))])  # fmt: skip
    restarts = sorted(wire.get("restarts", {}).items())
    yield _family("counter", "omniflow_replica_restarts_total",
                  "Spawned replicas respawned after they died or stopped answering.",
                  [({"role": r}, n) for r, n in restarts])  # fmt: skip
    live = sorted(wire.get("live_replicas", {}).items())
    yield _family("gauge", "omniflow_live_replicas", "Replicas of a role that can serve now.",
                  [({"role": r}, n) for r, n in live])  # fmt: skip


def render(rt: Runtime, http: HttpMetrics, *, inflight: int, draining: bool) -> str:
    """The whole exposition (Prometheus text format 0.0.4), ending with a newline."""
    collector = ServeCollector(rt, http, lambda: (inflight, draining))
    return generate_latest(collector).decode("utf-8")
