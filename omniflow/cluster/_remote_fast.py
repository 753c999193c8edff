"""The front's side of forwarded runs, as I/O: each thing that happens to one becomes an event
for the pure machine (``fastpath.FastPathCore``, docs/fast-path.md), whose instructions are
carried out here: cancels and claims sent to replicas, refs released, replays handed to the
router, runs failed, malformed parts counted. Nothing here decides anything."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from omniflow._exceptions import NodeError, OmniflowError
from omniflow.cluster._fleet import Fleet, Replica
from omniflow.cluster._remote_pending import Key, Pending, Wid
from omniflow.cluster.fastpath import FastPathCore
from omniflow.cluster.fastpath._events import (
    WAIT,
    AskClaims,
    Bind,
    CallEnded,
    ClaimAnswer,
    Deliver,
    Drop,
    Ended,
    Fail,
    Handled,
    Instruction,
    Lost,
    Made,
    Malformed,
    Reported,
    SendCancel,
    SendClaim,
    Started,
    Unbound,
)
from omniflow.data._ref import DataRef, refs_in
from omniflow.transport._protocol import (
    Cancel,
    Claim,
    Claimed,
    Done,
    Frame,
    Frames,
    Message,
    encode_msg,
)

logger = logging.getLogger("omniflow.remote")

_new = tuple.__new__


class FastPath:
    """Carries out what the fast-path machine decides (``core``) for the router."""

    def __init__(
        self,
        fleet: Fleet,
        pending: dict[Key, Pending],
        *,
        release: Callable[[list[DataRef]], None],
        deliver: Callable[[Replica, Message], Message | None],
        fail: Callable[[Replica | None, Key, Done | None], None],
    ) -> None:
        self.fleet = fleet
        #: The router's runs on replicas (a claimed run is failed through its record).
        self.pending = pending
        #: Let the data-plane refs among an orphan's outputs go.
        self._release = release
        #: Hand a replayed message to the router, as if it arrived now.
        self._deliver = deliver
        #: End a pending run on a replica (its ``error`` set first).
        self._fail = fail
        #: Every decision about forwarded runs.
        self.core = FastPathCore()
        self._handle = self.core.handle

    # ---------------------------------------------------------------- events

    def reported(self, rep: Replica, p: Pending, k: int, x: list[Any]) -> None:
        """Frame ``k`` of ``p`` (``x``: what it forwarded) goes into the core next."""
        out = self._handle(_new(Reported, (rep, p.key[0], p.key[1], k, x, p.routes, p.act.seq[2])))
        if out:
            self._run(out)

    def made(self, c: str, node: str, group: int, q: int, kwargs: dict[str, Any]) -> Bind | None:
        """The core made an activation while a reported frame is in it: the forwarded run it
        binds, if it is one."""
        out = self._handle(_new(Made, (c, node, group, q, kwargs)))
        if not out:
            return None
        bind = out[0]
        assert type(bind) is Bind
        return bind

    def handled(self, c: str) -> None:
        """The core handled the reported frame: orphans cancelled, early messages replayed."""
        self._run(self._handle(_new(Handled, (c,))))

    def unbound(self, rep: Replica, c: str, wid: str, msg: Message, may_wait: bool) -> bool:
        """A message of forwarded run ``wid`` that ``rep`` does not hold: kept, dropped, or
        (True) handed back to wait at the fleet for the end of the loop turn."""
        out = self._handle(_new(Unbound, (rep, c, wid, msg, type(msg) is Done, may_wait)))
        if out and out[0] is WAIT:
            return True
        self._run(out)
        return False

    def started(self, c: str, a: Wid) -> None:
        """Run ``a`` left with routes: what it forwards names it as parent."""
        self._handle(_new(Started, (c, a)))

    def ended(self, c: str, a: Wid) -> None:
        """Run ``a`` (with routes, or bound to a forwarded run) ended."""
        out = self._handle(_new(Ended, (c, a)))
        if out:
            self._run(out)

    def lost(self, rep: Replica, cut: tuple[Key, ...]) -> None:
        """``rep`` was lost (before what it held fails): ``cut``, its runs with routes."""
        self._run(self._handle(Lost(rep, cut)))

    def ask_claims(self, via: Replica, why: str) -> None:
        """``via`` was lost and what it held failed: claim the runs it forwarded."""
        out = self._handle(AskClaims(via))
        self._run(out)
        for ins in out:
            assert type(ins) is SendClaim
            logger.info(
                "asked replica %s which of %d runs of call %s forwarded by lost replica %s "
                "it holds (%s)", ins.target.replica_id, len(ins.wids), ins.c, via.replica_id,
                why,
            )  # fmt: skip

    def on_claimed(self, rep: Replica, msg: Claimed) -> None:
        """``rep`` answered a claim."""
        r, c, missing = msg
        self._run(self._handle(ClaimAnswer(rep, r, c, missing)))

    def end_call(self, call_id: str) -> None:
        """Call ``call_id`` ended: its forwarded runs still unaccounted for are orphans."""
        self._run(self._handle(CallEnded(call_id)))

    # ---------------------------------------------------------------- observability

    @property
    def forwarded(self) -> int:
        return self.core.forwarded

    @property
    def orphaned(self) -> int:
        return self.core.orphaned

    def waiting(self) -> int:
        """Forwarded runs and cut activations kept for calls (0 once every call ended)."""
        return self.core.waiting()

    # ---------------------------------------------------------------- instructions

    def _run(self, out: list[Instruction]) -> None:
        for ins in out:
            if type(ins) is Deliver:
                self._deliver(ins.rep, ins.msg)
            elif type(ins) is Drop:
                self._drop(ins.msg)
            elif type(ins) is SendCancel:
                ins.rep.out.put_nowait(encode_msg(Cancel(ins.c, ins.wid)))
            elif type(ins) is SendClaim:
                ins.target.out.put_nowait(encode_msg(Claim(ins.r, ins.c, ins.wids)))
            elif type(ins) is Fail:
                self._lost_with_forwarder(ins.rep, ins.c, ins.wid, ins.via)
            elif type(ins) is Malformed:
                self.fleet.dropped(ins.rep, ins.reason, OmniflowError(ins.what))
            else:
                raise AssertionError(f"the fast path's shell cannot carry out {ins!r}")

    def _drop(self, msg: Message) -> None:
        """An orphan's message is dropped: the data-plane refs among its outputs are let go."""
        frames: list[Any] = []
        match msg:
            case Frame(frame=f):
                frames = [f]
            case Frames(frames=fs):
                frames = fs
            case Done(frame=f) if f is not None:
                frames = [f]
        refs = [r for fr in frames if isinstance(fr, dict) for v in fr.values() for r in refs_in(v)]
        if refs:
            self._release(refs)

    def _lost_with_forwarder(self, rep: Replica, c: str, wid: str, via: Replica) -> None:
        """A claimed run ``rep`` does not hold: it fails as lost with its forwarder."""
        key = (c, wid)
        p = self.pending[key]
        if p.error is None:
            p.error = NodeError(
                p.act.node,
                f"replica lost: replica '{via.replica_id}', which started this run on replica "
                f"'{rep.replica_id}' of role '{p.core.c.specs[p.act.node].role}', was "
                "lost before the run reached it",
                call_id=p.call.call_id,
                graph=p.call.graph,
            )
        self._fail(rep, key, None)
