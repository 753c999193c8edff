"""Supervision of the fleet's replicas: exits reaped and restarted with backoff, heartbeats
judged, and the registry watched for replicas that appear or vanish.

>>> watch = Supervision(fleet)                  # doctest: +SKIP
>>> watch.start(sorted(fleet.roles))            # doctest: +SKIP

The fleet (``_fleet.Fleet``) owns one; what it sees becomes a ``_replica.ReplicaEvent`` through
the fleet's ``event``, a loss through its ``lost``. It reaches the fleet through
:class:`Supervised` (what it reads and calls there), not the class, so the two modules do not
import each other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from omniflow._exceptions import OmniflowError, RegistryError
from omniflow.cluster._fleet_replica import Replica
from omniflow.cluster._placement import ProcessSpec
from omniflow.cluster._replica import Backoff, ReplicaEvent, ReplicaState

if TYPE_CHECKING:
    from omniflow.registry import ServiceRegistry

__all__ = ["Supervised", "Supervision"]

logger = logging.getLogger("omniflow.remote")


class Supervised(Protocol):
    """What supervision needs of the fleet (``_fleet.Fleet``)."""

    replicas: dict[str, Replica]
    registry: ServiceRegistry | None
    restarts: dict[str, int]
    heartbeat_interval: float
    heartbeat_misses: int
    start_timeout: float
    respawn: bool
    closing: bool

    async def spawn(self, spec: ProcessSpec, slot: int) -> None: ...
    def adopt(self, role: str, rid: str, address: str) -> Replica: ...
    def event(self, rep: Replica, event: ReplicaEvent, why: str = "") -> None: ...
    def lost(self, rep: Replica, why: str) -> None: ...
    def in_background(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...


class Supervision:
    """The fleet's supervisor and registry watches; see the module docstring."""

    def __init__(self, fleet: Supervised) -> None:
        self.fleet = fleet
        #: Restart delays per (process group, slot).
        self._backoff = Backoff()
        self._supervisor: asyncio.Task[None] | None = None
        self._watchers: list[asyncio.Task[Any]] = []

    def start(self, roles: list[str]) -> None:
        """Start judging heartbeats, and watching the registry (if any) for ``roles``."""
        loop = asyncio.get_running_loop()
        self._supervisor = loop.create_task(self._supervise())
        if self.fleet.registry is not None:
            for role in roles:
                self._watchers.append(loop.create_task(self._watch(role)))

    def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
        for task in self._watchers:
            task.cancel()

    # ------------------------------------------------------------------ processes

    async def reap(self, rep: Replica) -> None:
        """Wait for a started replica's process to exit; it is lost then (and respawned)."""
        assert rep.process is not None
        fleet = self.fleet
        code = await rep.process.wait()
        rep.exit_code = code
        if fleet.closing:
            return
        fleet.lost(rep, f"its process exited with code {code}")
        # One that never became ready is retried by the _respawn (or start) that spawned it;
        # one that LEFT (said bye first) went as it said.
        dead = rep.life.state is ReplicaState.DEAD
        if fleet.respawn and rep.spec is not None and dead and rep.pid is not None:
            fleet.in_background(self._respawn(rep))

    async def _respawn(self, dead: Replica) -> None:
        """Start a new replica in the dead one's slot after a backoff (``_replica.Backoff``)."""
        assert dead.spec is not None
        fleet = self.fleet
        loop = asyncio.get_running_loop()
        slot = (dead.spec.name, dead.slot)
        delay = self._backoff.after_death(slot, lived=loop.time() - dead.born)
        fleet.event(dead, ReplicaEvent.RESPAWN, f"a new replica takes its slot in {delay:.1f} s")
        if fleet.replicas.get(dead.replica_id) is dead:
            del fleet.replicas[dead.replica_id]
        for task in dead.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if dead.endpoint is not None:
            dead.endpoint.close()
        logger.warning(
            "respawning a replica of %s in %.1f s (restart %d of this slot)",
            dead.spec.name,
            delay,
            self._backoff.restarts(slot),
        )
        await asyncio.sleep(delay)
        while not fleet.closing:
            try:
                await asyncio.wait_for(fleet.spawn(dead.spec, dead.slot), fleet.start_timeout)
            except (OmniflowError, OSError, TimeoutError) as exc:
                delay = self._backoff.after_failed_start(slot)
                logger.warning(
                    "respawning %s failed (%s); next try in %.1f s", dead.spec.name, exc, delay
                )
                await asyncio.sleep(delay)
                continue
            for role in dead.spec.roles:
                fleet.restarts[role] = fleet.restarts.get(role, 0) + 1
            logger.warning("respawned a replica of %s (roles %s)", dead.spec.name, dead.spec.roles)
            return

    async def _supervise(self) -> None:
        """Every quarter interval: a replica silent for ``heartbeat_misses`` intervals is lost
        (a started one is killed first, so it cannot come back half-alive). A front whose own
        loop was stalled judges nobody on that tick: it has not read what waits."""
        fleet = self.fleet
        loop = asyncio.get_running_loop()
        tick = fleet.heartbeat_interval / 4
        limit = fleet.heartbeat_misses * fleet.heartbeat_interval
        last = loop.time()
        while not fleet.closing:
            await asyncio.sleep(tick)
            now = loop.time()
            stalled, last = now - last > tick + fleet.heartbeat_interval / 2, now
            for rep in list(fleet.replicas.values()):
                if not rep.alive or rep.ready is None or not rep.ready.done():
                    continue
                if stalled:
                    rep.last_seen = max(rep.last_seen, now - tick)
                    continue
                if now - rep.last_seen <= limit:
                    continue
                silent = now - rep.last_seen
                fleet.lost(
                    rep,
                    f"it missed {fleet.heartbeat_misses} heartbeats ({silent:.2f} s "
                    "without a word; a spawned replica is killed)",
                )

    # ------------------------------------------------------------------ registry

    async def _watch(self, role: str) -> None:
        """Follow the registry: connect to replicas that appear, drop the ones that vanish.

        Replicas this front started are watched through their processes, not the registry, so
        a Redis restart (an empty registry until workers re-register, within one heartbeat
        interval) cannot fail their calls. A replica found elsewhere that vanishes gets two
        heartbeat intervals of grace (one to re-register after a restart, one for this watch
        to see it) before it counts as lost: with the default ttl of three intervals, a killed
        worker is lost within ``ttl + watch interval + grace`` = 6 intervals, under two ttls
        plus one watch interval. New replicas are connected in the background, so one that
        does not answer never holds up the watch.
        """
        fleet = self.fleet
        assert fleet.registry is not None
        loop = asyncio.get_running_loop()
        grace = 2 * fleet.heartbeat_interval
        while not fleet.closing:
            try:
                async with fleet.registry.watch(role) as watch:
                    async for snapshot in watch:
                        present = {r.replica_id: r for r in snapshot.replicas}
                        for rep in list(fleet.replicas.values()):
                            if rep.process is not None or not rep.alive or role not in rep.roles:
                                continue
                            if rep.replica_id in present:
                                fleet.event(rep, ReplicaEvent.PRESENT)
                                if rep.probation is not None:
                                    rep.probation.cancel()
                                    rep.probation = None
                                continue
                            fleet.event(rep, ReplicaEvent.MISSING, "gone from the registry")
                            if rep.probation is None:
                                rep.probation = loop.call_later(grace, self._check_missing, rep)
                        for rid, replica in present.items():
                            if rid not in fleet.replicas:
                                fleet.adopt(role, rid, replica.address)
                            elif role not in fleet.replicas[rid].roles:
                                fleet.replicas[rid].roles.append(role)
            except RegistryError as exc:
                logger.warning("registry unreachable while watching %s: %s", role, exc)
                await asyncio.sleep(fleet.heartbeat_interval)

    def _check_missing(self, rep: Replica) -> None:
        """Its probation ended and it is still absent from the registry (a snapshot that lists
        it again cancels the probation)."""
        fleet = self.fleet
        rep.probation = None
        if not rep.alive or fleet.closing:
            return
        loop = asyncio.get_running_loop()
        leaving = rep.life.state is ReplicaState.LEAVING
        if leaving and rep.held and loop.time() - rep.last_bye < 3 * fleet.heartbeat_interval:
            # Deregistered on purpose and still finishing runs (its repeated byes say it lives).
            rep.probation = loop.call_later(fleet.heartbeat_interval, self._check_missing, rep)
            return
        fleet.lost(rep, "it stopped heartbeating (gone from the registry)")
