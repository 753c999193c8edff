"""Replicas and routes for driving the fast-path machine (``cluster.fastpath``) without a
fleet: what the machine reads of them and nothing more."""

from __future__ import annotations

from typing import Any, NamedTuple

from omniflow.cluster._forward import Hop
from omniflow.cluster.fastpath import FastPathCore
from omniflow.cluster.fastpath._events import Handled, Instruction, Made, Reported


class Rep:
    """A replica handle: its name, whether it is alive and whether it takes runs."""

    __slots__ = ("alive", "name", "routable")

    def __init__(self, name: str) -> None:
        self.name = name
        self.alive = True
        self.routable = True

    def lose(self) -> None:
        self.alive = self.routable = False

    def __repr__(self) -> str:
        return self.name


class Plan(NamedTuple):
    """A route as the front sent it (``_remote_pending.Plan``'s fields)."""

    hop: Hop
    rep: Any
    sub: tuple[Any, ...]


def route(node: str, rep: Rep, sub: tuple[Plan, ...] = (), qk: bool = False) -> Plan:
    """A route to ``node`` (field "x", OR group 0) on ``rep``."""
    return Plan(Hop("x", node, 0, node.split(".")[0], qk), rep, sub)


def frame(
    core: FastPathCore,
    rep: Rep,
    c: str,
    a: int | str,
    k: int,
    routes: tuple[Plan, ...],
    made: list[Made],
    seq: int = 0,
) -> tuple[list[Instruction], list[list[Instruction]], list[Instruction]]:
    """Frame ``k`` of ``a`` (on ``rep``) reports one forward per route, the core makes
    ``made``, and the frame is handled: what each step returned."""
    x = [[r, f"{a}.{k}.{r}"] for r in range(len(routes))]
    reported = core.handle(Reported(rep, c, a, k, x, routes, seq))
    binds = [core.handle(m) for m in made]
    handled = core.handle(Handled(c))
    return reported, binds, handled


def made(c: str, node: str, q: int = 0, group: int = 0, field: str = "x") -> Made:
    """The core's activation of ``node`` as the forwarded one would be."""
    return Made(c, node, group, q, {field: 1})
