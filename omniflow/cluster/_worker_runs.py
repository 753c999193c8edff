"""Running activations in a worker: inputs resolved (pulled from the data plane when they
must be), the method called in its own context, a coroutine's task or a generator's stream
driven (``_drive``), a batched node's entry handed to its batcher, and each end reported once
(``_done``): at once, or held for the end of the received batch (gathered into a ``Dones``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from omniflow._exceptions import OmniflowError
from omniflow.cluster._worker_held import DoneBatch, Fw, _Unsendable, failed_done
from omniflow.cluster._worker_state import FRAME_BATCH, WorkerState, _Key
from omniflow.data._ref import DataRef, refs_in
from omniflow.dsl._context import ActivationContext, _current
from omniflow.runtime._batcher import BatchEntry
from omniflow.runtime._drive import drive, eager_task, generator_end
from omniflow.runtime._metrics import count_reads
from omniflow.runtime._tracing import attach_traceparent
from omniflow.transport._protocol import MAX_BATCH, Done, Frame, Frames, Run, encode_fields


class Activations(WorkerState):
    """Starting, running and ending activations (a part of ``Worker``: see ``_worker_state``
    for why a mixin)."""

    def _start(self, peer: bytes | None, run: Run) -> None:
        """Resolve data-plane refs among the inputs (waiting only for pulls), then run."""
        if self._cancelled_early and (peer, run.call_id, run.aid) in self._cancelled_early:
            del self._cancelled_early[(peer, run.call_id, run.aid)]
            self._done(peer, run.call_id, run.aid, asyncio.CancelledError())
            return
        kwargs = run.kwargs
        for v in kwargs.values():  # (most runs: no value that can hold a ref, nothing to do)
            if type(v) is DataRef or type(v) is list or type(v) is tuple:
                break
        else:
            self._run(peer, run)
            return
        refs = [r for v in kwargs.values() for r in refs_in(v)]
        if refs:
            conn = run.connectors or {}
            key = (peer, run.call_id, run.aid)
            if any(self.plane.needs_pull(r, conn.get(r.key[0], "auto")) for r in refs):
                task = asyncio.get_running_loop().create_task(self._pull_then_run(peer, run))
                self._running[key] = task
                task.add_done_callback(lambda t: self._unreported(key, t))
                return
            try:
                read = self.plane.resolve_now
                run = run._replace(kwargs={f: read(v, conn) for f, v in kwargs.items()})
            except Exception as exc:
                self._done(peer, run.call_id, run.aid, exc)
                return
            if self._edge_bytes is not None:  # (read from another process's pool: /metrics)
                count_reads(self._edge_bytes, run.graph, run.node, kwargs.items())
        self._run(peer, run)

    async def _pull_then_run(self, peer: bytes | None, run: Run) -> None:
        key = (peer, run.call_id, run.aid)
        conn = run.connectors or {}
        kwargs = run.kwargs
        try:
            resolve = self.plane.resolve
            run = run._replace(kwargs={f: await resolve(v, conn) for f, v in kwargs.items()})
        except BaseException as exc:
            self._running.pop(key, None)
            self._done(peer, run.call_id, run.aid, exc)
            return
        self._running.pop(key, None)
        if self._edge_bytes is not None:  # (read from another process's pool: /metrics)
            count_reads(self._edge_bytes, run.graph, run.node, kwargs.items())
        self._run(peer, run)

    def _run(self, peer: bytes | None, run: Run) -> None:
        # (Shell._launch runs the front's by the same rules, runtime/_drive; its ends step a
        # call core, these go to the front as messages.)
        c, a, node, kwargs, session, group, q, graph, off, th, _conn, fw, tp = run
        # The front will send end_call (it tracks this worker for the call) when the call may
        # leave state here: per-call params, pages in a Params Pool, or offloaded outputs
        # (``_placed``: only once one was, as the front learns only from a frame that has one).
        if (self._pools or graph in self._param_graphs) and c not in self._call_owner:
            self._call_owner[c] = peer
        if off:
            self._offload[(peer, c, a)] = (node, off, th)
        if fw:
            ft = self._fronts.get(peer)
            routes = self._routes_of(node, fw)
            if routes is not None and ft is not None:
                self._fw[(peer, c, a)] = Fw(routes, run, ft)
        method = self._methods.get(node)
        if method is None:
            self._done(peer, c, a, OmniflowError(f"node '{node}' is not hosted by this worker"))
            return
        key = (peer, c, a)
        if self._batchers and node in self._batchers:
            self._batched(key, node, kwargs, (
                ActivationContext, graph, session, c, node, group, self._params(session, c, graph),
                q, a, self._pool_view,
            ))  # fmt: skip
            return
        # Its own context, a copy of the worker's, with what of.context() builds on asking.
        ctx = self._ctx.copy()
        ctx.run(_current.set, (
            ActivationContext, graph, session, c, node, group, self._params(session, c, graph),
            q, a, self._pool_view,
        ))  # fmt: skip
        if tp is not None:  # traced: the method runs under its activation's span
            ctx.run(attach_traceparent, tp)
        try:
            call = method(**kwargs)
        except Exception as exc:
            self._done(peer, c, a, exc)
            return
        if node in self._generators:
            gtask = asyncio.get_running_loop().create_task(self._drive(key, call), context=ctx)
            self._running[key] = gtask
            gtask.add_done_callback(lambda t: self._unreported(key, t))
            return
        # The method's own task, its first step run now (most methods end in it).
        task = eager_task(call, ctx)
        if task.done():
            self._finished(key, task)
            return
        self._running[key] = task
        task.add_done_callback(lambda t: self._finished(key, t))

    def _batched(self, key: _Key, node: str, kwargs: dict[str, Any], cur: Any) -> None:
        """Hand a run of a batched node to its batcher: its entry stands in ``_running``
        where a task would (``Cancel`` cancels it) until its batch reports it."""
        batcher = self._batchers[node]

        def done(frame: Any) -> None:
            if self._running.pop(key, None) is entry:
                self._done(key[0], key[1], key[2], None, frame)

        def failed(exc: BaseException) -> None:
            if self._running.pop(key, None) is entry:
                self._done(key[0], key[1], key[2], exc)

        entry = BatchEntry(batcher, kwargs, cur, (key[0], key[1]), done, failed)
        self._running[key] = entry
        batcher.add(entry)

    def batch_statistics(self) -> dict[str, dict[str, Any]]:
        """Per batched node hosted here, its batcher's ``statistics()``."""
        return {n: b.statistics() for n, b in sorted(self._batchers.items())}

    def _finished(self, key: _Key, task: asyncio.Task[Any]) -> None:
        """A coroutine method's task ended: report its frame, or what it raised."""
        self._running.pop(key, None)
        if task.cancelled():
            self._done(key[0], key[1], key[2], asyncio.CancelledError())
            return
        exc = task.exception()
        self._done(key[0], key[1], key[2], exc, None if exc is not None else task.result())

    def _unreported(self, key: _Key, task: asyncio.Task[Any]) -> None:
        """A ``_drive`` / ``_pull_then_run`` task ended. Its body reports the end itself (and
        leaves ``_running``); a task cancelled before its first step never ran its body, so
        its end is reported here, or the front would wait for the activation forever."""
        if self._running.get(key) is not task:
            return
        del self._running[key]
        self._done(key[0], key[1], key[2], generator_end(task))

    async def _drive(self, key: _Key, agen: Any) -> None:
        """Run a generator method (``_drive.drive``). Frames yielded within one event-loop
        turn leave as one ``frames`` message (at most FRAME_BATCH each): a stream that does not
        pause costs the front one message per batch, and one that pauses still sends each
        frame at once."""
        peer, c, a = key
        out = FrameBatch(self, peer, c, a)
        exc = await drive(agen, out.push)
        self._running.pop(key, None)
        out.flush()  # frames yielded before a failure still reach the front, in order
        self._fw.pop(key, None)
        self._done(peer, c, a, exc or out.error)

    def _placed(self, peer: bytes | None, c: str, a: int | str, frame: Any) -> Any:
        """``frame`` with the outputs this activation offloads put in the data plane."""
        off = self._offload.get((peer, c, a))
        if off is not None and isinstance(frame, dict):
            try:
                placed = self.plane.offload(
                    off[0], c, a, next(self._payloads), frame, off[1], off[2]
                )
            except Exception as exc:
                raise _Unsendable(f"a frame could not be placed in the data plane: {exc}") from exc
            if placed is not frame and c not in self._call_owner:
                self._call_owner[c] = peer  # its blocks are released, and the call ended, by it
            return placed
        return frame

    def _done(
        self,
        peer: bytes | None,
        c: str,
        a: int | str,
        exc: BaseException | None,
        frame: Any = None,
    ) -> None:
        """Say the activation ended; a coroutine's returned ``frame`` (not None) rides along,
        one message instead of ``frame`` + ``done`` (the front applies it first). A failure
        carries its type, message and formatted traceback (the front's NodeError gets it)."""
        key = (peer, c, a)
        if exc is None and frame is not None:
            try:
                placed = self._placed(peer, c, a, frame) if self._offload else frame
                x = self._forward(key, placed) if self._fw else None
                if self._reading:  # encoded with the others at the flush (``DoneBatch``)
                    self._hold_done(peer, c, a, placed, x)
                elif x is None:
                    self._put(peer, encode_fields(Done, c, a, placed))
                else:  # (what it forwarded, if this cannot be sent, the front orphans)
                    self._put(peer, encode_fields(Done, c, a, placed, None, None, False, None, x))
            except _Unsendable as e:
                exc = e
            except Exception as e:  # a value the wire cannot carry fails the activation
                exc = _Unsendable.sending(e)
            else:
                if self._offload:
                    self._offload.pop(key, None)
                if self._fw:
                    self._fw.pop(key, None)
                return
        self._offload.pop(key, None)
        self._fw.pop(key, None)
        if exc is None:
            if self._reading:
                self._hold_done(peer, c, a, None, None)
            else:
                self._send(peer, Done(c, a))
        else:
            self._send(peer, failed_done(c, a, exc))

    def _hold_done(
        self, peer: bytes | None, c: str, a: int | str, frame: Any, x: list[Any] | None
    ) -> None:
        """Hold a good end for the flush: with the good ends held for ``peer`` just before
        it, it leaves as one ``Dones`` (in its place among what is held)."""
        items = self._held.setdefault(peer, [])
        last = items[-1] if items else None
        if type(last) is DoneBatch and len(last.cs) < MAX_BATCH:
            last.cs.append(c)
            last.as_.append(a)
            last.fs.append(frame)
            last.xs.append(x)
        else:
            items.append(DoneBatch(c, a, frame, x))


