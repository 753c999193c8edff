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
(``runtime/_forward.py``). ``tp`` the W3C ``traceparent`` of the activation's span while the
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

On the wire a message is sealed (``_auth``: a MAC over every frame, checked before anything
is decoded) around the codec's envelope: ``kind`` and the message's fields as a msgpack array
in declaration order (trailing fields at their defaults may be left out: ``encode_fields``).
Field values that are not plain data (a frame's objects, a DataRef) are pickled, and are
unpickled only once the MAC held. ``decode_msg`` checks the kind and every field's type and
raises ``ProtocolError`` (with ``reason`` "malformed" or "unknown_kind") for anything else;
receivers drop such a message, count it and log it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from omniflow._exceptions import TransportError
from omniflow.transport._codec import Buffer, decode_message, encode, unpack_small

__all__ = [
    "MAX_BATCH",
    "MESSAGES",
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
    "ProtocolError",
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
    "batch",
    "decode_inner",
    "decode_msg",
    "encode_fields",
    "encode_msg",
    "kind_of",
]

_N = type(None)
_ANY = (object,)


class ProtocolError(TransportError):
    """A message that authenticated but is not one this protocol knows (``reason`` says how)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


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
    #: Its opened Params Pools' ``stats()`` by pool name (None: it has opened none).
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


#: The fields of a run (a forward is one, after whom it is for: ``ft``, ``rid``; its ``a`` is
#: always a forwarded wire id, a str).
_RUN: tuple[tuple[type, ...], ...] = (
    (str,),
    (int, str),
    (str,),
    (dict,),
    (str, _N),
    (int,),
    (int,),
    (str,),
    (list, _N),
    (int, _N),
    (dict, _N),
    (list, _N),
    (str, _N),
)
#: The fields of a ``Forwards``: ft, rid, c, n, f, s, g, gr, the three lists, then as a run's.
_FORWARDS: tuple[tuple[type, ...], ...] = (
    (str,), (str,), (str,), (str,), (str,), (str, _N), (int,), (str,), (list,), (list,), (list,),
    *_RUN[8:],
)  # fmt: skip
#: message type -> (kind, allowed types of each field, in order).
_SPEC: dict[type, tuple[str, tuple[tuple[type, ...], ...]]] = {
    Batch: ("batch", ((list,),)),
    Hello: ("hello", ((str,), (float, int))),
    Ready: ("ready", ((str,), (list,), (int,))),
    Run: ("run", _RUN),
    Forward: ("forward", ((str,), (str,), _RUN[0], (str,), *_RUN[2:])),  # (its wire id: a str)
    Forwards: ("forwards", _FORWARDS),
    Cancel: ("cancel", ((str,), (int, str))),
    Frame: ("frame", ((str,), (int, str), _ANY, (list, _N))),
    Frames: ("frames", ((str,), (int, str), (list,), (list, _N))),
    Done: (
        "done",
        ((str,), (int, str), _ANY, (str, _N), (str, _N), (bool,), (str, _N), (list, _N)),
    ),
    Dones: ("dones", ((list,), (list,), (list,), (list,))),
    Claim: ("claim", ((int,), (str,), (list,))),
    Claimed: ("claimed", ((int,), (str,), (list,))),
    Release: ("release", ((list,),)),
    EndCall: ("end_call", ((str,), (bool,))),
    CallEnded: ("call_ended", ((str,),)),
    SourceLost: ("source_lost", ((str,), (int,))),
    StatsRequest: ("stats", ((int,),)),
    StatsReply: ("stats_reply", ((int,), (str,), (int,), (dict,), (dict,), (dict, _N), (dict, _N))),
    CloseSession: ("close_session", ((str,),)),
    Stop: ("stop", ()),
    Bye: ("bye", ()),
    Heartbeat: ("heartbeat", ((dict, _N),)),
    Pull: ("pull", ((int,), _ANY)),
    Pulled: ("pulled", ((int,), _ANY)),
    PullFailed: ("pull_failed", ((int,), (str,))),
    MetaCall: ("meta_call", ((int,), (str,), (list,))),
    MetaReply: ("meta_reply", ((int,), _ANY, (str, _N))),
    MetaNotify: ("meta_notify", ((str,), (str, _N), (list,))),
}


Message = (
    Batch | Hello | Ready | Run | Forward | Forwards | Cancel | Frame | Frames | Done | Dones
    | Claim | Claimed | Release | EndCall | CallEnded | SourceLost | StatsRequest | StatsReply
    | CloseSession | Stop | Bye | Heartbeat | Pull | Pulled | PullFailed | MetaCall | MetaReply
    | MetaNotify
)  # fmt: skip
#: kind -> (message type, allowed types of each field).
MESSAGES: dict[str, tuple[Any, tuple[tuple[type, ...], ...]]] = {
    kind: (cls, types) for cls, (kind, types) in _SPEC.items()
}
#: kind -> (type, fewest fields, most fields, (field index, exact types allowed) to check).
_CHECKS: dict[str, tuple[Any, int, int, tuple[tuple[int, tuple[type, ...]], ...]]] = {
    kind: (
        cls,
        len(types) - len(cls._field_defaults),
        len(types),
        tuple((i, t) for i, t in enumerate(types) if t is not _ANY),
    )
    for kind, (cls, types) in MESSAGES.items()
}
_KIND: dict[type, str] = {cls: kind for cls, (kind, _types) in _SPEC.items()}
#: kind -> the shapes (exact field types, in order) its checks passed; at most _GOOD_SHAPES.
_GOOD: dict[str, set[tuple[type, ...]]] = {kind: set() for kind in _CHECKS}
_GOOD_SHAPES = 64


def kind_of(msg: Message) -> str:
    """The wire kind of ``msg``."""
    return _KIND[type(msg)]


def encode_msg(msg: Message) -> list[Buffer]:
    """The envelope of ``msg`` (not yet sealed: the connection's writer seals it)."""
    return encode(list(msg), kind=_KIND[type(msg)], pickle=True)


def encode_fields(cls: Any, *fields: Any) -> list[Buffer]:
    """The envelope of a ``cls`` message of which only the leading ``fields`` are given (the
    others decode as their defaults): what ``encode_msg(cls(*fields))`` carries, without
    building the message, in fewer bytes (the hot path's frames, dones and forwards)."""
    return encode(list(fields), kind=_KIND[cls], pickle=True)


def decode_msg(frames: list[Any], *, owned: bool = True) -> Message:
    """The message in already authenticated ``frames``; ProtocolError for anything else.

    Big values come back as owned, writable copies (``owned=True``, what a method must get);
    ``owned=False`` leaves them views of the frames, for a receiver that copies them itself."""
    try:
        small = unpack_small(frames, allow_pickle=True)
        kind, body = (
            small if small is not None else decode_message(frames, allow_pickle=True, owned=owned)
        )
    except TransportError as exc:
        raise ProtocolError(str(exc), "malformed") from None
    except Exception as exc:  # bytes msgpack cannot unpack; an authenticated pickle that fails
        raise ProtocolError(
            f"malformed message: {type(exc).__name__}: {exc}", "malformed"
        ) from None
    check = _CHECKS.get(kind)
    if check is None:
        raise ProtocolError(f"unknown message kind {kind!r:.40}", "unknown_kind")
    cls, fewest, most, fields = check
    if type(body) is not list or not fewest <= len(body) <= most:
        raise ProtocolError(
            f"malformed {kind}: {len(body) if type(body) is list else 'no'} fields where "
            f"{most} are expected",
            "malformed",
        )
    # The exact types of the fields, in order: a hot path repeats a few shapes, so after the
    # first of each shape its check is one set lookup (a bounded set per kind).
    shape = tuple(map(type, body))
    good = _GOOD[kind]
    if shape not in good:
        n = len(body)
        for i, allowed in fields:
            # Exact types: what msgpack decodes is never a subclass, and a bool is not an int.
            if i < n and shape[i] not in allowed:
                raise ProtocolError(
                    f"malformed {kind}: {cls._fields[i]!r} is a {shape[i].__name__}, "
                    f"expected {' or '.join(t.__name__ for t in allowed)}",
                    "malformed",
                )
        if len(good) < _GOOD_SHAPES:
            good.add(shape)
    msg: Message = cls(*body)
    return msg


def batch(items: list[list[Buffer]]) -> list[list[Buffer]]:
    """The messages ``items`` (encoded envelopes, in order) as few messages as can carry them:
    runs of single-frame envelopes become ``Batch`` messages of at most MAX_BATCH; a message
    with out-of-band frames goes alone, in its place (one message: ``items`` itself)."""
    if len(items) == 1:
        return items
    out: list[list[Buffer]] = []
    run: list[bytes] = []

    def close_run() -> None:
        if len(run) == 1:
            out.append([run[0]])
        elif run:
            out.append(encode_msg(Batch(list(run))))
        run.clear()

    for frames in items:
        if len(frames) == 1:
            run.append(bytes(frames[0]))
            if len(run) == MAX_BATCH:
                close_run()
        else:
            close_run()
            out.append(frames)
    close_run()
    return out


def decode_inner(m: Any) -> Message:
    """One message of a ``Batch`` (ProtocolError for anything else, or a nested batch)."""
    if type(m) is not bytes:
        raise ProtocolError(f"malformed batch: an item is a {type(m).__name__}", "malformed")
    msg = decode_msg([m])
    if type(msg) is Batch:
        raise ProtocolError("malformed batch: a batch inside a batch", "malformed")
    return msg
