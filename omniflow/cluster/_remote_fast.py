"""The front's side of forwarded runs (docs/fast-path.md): what a frame says it forwarded
(``expect``, which ``RemoteRoles.submit`` binds while the core handles that frame), what
forwarded runs sent before their binding (``early``, replayed right after it), the runs the
core did not make (``orphans``: cancelled, what they send dropped), and the claims about runs
a lost forwarder may never have delivered."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from omniflow._exceptions import NodeError, OmniflowError
from omniflow.cluster._fleet import Fleet, Replica
from omniflow.cluster._forward import Waiting, parent_of
from omniflow.cluster._remote_pending import Key, Pending, Plan, Wid
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

#: node -> (wire id, route, SeqId index, the replica that forwarded it), while a frame that
#: forwarded runs is in the core.
Expect = dict[str, tuple[str, Plan, int, Replica]]


logger = logging.getLogger("omniflow.remote")


class FastPath:
    """Forwarded runs between the frame that reports them and their binding, and after."""

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
        #: The router's runs on replicas (read here: is a parent running? failed by claims).
        self.pending = pending
        #: Let the data-plane refs among an orphan's outputs go.
        self._release = release
        #: Hand a replayed message to the router, as if it arrived now.
        self._deliver = deliver
        #: End a pending run on a replica (its ``error`` set first).
        self._fail = fail
        #: While a frame that forwarded runs is in the core: what it forwarded.
        self.expect: Expect | None = None
        #: Claims sent to replicas about runs whose forwarder was lost: request id ->
        #: (the replica asked, call id, wire ids, the forwarder).
        self.claims: dict[int, tuple[Replica, str, list[str], Replica]] = {}
        self.claim_ids = itertools.count(1)
        #: Forwarded runs bound while the core handled a frame (their early messages replay).
        self.bound: list[tuple[str, str]] = []
        #: call id -> what its forwarded runs sent before their binding.
        self.early: dict[str, Waiting] = {}
        #: call id -> wire id -> replica of forwarded runs the core did not make (cancelled;
        #: what they send is dropped) until their done.
        self.orphans: dict[str, dict[str, Replica]] = {}
        #: call id -> activations with routes that ended with their replica lost: frames of
        #: theirs may never arrive, so a run they forwarded that turns up later is an orphan.
        self.cut: dict[str, set[Wid]] = {}
        #: Runs bound to a forwarded run, and orphans.
        self.forwarded = 0
        self.orphaned = 0

    def waiting(self) -> int:
        """Forwarded runs and cut activations kept for calls (0 once every call ended)."""
        return (
            sum(len(e) for e in self.early.values())
            + sum(len(c) for c in self.cut.values())
            + sum(len(o) for o in self.orphans.values())
        )

    def end_call(self, call_id: str) -> None:
        """Call ``call_id`` ended: its forwarded runs still unaccounted for can never be bound."""
        waiting = self.early.pop(call_id, None)
        if waiting is not None:
            for wid, (rep, msgs) in waiting.early.items():
                self.drop_early(rep, call_id, wid, msgs)
        self.orphans.pop(call_id, None)  # (what they send later is dropped all the same)
        self.cut.pop(call_id, None)

    def forget(self, rep: Replica) -> None:
        """``rep`` was lost: what it sent before binding goes with it, and its orphans."""
        for c in list(self.early):
            waiting = self.early[c]
            waiting.drop_replica(rep)
            if not waiting:
                del self.early[c]
        for c in list(self.orphans):
            orphans = self.orphans[c]
            for wid in [w for w, r in orphans.items() if r is rep]:
                del orphans[wid]
            if not orphans:
                del self.orphans[c]

    def lost(self, rep: Replica, why: str) -> None:
        """``rep`` was lost and what it held failed: claims asked of it are forgotten, and the
        runs it forwarded are claimed (``claim``)."""
        for r in [r for r, claim in self.claims.items() if claim[0] is rep]:
            del self.claims[r]  # (what it held failed)
        self.claim(rep, why)

    def orphan(self, rep: Replica, c: str, wid: str, done: bool = False) -> None:
        """A forwarded run the core did not make: cancel it (unless it is ``done``) and drop
        what it sends until its done."""
        self.orphaned += 1
        if done or not rep.alive:  # (a lost replica sends nothing more)
            return
        self.orphans.setdefault(c, {})[wid] = rep
        rep.out.put_nowait(encode_msg(Cancel(c, wid)))

    def stray(self, rep: Replica, c: str, wid: str, msg: Message) -> None:
        """A message of forwarded run ``wid`` that is not bound: keep it until the frame that
        forwarded it arrives, or drop it (an orphan's)."""
        if self.is_orphan(c, wid):
            if wid not in self.orphans.get(c, {}) and type(msg) is not Done:
                self.orphan(rep, c, wid)  # (counted again: it was not known as one)
            self.drop(c, wid, msg)
            return
        waiting = self.early.get(c)
        if waiting is None:
            waiting = self.early[c] = Waiting()
        waiting.add(rep, wid, msg)

    def is_orphan(self, c: str, wid: Wid) -> bool:
        """Whether nothing can bind forwarded run ``wid`` any more: its nearest ancestor the
        front knows of is an orphan, or is not running (an activation that ended had every
        frame handled, so each run it forwarded is bound or orphaned). An ancestor still
        waiting for its own binding decides nothing: look further up."""
        orphans = self.orphans.get(c, {})
        cut = self.cut.get(c, ())
        while type(wid) is str:
            if wid in orphans:
                return True
            wid = parent_of(wid)
            if (c, wid) in self.pending:
                return False
            if wid in cut:
                return True
        return True

    def drop(self, c: str, wid: str, msg: Message) -> None:
        """Drop a message of orphan ``wid``: refs among its outputs are let go."""
        frames: list[Any] = []
        match msg:
            case Frame(frame=f):
                frames = [f]
            case Frames(frames=fs):
                frames = fs
            case Done(frame=f):
                if f is not None:
                    frames = [f]
                orphans = self.orphans.get(c)
                if orphans is not None:
                    orphans.pop(wid, None)
                    if not orphans:
                        del self.orphans[c]
        refs = [r for fr in frames if isinstance(fr, dict) for v in fr.values() for r in refs_in(v)]
        if refs:
            self._release(refs)

    def drop_early(self, rep: Replica, c: str, wid: str, msgs: list[Message]) -> None:
        """Forwarded run ``wid`` can no longer be bound: an orphan; drop what it sent."""
        self.orphan(rep, c, wid, done=any(type(m) is Done for m in msgs))
        for m in msgs:
            self.drop(c, wid, m)

    def orphan_early(self, c: str, a: Wid) -> None:
        """Activation ``a`` of call ``c`` ended: the runs forwarded below it that are still
        unbound can never be (its frames were all handled): orphans."""
        waiting = self.early.get(c)  # (never empty: emptied ones are deleted)
        if waiting is None or a not in waiting.kids:
            return
        for wid, rep, msgs in waiting.orphans_of(a):
            self.drop_early(rep, c, wid, msgs)
        if not waiting.early:
            del self.early[c]

    def replay(self) -> None:
        """Deliver what bound forwarded runs sent before their binding, in order."""
        bound = self.bound
        while bound:
            c, wid = bound.pop()
            waiting = self.early.get(c)
            if waiting is None:
                continue
            entry = waiting.take(wid)
            if entry is None:
                continue
            if not waiting.early:  # (the one it held was taken)
                del self.early[c]
            rep, msgs = entry
            for m in msgs:
                self._deliver(rep, m)

    def expecting(
        self, rep: Replica, p: Pending, k: int, x: list[Any]
    ) -> dict[str, tuple[str, Plan, int, Replica]]:
        """What frame ``k`` of ``p`` forwarded (its ``forwarded``): node -> (wire id, route, the
        SeqId index its activation must have, ``rep``), for ``submit`` to bind while the core
        handles it."""
        routes = p.routes
        a = p.key[1]
        expect: dict[str, tuple[str, Plan, int, Replica]] = {}
        for item in x:
            if type(item) is list and len(item) == 2:
                r, wid = item
                # (``wire_id(a, k, r)``, inline: once per forwarded run)
                if type(r) is int and 0 <= r < len(routes) and wid == f"{a}.{k}.{r}":
                    plan = routes[r]
                    expect[plan.hop.node] = (wid, plan, k if plan.hop.qk else p.act.seq[2], rep)
                    continue
            self.fleet.dropped(rep, "malformed", OmniflowError(f"a forward note {item!r:.60}"))
        return expect

    def settle(self, c: str, expect: dict[str, tuple[str, Plan, int, Replica]]) -> None:
        """The core handled a frame that forwarded runs: those it did not make (still in
        ``expect``) are orphans, with what they sent and their unbound descendants; what the
        bound ones sent before their binding is replayed."""
        for wid, plan, _q, _via in expect.values():
            waiting = self.early.get(c)
            entry = waiting.take(wid) if waiting is not None else None
            if entry is None:
                self.orphan(plan.rep, c, wid)
            else:
                self.drop_early(plan.rep, c, wid, entry[1])
            if waiting is not None:
                for sub, rep, msgs in waiting.orphans_of(wid):  # (it will bind none of them)
                    self.drop_early(rep, c, sub, msgs)
                if not waiting.early:
                    del self.early[c]
        self.replay()

    def claim(self, via: Replica, why: str) -> None:
        """``via`` was lost: runs it forwarded that the front bound may never have reached
        their replica (the frame that reported a forward may reach the front before the
        forward leaves the worker's queues). Ask each replica which of them it does not
        hold; those fail (``on_claimed``). A run that got there runs on, and one that is
        still on its way is ended there as cancelled when it comes (the worker keeps what it
        said it lacks)."""
        asked: dict[tuple[Replica, str], list[str]] = {}
        for (c, wid), p in self.pending.items():
            if p.via is via and type(wid) is str:
                for target in p.replicas:  # (never ``via``: ``_on_lost`` failed its runs)
                    if target.alive:
                        asked.setdefault((target, c), []).append(wid)
        for (target, c), wids in asked.items():
            r = next(self.claim_ids)
            self.claims[r] = (target, c, wids, via)
            target.out.put_nowait(encode_msg(Claim(r, c, wids)))
            logger.info(
                "asked replica %s which of %d runs of call %s forwarded by lost replica %s "
                "it holds (%s)", target.replica_id, len(wids), c, via.replica_id, why,
            )  # fmt: skip

    def on_claimed(self, rep: Replica, msg: Claimed) -> None:
        """``rep`` answered a claim: the runs it does not hold never will run; they fail as
        lost with their forwarder, and what they might still send is dropped (orphans)."""
        r, c, missing = msg
        claim = self.claims.get(r)
        if claim is None or claim[0] is not rep or claim[1] != c:
            self.fleet.dropped(rep, "foreign", OmniflowError(f"an answer to claim {r}, not its"))
            return
        del self.claims[r]
        asked, via = set(claim[2]), claim[3].replica_id
        for wid in missing:
            if type(wid) is not str or wid not in asked:
                self.fleet.dropped(rep, "malformed", OmniflowError(f"a claimed {wid!r:.40}"))
                continue
            key = (c, wid)
            p = self.pending.get(key)
            if p is None or rep not in p.replicas:
                continue  # (it ended meanwhile: its done came first)
            self.orphans.setdefault(c, {})[wid] = rep
            self.orphaned += 1
            if p.error is None:
                p.error = NodeError(
                    p.act.node,
                    f"replica lost: replica '{via}', which started this run on replica "
                    f"'{rep.replica_id}' of role '{p.core.c.specs[p.act.node].role}', was "
                    "lost before the run reached it",
                    call_id=p.call.call_id,
                    graph=p.call.graph,
                )
            self._fail(rep, key, None)
