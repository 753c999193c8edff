"""The cross-process fast path: which runs a worker may start on another worker by itself.

In the slow path every edge between two workers goes worker -> front -> worker: the upstream
worker sends its frame to the front, whose call core turns it into a run that the front sends
to the downstream worker. For an edge whose outcome the plan already fixes, the upstream
worker sends that run itself (a ``Forward``), at the same time as the frame, and tells the front
which runs it forwarded (the frame's ``forwarded``). The front's core still takes every decision:
when the frame reaches it, the core makes the very activation it would have made anyway, and the
front *binds* it to the forwarded run instead of sending one (``RemoteRoles``). An edge
``N.f -> M`` qualifies (``hops``) when:

- M runs in a worker, under round robin, with exactly one routable replica (checked per run:
  the route names that replica, and the front re-checks it when it binds);
- M is direct-fire: not on a cycle, not lb="session", not throttled, no latch, no bucket (its
  one OR group is the one field f), so every frame of N that carries f makes exactly one
  activation of M, admitted straight to running, unless the call is closing;
- nothing else feeds M: this is the only route into M, so every activation of M in the call
  comes from a frame of N, and the front can tell which;
- N is not lb="session" and not broadcast, so the SeqId index of M's activation is known to
  N's worker: N's frame index when N starts a SeqId stream, else N's own (``qk``).

A frame whose value is a data-plane ref (a big value in the producer's pool) is not forwarded:
the front holds such refs for each consumer, and a ref that crossed without it could be freed
under its reader. Whatever the front's core does not turn into the forwarded activation (the
call closing, the frame rejected, a replica changed) is an *orphan*: the front cancels it and
drops what it sends, releasing the refs among its outputs.

``OMNIFLOW_FAST_PATH=0`` (``transport.fast_path_enabled``, the one switch of the fast path:
``uds://`` between processes of a node, and forwarding) turns it off.

Wire ids: the front's runs carry its activation id (an int); a forwarded run's id is
``"<upstream wire id>.<frame index>.<route index>"`` (a str), unique within the call because
each frame of each activation is forwarded at most once per route.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from omniflow.cluster.fastpath._waiting import Waiting, parent_of, wire_id

if TYPE_CHECKING:
    from omniflow.runtime.callcore._compiled import Compiled

__all__ = ["Hop", "Route", "Waiting", "hops", "parent_of", "parse_routes", "wire_id"]


class Hop(NamedTuple):
    """A fast-path edge of the plan: frames of ``field`` may start ``node`` (OR group
    ``group``, role ``role``) directly; ``qk``: its SeqId index is the frame index."""

    field: str
    node: str
    group: int
    role: str
    qk: bool


def hops(c: Compiled, src: str, remote_roles: frozenset[str] | set[str]) -> tuple[Hop, ...]:
    """The fast-path edges out of ``src`` (see the module docstring for the rules)."""
    spec = c.specs.get(src)
    if spec is None or src in c.session_nodes or spec.lb == "broadcast":
        return ()
    into: dict[str, int] = {}
    for by_field in c.fanout.values():
        for routes, _latching, _to_caller in by_field.values():
            for dst, *_ in routes:
                into[dst] = into.get(dst, 0) + 1
    out = []
    for f, (routes, _latching, _to_caller) in c.fanout.get(src, {}).items():
        for dst, g, bspec, direct in routes:
            dspec = c.specs[dst]
            if (
                direct
                and bspec is None
                and into.get(dst) == 1
                and dspec.role in remote_roles
                and dspec.lb == "round_robin"
                and dst in c.unconstrained
                and (dst, g) not in c.latch_of
            ):
                out.append(Hop(f, dst, g, dspec.role, src in c.seq_nodes))
    return tuple(out)


class Route(NamedTuple):
    """A fast-path route as a worker receives it (``Run.routes``): where frames of ``field`` go."""

    field: str
    node: str
    group: int
    address: str
    replica: str
    offload: list[str] | None
    threshold: int | None
    connectors: dict[str, str] | None
    seq_from_frame: bool
    subroutes: list[Any] | None

    def wire(self) -> list[Any]:
        return list(self)


_ROUTE_TYPES: tuple[tuple[type, ...], ...] = (
    (str,), (str,), (int,), (str,), (str,), (list, type(None)), (int, type(None)),
    (dict, type(None)), (bool,), (list, type(None)),
)  # fmt: skip


def parse_routes(raw: Any) -> tuple[Route, ...]:
    """The routes of a run's ``routes``; ValueError naming what is wrong (the worker then
    forwards nothing for that run: the slow path stays correct)."""
    if type(raw) is not list:
        raise ValueError(f"routes must be a list, not {type(raw).__name__}")
    out = []
    for item in raw:
        if type(item) is not list or len(item) != len(_ROUTE_TYPES):
            raise ValueError(f"a route must be a list of {len(_ROUTE_TYPES)} fields")
        for i, (v, allowed) in enumerate(zip(item, _ROUTE_TYPES, strict=True)):
            if type(v) not in allowed:
                raise ValueError(f"route field {Route._fields[i]!r} is a {type(v).__name__}")
        out.append(Route(*item))
    return tuple(out)
