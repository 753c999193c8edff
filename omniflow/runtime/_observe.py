"""The call core, observed: stage metrics and a span per activation, from the stimuli alone.

>>> core = ObservedCore(compiled, "c1", metrics=rt.metrics, tracing=None)   # doctest: +SKIP

The runtime builds this subclass of ``CallCore`` instead of the plain one only while metrics or
tracing are on (``Calls.start``): the plain core, and so the hot path with both off,
carries no hook at all. Everything here is read off what goes in and out of ``handle``:

* an activation is *ready* when the core admits it (``_admit``: its inputs are complete) and
  *started* when the core hands it out to run (``Instructions.run``); the gap is the node's
  queue wait (session order, ``max_concurrency``, loop bounds);
* an activation is made by the stimulus during which the core admits it: one of
  ``Produced(act, ...)`` or ``Returned(act, ...)`` by a frame of ``act`` (its span's parent is
  ``act``'s span, even when it waited for its turn), one of ``Start`` by the call (the call
  span is its parent);
* a bucketed activation (a join, a diamond's merge) knows the activations whose frames it
  took as inputs, by the identity of the values the frames carried (remembered only while
  tracing, for the life of the call): its parent is the one whose frame completed the bucket
  when that is known (the bucket fired on that frame), else the producer of its first input
  (a bucket fired when its other streams ended, or at a deferred settle), and every other
  producer is a link;
* an activation's span ends with its ``Returned`` or ``Ended`` (an error sets the span's
  status to the exception's type, never its message, which may quote a value); the call span
  ends when the call finishes, after every output stream ended;
* the first frame of each output field in a call observes the time to first frame.

No attribute carries a field's value: only graph, node, role, OR group, replica, frame count.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from omniflow._media import Audio
from omniflow.runtime._metrics import Histogram, NodeMetrics, RuntimeMetrics
from omniflow.runtime.callcore._core import Activation, CallCore
from omniflow.runtime.callcore._stimuli import Ended, Instructions, Produced, Returned, Stimulus

if TYPE_CHECKING:
    import random
    from collections import deque

    from omniflow.plan import NodeSpec
    from omniflow.runtime._tracing import Tracing
    from omniflow.runtime.callcore._compiled import Compiled

__all__ = ["ObservedCore"]

#: The ``omniflow.replica`` of an activation that runs in the front process.
FRONT = "front"


class ObservedCore(CallCore):
    """A ``CallCore`` that records stage metrics and spans as it answers."""

    def __init__(
        self,
        compiled: Compiled,
        call_id: str,
        *,
        story: deque[tuple[Any, ...]] | None = None,
        shuffle: random.Random | None = None,
        metrics: RuntimeMetrics | None = None,
        tracing: Tracing | None = None,
        parent: Any = None,
        session: str | None = None,
    ) -> None:
        super().__init__(compiled, call_id, story=story, shuffle=shuffle)
        #: The runtime's metrics (None: off).
        self.metrics = metrics
        #: The tracer (None: off).
        self.tracing = tracing
        #: When the call started (``time.perf_counter``).
        self.t_start = time.perf_counter()
        #: Activations admitted and not handed out yet -> when they were admitted.
        self.ready_at: dict[Activation, float] = {}
        #: The activation whose frame is being handled (None: another stimulus), and what
        #: it made that waits to run (traced activations admitted and not handed out yet).
        self._cause: Activation | None = None
        self.made_by: dict[Activation, Activation | None] = {}
        #: Output fields whose first frame was seen.
        self.first_seen: set[str] = set()
        #: Output fields that carried ``of.Audio`` -> seconds of audio they carried so far.
        self.audio_s: dict[str, float] = {}
        #: node -> its metrics (looked up once per call).
        self._nodes: dict[str, NodeMetrics] = {}
        #: The call span, and each running activation's span.
        self.call_span: Any = None
        self.spans: dict[Activation, Any] = {}
        #: Frames each traced activation produced so far.
        self.frames: dict[Activation, int] = {}
        #: id(value) -> (value, the span context of the activation whose frame carried it):
        #: what a bucketed activation links to.
        self.producers: dict[int, tuple[Any, Any]] = {}
        self._call_ctx: Any = None
        if tracing is not None:
            span = tracing.tracer.start_span(
                "omniflow.call",
                context=parent,
                kind=tracing.INTERNAL,
                attributes={
                    "omniflow.graph": self.graph,
                    "omniflow.call_id": call_id,
                    "omniflow.session": session or "",
                },
            )
            self.call_span = span
            self._call_ctx = tracing.set_span_in_context(span)

    # ------------------------------------------------------------------ the core's hooks

    def _admit(self, act: Activation) -> None:
        self.ready_at[act] = time.perf_counter()
        if self.tracing is not None:
            self.made_by[act] = self._cause
        super()._admit(act)

    def handle(self, stimulus: Stimulus) -> Instructions:
        tracing = self.tracing
        cause: Activation | None = None
        kind = type(stimulus)
        if kind is Produced or kind is Returned:
            cause, frame = stimulus[0], stimulus[1]  # type: ignore[misc,assignment]
            if tracing is not None and frame is not None and cause in self.spans:
                self._produced(cause, frame)
        self._cause = cause
        ins = super().handle(stimulus)
        self._cause = None
        now = time.perf_counter()
        if ins.run:
            self._started(ins.run, cause, now)
        if tracing is not None and (kind is Returned or kind is Ended):
            ended: Activation = stimulus[0]  # type: ignore[misc,assignment]
            span = self.spans.pop(ended, None)
            if span is not None:
                exc: BaseException | None = stimulus[1] if kind is Ended else None  # type: ignore[misc,assignment]
                self._end_span(ended, span, exc)
        if ins.emit and self.metrics is not None:
            self._first_frames(ins, now)
        if ins.finished:
            if self.audio_s:
                self._audio_rtf()
            if tracing is not None:
                self._end_call()
        return ins

    # ------------------------------------------------------------------ recording

    def _produced(self, act: Activation, frame: Any) -> None:
        self.frames[act] = self.frames.get(act, 0) + 1
        if type(frame) is dict and self.c.bucket_nodes:  # (only bucketed activations link)
            sc = self.spans[act].get_span_context()
            for v in frame.values():
                self.producers[id(v)] = (v, sc)

    def _node(self, node: str) -> NodeMetrics:
        nm = self._nodes.get(node)
        if nm is None:
            assert self.metrics is not None
            nm = self._nodes[node] = self.metrics.node(self.graph, node)
        return nm

    def _started(self, run: tuple[Activation, ...], cause: Activation | None, now: float) -> None:
        ready_at = self.ready_at
        metrics = self.metrics
        for act in run:
            t = ready_at.pop(act, now)
            if metrics is not None:
                nm = self._node(act.node)
                nm.started += 1
                nm.queue_wait.observe(now - t)
            if self.tracing is not None:
                self._start_span(act, cause)

    def _start_span(self, act: Activation, cause: Activation | None) -> None:
        tracing = self.tracing
        assert tracing is not None
        cause = self.made_by.pop(act, cause)
        parent_span = self.spans.get(cause) if cause is not None else None
        links = None
        if act.node in self.c.bucket_nodes:
            inputs: list[Any] = []  # the producers' span contexts, first input first
            for v in _values(act.kwargs, self.c.specs[act.node]):
                got = self.producers.get(id(v))
                if got is not None and got[0] is v and got[1] not in inputs:
                    inputs.append(got[1])
            parent_sc = parent_span.get_span_context() if parent_span is not None else None
            if parent_sc not in inputs and inputs:
                parent_sc = inputs[0]
                parent_span = tracing.NonRecordingSpan(parent_sc)
            links = [tracing.Link(sc) for sc in inputs if sc != parent_sc]
        ctx = (
            tracing.set_span_in_context(parent_span) if parent_span is not None else self._call_ctx
        )
        span = tracing.tracer.start_span(
            act.node,
            context=ctx,
            kind=tracing.INTERNAL,
            links=links,
            attributes={
                "omniflow.node": act.node,
                "omniflow.role": self.c.specs[act.node].role,
                "omniflow.or_group": act.group,
                "omniflow.replica": FRONT,
                "omniflow.activation": act.aid,
            },
        )
        self.spans[act] = span

    def _end_span(self, act: Activation, span: Any, exc: BaseException | None) -> None:
        tracing = self.tracing
        assert tracing is not None
        span.set_attribute("omniflow.frames", self.frames.pop(act, 0))
        if exc is not None:
            span.set_status(tracing.error(type(exc).__name__))
        span.end()

    def _first_frames(self, ins: Instructions, now: float) -> None:
        metrics = self.metrics
        assert metrics is not None
        seen = self.first_seen
        for f, value, *_ in ins.emit:
            if f not in seen:
                seen.add(f)
                _observe_into(metrics.first_frame, (self.graph, f), now - self.t_start)
            if type(value) is Audio:  # time to first audio, and seconds of audio made
                if f not in self.audio_s:
                    self.audio_s[f] = 0.0
                    _observe_into(metrics.first_audio, (self.graph, f), now - self.t_start)
                self.audio_s[f] += value.duration

    def _audio_rtf(self) -> None:
        """Real-time factor of each audio output: seconds the call took per second of audio."""
        assert self.metrics is not None
        took = time.perf_counter() - self.t_start
        for f, made in self.audio_s.items():
            if made > 0:
                _observe_into(self.metrics.audio_rtf, (self.graph, f), took / made)

    def _end_call(self) -> None:
        for act, span in list(self.spans.items()):  # cancelled, or lost with the call
            self._end_span(act, span, None)
        self.spans.clear()
        self.producers.clear()
        self.made_by.clear()
        span = self.call_span
        if span is not None:
            self.call_span = None
            span.set_attribute("omniflow.status", self.status)
            span.end()

    # ------------------------------------------------------------------ the shell's hooks

    def placed(self, act: Activation, replica: str) -> str | None:
        """``act`` was sent to ``replica`` (``RemoteRoles.submit``): name it on the span and
        return the ``traceparent`` the run carries (None while not traced)."""
        span = self.spans.get(act)
        if span is None:
            return None
        from omniflow.runtime._tracing import traceparent

        span.set_attribute("omniflow.replica", replica)
        return traceparent(span)


def _observe_into(table: dict[tuple[str, str], Histogram], key: tuple[str, str], v: float) -> None:
    h = table.get(key)
    if h is None:
        h = table[key] = Histogram()
    h.observe(v)


def _values(kwargs: dict[str, Any], spec: NodeSpec) -> list[Any]:
    """The frame values an activation's inputs hold (a collect or count field's list holds
    one per frame)."""
    many = spec.collect | {f for f, _ in spec.count}
    out: list[Any] = []
    for f, v in kwargs.items():
        if f in many and type(v) is list:
            out.extend(v)
        else:
            out.append(v)
    return out
