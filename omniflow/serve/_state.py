"""What one served app holds: the Runtime, admission (max in-flight, draining) and counters.

>>> state = ServeState(rt, owns_runtime=True, max_inflight=64)   # doctest: +SKIP
>>> await state.start()                                          # doctest: +SKIP
>>> state.admit()            # None, or (status, reason, message) to refuse the call with
>>> await state.drain(10.0)  # stop admitting, wait for in-flight calls, cancel the rest

Lifecycle: NEW -> RUNNING -> DRAINING -> CLOSED. ``start`` starts the Runtime when the state
owns it (the app built it, or was given one that was not started); ``close`` drains, then closes
an owned Runtime, which runs every role's teardown.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence
from typing import Any

from omniflow._exceptions import OmniflowError, RuntimeClosedError
from omniflow.runtime import Call, Runtime
from omniflow.runtime._runtime import RuntimeState
from omniflow.serve._limits import LOOPBACK_HOSTS, Limits
from omniflow.serve._metrics import HttpMetrics

__all__ = ["ServeState", "ServeStatus"]

log = logging.getLogger("omniflow.serve")


class ServeStatus(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


class ServeState:
    """Admission and lifecycle of one app. Single event loop: no locks."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        owns_runtime: bool,
        max_inflight: int | None = None,
        api_key: str | None = None,
        drain_timeout: float = 30.0,
        limits: Limits | None = None,
        allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
    ) -> None:
        if max_inflight is not None and max_inflight < 1:
            raise OmniflowError(f"max_inflight must be >= 1 or None, got {max_inflight}")
        if drain_timeout < 0:
            raise OmniflowError(f"drain_timeout must be >= 0 seconds, got {drain_timeout}")
        #: The runtime that runs the calls.
        self.runtime = runtime
        #: Whether ``close`` closes the runtime (the app started it).
        self.owns_runtime = owns_runtime
        #: Most calls answered at once; more get 429.
        self.max_inflight = max_inflight
        #: Bearer token every route but /healthz needs (None: open).
        self.api_key = api_key
        #: Seconds ``close`` lets in-flight calls finish before cancelling them.
        self.drain_timeout = drain_timeout
        #: Body size and time limits (the app), header/idle timeouts and cap (the server).
        self.limits = limits or Limits()
        #: ``Host`` names served (``"*"``: any); others get 403.
        self.allowed_hosts = tuple(allowed_hosts)
        #: HTTP-side counters for /metrics.
        self.http = HttpMetrics()
        #: Lifecycle state.
        self.status = ServeStatus.NEW
        #: Calls admitted whose response is not finished yet.
        self.calls: set[Call] = set()
        #: Slots admitted whose call has not started yet (its body is being read).
        self.reserved = 0
        self._idle: asyncio.Event | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the runtime (role setup) if this state owns it; idempotent."""
        if self.status is not ServeStatus.NEW:
            if self.status is ServeStatus.CLOSED:
                raise RuntimeClosedError("this omniflow app was shut down; create a new one")
            return
        rt = self.runtime
        if rt.state is RuntimeState.NEW:
            self.owns_runtime = True
            try:
                await rt.start()
            except OmniflowError:
                raise
            except Exception as exc:
                raise OmniflowError(f"role setup failed: {exc!r}") from exc
        elif rt.state is RuntimeState.CLOSED:
            raise RuntimeClosedError("the Runtime given to create_app is already closed")
        self.status = ServeStatus.RUNNING

    async def drain(self, timeout: float | None = None) -> int:
        """Stop admitting calls; wait up to ``timeout`` s for in-flight ones; cancel the rest.

        Returns how many calls were cancelled.
        """
        if self.status is ServeStatus.RUNNING:
            self.status = ServeStatus.DRAINING
        timeout = self.drain_timeout if timeout is None else timeout
        if self.calls:
            log.info("draining: waiting up to %gs for %d call(s)", timeout, len(self.calls))
            idle = self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(idle.wait(), timeout)
            except TimeoutError:
                pass
            finally:
                self._idle = None
        return await self.cancel_all()

    async def cancel_all(self) -> int:
        """Cancel every call still in flight and wait until each has ended."""
        left = [c for c in self.calls if not c.done]
        if left:
            log.warning("cancelling %d call(s) still running", len(left))
        for call in left:
            await call.cancel()
        return len(left)

    async def close(self) -> None:
        """Drain, then close the runtime if owned (role teardown). Idempotent."""
        if self.status is ServeStatus.CLOSED:
            return
        if self.status is not ServeStatus.NEW:
            await self.drain()
        self.status = ServeStatus.CLOSED
        if self.owns_runtime:
            await self.runtime.close()

    # ------------------------------------------------------------------ admission

    @property
    def draining(self) -> bool:
        return self.status is not ServeStatus.RUNNING

    def admit(self) -> tuple[int, str, str] | None:
        """None when a new call may start now (a slot is then reserved until ``enter`` or
        ``release``), else (HTTP status, reason, message)."""
        if self.status is not ServeStatus.RUNNING:
            reason, status = "draining", 503
            msg = (
                "the server is shutting down and admits no new calls"
                if self.status is not ServeStatus.NEW
                else "the server has not started yet (its lifespan did not run)"
            )
        elif self.max_inflight is not None and self.inflight >= self.max_inflight:
            reason, status = "max_inflight", 429
            msg = f"too many calls in flight (max_inflight={self.max_inflight}); retry later"
        else:
            self.reserved += 1
            return None
        self.http.rejected[reason] = self.http.rejected.get(reason, 0) + 1
        return status, reason, msg

    @property
    def inflight(self) -> int:
        """Calls admitted: running, or reading their body."""
        return len(self.calls) + self.reserved

    def enter(self, call: Call) -> None:
        """The call of a reserved slot started."""
        self.release()
        self.calls.add(call)

    def release(self) -> None:
        """Give back a slot ``admit`` reserved (the request failed before its call started)."""
        if self.reserved <= 0:
            raise OmniflowError("ServeState.release without a reserved slot (admit first)")
        self.reserved -= 1

    def leave(self, call: Call) -> None:
        self.calls.discard(call)
        if not self.calls and self._idle is not None:
            self._idle.set()

    def statistics(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "calls_inflight": len(self.calls),
            "calls_reserved": self.reserved,
            "max_inflight": self.max_inflight,
            **self.runtime.stats(),
        }
