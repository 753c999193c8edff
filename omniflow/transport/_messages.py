"""The worker protocol: one small immutable type per message the processes say to each other.

    front -> worker                            worker -> front
    Hello  (front, interval)                   Ready  (replica, roles, pid)
    Run    (c, a, n, k, s, g, q, gr,           Frame  (c, a, f, x)         (any number)
            off, th, conn, fw, tp)             Frames (c, a, fs, xs)       (several, in order)
    Cancel (c, a)                              Done   (c, a, f, et, em, cancel, tb, x)
                                               Dones  (cs, as_, fs, xs)    (good ends, together)
    Release (refs)   EndCall (c, ack)          Heartbeat (st)              (every interval)
                                               CallEnded (c)  (EndCall's ack: released)
    SourceLost (addr, pid)                     StatsReply (r, replica, pid, plane, wire, work,
                                                           pools)
    StatsRequest (r)   CloseSession (s)
    Stop ()                                    Bye ()  (leaving; repeated while it drains)
    Bye ()     (answer to the worker's bye)        MetaCall (r, op, args)     (front-hosted
    MetaReply (r, v, e)                                                   pool metadata)
    MetaNotify (p, s, keys)  (pages published in a chain the worker's pool subscribed to)
    Claim (r, c, ws)                           Claimed (r, c, missing)
      (forwarded runs whose forwarder was lost: the ones not here never run here)

    consumer worker -> producer worker (the zmq connector, on the producer's endpoint)
    Pull (r, h)                                Pulled (r, data)  or  PullFailed (r, error)

    upstream worker -> downstream worker (the fast path: no answer; results go to the front)
    Forward (ft, rid, c, a, n, k, s, g, q, gr, off, th, conn, fw, tp)
    Forwards (ft, rid, c, n, f, s, g, gr, as_, vs, qs, off, th, conn, fw, tp)   (several)

    either way
    Batch (ms)   several single-frame messages to one peer, sealed once (``batch``)

``c`` call id, ``a`` activation id, ``n`` node, ``k`` keyword arguments, ``s`` session,
``g`` OR group, ``q`` SeqId index, ``gr`` graph; ``off`` outputs to put in the worker's pool,
``th`` the front's offload threshold (None: the default), ``conn`` source node -> connector.
``fw`` the run's fast-path routes: one ``[field, node, group, address, replica id, off, th,
conn, q from the frame index, sub-routes]`` per downstream node the worker may start itself
(``cluster/_forward.py``). ``tp`` the W3C ``traceparent`` of the activation's span while the
front traces (None: not traced, and left off the wire); a forward carries its upstream run's.
A frame's ``x`` lists ``[route index, wire id]`` of the runs its
worker forwarded for it (``xs``: one such list or None per frame of ``Frames``). ``a`` is the
front's activation id (an int) or, for a forwarded run, its wire id (a str, ``"<upstream wire
id>.<frame index>.<route index>"``). A ``Forward`` is a ``Run`` one worker sends another on
behalf of front ``ft`` to replica ``rid``. ``Forwards`` is forwards one worker had for one
link at once that share everything but their wire id, value and SeqId index (same front,
replica, call, node, field, session, group, graph and routes), as flat lists of one length:
record ``i`` is ``Forward(ft, rid, c, as_[i], n, {f: vs[i]}, s, g, qs[i], gr, off, th, conn,
fw)``; the receiver checks each record's types and drops a bad one alone.
A ``Done`` carries the coroutine's returned frame ``f`` (None: none; the front applies it
first) and, for a failure, the exception's type name ``et``, message ``em``, whether it was a
cancellation, and the formatted traceback ``tb``. ``Dones`` is the good ends (no error) a
worker had for one front at once, as flat lists of the same length: record ``i`` is
``Done(cs[i], as_[i], fs[i], x=xs[i])``. It is decoded in one go; the front checks each
record's types and drops a bad one alone.
An ``EndCall`` with ``ack`` True is answered by ``CallEnded(c)`` once what the call left in the
worker is released, its Params Pool pages included (the front's end of a call waits for it
when the runtime has pools).
A ``Claim`` asks a worker which of the forwarded runs ``ws`` (wire ids) of call ``c`` it holds,
after their forwarder was lost: the ``Claimed`` answer lists those ``missing`` (neither
running nor pulling their inputs there), and each of them, should its forward still come,
ends at once as cancelled without running.

How they travel (sealed, encoded, checked) is ``_protocol``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "MAX_BATCH",
    "Batch",
    "Bye",
    "CallEnded",
    "Cancel",
    "Claim",
    "Claimed",
    "CloseSession",
    "Done",
    "Dones",
    "EndCall",
    "Forward",
    "Forwards",
    "Frame",
    "Frames",
    "Heartbeat",
    "Hello",
    "Message",
    "MetaCall",
    "MetaNotify",
    "MetaReply",
    "Pull",
    "PullFailed",
    "Pulled",
    "Ready",
    "Release",
    "Run",
    "SourceLost",
    "StatsReply",
    "StatsRequest",
    "Stop",
]


#: Most messages in one ``Batch``.
MAX_BATCH = 256


class Batch(NamedTuple):
    """Messages to one peer that were ready together: each an encoded single-frame envelope,
    all under the batch's one MAC (no batch inside a batch)."""

    ms: list[bytes]


