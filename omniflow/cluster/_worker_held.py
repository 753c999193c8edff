"""What a worker holds on its way out: the fast-path routes of a running activation, the
links to other workers, and the gathered batches of ends and forwards that leave as one message
(``Dones``, ``Forwards``) when a received batch is handled (docs/fast-path.md, *Batches*).

Plain records and encoders: no I/O, nothing of the Worker (``_worker_state`` and the parts
built on it use them).
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections import deque
from typing import Any

from omniflow._exceptions import OmniflowError
from omniflow.cluster._forward import Route
from omniflow.transport._auth import PlainSealer, Sealer
from omniflow.transport._protocol import (
    MAX_BATCH,
    Done,
    Dones,
    Forward,
    Forwards,
    Run,
    encode_fields,
    encode_msg,
)

logger = logging.getLogger("omniflow.worker")

#: Values a forward may carry in a ``Forwards`` (encoded at the flush): immutable, so what
#: leaves is what the frame held when it was forwarded. Others are encoded at once, alone.
SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


class Fw:
    """The fast-path routes of one running activation, and its next frame index."""

    __slots__ = ("a", "c", "ft", "gr", "k", "n", "q", "routes", "s", "tp")

    def __init__(self, routes: tuple[Route, ...], run: Run, ft: str) -> None:
        self.routes = routes
        #: The run's traceparent: its forwards carry it on (None: not traced).
        self.tp = run.traceparent
        self.c = run.call_id
        self.a = run.aid
        self.n = run.node
        self.s = run.session
        self.gr = run.graph
        self.q = run.seq
        self.ft = ft
        self.k = 0


class Link:
    """This worker's connection to another worker it forwards runs to (one per address)."""

    __slots__ = ("endpoint", "out", "sealer", "writer")

    def __init__(self, endpoint: Any, sealer: Sealer | PlainSealer) -> None:
        self.endpoint = endpoint
        self.sealer = sealer
        #: Messages that could not go out at once, in order (the writer sends them).
        self.out: deque[list[Any]] = deque()
        self.writer: asyncio.Task[None] | None = None


class _Unsendable(OmniflowError):
    """A frame the codec cannot carry; the activation fails with this error."""

    @classmethod
    def sending(cls, exc: Exception) -> _Unsendable:
        return cls(f"a frame could not be sent to the front: {exc}")


def failed_done(c: str, a: int | str, exc: BaseException) -> Done:
    """The done of an activation that failed with ``exc`` (a cancellation says so)."""
    if isinstance(exc, asyncio.CancelledError):
        return Done(c, a, None, type(exc).__name__, str(exc), True)
    tb = "".join(traceback.format_exception(exc))
    return Done(c, a, None, type(exc).__name__, str(exc), False, tb)


class DoneBatch:
    """Good ends held for one peer, in order: encoded together when the held messages leave."""

    __slots__ = ("as_", "cs", "fs", "xs")

    def __init__(self, c: str, a: int | str, frame: Any, x: list[Any] | None) -> None:
        self.cs = [c]
        self.as_ = [a]
        self.fs = [frame]
        self.xs = [x]

    def encoded(self) -> list[list[Any]]:
        """The envelopes: one ``Dones`` (a ``Done`` for one end). A frame the wire cannot
        carry fails its activation alone: then each end is encoded on its own (what such a
        one forwarded, the front orphans, as for a ``Done``)."""
        if len(self.cs) > 1:
            try:
                return [encode_fields(Dones, self.cs, self.as_, self.fs, self.xs)]
            except Exception:  # (rare: find the one that cannot be sent)
                pass
        return [encoded_done(*end) for end in zip(self.cs, self.as_, self.fs, self.xs, strict=True)]


def encoded_done(c: str, a: int | str, frame: Any, x: list[Any] | None) -> list[Any]:
    """The envelope of one good end; a failed one if the wire cannot carry ``frame``."""
    try:
        if x is not None:
            return encode_fields(Done, c, a, frame, None, None, False, None, x)
        return encode_fields(Done, c, a, frame) if frame is not None else encode_fields(Done, c, a)
    except Exception as e:
        return encode_msg(failed_done(c, a, _Unsendable.sending(e)))


def envelopes(held: list[list[Any] | FwdBatch] | list[list[Any] | DoneBatch]) -> list[list[Any]]:
    """Held messages in order, a gathered batch (``FwdBatch``, ``DoneBatch``) as the
    envelopes it encodes to."""
    out: list[list[Any]] = []
    for item in held:
        if isinstance(item, list):
            out.append(item)
        else:
            out.extend(item.encoded())
    return out


class FwdBatch:
    """Forwards held for one link, in order, that share their front, replica, call, node,
    field, session, group, graph and routes (one route of runs with equal ``Fw`` fields):
    encoded together when the held messages leave."""

    __slots__ = ("as_", "c", "ft", "gr", "qs", "route", "s", "tp", "vs")

    def __init__(self, fw: Fw, route: Route, wid: str, value: Any, q: int) -> None:
        self.ft, self.c, self.s, self.gr, self.tp = fw.ft, fw.c, fw.s, fw.gr, fw.tp
        self.route = route
        self.as_ = [wid]
        self.vs = [value]
        self.qs = [q]

    def takes(self, fw: Fw, route: Route) -> bool:
        """Whether a forward of ``fw`` by ``route`` shares everything but its id, value, q."""
        return (
            route is self.route
            and fw.c == self.c
            and fw.ft == self.ft
            and fw.s == self.s
            and fw.gr == self.gr
            and fw.tp == self.tp
            and len(self.as_) < MAX_BATCH
        )

    def encoded(self) -> list[list[Any]]:
        """The envelopes: one ``Forwards`` (a ``Forward`` for one). A value the wire cannot
        carry (a str with a lone surrogate) is not forwarded: its frame cannot reach the
        front either, so its activation fails there, and the front never expects this run."""
        r = self.route
        if len(self.as_) > 1:
            try:
                return [encode_fields(
                    Forwards, self.ft, r.replica, self.c, r.node, r.field, self.s, r.group, self.gr,
                    self.as_, self.vs, self.qs, r.offload, r.threshold, r.connectors, r.subroutes,
                    self.tp,
                )]  # fmt: skip
            except Exception:  # (rare: find the ones that cannot be sent)
                pass
        out = []
        for wid, value, q in zip(self.as_, self.vs, self.qs, strict=True):
            try:
                out.append(encode_fields(
                    Forward, self.ft, r.replica, self.c, wid, r.node, {r.field: value}, self.s,
                    r.group, q, self.gr, r.offload, r.threshold, r.connectors, r.subroutes, self.tp,
                ))  # fmt: skip
            except Exception as exc:
                logger.debug("forward %s not sent: %s", wid, exc)
        return out
