"""What the front's router keeps per remote activation: its wire id and key, the
fast-path routes its run carried (``Plan``), and the run itself while it is on a replica
(``Pending``, the shell's task for it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omniflow.cluster._fleet import Replica
from omniflow.cluster._forward import Hop

if TYPE_CHECKING:
    from omniflow.runtime._call import Call
    from omniflow.runtime.callcore._core import Activation, CallCore

from typing import Protocol

#: A run's wire id: the front's activation id, or a forwarded run's str id (``_forward``).
Wid = int | str
#: The exact types of a wire activation id (front's int, forwarded run's str).
WIRE_IDS = (int, str)
#: (call id, wire id): how the front knows a remote activation.
Key = tuple[str, Wid]


class Canceller(Protocol):
    """Who cancels a pending run on its replicas (the router)."""

    def _cancel(self, key: Key) -> None: ...


@dataclass(slots=True)
class Plan:
    """A fast-path route as the front sent it: the edge, the replica it names, and the routes
    the downstream run itself was given."""

    hop: Hop
    rep: Replica
    sub: tuple[Plan, ...]


class Pending:
    """An activation running on one or more replicas; the shell's task for it (in
    ``call._tasks``): ``cancel()`` asks its replicas."""

    __slots__ = (
        "act", "call", "core", "error", "k", "key", "remote", "replicas", "routes", "via",
    )  # fmt: skip

    def __init__(
        self,
        remote: Canceller,
        key: Key,
        call: Call,
        core: CallCore,
        act: Activation,
        replicas: list[Replica],
        routes: tuple[Plan, ...] = (),
        via: Replica | None = None,
    ) -> None:
        self.remote = remote
        #: (call id, wire id): its entry in ``RemoteRoles._pending`` and in replicas' ``held``.
        self.key = key
        self.call = call
        self.core = core
        self.act = act
        #: The replicas running it (its done comes from each).
        self.replicas = replicas
        #: The error to end it with (the first a replica reported, or a lost replica's).
        self.error: BaseException | None = None
        #: The fast-path routes its run carried (index = route number in a frame's ``forwarded``).
        self.routes = routes
        #: Frames it sent so far (a forwarded run's id names the frame by this index).
        self.k = 0
        #: A forwarded run's forwarder: the replica whose frame said it started it.
        self.via = via

    def cancel(self) -> None:
        self.remote._cancel(self.key)
