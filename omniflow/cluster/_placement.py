"""Placement planning: which roles run in which worker processes, and which edges may use
which connector. Pure: no I/O, no event loop (tests/runtime/test_placement_plan.py).

>>> [p.name for p in plan_processes("process", {"llm": "graphs.chat", "vit": "graphs.chat"})]
['llm', 'vit']

``plan_processes`` turns ``placement=`` (``"inproc"``, ``"process"``, a :class:`Deploy` or an
``of.Ray``, whose own plan of bundles and layers is ``_ray_plan``) into :class:`ProcessSpec`
groups; ``resolve_connectors`` checks a ``connectors=`` config against
those groups. The I/O shell (``_remote.RemoteRoles``) starts one replica per slot of each group
through a launcher (``_launch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omniflow._exceptions import GraphError, OmniflowError
from omniflow.cluster._ray_plan import Ray
from omniflow.data._ref import CONNECTORS

__all__ = ["Deploy", "ProcessSpec", "plan_processes", "resolve_connectors"]


class Deploy:
    """Group roles into named worker processes and replicate them.

    >>> Deploy({"llm": {"replicas": 2, "process": "gpu0"}, "vit": {"process": "gpu0"}})
    Deploy({'llm': {'replicas': 2, 'process': 'gpu0'}, 'vit': {'process': 'gpu0'}})

    Roles that share a ``process`` name run in one process (each replica of the group is one
    process); roles not named stay in the front process.
    """

    _KEYS = frozenset({"replicas", "process"})

    def __init__(self, roles: dict[str, dict[str, Any]]) -> None:
        if not isinstance(roles, dict):
            raise OmniflowError(
                "Deploy takes a dict: {role name: {'replicas': n, 'process': name}}"
            )
        for name, opts in roles.items():
            if not isinstance(opts, dict):
                raise OmniflowError(f"Deploy: options of role '{name}' must be a dict")
            unknown = set(opts) - self._KEYS
            if unknown:
                raise OmniflowError(
                    f"Deploy: role '{name}' has unknown option(s) {sorted(unknown)}; "
                    f"use {sorted(self._KEYS)}"
                )
            n = opts.get("replicas", 1)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise OmniflowError(f"Deploy: role '{name}' replicas must be an int >= 1")
        self.roles = {k: dict(v) for k, v in roles.items()}

    def __repr__(self) -> str:
        return f"Deploy({self.roles!r})"


@dataclass
class ProcessSpec:
    """One group of roles that runs as ``replicas`` worker processes."""

    name: str
    roles: list[str]
    replicas: int
    modules: list[str]


def plan_processes(placement: Any, role_modules: dict[str, str | None]) -> list[ProcessSpec]:
    """Which roles go to which worker processes; [] for in-process placement."""
    if placement == "inproc":
        return []
    wanted: dict[str, dict[str, Any]]
    if placement == "process":
        wanted = {r: {"process": r, "replicas": 1} for r in role_modules}
    elif isinstance(placement, Deploy):
        wanted = placement.roles
    elif isinstance(placement, Ray):  # one group per role, its replicas Ray actors
        ray_roles = placement.plan(role_modules).roles
        wanted = {r: {"process": r, "replicas": ray_roles[r].replicas} for r in role_modules}
    else:
        raise OmniflowError(
            f"placement={placement!r} is not understood; use 'inproc', 'process', "
            "omniflow.Deploy({...}) or omniflow.Ray({...})"
        )
    groups: dict[str, ProcessSpec] = {}
    #: process name -> the role whose options gave the group its replica count.
    stated: dict[str, str] = {}
    for role, opts in wanted.items():
        if role not in role_modules:
            raise OmniflowError(
                f"Deploy names role '{role}', which no graph of this runtime declares; roles: "
                f"{sorted(role_modules)}"
            )
        module = role_modules[role]
        if module is None:
            raise OmniflowError(
                f"role '{role}' must run in a worker process, but its graph was built in "
                "__main__; define the graph at module level in an importable module or .py file"
            )
        pname = str(opts.get("process", role))
        n = opts.get("replicas")
        spec = groups.get(pname)
        if spec is None:
            spec = groups[pname] = ProcessSpec(pname, [], 1, [])
        if n is not None:
            # A role that does not say how many replicas joins its group's count, whatever
            # the order of the Deploy dict; two roles that say different counts disagree.
            if pname in stated and spec.replicas != n:
                raise OmniflowError(
                    f"Deploy: roles of process '{pname}' disagree on replicas "
                    f"({spec.replicas} vs {n}: roles '{stated[pname]}' and '{role}'); a "
                    "process group is replicated as a whole, so state it on one role"
                )
            spec.replicas = int(n)
            stated[pname] = role
        spec.roles.append(role)
        if module not in spec.modules:
            spec.modules.append(module)
    return list(groups.values())


def resolve_connectors(
    plans: dict[str, Any],
    config: dict[Any, str] | None,
    remote_roles: frozenset[str],
    processes: list[ProcessSpec],
) -> dict[str, dict[str, str]]:
    """Per-edge connector choice, checked now: ``{dst node: {src node: connector}}``.

    ``config`` maps ``(src, dst)`` (or ``"src->dst"``) to one of CONNECTORS, plus an optional
    ``"default"``. An edge that its connector cannot carry is a GraphError: ``inproc`` needs
    both ends in one process (the front, or a process group with a single replica).
    """
    if not config:
        return {}
    home: dict[str, str | None] = {}
    for spec in processes:
        for role in spec.roles:
            home[role] = spec.name if spec.replicas == 1 else None
    roles_of: dict[str, str] = {}
    edges: set[tuple[str, str]] = set()
    for plan in plans.values():
        for n, s in plan.specs.items():
            roles_of[n] = s.role
        edges.update((src, dst) for src, _f, dst, _g in plan.edges if src != "<input>")

    def place(node: str) -> str | None:
        role = roles_of[node]
        return home[role] if role in remote_roles else "<front>"

    def check(src: str, dst: str, conn: str) -> None:
        if conn not in CONNECTORS:
            raise GraphError(
                f"connector {conn!r} for edge {src} -> {dst} is unknown; use one of {CONNECTORS}",
                node=dst,
            )
        if conn == "inproc" and (place(src) is None or place(src) != place(dst)):
            raise GraphError(
                f"edge {src} -> {dst} crosses processes (placement puts them in different or "
                "replicated processes), so connector 'inproc' cannot carry it; use 'shm' "
                "(same host) or 'zmq'",
                node=dst,
            )

    out: dict[str, dict[str, str]] = {}
    default = config.get("default", "auto")
    explicit: dict[tuple[str, str], str] = {}
    for key, conn in config.items():
        if key == "default":
            continue
        if isinstance(key, str) and "->" in key:
            src, dst = (part.strip() for part in key.split("->", 1))
        elif isinstance(key, tuple) and len(key) == 2:
            src, dst = key
        else:
            raise GraphError(
                f"connectors key {key!r} is not an edge; write ('src.node', 'dst.node') or "
                "'src.node->dst.node'"
            )
        if (src, dst) not in edges:
            raise GraphError(
                f"connectors names edge {src} -> {dst}, which no graph of this runtime has",
                node=dst,
            )
        explicit[(src, dst)] = conn
    for src, dst in sorted(edges):
        conn = explicit.get((src, dst), default)
        if conn == "auto":
            continue
        check(src, dst, conn)
        out.setdefault(dst, {})[src] = conn
    return out
