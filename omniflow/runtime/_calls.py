"""The calls of one Runtime from their start to their end: cores, deadlines, cancels, ends.

``Calls`` makes each call's core when the call may start (``start``), cuts it at its deadline
(``time_out``) or on ``cancel``, and ends it (``finish``: its Params Pool pages, its workers'
state, its data-plane buffers, the next call of its session). The shell runs what lies between.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import NodeError
from omniflow.runtime._call import Call
from omniflow.runtime._observe import ObservedCore
from omniflow.runtime._sessions import Sessions
from omniflow.runtime._shell import Shell
from omniflow.runtime.callcore._compiled import Compiled
from omniflow.runtime.callcore._core import CallCore
from omniflow.runtime.callcore._stimuli import Cancel, CancelKind, Start

if TYPE_CHECKING:
    from omniflow.runtime._tracing import Tracing

__all__ = ["Calls"]

logger = logging.getLogger("omniflow.runtime")

_new = tuple.__new__


class Calls:
    """The call table of one Runtime (``calls``: started or queued, not finished)."""

    def __init__(
        self,
        shell: Shell,
        sessions: Sessions,
        compiled: dict[str, Compiled],
        coros: dict[str, dict[str, Any]],
        pools: dict[str, Any],
        *,
        story_log: deque[tuple[Any, ...]] | None,
        tracing: Tracing | None,
    ) -> None:
        #: call id -> every call started or queued and not finished.
        self.calls: dict[str, Call] = {}
        #: With ``validate``, each batch of ready work runs in an order shuffled by this seed
        #: and the call id, so that order bugs surface.
        self.shuffle_seed = 0
        #: The runtime's loop (set at its start).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.shell = shell
        self.sessions = sessions
        self.story_log = story_log
        self.tracing = tracing
        self._compiled = compiled
        self._coros = coros
        self._pools = pools

    def start(self, call: Call) -> None:
        """The call may start (first of its session, or not in one): its core takes ``Start``."""
        if call.done or call.core is not None:
            return
        compiled = self._compiled[call.graph]
        seeded = self.shell.validate
        shuffle = random.Random(f"{self.shuffle_seed}:{call.call_id}") if seeded else None
        if self.shell.metrics is None and self.tracing is None:
            core = CallCore(compiled, call.call_id, story=self.story_log, shuffle=shuffle)
        else:  # the same core, observed: stage metrics and spans (``_observe``)
            core = ObservedCore(
                compiled, call.call_id, story=self.story_log, shuffle=shuffle,
                metrics=self.shell.metrics, tracing=self.tracing,
                parent=call._ctx.run(_otel_current) if self.tracing is not None else None,
                session=call.session,
            )  # fmt: skip
        call.core = core
        if self.shell.metrics is not None:
            self.shell.metrics.calls_started += 1
        call.status = "running"
        call._coros = self._coros[call.graph]
        if call.session is not None:
            call._params = self.sessions.held(call.session)
        inputs = call._inputs or {}
        call._inputs = None
        try:
            self.shell.step(call, core, _new(Start, (inputs,)))
        except Exception as exc:
            self.shell.crash(call, exc)

    def time_out(self, call: Call) -> None:
        """The call's deadline passed: cancel it; it ends "error" with a "timeout" NodeError
        naming the earliest activation still running (or the session queue it waits in)."""
        call._timer = None
        if call.done:
            return
        after = f"the call exceeded its timeout of {call._timeout:g}s"
        core = call.core
        if core is None:
            err = NodeError(
                "<session queue>",
                f"{after} while queued behind earlier calls of session {call.session!r}",
                kind="timeout",
                call_id=call.call_id,
                graph=call.graph,
            )
            call._timed_out = True
            self.finish(call, None, status="error", errors=[err])
            return
        running = sorted(core.running, key=lambda a: a.aid)
        node = running[0].node if running else "<call>"
        err = NodeError(
            node,
            f"{after} while this node was still running; raise timeout= or make it faster",
            kind="timeout",
            call_id=call.call_id,
            graph=call.graph,
        )
        call._timed_out = True
        try:
            reason = f"timeout after {call._timeout:g}s"
            self.shell.step(call, core, Cancel(CancelKind.TIMEOUT, reason, err))
        except Exception as exc:
            self.shell.crash(call, exc)

    def cancel(self, call: Call) -> None:
        if call.done:
            return
        core = call.core
        if core is None:
            # Still queued behind its session: it never started.
            self.finish(call, None, status="cancelled")
            return
        try:
            self.shell.step(call, core, Cancel())
        except Exception as exc:
            self.shell.crash(call, exc)

    def _release_pools(self, call: Call) -> None:
        """Unpin the pages the call holds in any Params Pool (ok, error or cancelled); the
        caller's view of the end (``wait``, the iterator's end, ``run``) waits for it."""
        held = [p for p in self._pools.values() if p.holds(call.call_id)]
        if held and self.loop is not None:
            task = self.loop.create_task(_release(held, call.call_id))
            self.shell.track(task)
            call._releasing = task

    def finish(
        self,
        call: Call,
        core: CallCore | None,
        status: str | None = None,
        errors: list[NodeError] | None = None,
    ) -> None:
        if call.done:
            return
        timer = call._timer
        if timer is not None:
            call._timer = None
            timer.cancel()
        self.calls.pop(call.call_id, None)
        if self._pools:
            self._release_pools(call)
        if self.shell.remote is not None:
            ended = self.shell.remote.end_call(call.call_id)
            if ended is not None:  # (the workers' releases of its pool pages: waited for too)
                releasing = call._releasing
                call._releasing = ended if releasing is None else asyncio.gather(releasing, ended)
        if self.shell.plane is not None:
            self.shell.plane.cleanup(call.call_id)
        if core is not None:
            # A call cut by its deadline ends "error" (its cancelled methods say "cancel").
            call._finish("error" if call._timed_out else core.status, core.errors)
        else:
            call._finish(status or "cancelled", errors or [])
        if self.shell.metrics is not None:
            done = self.shell.metrics.calls_finished
            done[call.status] = done.get(call.status, 0) + 1
        if call.session is not None:
            nxt = self.sessions.next_after(call)
            if nxt is not None and self.loop is not None:
                self.loop.call_soon(self.start, nxt)


def _otel_current() -> Any:
    """The OpenTelemetry context current where the call was made (the server span)."""
    from opentelemetry import context

    return context.get_current()


async def _release(pools: list[Any], call_id: str) -> None:
    """Release ``call_id``'s pages in each pool; a failure is logged, the others go on."""
    for pool in pools:
        try:
            await pool.release(call_id)
        except Exception:
            logger.exception("releasing call %s's pages in pool %r failed", call_id, pool.name)
