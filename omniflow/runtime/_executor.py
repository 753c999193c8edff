"""The runtime's side of the cluster: what a Runtime needs from roles that run elsewhere.

The runtime schedules every call here and runs the roles it hosts; roles placed in worker
processes or on Ray are run by ``omniflow.cluster``, which registers itself with
``register_cluster`` when the package is imported. The runtime holds only these protocols and
never imports the cluster (tests/test_layering.py), so the arrow points one way: the cluster
knows the runtime, the runtime knows an interface.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from omniflow._exceptions import OmniflowError

if TYPE_CHECKING:
    from omniflow.data._plane import DataPlane
    from omniflow.data._ref import DataRef
    from omniflow.dsl._context import Colocation
    from omniflow.plan._plan import StaticPlan
    from omniflow.runtime._call import Call
    from omniflow.runtime.callcore._core import Activation, CallCore

__all__ = ["Cluster", "OnDone", "OnFrame", "Placed", "Remote", "cluster", "register_cluster"]

#: A frame or a return of an activation run elsewhere, handed to the shell.
OnFrame = Callable[["Call", "CallCore", "Activation", Any], None]
#: The end of an activation run elsewhere (its error, or None).
OnDone = Callable[["Call", "CallCore", "Activation", BaseException | None], None]


class Remote(Protocol):
    """The worker processes of one Runtime and the replicas it routes to."""

    #: Runs carry their span's context (the front traces).
    traced: bool
    #: Every worker a call ran on acknowledges its end (Params Pools release there).
    track_calls: bool

    @property
    def pool_meta(self) -> Any:
        """The metadata of pools with ``metadata=None``: one truth for front and workers."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def readiness(self) -> list[str]: ...
    def submit(self, call: Call, core: CallCore, act: Activation) -> None: ...
    def release(self, refs: list[DataRef]) -> None: ...
    def end_call(self, call_id: str) -> asyncio.Future[None] | None: ...
    def close_session(self, session: str) -> None: ...
    def colocation(self, local: frozenset[str]) -> Colocation: ...
    def count_edge_bytes(
        self, into: dict[tuple[str, str, str, str], int], plans: Mapping[str, StaticPlan]
    ) -> None: ...
    def edge_byte_totals(self) -> dict[tuple[str, str, str, str], int]: ...
    def statistics(self) -> dict[str, int]: ...
    def wire_statistics(self) -> dict[str, Any]: ...
    def replica_batch_statistics(self) -> dict[str, dict[str, dict[str, Any]]]: ...
    async def data_plane_statistics(self, timeout: float = 5.0) -> dict[str, dict[str, int]]: ...
    async def worker_statistics(self, timeout: float = 5.0) -> dict[str, dict[str, Any]]: ...


class Placed(Protocol):
    """A placement resolved against a runtime's roles: which roles run elsewhere."""

    @property
    def remote_roles(self) -> frozenset[str]:
        """Roles run by worker processes or Ray actors (empty: every role runs here)."""

    def remote(
        self,
        *,
        registry: str | None,
        on_frame: OnFrame,
        on_done: OnDone,
        on_return: OnFrame,
        plane: DataPlane | None,
        offload: dict[tuple[str, str], list[str]],
        heartbeat_interval: float,
        cluster_key: bytes | None,
        heartbeat_misses: int,
        otlp_endpoint: str | None = None,
    ) -> Remote:
        """The replicas of ``remote_roles`` (called only when there are some);
        ``otlp_endpoint``: the collector the front exports to, where the replicas export the
        spans their methods make themselves."""


class Cluster(Protocol):
    """Resolves placements: ``"inproc"``, ``"process"``, ``Deploy``, ``Ray``."""

    def place(
        self,
        placement: Any,
        role_modules: dict[str, str | None],
        plans: dict[str, Any],
        connectors: dict[Any, str] | None,
    ) -> Placed: ...


_cluster: list[Cluster] = []


def register_cluster(impl: Cluster) -> None:
    """Make ``impl`` resolve every Runtime's placement (``omniflow.cluster`` does, on import)."""
    _cluster[:] = [impl]


def cluster() -> Cluster:
    """The registered cluster; importing ``omniflow`` registers ``omniflow.cluster``."""
    if not _cluster:
        raise OmniflowError(
            "no cluster is registered to place roles: import omniflow (or omniflow.cluster) "
            "before building a Runtime"
        )
    return _cluster[0]
