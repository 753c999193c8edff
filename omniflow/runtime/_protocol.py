"""The worker protocol: what the front process and a role's worker process say to each other.

Messages ride the codec's envelope (``kind`` + body); frame values are encoded with
``pickle=True`` (the control plane of one deployment is trusted) so a worker's frames reach
the front exactly as an in-process method returned them, tuples and objects included.

    front -> worker                          worker -> front
    hello  {}                                ready  {replica, roles, pid}
    run    {c, a, n, k, s, g, q, gr}         frame  {c, a, f}          (any number)
                                             frames {c, a, fs}         (several, in order)
    cancel {c, a}                            done   {c, a, e, f?}      (exactly one per run)
    release {refs}     end_call {c}     source_lost {addr, pid}
    stats  {r}                               stats  {r, replica, pid, plane}
    close_session {s}
    stop   {}                                bye    {}          (leaving; repeated while
    bye    {}          (answer to its bye)                 it drains)

    consumer worker -> producer worker (the zmq connector, on the producer's endpoint)
    pull   {r, h}                            pulled {r, data}  or  pull_failed {r, error}

``c`` call id, ``a`` activation id, ``n`` node, ``k`` keyword arguments, ``s`` session,
``g`` OR group, ``q`` SeqId index, ``gr`` graph, ``f`` frame dict, ``e`` error or None:
``{"t": exception type, "m": message, "cancel": bool}``. Frames of one activation and its
``done`` travel on one connection, so they arrive in the order they were sent. A coroutine
method's returned frame (not None) rides in its ``done`` as ``f`` instead of a ``frame`` of
its own: one message per activation; the front applies ``f`` first, then the ``done``.
Async generators send the frames they yield within one event-loop turn as one ``frames``
message (in order, at most 64): a stream that never pauses costs one message per batch, and a
stream that pauses between yields still sends each frame at once.

Leaving (SIGTERM or ``stop``): the worker deregisters, says ``bye`` to every front that
said ``hello`` and keeps serving; each front stops routing to it and answers ``bye``
once, behind every ``run`` it sent, so the worker exits when all answered (or a second
passed) and its running activations ended. A ``run`` whose fields do not have the types
above is dropped with a warning, like any malformed message.

Data plane: a ``run`` may also carry ``off`` (outputs to put in the worker's pool), ``th``
(the front's offload threshold, when not the default) and ``conn`` (source node ->
connector). ``release`` frees blocks whose last consumer finished, ``end_call`` drops what a
finished call still holds, ``source_lost`` fails pulls from a producer that died, and
``stats`` answers ``DataPlane.statistics()``; ``h`` is a BlockHandle, ``data`` its bytes.
"""

from __future__ import annotations

from typing import Any

from omniflow.transport._codec import Buffer, decode_message, encode

__all__ = ["decode_msg", "encode_msg"]


def encode_msg(kind: str, body: dict[str, Any]) -> list[Buffer]:
    return encode(body, kind=kind, pickle=True)


def decode_msg(frames: list[Buffer]) -> tuple[str, Any]:
    msg = decode_message(frames, allow_pickle=True)
    return msg.kind, msg.body
