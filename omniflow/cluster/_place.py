"""The cluster's answer to a Runtime's placement (``runtime._executor.Cluster``): which roles
run in worker processes or on Ray, and the ``RemoteRoles`` that runs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omniflow.cluster._launch import Launcher, SubprocessLauncher
from omniflow.cluster._placement import ProcessSpec, plan_processes, resolve_connectors
from omniflow.cluster._ray_plan import Ray
from omniflow.cluster._remote import RemoteRoles
from omniflow.data._plane import DataPlane
from omniflow.runtime._executor import OnDone, OnFrame

__all__ = ["Placement", "Processes"]


@dataclass(frozen=True)
class Processes:
    """A placement resolved: the process groups and each remote edge's connector."""

    placement: Any
    role_modules: dict[str, str | None]
    processes: list[ProcessSpec]
    connectors: dict[str, dict[str, str]]

    @property
    def remote_roles(self) -> frozenset[str]:
        return frozenset(r for p in self.processes for r in p.roles)

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
    ) -> RemoteRoles:
        return RemoteRoles(
            self.processes,
            registry=registry,
            on_frame=on_frame,
            on_done=on_done,
            on_return=on_return,
            plane=plane,
            offload=offload,
            connectors=self.connectors,
            heartbeat_interval=heartbeat_interval,
            cluster_key=cluster_key,
            heartbeat_misses=heartbeat_misses,
            launcher=self._launcher(plane, otlp_endpoint),
        )

    def _launcher(self, plane: DataPlane | None, otlp_endpoint: str | None) -> Launcher:
        """What starts the replicas (``_launch``): subprocesses unless Ray places them."""
        launcher: Launcher
        if isinstance(self.placement, Ray):
            from omniflow.cluster._ray import RayLauncher

            plan = self.placement.plan(self.role_modules)
            launcher = RayLauncher(self.placement, plan, plane=plane)
        else:
            launcher = SubprocessLauncher()
        launcher.otlp_endpoint = otlp_endpoint
        return launcher


class Placement:
    """Resolves ``"inproc"``, ``"process"``, ``Deploy`` and ``Ray`` (registered on import)."""

    def place(
        self,
        placement: Any,
        role_modules: dict[str, str | None],
        plans: dict[str, Any],
        connectors: dict[Any, str] | None,
    ) -> Processes:
        processes = plan_processes(placement, role_modules)
        remote_roles = frozenset(r for p in processes for r in p.roles)
        edges = resolve_connectors(plans, connectors, remote_roles, processes)
        return Processes(placement, role_modules, processes, edges)
