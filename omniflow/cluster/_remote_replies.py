"""The router's handling of what replicas report about calls: frames, dones (one at a time
or a ``Dones``), claims' answers and end-of-call answers, checked against the replica that
runs each activation and handed to the runtime shell as stimuli; a forwarded run's messages
that its replica does not hold go to the fast path (``_remote_fast``, whose machine decides:
wait at the fleet, keep, or drop)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import NodeError, OmniflowError
from omniflow.cluster._fleet import Fleet, Replica
from omniflow.cluster._remote_ends import CallEnds
from omniflow.cluster._remote_fast import FastPath
from omniflow.cluster._remote_meta import WorkerQueries
from omniflow.cluster._remote_pending import WIRE_IDS, Key, Pending, Wid
from omniflow.data._plane import DataPlane
from omniflow.data._ref import DataRef
from omniflow.runtime._executor import OnDone, OnFrame
from omniflow.transport._protocol import (
    CallEnded,
    Claimed,
    Done,
    Dones,
    Frame,
    Frames,
    Message,
    MetaCall,
    StatsReply,
)

_new = tuple.__new__


class Replies:
    """Frames, dones and answers from replicas (a part of ``RemoteRoles``). A mixin, not an
    object the router owns: the fleet calls it back as the router (``on_message``), the
    fast path's replay re-enters it, and it ends the router's pending runs through the
    router's callbacks; an object would hold all of the router's state by reference."""

    fleet: Fleet
    plane: DataPlane | None
    _pending: dict[Key, Pending]
    _front_refs: dict[Key, list[DataRef]]
    _fast: FastPath
    _ends: CallEnds
    _queries: WorkerQueries
    _on_frame: OnFrame
    _on_done: OnDone
    _on_return: OnFrame

    if TYPE_CHECKING:

        def _kick(self) -> None: ...

    def _on_message(self, rep: Replica, msg: Message, may_wait: bool = False) -> Message | None:
        """A checked message about calls from ``rep`` (the fleet handles its own kinds).

        ``may_wait``: a message (or the rest of a ``Dones``) about a forwarded run the front
        has not bound yet, whose binding frame may still come this loop turn, is handed back
        instead, for the fleet to deliver at the end of the turn (``_fleet_intake.Intake._later``):
        then it needs no keeping and replaying (the fast-path machine's ``WAIT``)."""
        self._kick()
        # By exact type, the commonest first (a decoded message is never a subclass).
        if type(msg) is Dones:
            return self._on_dones(rep, msg, may_wait)
        elif type(msg) is Done:
            c, a = msg.call_id, msg.aid
            if type(a) is str and (c, a) not in rep.held:
                return msg if self._fast.unbound(rep, c, a, msg, may_wait) else None
            self._on_done_msg(rep, msg)
        elif type(msg) is Frames:  # consecutive frames of one generator act
            c, a, fs, xs = msg
            if (c, a) not in rep.held and type(a) is str:
                return msg if self._fast.unbound(rep, c, a, msg, may_wait) else None
            elif xs is None:
                for frame in fs:
                    self._replica_frame(rep, c, a, frame)
            elif len(xs) != len(fs):
                self.fleet.dropped(rep, "malformed", OmniflowError("frames: len(xs) != len(fs)"))
            else:
                for frame, x in zip(fs, xs, strict=True):
                    self._replica_frame(rep, c, a, frame, x)
        elif type(msg) is Frame:
            c, a, f, x = msg
            if (c, a) not in rep.held and type(a) is str:
                return msg if self._fast.unbound(rep, c, a, msg, may_wait) else None
            else:
                self._replica_frame(rep, c, a, f, x)
        elif type(msg) is Claimed:
            self._fast.on_claimed(rep, msg)
        elif type(msg) is CallEnded:
            self._ends.call_ended(rep, msg.call_id)
        elif type(msg) is StatsReply:
            self._queries.on_stats(msg)
        elif type(msg) is MetaCall:
            self._queries.on_call(rep, msg)
        else:
            self.fleet.dropped(
                rep,
                "unknown_kind",
                OmniflowError(f"a front does not take {type(msg).__name__}"),
            )
        return None

    def _on_dones(self, rep: Replica, msg: Dones, may_wait: bool = False) -> Dones | None:
        """Activations that ended well on ``rep``, one record at a time (a bad record is
        dropped alone); with ``may_wait``, from the first record of a forwarded run not bound
        yet on, the rest is handed back (``_on_message``)."""
        cs, as_, fs, xs = msg
        n = len(cs)
        if len(as_) != n or len(fs) != n or len(xs) != n:
            self.fleet.dropped(rep, "malformed", OmniflowError("dones: lists of unlike lengths"))
            return None
        for i, (c, a, f, x) in enumerate(zip(cs, as_, fs, xs, strict=True)):
            if (
                type(c) is not str
                or type(a) not in WIRE_IDS
                or (x is not None and type(x) is not list)
            ):
                bad = OmniflowError(f"dones: a record ({c!r:.40}, {a!r:.40}, x={x!r:.40})")
                self.fleet.dropped(rep, "malformed", bad)
                continue
            try:
                if self._good_end(rep, c, a, f, x, may_wait):
                    return msg if i == 0 else _new(Dones, (cs[i:], as_[i:], fs[i:], xs[i:]))
            except (KeyError, TypeError, ValueError) as exc:  # a malformed value
                self.fleet.dropped(rep, "malformed", exc)
        return None

    def _good_end(
        self, rep: Replica, c: str, a: Wid, f: Any, x: list[Any] | None, may_wait: bool = False
    ) -> bool:
        """An activation ended well on ``rep``, with its coroutine's returned frame ``f`` if
        it has one (not None). True, and nothing done, if it is a forwarded run not bound yet
        and ``may_wait`` (``_on_message``)."""
        key = (c, a)
        if key not in rep.held:
            if type(a) is str:
                done = _new(Done, (c, a, f, None, None, False, None, x))
                return self._fast.unbound(rep, c, a, done, may_wait)
            else:
                self._foreign(rep, c, a, "done")
            return False
        if f is not None:  # a coroutine's returned frame rides in its done
            p = self._pending.get(key)
            if p is not None and p.error is None and len(p.replicas) == 1:
                self._returned(rep, p, f, x)
                return False
            self._replica_frame(rep, c, a, f, x)  # (first, then the done)
        self._replica_done(rep, key, None)
        return False

    def _on_done_msg(self, rep: Replica, msg: Done) -> None:
        """An activation ended on ``rep``, with its coroutine's returned frame if it has one."""
        c, a, f, et, _em, _cancel, _tb, x = msg
        if et is None:
            self._good_end(rep, c, a, f, x)
            return
        key = (c, a)
        if key not in rep.held:
            if type(a) is str:
                self._fast.unbound(rep, c, a, msg, False)
            else:
                self._foreign(rep, c, a, "done")
            return
        if f is not None:  # (a frame with a failure: first, then the done)
            self._replica_frame(rep, c, a, f, x)
        self._replica_done(rep, key, msg)

    def _foreign(self, rep: Replica, c: str, a: Wid, what: str) -> None:
        """Only the replica that runs an activation speaks for it; anything else is dropped."""
        foreign = OmniflowError(f"a {what} of ({c!r:.40}, {a}), which it does not run")
        self.fleet.dropped(rep, "foreign", foreign)

    def _replica_frame(
        self, rep: Replica, c: str, a: Wid, frame: Any, x: list[Any] | None = None
    ) -> None:
        key = (c, a)
        if key not in rep.held:
            self._foreign(rep, c, a, "frame")
            return
        p = self._pending.get(key)
        if p is None:
            return
        if isinstance(frame, dict) and DataRef in map(type, frame.values()):
            self._ends.replicas.setdefault(c, set()).add(rep)
        k = p.k
        p.k = k + 1
        if x is None:
            self._on_frame(p.call, p.core, p.act, frame)
            return
        self._fast.reported(rep, p, k, x)
        try:
            self._on_frame(p.call, p.core, p.act, frame)
        finally:
            self._fast.handled(c)

    def _returned(self, rep: Replica, p: Pending, frame: Any, x: list[Any] | None) -> None:
        """The done of ``p``'s one replica with its coroutine's returned frame: one stimulus,
        as a local coroutine's return is (the core takes the frame and the end together and
        settles once)."""
        key = p.key
        rep.held.discard(key)
        del self._pending[key]
        call = p.call
        if isinstance(frame, dict) and DataRef in map(type, frame.values()):
            self._ends.replicas.setdefault(key[0], set()).add(rep)
        front_refs = self._front_refs.pop(key, None)
        if front_refs and self.plane is not None:
            for ref in front_refs:
                self.plane.release(ref)
        if x is None:
            self._on_return(call, p.core, p.act, frame)
        else:
            self._fast.reported(rep, p, p.k, x)
            try:
                self._on_return(call, p.core, p.act, frame)
            finally:
                self._fast.handled(key[0])
        if p.routes or p.via is not None:
            self._fast.ended(*key)

    def _replica_done(self, rep: Replica | None, key: Key, err: Done | None) -> None:
        if rep is not None:
            rep.held.discard(key)
        p = self._pending.get(key)
        if p is None:
            return
        if rep in p.replicas:
            p.replicas.remove(rep)
        if err is not None and err.error_type is not None and p.error is None:
            if err.cancelled:
                p.error = asyncio.CancelledError()
            else:
                error = NodeError(
                    p.act.node,
                    f"{err.error_type}: {err.error_message}",
                    call_id=p.call.call_id,
                    graph=p.call.graph,
                    exc_type=err.error_type,
                )
                error.traceback = err.traceback
                p.error = error
        if not p.replicas:
            del self._pending[key]
            front_refs = self._front_refs.pop(key, None)
            if front_refs and self.plane is not None:
                for ref in front_refs:
                    self.plane.release(ref)
            self._on_done(p.call, p.core, p.act, p.error)
            if p.routes or p.via is not None:
                self._fast.ended(*key)

    def _on_lost(self, rep: Replica, why: str) -> None:
        """``rep`` was lost: its pools leave the hosted metadata, what it held fails."""
        self._queries.lost(rep)
        self._ends.lost(rep)
        held = sorted(rep.held, key=str)
        pending = self._pending
        # (Its runs with routes are cut first: frames of theirs may never come.)
        self._fast.lost(rep, tuple(k for k in held if k in pending and pending[k].routes))
        for key in held:
            p = pending.get(key)
            if p is None:
                continue
            if p.error is None:
                p.error = NodeError(
                    p.act.node,
                    f"replica lost: replica '{rep.replica_id}' of role "
                    f"'{p.core.c.specs[p.act.node].role}' was lost while running it ({why})",
                    call_id=p.call.call_id,
                    graph=p.call.graph,
                )
            self._replica_done(rep, key, None)
        self._fast.ask_claims(rep, why)
