"""The worker protocol on the wire: each message kind's checks table, and encoding,
decoding and batching (the messages themselves are ``_messages``, re-exported here).

On the wire a message is sealed (``_auth``: a MAC over every frame, checked before anything
is decoded) around the codec's envelope: ``kind`` and the message's fields as a msgpack array
in declaration order (trailing fields at their defaults may be left out: ``encode_fields``).
Field values that are not plain data (a frame's objects, a DataRef) are pickled, and are
unpickled only once the MAC held. ``decode_msg`` checks the kind and every field's type and
raises ``ProtocolError`` (with ``reason`` "malformed" or "unknown_kind") for anything else;
receivers drop such a message, count it and log it.
"""

from __future__ import annotations

from typing import Any

from omniflow._exceptions import TransportError
from omniflow.transport._codec import Buffer, decode_message, encode, unpack_small
from omniflow.transport._messages import (
    MAX_BATCH,
    Batch,
    Bye,
    CallEnded,
    Cancel,
    Claim,
    Claimed,
    CloseSession,
    Done,
    Dones,
    EndCall,
    Forward,
    Forwards,
    Frame,
    Frames,
    Heartbeat,
    Hello,
    Message,
    MetaCall,
    MetaNotify,
    MetaReply,
    Pull,
    Pulled,
    PullFailed,
    Ready,
    Release,
    Run,
    SourceLost,
    StatsReply,
    StatsRequest,
    Stop,
)

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


#: The fields of a run (a forward is one, after whom it is for: ``front``, ``replica``; its
#: ``aid`` is always a forwarded wire id, a str).
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
#: The fields of a ``Forwards``: front, replica, call_id, node, field, session, group, graph,
#: the three lists (aids, values, seqs), then as a run's.
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
    StatsReply: (
        "stats_reply",
        ((int,), (str,), (int,), (dict,), (dict,), (dict, _N), (dict, _N)),
    ),
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
