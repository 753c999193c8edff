"""OpenTelemetry for the runtime: an OTLP/HTTP tracer provider, W3C trace context on the wire.

>>> provider = otlp_provider("http://127.0.0.1:4318")          # doctest: +SKIP
>>> rt = of.Runtime(graph, tracer_provider=provider)          # doctest: +SKIP

Imported only when tracing is on (``Runtime(tracer_provider=...)``, ``omniflow serve
--otlp-endpoint``), so ``opentelemetry`` (the ``omniflow[otel]`` extra) is needed only then.
Exports are batched by the SDK's ``BatchSpanProcessor`` in its own thread: a call never waits
for the collector. A collector that cannot be reached drops the batch; ``_LogOnce`` says so
once (and once more if it recovers and fails again), not on every batch.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from omniflow._exceptions import OmniflowError

__all__ = [
    "Tracing",
    "attach_traceparent",
    "global_otlp_provider",
    "otlp_endpoint",
    "otlp_provider",
]

logger = logging.getLogger("omniflow.tracing")

#: The SDK exporter's own loggers, which warn on every failed batch (``_LogOnce`` speaks
#: for them instead).
_NOISY = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http",
    "opentelemetry.sdk.trace.export",
)


#: The SDK's span queue, which warns on every span it drops when full (a stream that outruns
#: the exporter): said once per process (``_FirstOnly``), then counted silently.
_QUEUE = "opentelemetry.sdk._shared_internal"


class _FirstOnly(logging.Filter):
    """Let the first record through, drop the rest (and count them)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        self.seen += 1
        return self.seen == 1


def _otel() -> Any:
    try:
        from opentelemetry import trace
    except ImportError as exc:  # pragma: no cover - the extra is in dev
        raise OmniflowError("tracing needs OpenTelemetry: pip install 'omniflow[otel]'") from exc
    return trace


class Tracing:
    """The runtime's tracer and what it needs per span, built once."""

    def __init__(self, provider: Any) -> None:
        trace = _otel()
        from opentelemetry.trace import Link, NonRecordingSpan, SpanKind, Status, StatusCode

        #: The TracerProvider given (or built from an endpoint).
        self.provider = provider
        #: omniflow's tracer.
        self.tracer = provider.get_tracer("omniflow")
        self.set_span_in_context = trace.set_span_in_context
        self.Link = Link
        self.NonRecordingSpan = NonRecordingSpan
        self.INTERNAL = SpanKind.INTERNAL
        self.SERVER = SpanKind.SERVER
        self.Status = Status
        self.ERROR = StatusCode.ERROR

    def error(self, description: str) -> Any:
        """An error status saying ``description`` (an exception's type name)."""
        return self.Status(self.ERROR, description)

    def shutdown(self) -> None:
        """Flush what is batched and stop the exporter (only for a provider omniflow built)."""
        shutdown = getattr(self.provider, "shutdown", None)
        if shutdown is not None:
            shutdown()


def otlp_provider(endpoint: str, *, timeout: float = 5.0) -> Any:
    """A TracerProvider exporting over OTLP/HTTP (protobuf) to ``endpoint/v1/traces`` in
    batches, off the event loop; service name ``omniflow`` unless ``OTEL_SERVICE_NAME`` says."""
    _otel()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": "omniflow"}))
    exporter = _LogOnce(OTLPSpanExporter(endpoint=url, timeout=timeout), url)
    provider.add_span_processor(BatchSpanProcessor(exporter))  # type: ignore[arg-type]
    _ENDPOINTS[provider] = url
    return provider


#: Providers ``otlp_provider`` built -> their collector's URL (what workers export to).
_ENDPOINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def otlp_endpoint(provider: Any) -> str | None:
    """The collector URL of a provider ``otlp_provider`` built (None for any other: a
    provider the caller built cannot be rebuilt in a worker)."""
    try:
        return _ENDPOINTS.get(provider)
    except TypeError:  # (an unhashable provider is not one of ours)
        return None


def global_otlp_provider(endpoint: str) -> Any:
    """Make an ``otlp_provider`` the process's global provider (a worker whose front exports
    to ``endpoint``): spans a role's method starts with ``opentelemetry.trace.get_tracer``
    are exported there, under the activation's span (``attach_traceparent``)."""
    provider = otlp_provider(endpoint)
    _otel().set_tracer_provider(provider)
    return provider


class _LogOnce:
    """An exporter that drops a batch the collector did not take and logs that once per
    outage (the SDK's own exporter warns, and retries, on every batch)."""

    def __init__(self, inner: Any, url: str) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._inner = inner
        self._url = url
        self._ok = SpanExportResult.SUCCESS
        self._failure = SpanExportResult.FAILURE
        #: The last batch failed (the next failure is the same outage: not logged).
        self.down = False
        #: Batches dropped.
        self.dropped = 0
        for name in _NOISY:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        queue = logging.getLogger(_QUEUE)
        if not any(isinstance(f, _FirstOnly) for f in queue.filters):
            queue.addFilter(_FirstOnly())

    def export(self, spans: Any) -> Any:
        try:
            result = self._inner.export(spans)
        except Exception:
            result = self._failure
        if result is self._ok:
            self.down = False
            return result
        self.dropped += 1
        if not self.down:
            self.down = True
            logger.warning(
                "OTLP collector at %s did not take a batch of %d spans; dropping spans until "
                "it does (calls are not affected)",
                self._url,
                len(spans),
            )
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        result: bool = self._inner.force_flush(timeout_millis)
        return result


def traceparent(span: Any) -> str:
    """The W3C ``traceparent`` of ``span``."""
    sc = span.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def parse_traceparent(value: str) -> Any:
    """The OpenTelemetry Context that a W3C ``traceparent`` names (an empty one when it is
    malformed: a bad header starts a new trace, it never fails the request)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": value})


def attach_traceparent(value: str) -> None:
    """Make ``value`` the current trace context (in the running contextvars context): a
    worker runs a method under its activation's span, so spans the method makes nest there.
    Without OpenTelemetry installed the context is ignored."""
    try:
        from opentelemetry import context
    except ImportError:  # pragma: no cover - the extra is in dev
        return
    context.attach(parse_traceparent(value))
