"""The worker protocol: one small immutable type per message the processes say to each other.

    front -> worker                            worker -> front
    Hello  (front, interval)                   Ready  (replica, roles, pid)
    Run    (call_id, aid, node, kwargs,        Frame  (call_id, aid, frame, forwarded)
            session, group, seq, graph,                                     (any number)
            offload, threshold, connectors,    Frames (call_id, aid, frames, forwarded)
            routes, traceparent)                                       (several, in order)
    Cancel (call_id, aid)                      Done   (call_id, aid, frame, error_type,
                                                       error_message, cancelled, traceback,
                                                       forwarded)
                                               Dones  (call_ids, aids, frames, forwarded)
                                                                      (good ends, together)
    Release (refs)                             Heartbeat (batching)       (every interval)
    EndCall (call_id, ack)                     CallEnded (call_id)  (EndCall's ack: released)
    SourceLost (address, pid)                  StatsReply (request, replica, pid, plane, wire,
                                                           work, pools)
    StatsRequest (request)   CloseSession (session)
    Stop ()                                    Bye ()  (leaving; repeated while it drains)
    Bye ()     (answer to the worker's bye)    MetaCall (request, op, args)  (front-hosted
    MetaReply (request, value, error)                                      pool metadata)
    MetaNotify (pool, session, keys)  (pages published in a chain the worker's pool follows)
    Claim (request, call_id, wire_ids)         Claimed (request, call_id, missing)
      (forwarded runs whose forwarder was lost: the ones not here never run here)

    consumer worker -> producer worker (the zmq connector, on the producer's endpoint)
    Pull (request, handle)                     Pulled (request, data)
                                               or PullFailed (request, error)

    upstream worker -> downstream worker (the fast path: no answer; results go to the front)
    Forward  (front, replica, call_id, aid, node, kwargs, session, group, seq, graph,
              offload, threshold, connectors, routes, traceparent)
    Forwards (front, replica, call_id, node, field, session, group, graph, aids, values, seqs,
              offload, threshold, connectors, routes, traceparent)                (several)

    either way
    Batch (messages)   several single-frame messages to one peer, sealed once (``batch``)

The names cost nothing on the wire: a message travels as a msgpack array of its fields in
declaration order (``_protocol``), so renaming a field never changes a byte and reordering one
changes the protocol (tests/transport/test_wire_golden.py pins each kind's bytes).

A run's ``aid`` is the front's activation id (an int) or, for a forwarded run, its wire id (a
str, ``"<upstream wire id>.<frame index>.<route index>"``); ``group`` its OR group, ``seq`` its
SeqId index; ``offload`` the outputs to put in the worker's pool, ``threshold`` the front's
offload threshold (None: the default), ``connectors`` source node -> connector. ``routes`` are
the run's fast-path routes: one ``Route`` (``cluster/_forward.py``: ``[field, node, group,
address, replica, offload, threshold, connectors, seq_from_frame, subroutes]``) per downstream
node the worker may start itself. ``traceparent`` is the W3C ``traceparent`` of the
activation's span while the front traces (None: not traced, and left off the wire); a forward
carries its upstream run's. A frame's ``forwarded`` lists ``[route index, wire id]`` of the
runs its worker forwarded for it (in ``Frames``: one such list or None per frame). A
``Forward`` is a ``Run`` one worker sends another on behalf of ``front`` to ``replica``.
``Forwards`` is forwards one worker had for one link at once that share everything but their
wire id, value and SeqId index (same front, replica, call, node, field, session, group, graph
and routes), as flat lists of one length: record ``i`` is ``Forward(front, replica, call_id,
aids[i], node, {field: values[i]}, session, group, seqs[i], graph, offload, threshold,
connectors, routes)``; the receiver checks each record's types and drops a bad one alone.
A ``Done`` carries the coroutine's returned ``frame`` (None: none; the front applies it
first) and, for a failure, the exception's type name ``error_type``, its ``error_message``,
whether it was a cancellation, and the formatted ``traceback``. ``Dones`` is the good ends (no
error) a worker had for one front at once, as flat lists of the same length: record ``i`` is
``Done(call_ids[i], aids[i], frames[i], forwarded=forwarded[i])``. It is decoded in one go;
the front checks each record's types and drops a bad one alone.
An ``EndCall`` with ``ack`` True is answered by ``CallEnded(call_id)`` once what the call left
in the worker is released, its Params Pool pages included (the front's end of a call waits for
it when the runtime has pools).
A ``Claim`` asks a worker which of the forwarded runs ``wire_ids`` of call ``call_id`` it
holds, after their forwarder was lost: the ``Claimed`` answer lists those ``missing`` (neither
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

    messages: list[bytes]


class Hello(NamedTuple):
    front: str
    interval: float


class Ready(NamedTuple):
    replica: str
    roles: list[str]
    pid: int


class Run(NamedTuple):
    call_id: str
    aid: int | str
    node: str
    kwargs: dict[str, Any]
    session: str | None
    group: int
    seq: int
    graph: str
    offload: list[str] | None = None
    threshold: int | None = None
    connectors: dict[str, str] | None = None
    routes: list[Any] | None = None
    traceparent: str | None = None


class Forward(NamedTuple):
    """A run one worker starts on another for ``front``, to ``replica`` only."""

    front: str
    replica: str
    call_id: str
    aid: str
    node: str
    kwargs: dict[str, Any]
    session: str | None
    group: int
    seq: int
    graph: str
    offload: list[str] | None = None
    threshold: int | None = None
    connectors: dict[str, str] | None = None
    routes: list[Any] | None = None
    traceparent: str | None = None


class Forwards(NamedTuple):
    """Forwards for one front, replica, call, node and ``field`` that differ only in their
    wire id, value and SeqId index: record ``i`` is ``Forward(front, replica, call_id,
    aids[i], node, {field: values[i]}, session, group, seqs[i], graph, offload, threshold,
    connectors, routes)`` (the lists have one length)."""

    front: str
    replica: str
    call_id: str
    node: str
    field: str
    session: str | None
    group: int
    graph: str
    aids: list[str]
    values: list[Any]
    seqs: list[int]
    offload: list[str] | None = None
    threshold: int | None = None
    connectors: dict[str, str] | None = None
    routes: list[Any] | None = None
    traceparent: str | None = None


class Cancel(NamedTuple):
    call_id: str
    aid: int | str


class Frame(NamedTuple):
    call_id: str
    aid: int | str
    frame: Any
    forwarded: list[Any] | None = None


class Frames(NamedTuple):
    call_id: str
    aid: int | str
    frames: list[Any]
    forwarded: list[Any] | None = None


class Done(NamedTuple):
    call_id: str
    aid: int | str
    frame: Any = None
    error_type: str | None = None
    error_message: str | None = None
    cancelled: bool = False
    traceback: str | None = None
    forwarded: list[Any] | None = None


class Dones(NamedTuple):
    """Activations that ended without an error: record ``i`` is ``Done(call_ids[i], aids[i],
    frames[i], forwarded=forwarded[i])`` (the lists have one length)."""

    call_ids: list[str]
    aids: list[int | str]
    frames: list[Any]
    forwarded: list[list[Any] | None]


class Claim(NamedTuple):
    """Which of the forwarded runs ``wire_ids`` of call ``call_id`` does the worker hold?"""

    request: int
    call_id: str
    wire_ids: list[str]


class Claimed(NamedTuple):
    """The answer to ``Claim`` ``request``: the runs it asked about that the worker does not hold
    (they will never run there)."""

    request: int
    call_id: str
    missing: list[str]


class Release(NamedTuple):
    refs: list[Any]


class EndCall(NamedTuple):
    call_id: str
    #: Answer with ``CallEnded(call_id)`` once the call's pages here are released.
    ack: bool = False


class CallEnded(NamedTuple):
    """What call ``call_id`` left in the worker is released (the answer to
    ``EndCall(call_id, ack=True)``)."""

    call_id: str


class SourceLost(NamedTuple):
    address: str
    pid: int


class StatsRequest(NamedTuple):
    request: int


class StatsReply(NamedTuple):
    request: int
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
    session: str


class Stop(NamedTuple):
    """No fields."""


class Bye(NamedTuple):
    """No fields."""


class Heartbeat(NamedTuple):
    #: The worker's batchers' ``statistics()`` by node, when it runs batched nodes (None: none).
    batching: dict[str, Any] | None = None


class Pull(NamedTuple):
    request: int
    handle: Any


class Pulled(NamedTuple):
    request: int
    data: Any


class PullFailed(NamedTuple):
    request: int
    error: str


class MetaCall(NamedTuple):
    """A worker's call of the Params Pools' metadata hosted by its front (``kv._hosted``)."""

    request: int
    op: str
    args: list[Any]


class MetaReply(NamedTuple):
    """The front's answer to ``MetaCall`` ``request``: its ``value``, or the ``error``."""

    request: int
    value: Any
    error: str | None = None


class MetaNotify(NamedTuple):
    """Pages ``keys`` were published in ``session``'s chain of ``pool`` (one batch)."""

    pool: str
    session: str | None
    keys: list[str]


Message = (
    Batch | Hello | Ready | Run | Forward | Forwards | Cancel | Frame | Frames | Done | Dones
    | Claim | Claimed | Release | EndCall | CallEnded | SourceLost | StatsRequest | StatsReply
    | CloseSession | Stop | Bye | Heartbeat | Pull | Pulled | PullFailed | MetaCall | MetaReply
    | MetaNotify
)  # fmt: skip
