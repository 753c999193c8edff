"""The record the fleet (``_fleet``) keeps of each replica: its connection, its process, what
it holds and what of what it sent waits (``_fleet_intake``). Its state is ``life``
(``_replica.Lifecycle``, pure), changed only through ``Fleet.event``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omniflow.cluster._launch import ReplicaHandle
from omniflow.cluster._placement import ProcessSpec
from omniflow.cluster._replica import Lifecycle
from omniflow.transport._auth import PlainOpener, PlainSealer, Sealer
from omniflow.transport._protocol import Message

__all__ = ["OnLost", "OnMessage", "Replica"]


@dataclass(eq=False)
class Replica:
    """One replica as this front knows it: its connection and what it runs. Its state is
    ``life`` (``_replica.Lifecycle``), changed only through ``Fleet.event``."""

    replica_id: str
    roles: list[str]
    address: str
    #: The started process, as its launcher handed it back (None: found in the registry).
    process: ReplicaHandle | None = None
    life: Lifecycle = field(init=False)
    endpoint: Any = None
    #: Resolved by its ``ready`` (failed if it is lost first).
    ready: asyncio.Future[None] | None = None
    out: asyncio.Queue[list[Any] | None] = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    #: (call id, aid) of activations it runs.
    held: set[tuple[str, int | str]] = field(default_factory=set)
    exit_code: int | None = None
    #: Pending judgement of a replica absent from the registry (cancelled if it comes back).
    probation: asyncio.TimerHandle | None = None
    #: Loop time of its last ``bye`` (a leaving replica repeats it while it drains).
    last_bye: float = 0.0
    #: Process id the worker reported in "ready" (its data-plane refs carry it).
    pid: int | None = None
    #: Seals what this front sends on this connection (one sender, one counter).
    sealer: Sealer | PlainSealer | None = None
    #: Checks what it sends where its connection is authenticated (None: the fleet's opener,
    #: which checks each message's seal).
    opener: PlainOpener | None = None
    #: Loop time of the last authentic message from it (heartbeats included).
    last_seen: float = 0.0
    #: The process group it was started for and its slot there (None: found in the registry).
    spec: ProcessSpec | None = None
    slot: int = 0
    #: Loop time it was started at (a replica that lived long resets its slot's backoff).
    born: float = 0.0
    #: (pool, node) of the Params Pools it registered in the front-hosted metadata.
    pool_nodes: set[tuple[str, str]] = field(default_factory=set)
    #: What it sent that waits for the end of this loop turn, in arrival order (None: none):
    #: each (a decoded message, a batch's encoded messages, packets), handled in that order.
    late: list[tuple[Message | None, list[Any], list[Any]]] | None = None
    #: Loop turns in a row that what it sent waited (``_fleet_intake.Intake._later``).
    waited: int = 0
    #: Its batchers' ``statistics()`` by node, as its last heartbeat said (None: none).
    batches: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.life = Lifecycle(self.replica_id)

    @property
    def alive(self) -> bool:
        """Not gone (it may still be starting or leaving)."""
        return self.life.alive

    @property
    def routable(self) -> bool:
        """Connected and not leaving: what runs can be routed to."""
        return self.life.routable

    def __repr__(self) -> str:
        return f"Replica({self.replica_id!r}, {self.life.state.value})"


#: Where the fleet hands a checked message about calls (with whether it may hand back what
#: should wait: ``_fleet_intake.Intake.later``), and a lost replica's activations.
OnMessage = Callable[[Replica, Message, bool], "Message | None"]
OnLost = Callable[[Replica, str], None]
