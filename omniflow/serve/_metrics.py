"""``GET /metrics``: the runtime's and the server's counters in Prometheus text format 0.0.4.

Rendered by hand (the format is a few lines of text per sample; no client library needed).

    omniflow_node_activations_total{graph,node}     counter   finished activations
    omniflow_node_errors_total{graph,node}          counter   activations that raised
    omniflow_node_cancelled_total{graph,node}       counter   activations cancelled
    omniflow_node_latency_seconds{graph,node}       histogram activation wall time
    omniflow_calls_started_total                    counter
    omniflow_calls_finished_total{status}           counter   ok | error | cancelled
    omniflow_frames_total{graph,field}              counter   frames the runtime delivered
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

The node and call series need ``Runtime(metrics=True)`` (what ``create_app`` builds); with a
Runtime given without it, they are simply absent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from omniflow.runtime import Runtime
from omniflow.runtime._metrics import LATENCY_BUCKETS

__all__ = ["CONTENT_TYPE", "HttpMetrics", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True)
class HttpMetrics:
    """What the HTTP layer counts (the runtime counts the rest)."""

    #: Responses by status code.
    requests: dict[int, int] = field(default_factory=dict)
    #: Calls refused before they started, by reason ("max_inflight", "draining").
    rejected: dict[str, int] = field(default_factory=dict)
    #: Calls cancelled because their client disconnected.
    disconnects: int = 0
    #: Frames written to clients, by graph.
    frames_out: dict[str, int] = field(default_factory=dict)
    #: Body bytes of call responses.
    bytes_out: int = 0
    #: Frame values dropped because they had no JSON form.
    encoding_errors: int = 0


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _num(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    return repr(float(x))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        self.lines.append(f"{name}{_labels(**labels)} {_num(value)}")

    def simple(
        self, name: str, kind: str, help_: str, samples: Iterable[tuple[dict[str, str], float]]
    ) -> None:
        self.family(name, kind, help_)
        for labels, value in samples:
            self.sample(name, value, **labels)


def _runtime_families(w: _Writer, rt: Runtime) -> None:
    m = rt.metrics
    if m is None:
        return
    nodes = sorted(m.nodes.items())
    for attr, name, help_ in (
        ("activations", "omniflow_node_activations_total", "Finished activations per node."),
        ("errors", "omniflow_node_errors_total", "Activations that raised, per node."),
        ("cancelled", "omniflow_node_cancelled_total", "Activations cancelled, per node."),
    ):
        w.simple(
            name,
            "counter",
            help_,
            ((dict(graph=g, node=n), getattr(nm, attr)) for (g, n), nm in nodes),
        )
    name = "omniflow_node_latency_seconds"
    w.family(name, "histogram", "Wall time of activations, per node.")
    bounds = [*(repr(b) for b in LATENCY_BUCKETS), "+Inf"]
    for (g, n), nm in nodes:
        cumulative = 0
        for le, count in zip(bounds, nm.latency_counts, strict=True):
            cumulative += count
            w.sample(f"{name}_bucket", cumulative, graph=g, node=n, le=le)
        w.sample(f"{name}_sum", nm.latency_sum, graph=g, node=n)
        w.sample(f"{name}_count", cumulative, graph=g, node=n)
    w.simple("omniflow_calls_started_total", "counter", "Calls started.", [({}, m.calls_started)])
    w.simple(
        "omniflow_calls_finished_total",
        "counter",
        "Calls finished, by status.",
        ((dict(status=s), c) for s, c in sorted(m.calls_finished.items())),
    )
    w.simple(
        "omniflow_frames_total",
        "counter",
        "Frames the runtime delivered to callers, per output field.",
        ((dict(graph=g, field=f), c) for (g, f), c in sorted(m.frames_out.items())),
    )


def _data_plane_families(w: _Writer, rt: Runtime, stats: dict[str, int]) -> None:
    held = stats.get("data_plane_bytes", 0)
    w.simple("omniflow_data_plane_held_bytes", "gauge",
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
        w.simple(name, kind, help_, [({}, pool[key])])


def render(rt: Runtime, http: HttpMetrics, *, inflight: int, draining: bool) -> str:
    """The whole exposition, ending with a newline."""
    w = _Writer()
    _runtime_families(w, rt)
    stats = rt.stats()
    for key, name, help_ in (
        ("open_buckets", "omniflow_open_buckets", "Buckets held by running calls."),
        ("inflight", "omniflow_inflight_activations", "Activations running now."),
        ("active_calls", "omniflow_active_calls", "Calls started or queued, not yet ended."),
    ):
        w.simple(name, "gauge", help_, [({}, stats[key])])
    _data_plane_families(w, rt, stats)
    w.simple(
        "omniflow_http_requests_total",
        "counter",
        "HTTP responses by status code (499: the client left before a response).",
        ((dict(code=str(c)), n) for c, n in sorted(http.requests.items())),
    )
    w.simple(
        "omniflow_http_calls_inflight",
        "gauge",
        "Calls admitted over HTTP whose response is not finished.",
        [({}, inflight)],
    )
    w.simple(
        "omniflow_http_calls_rejected_total",
        "counter",
        "Calls refused before they started, by reason.",
        ((dict(reason=r), n) for r, n in sorted(http.rejected.items())),
    )
    w.simple(
        "omniflow_http_disconnects_total",
        "counter",
        "Calls cancelled because the client disconnected.",
        [({}, http.disconnects)],
    )
    w.simple(
        "omniflow_http_frames_out_total",
        "counter",
        "Frames written to HTTP clients, per graph.",
        ((dict(graph=g), n) for g, n in sorted(http.frames_out.items())),
    )
    w.simple(
        "omniflow_http_bytes_out_total",
        "counter",
        "Response body bytes of calls.",
        [({}, http.bytes_out)],
    )
    w.simple(
        "omniflow_http_encoding_errors_total",
        "counter",
        "Frame values dropped because they have no JSON form.",
        [({}, http.encoding_errors)],
    )
    w.simple(
        "omniflow_http_draining",
        "gauge",
        "1 once the server stopped admitting calls (shutdown).",
        [({}, int(draining))],
    )
    return "\n".join(w.lines) + "\n"
