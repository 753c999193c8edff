"""The fast-path routes the front puts in a run (docs/fast-path.md, *Which edges*): per node,
one route per edge the plan fixes (``_forward.hops``) whose role has exactly one routable
replica, READY; the same until a replica changes state (the fleet's epoch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omniflow.cluster._fleet import Fleet
from omniflow.cluster._forward import Hop, hops
from omniflow.cluster._remote_pending import Plan
from omniflow.cluster._replica import ReplicaState

if TYPE_CHECKING:
    from omniflow.runtime.callcore._compiled import Compiled


class RouteTable:
    """Each node's fast-path routes, made once per fleet epoch."""

    def __init__(
        self,
        fleet: Fleet,
        roles: Any,
        offload: dict[tuple[str, str], list[str]],
        connectors: dict[str, dict[str, str]],
        threshold: int | None,
    ) -> None:
        self.fleet = fleet
        #: Roles served by workers (``hops`` routes only to them).
        self.roles = roles
        self._offload = offload
        self._connectors = connectors
        self._threshold = threshold
        #: (graph, node) -> its fast-path edges (from the plan; ``_forward.hops``).
        self._hops: dict[tuple[str, str], tuple[Hop, ...]] = {}
        #: (graph, node) -> (fleet epoch, routes, their wire form) of its runs.
        self._routes: dict[tuple[str, str], tuple[int, tuple[Plan, ...], list[Any] | None]] = {}

    def of(self, c: Compiled, graph: str, node: str) -> tuple[tuple[Plan, ...], list[Any] | None]:
        """The fast-path routes of a run of ``node``: each to the one routable replica of its
        target (an edge whose role has more, or none ready, is left to the front); the same
        until a replica changes state."""
        cached = self._routes.get((graph, node))
        if cached is not None and cached[0] == self.fleet.epoch:
            return cached[1], cached[2]
        plans, wire = self._make_routes(c, graph, node)
        self._routes[(graph, node)] = (self.fleet.epoch, plans, wire)
        return plans, wire

    def _make_routes(
        self, c: Compiled, graph: str, node: str
    ) -> tuple[tuple[Plan, ...], list[Any] | None]:
        edges = self._hops.get((graph, node))
        if edges is None:
            edges = self._hops[(graph, node)] = hops(c, node, self.roles)
        if not edges:
            return (), None
        plans: list[Plan] = []
        wire: list[Any] = []
        for hop in edges:
            live = self.fleet.routable(hop.role)
            if len(live) != 1 or live[0].life.state is not ReplicaState.READY:
                continue
            rep = live[0]
            sub, sub_wire = self._make_routes(c, graph, hop.node)
            off = self._offload.get((graph, hop.node)) or None
            plans.append(Plan(hop, rep, sub))
            wire.append([
                hop.field, hop.node, hop.group, rep.address, rep.replica_id, off,
                self._threshold if off else None, self._connectors.get(hop.node) or None,
                hop.qk, sub_wire,
            ])  # fmt: skip
        return tuple(plans), wire or None