class FrameBatch:
    """The frames of one generator activation on their way to the front, batched per turn."""

    __slots__ = ("a", "batch", "c", "error", "key", "peer", "scheduled", "worker", "xs")

    def __init__(self, worker: Activations, peer: bytes | None, c: str, a: int | str) -> None:
        self.worker = worker
        self.peer, self.c, self.a = peer, c, a
        self.key = (peer, c, a)
        #: Frames placed (offloaded outputs in the data plane) and not sent yet.
        self.batch: list[Any] = []
        #: Per frame of ``batch``: the runs forwarded for it (None when no frame had any).
        self.xs: list[Any] | None = None
        #: A flush is due at the end of this loop turn.
        self.scheduled = False
        #: Why a flush failed (a value the wire cannot carry fails the activation).
        self.error: _Unsendable | None = None

    def push(self, frame: Any) -> bool:
        """``drive``'s push: place and queue the frame (forwarding its fast-path runs);
        raises once a send failed."""
        worker = self.worker
        placed = worker._placed(self.peer, self.c, self.a, frame)
        if worker._fw:
            x = worker._forward(self.key, placed)
            if x is not None and self.xs is None:
                self.xs = [None] * len(self.batch)
            if self.xs is not None:
                self.xs.append(x)
        self.batch.append(placed)
        if len(self.batch) >= FRAME_BATCH:
            self.flush()
        elif not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)
        if self.error is not None:
            raise self.error
        return True

    def flush(self) -> None:
        self.scheduled = False
        if not self.batch:
            return
        frames, self.batch = self.batch, []
        xs, self.xs = self.xs, None
        try:
            if len(frames) == 1:
                if xs is None or xs[0] is None:
                    msg = encode_fields(Frame, self.c, self.a, frames[0])
                else:
                    msg = encode_fields(Frame, self.c, self.a, frames[0], xs[0])
            elif xs is None:
                msg = encode_fields(Frames, self.c, self.a, frames)
            else:
                msg = encode_fields(Frames, self.c, self.a, frames, xs)
            self.worker._put(self.peer, msg)
        except Exception as e:  # a value the wire cannot carry fails the activation
            self.error = _Unsendable.sending(e)