class Hello(NamedTuple):
    front: str
    interval: float


class Ready(NamedTuple):
    replica: str
    roles: list[str]
    pid: int


class Run(NamedTuple):
    c: str
    a: int | str
    n: str
    k: dict[str, Any]
    s: str | None
    g: int
    q: int
    gr: str
    off: list[str] | None = None
    th: int | None = None
    conn: dict[str, str] | None = None
    fw: list[Any] | None = None
    tp: str | None = None


class Forward(NamedTuple):
    """A run one worker starts on another for front ``ft``, to replica ``rid`` only."""

    ft: str
    rid: str
    c: str
    a: str
    n: str
    k: dict[str, Any]
    s: str | None
    g: int
    q: int
    gr: str
    off: list[str] | None = None
    th: int | None = None
    conn: dict[str, str] | None = None
    fw: list[Any] | None = None
    tp: str | None = None


class Forwards(NamedTuple):
    """Forwards for one front, replica, call, node and field (``f``) that differ only in their
    wire id, value and SeqId index: record ``i`` is ``Forward(ft, rid, c, as_[i], n,
    {f: vs[i]}, s, g, qs[i], gr, off, th, conn, fw)`` (the lists have one length)."""

    ft: str
    rid: str
    c: str
    n: str
    f: str
    s: str | None
    g: int
    gr: str
    as_: list[str]
    vs: list[Any]
    qs: list[int]
    off: list[str] | None = None
    th: int | None = None
    conn: dict[str, str] | None = None
    fw: list[Any] | None = None
    tp: str | None = None


class Cancel(NamedTuple):
    c: str
    a: int | str


class Frame(NamedTuple):
    c: str
    a: int | str
    f: Any
    x: list[Any] | None = None


class Frames(NamedTuple):
    c: str
    a: int | str
    fs: list[Any]
    xs: list[Any] | None = None


class Done(NamedTuple):
    c: str
    a: int | str
    f: Any = None
    et: str | None = None
    em: str | None = None
    cancel: bool = False
    tb: str | None = None
    x: list[Any] | None = None


class Dones(NamedTuple):
    """Activations that ended without an error: record ``i`` is ``Done(cs[i], as_[i], fs[i],
    x=xs[i])`` (the lists have one length; ``as`` is a keyword, hence ``as_``)."""

    cs: list[str]
    as_: list[int | str]
    fs: list[Any]
    xs: list[list[Any] | None]


class Claim(NamedTuple):
    """Which of the forwarded runs ``ws`` of call ``c`` does the worker hold (request ``r``)?"""

    r: int
    c: str
    ws: list[str]


class Claimed(NamedTuple):
    """The answer to ``Claim`` ``r``: the runs it asked about that the worker does not hold
    (they will never run there)."""

    r: int
    c: str
    missing: list[str]


class Release(NamedTuple):
    refs: list[Any]


class EndCall(NamedTuple):
    c: str
    #: Answer with ``CallEnded(c)`` once the call's pages here are released.
    ack: bool = False


class CallEnded(NamedTuple):
    """What call ``c`` left in the worker is released (the answer to ``EndCall(c, ack=True)``)."""

    c: str


class SourceLost(NamedTuple):
    addr: str
    pid: int


class StatsRequest(NamedTuple):
    r: int


class StatsReply(NamedTuple):
    r: int
    replica: str
    pid: int
    plane: dict[str, int]
    wire: dict[str, int]
    #: What the worker holds now: activations ``running``, calls whose state here waits for
    #: the front's end_call (``calls``), runs with fast-path routes (``forwarding``), forward
    #: ``links`` and messages queued on them (``link_queued``).
    work: dict[str, int] | None = None
    #: Its opened Params Pools' ``stats()`` by pool name (None: none opened).
    pools: dict[str, Any] | None = None


class CloseSession(NamedTuple):
    s: str


class Stop(NamedTuple):
    """No fields."""


class Bye(NamedTuple):
    """No fields."""


class Heartbeat(NamedTuple):
    #: The worker's batchers' ``statistics()`` by node, when it runs batched nodes (None: none).
    st: dict[str, Any] | None = None


class Pull(NamedTuple):
    r: int
    h: Any


class Pulled(NamedTuple):
    r: int
    data: Any


class PullFailed(NamedTuple):
    r: int
    error: str


class MetaCall(NamedTuple):
    """A worker's call of the Params Pools' metadata hosted by its front (``kv._hosted``)."""

    r: int
    op: str
    args: list[Any]


class MetaReply(NamedTuple):
    """The front's answer to ``MetaCall`` ``r``: its value, or the error ``e``."""

    r: int
    v: Any
    e: str | None = None


class MetaNotify(NamedTuple):
    """Pages ``keys`` were published in session ``s``'s chain of pool ``p`` (one batch)."""

    p: str
    s: str | None
    keys: list[str]


Message = (
    Batch | Hello | Ready | Run | Forward | Forwards | Cancel | Frame | Frames | Done | Dones
    | Claim | Claimed | Release | EndCall | CallEnded | SourceLost | StatsRequest | StatsReply
    | CloseSession | Stop | Bye | Heartbeat | Pull | Pulled | PullFailed | MetaCall | MetaReply
    | MetaNotify
)  # fmt: skip
