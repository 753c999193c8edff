"""A worker's part of the fast path (docs/fast-path.md): the runs it forwards to other
workers frame by frame (``_forward``), its links to them, the forwards it serves (``Forward``,
``Forwards``), and the cancels and claims about forwarded runs that have not come (yet).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from omniflow._exceptions import RuntimeClosedError, TransportError
from omniflow.cluster._forward import Route, parse_routes, wire_id
from omniflow.cluster._remote_edges import wire_size
from omniflow.cluster._worker_held import SCALARS, FwdBatch, Link
from omniflow.cluster._worker_state import CANCELLED_EARLY, WorkerState, _Key
from omniflow.data._ref import refs_in
from omniflow.transport import connect
from omniflow.transport._auth import sealer_for, send_sealed_now
from omniflow.transport._protocol import Claimed, Forward, Forwards, Run, encode_fields

logger = logging.getLogger("omniflow.worker")

_new = tuple.__new__


class ForwardLinks(WorkerState):
    """Forwarding runs to other workers and serving the ones they forward here (a part of
    ``Worker``: see ``_worker_state`` for why a mixin)."""

    def _claimed(self, peer: bytes | None, r: int, c: str, ws: list[Any]) -> None:
        """Answer ``peer``'s claim ``r``: which forwarded runs ``ws`` of call ``c`` are not
        here (neither running nor pulling their inputs). Each of those is then kept as
        cancelled early: should its forward still come, it ends at once without running,
        so the front may fail it now (its forwarder was lost) and no method runs for it."""
        if self._endpoint is not None:
            self._endpoint.drain()  # (the runs already here start first)
        missing = []
        for wid in ws:
            if type(wid) is not str:
                self._dropped("malformed", TransportError(f"a claim of {wid!r:.40}"))
                continue
            key = (peer, c, wid)
            if key not in self._running:
                missing.append(wid)
                self._cancel_early(key)
        self._send(peer, Claimed(r, c, missing))

    def _cancel_early(self, key: _Key) -> None:
        """Forwarded run ``key`` is cancelled before it came: if it comes, it ends at once as
        cancelled (CANCELLED_EARLY kept at most, the oldest forgotten first)."""
        early = self._cancelled_early
        early[key] = None
        if len(early) > CANCELLED_EARLY:
            del early[next(iter(early))]

    def _for_here(self, ft: str, rid: str) -> bool:
        """Whether a forward for replica ``rid`` on behalf of front ``ft`` is this replica's
        to serve (else it is dropped and counted as foreign)."""
        if rid != self.replica_id:
            self._dropped("foreign", TransportError(
                f"a forward for replica {rid!r:.60}, which this one ({self.replica_id}) "
                "is not"))  # fmt: skip
            return False
        if ft not in self._front_peers:
            self._dropped(
                "foreign",
                TransportError(f"a forward on behalf of front {ft!r:.40}, which never said hello"),
            )
            return False
        return True

    def _forwards(self, msg: Forwards) -> None:
        """Serve each record of ``msg`` as the ``Forward`` it stands for, in order (a bad
        record is dropped alone)."""
        ft, rid, c, n, f, s, g, gr, as_, vs, qs, off, th, conn, fw, tp = msg
        if len(vs) != len(as_) or len(qs) != len(as_):
            self._dropped("malformed", TransportError("forwards: lists of unlike lengths"))
            return
        if not self._for_here(ft, rid):
            return
        front = self._front_peers[ft]
        for a, v, q in zip(as_, vs, qs, strict=True):
            if type(a) is not str or type(q) is not int:
                bad = TransportError(f"forwards: a record ({a!r:.40}, q={q!r:.20})")
                self._dropped("malformed", bad)
                continue
            try:
                # (``tuple.__new__``: the NamedTuple's own constructor is Python code.)
                self._start(front, _new(Run, (c, a, n, {f: v}, s, g, q, gr, off, th, conn, fw, tp)))
            except Exception as exc:  # one that fails stops none of the others (``_handle_one``)
                self._dropped("malformed", exc)

    def _routes_of(self, node: str, raw: list[Any]) -> tuple[Route, ...] | None:
        """The parsed fast-path routes of a run of ``node`` (None: malformed, dropped). A
        front sends the same routes for a node until a replica changes, so the last ones
        parsed for each hosted node are kept and reused while the raw list is equal."""
        seen = self._routes_seen.get(node)
        if seen is not None and seen[0] == raw:
            routes = seen[1]
        else:
            try:
                routes = parse_routes(raw)
            except ValueError as exc:
                self._dropped("malformed", TransportError(f"fast-path routes of a run: {exc}"))
                return None
            if node in self._methods:
                self._routes_seen[node] = (raw, routes)
        if self._gone:  # a front that routes there again: the worker there is back
            self._gone.difference_update(r.address for r in routes)
        return routes

    def _forward(self, key: _Key, frame: Any) -> list[Any] | None:
        """Start this frame's fast-path runs on their workers; ``[route, wire id]`` of each
        (None: none). A value on the data plane is not forwarded (the front holds refs)."""
        fw = self._fw.get(key)
        if fw is None:
            return None
        k = fw.k  # every frame counts (the front counts them the same way)
        fw.k = k + 1
        if type(frame) is not dict:
            return None
        x = None
        for r, route in enumerate(fw.routes):
            f = route.field
            if f not in frame or route.address in self._gone:
                continue
            value = frame[f]
            scalar = type(value) in SCALARS
            if not scalar and refs_in(value):
                continue
            wid = wire_id(fw.a, k, r)
            q = k if route.seq_from_frame else fw.q
            try:
                self._link(route.address)  # (a link that cannot be made: not forwarded)
                if scalar and not self._direct:  # with the alike forwards held before it
                    items = self._held_for(route.address)
                    last = items[-1] if items else None
                    if isinstance(last, FwdBatch) and last.takes(fw, route):
                        last.as_.append(wid)
                        last.vs.append(value)
                        last.qs.append(q)
                    else:
                        items.append(FwdBatch(fw, route, wid, value, q))
                else:  # encoded now: what the value is now (or a batch of one's run: it goes)
                    envelope = encode_fields(
                        Forward, fw.ft, route.replica, fw.c, wid, route.node, {f: value}, fw.s,
                        route.group, q, fw.gr, route.offload, route.threshold, route.connectors,
                        route.subroutes, fw.tp,
                    )  # fmt: skip
                    if self._direct:  # (sent right after the run's end: ``_take``)
                        self._after_end.append((route.address, envelope))
                    else:
                        self._held_for(route.address).append(envelope)
            except Exception as exc:  # not forwarded: the front runs it the slow way
                logger.debug("worker %s: forward to %s failed: %s", self.replica_id,
                             route.address, exc)  # fmt: skip
                continue
            eb = self._edge_bytes
            if eb is not None:  # (/metrics: omniflow_edge_bytes_total; see ``_heartbeat``)
                ek = (fw.gr, fw.n, f, route.node)
                eb[ek] = eb.get(ek, 0) + wire_size(value)
            if x is None:
                x = []
            x.append([r, wid])
        return x

    def _held_for(self, address: str) -> list[list[Any] | FwdBatch]:
        """The forwards held for ``address``: until the received batch is handled, or to the
        end of this loop turn (a generator's frames of one turn leave together, as its frames
        to the front)."""
        held = self._held_links
        if not held and not self._reading:
            asyncio.get_running_loop().call_soon(self._flush_held)
        items = held.get(address)
        if items is None:
            items = held[address] = []
        return items

    def _link(self, address: str) -> Link:
        """The connection to the worker at ``address`` (made on first use)."""
        link = self._links.get(address)
        if link is None:
            endpoint = connect(address, key=self._key)
            link = self._links[address] = Link(endpoint, sealer_for(endpoint, self._key))
        return link

    def _link_send(self, address: str, frames: list[Any]) -> None:
        """Send a batch of forwards down its link, in order behind what waits there; a link
        that fails is logged by its writer (its worker is lost: the front fails what it held).
        Forwards held for a worker a front has since said is lost (``SourceLost`` handled in
        the same batch) are dropped, not sent down a new link: the front orphans them, and a
        link to a dead address would hold them for good."""
        if address in self._gone:
            return
        link = self._link(address)
        if (
            link.writer is None
            and not link.out
            and send_sealed_now(link.endpoint, link.sealer, frames)
        ):
            return
        link.out.append(frames)
        if link.writer is None:
            link.writer = asyncio.get_running_loop().create_task(self._link_write(link))

    def _link_lost(self, address: str) -> None:
        """The worker at ``address`` is lost: forward nothing more there, and drop what waits
        for it (its link would hold it forever: nothing listens there any more)."""
        self._gone.add(address)
        link = self._links.pop(address, None)
        if link is not None:
            if link.writer is not None:
                link.writer.cancel()
            link.endpoint.close()

    async def _link_write(self, link: Link) -> None:
        """Send what queued for a link, in order; done when the queue is empty."""
        # (Not the worker's ``_write``: a failed link is only logged; the front fails its runs.)
        try:
            while link.out:
                frames = link.out.popleft()
                await link.endpoint.send(link.sealer.seal(frames))
        except (TransportError, RuntimeClosedError) as exc:
            logger.warning("worker %s: a forward link failed: %s", self.replica_id, exc)
        finally:
            link.writer = None
