"""Front side of ``of.Ray``: a ``_launch.Launcher`` that starts each replica as a Ray actor.

The fleet (``_fleet``) starts replicas through a launcher (``_launch``); this is the Ray one.
Each replica is a ``ReplicaHost`` actor (``_ray_actor.py``) that runs the existing worker loop
and answers on ZMQ, so everything after ``start`` (routing, supervision, the replica lifecycle
of ``_replica``, the data plane, errors) is the multi-process runtime's, unchanged. What Ray
adds:

- **Placement.** Each layer-0 role gets a placement group, one bundle per replica (strategy
  from the deploy map, planned in ``_ray_plan``); its replica ``i`` runs in bundle ``i`` with
  its ``num_gpus``. A layer >= 1 role asks for no GPU, runs in the bundle of the role it
  colocates with, and gets that bundle's ``CUDA_VISIBLE_DEVICES`` (read from the layer-0
  replica there) in its constructor.
- **Liveness.** A replica's handle is a ``RayReplica``: ``wait()`` holds the actor's ``wait``
  call open, which returns when the worker leaves and fails when Ray loses the actor. The
  fleet then marks the replica DEAD (its calls fail with the usual NodeError), RESTARTING, and
  starts its slot again: ``start`` reaches the same actor once Ray restarted it (up to
  ``max_restarts``), and the new replica goes STARTING -> READY. ``kill()`` (the fleet gave up
  on a silent replica) kills the actor and lets Ray restart it; ``stop`` (the front closes)
  kills it for good.
- **Teardown.** ``close`` kills every actor (no restart) and removes every placement group;
  nothing is detached, so a driver that dies takes its actors with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import OmniflowError, StartError
from omniflow.cluster._launch import (
    COLOCATE_ENV,
    EDGE_BYTES_ENV,
    OTLP_ENV,
    START_ERROR_ENV,
    Launcher,
    LaunchSpec,
    ReplicaHandle,
    _start_error,
    colocation_group,
)
from omniflow.transport._fastpath import FAST_PATH_ENV, fast_path_enabled

if TYPE_CHECKING:
    from omniflow.cluster._ray_plan import Ray, RayPlan
    from omniflow.data._plane import DataPlane

__all__ = ["RAY_ENV", "RayLauncher", "RayReplica", "import_ray", "init_ray"]

logger = logging.getLogger("omniflow.ray")

#: Exit code a replica reports when Ray lost its actor (as a SIGKILLed process would).
LOST = -9
#: Launchers using the Ray instance that one of them started in this process (the last to
#: close shuts it down; a Ray started by anyone else is never shut down here).
_OWNED = {"started": False, "users": 0}
#: How long ``close`` waits, in all, for Ray to report the actors it killed dead (s), and how
#: often it asks.
GONE_TIMEOUT = 10.0
GONE_POLL = 0.05
#: Ray settings of the front's own Ray process, applied (unless already set) before this
#: process initialises Ray: a call in flight on an actor that died fails after Ray waits this
#: long for the death's cause (default 1000 ms), which is how soon a lost replica's calls fail.
RAY_ENV = {"RAY_timeout_ms_task_wait_for_death_info": "100"}


def init_ray(address: str | None = None, **kwargs: Any) -> Any:
    """``ray.init(address, **kwargs)`` with RAY_ENV's defaults for this process; the module."""
    ray = import_ray()
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    ray.init(address=address, **kwargs)
    return ray


def import_ray() -> Any:
    """The ``ray`` module, or an error that says how to get it."""
    try:
        import ray
    except ImportError as exc:
        raise OmniflowError(
            "placement=of.Ray(...) needs the 'ray' package: pip install 'omniflow[ray]'"
        ) from exc
    return ray


def _cause(exc: BaseException) -> str:
    """The worker's own error inside a RayTaskError (``type: message``), else the error."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return (
            str(cause) if isinstance(cause, OmniflowError) else f"{type(cause).__name__}: {cause}"
        )
    return f"{type(exc).__name__}: {exc}"


class RayReplica(ReplicaHandle):
    """A replica's actor, seen by the fleet (``_fleet``) as it sees a spawned process."""

    def __init__(self, launcher: RayLauncher, actor: Any, info: dict[str, Any]) -> None:
        self._launcher = launcher
        self.actor = actor
        #: What ``start`` reported: address, pid, node, cuda, gpu_ids.
        self.info = info
        self.address = str(info["address"])
        self._pid = int(info["pid"])
        #: None while the actor serves; 0 after a clean leave, LOST when Ray lost it, 1 when
        #: its worker loop failed.
        self._returncode: int | None = None
        self._waiter = actor.wait.remote()
        self._done: asyncio.Task[int] | None = None

    @property
    def pid(self) -> int:
        """The actor's process id (as its ``start`` reported it)."""
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def _watch(self) -> int:
        ray = import_ray()
        code: int
        try:
            failure = await self._waiter
        except ray.exceptions.RayError as exc:
            logger.warning("ray lost the actor of replica pid %s: %s", self._pid, _brief(exc))
            code = LOST
        else:
            code = 0 if failure is None else 1
            if failure is not None:
                logger.warning("replica pid %s: worker loop failed: %s", self._pid, failure)
        self._returncode = code
        return code

    async def wait(self) -> int:
        """Until the worker leaves (0) or Ray loses the actor (LOST)."""
        if self._done is None:
            self._done = asyncio.get_running_loop().create_task(self._watch())
        return await asyncio.shield(self._done)

    def kill(self) -> None:
        """The front lost it while it runs (silent, unreachable): kill the actor and let Ray
        restart it, so the respawn of its slot (``_fleet``) starts over in the restarted one."""
        self._launcher.kill(self.actor, restart=True)

    def end(self) -> None:
        """Kill the actor for good (the front is closing)."""
        self._launcher.kill(self.actor, restart=False)


def _words_file(spec: LaunchSpec) -> str:
    """Where the replica's worker leaves its last words (in the front's private directory: an
    actor on another node cannot write there, and its death is then told by Ray alone)."""
    return os.path.join(spec.workdir, f"{spec.replica_id}.err")


def _brief(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


class RayLauncher(Launcher):
    """Starts the replicas of one runtime as Ray actors in their placement groups."""

    def __init__(
        self,
        placement: Ray,
        plan: RayPlan,
        *,
        plane: DataPlane | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        self.placement = placement
        self.plan = plan
        #: The front's data plane: the blocks it offloads carry its Ray node id.
        self.plane = plane
        self.start_timeout = start_timeout
        #: Whether this launcher uses a Ray that a launcher started (the last to close shuts
        #: it down).
        self.owns_ray = False
        #: The Ray node id of this (the front's) process.
        self.node_id = ""
        #: Layer-0 role -> its placement group.
        self.groups: dict[str, Any] = {}
        #: (role, slot) -> the actor serving that slot (kept across restarts).
        self.actors: dict[tuple[str, int], Any] = {}
        #: (role, slot) -> the last ``start`` report of that slot's actor.
        self.reports: dict[tuple[str, int], dict[str, Any]] = {}
        #: (layer-0 role, bundle) -> CUDA_VISIBLE_DEVICES there (None: no GPU in the bundle).
        self._bundle_env: dict[tuple[str, int], asyncio.Future[str | None]] = {}
        self._ready: asyncio.Task[None] | None = None
        self._actor_class: Any = None
        self._closed = False

    # ------------------------------------------------------------------ setup

    async def _connect(self) -> None:
        ray = import_ray()
        if not ray.is_initialized():
            where = self.placement.address or "a new local instance"
            try:
                init_ray(self.placement.address)
            except Exception as exc:
                raise OmniflowError(f"of.Ray: cannot start or join Ray at {where}: {exc}") from exc
            _OWNED["started"], _OWNED["users"] = True, 0
        if _OWNED["started"]:
            _OWNED["users"] += 1
            self.owns_ray = True
        from omniflow.cluster._ray_actor import ReplicaHost

        self._actor_class = ray.remote(ReplicaHost)
        self.node_id = ray.get_runtime_context().get_node_id()
        if self.plane is not None:  # blocks this front offloads are mapped on its node
            self.plane.shm.host = self.node_id
        from ray.util.placement_group import placement_group

        for role_name, bundles in self.plan.bundles.items():
            role = self.plan.roles[role_name]
            self.groups[role_name] = placement_group(
                bundles, strategy=role.strategy, name=f"omniflow-{role_name}-{id(self):x}"
            )
        for role_name, pg in self.groups.items():
            try:
                await asyncio.wait_for(pg.ready(), self.placement.ready_timeout)
            except TimeoutError:
                role = self.plan.roles[role_name]
                raise OmniflowError(
                    f"of.Ray: the placement group of role '{role_name}' ({role.replicas} "
                    f"bundle(s) {self.plan.bundles[role_name][0]}, strategy {role.strategy}) "
                    f"was not placed within {self.placement.ready_timeout}s; the cluster has "
                    f"{_resources(ray.available_resources())} free of "
                    f"{_resources(ray.cluster_resources())}: lower the role's replicas or "
                    "resources, or add nodes"
                ) from None

    async def _ensure_ready(self) -> None:
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_task(self._connect())
        await asyncio.shield(self._ready)

    # ------------------------------------------------------------------ replicas

    async def start(self, spec: LaunchSpec) -> RayReplica:
        """Start (or restart) the actor of replica ``spec.slot`` of ``spec``'s role."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from omniflow.cluster._ray_actor import Secret

        if self._closed:
            raise OmniflowError("of.Ray: this runtime's replicas are shut down")
        await self._ensure_ready()
        slot = spec.slot
        (role_name,) = spec.roles
        role = self.plan.roles[role_name]
        anchor, bundle = self.plan.slot(role_name, slot)
        env_key = (anchor, bundle)
        env_fut = self._bundle_env.get(env_key)
        if env_fut is None:
            env_fut = self._bundle_env[env_key] = asyncio.get_running_loop().create_future()
        actor = self.actors.get((role_name, slot))
        if actor is None:
            # The actor picks uds:// or ipc:// on the front's node by the front's setting
            # (an actor's environment is Ray's, not the front's).
            env = {
                FAST_PATH_ENV: "1" if fast_path_enabled() else "0",
                # One co-location group per bundle: its layer-0 role and the roles colocated
                # with it share their pools (they are on one node: Ray packs a bundle whole).
                COLOCATE_ENV: colocation_group(spec.owner, f"{anchor}:{bundle}"),
                # What it was doing should it die while starting (read back on this node).
                START_ERROR_ENV: _words_file(spec),
            }
            if self.edge_bytes:  # it counts the bytes it moves per edge (the front's metrics)
                env[EDGE_BYTES_ENV] = "1"
            if self.otlp_endpoint:  # it exports its methods' own spans to the front's collector
                env[OTLP_ENV] = self.otlp_endpoint
            if role.layer:
                cuda = await asyncio.shield(env_fut)  # the layer-0 replica of this bundle
                if cuda is not None:
                    env["CUDA_VISIBLE_DEVICES"] = cuda
            actor = self._actor_class.options(
                num_cpus=role.num_cpus,
                num_gpus=role.num_gpus,
                resources=role.resources or None,
                max_restarts=role.max_restarts,
                max_task_retries=0,
                max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.groups[anchor],
                    placement_group_bundle_index=bundle,
                    placement_group_capture_child_tasks=False,
                ),
            ).remote(env)
            self.actors[(role_name, slot)] = actor
        try:
            info = await self._start_actor(actor, spec, role.max_restarts, (
                spec.owner, spec.heartbeat_interval, spec.registry_url, Secret(spec.cluster_key),
                spec.workdir, self.node_id, self.start_timeout,
            ))  # fmt: skip
        except BaseException:
            if not role.layer and not env_fut.done():  # its colocated roles wait for it
                env_fut.set_exception(OmniflowError(f"role '{role_name}' did not start"))
                env_fut.exception()
            raise
        self.reports[(role_name, slot)] = info
        if not role.layer and not env_fut.done():
            env_fut.set_result(info["cuda"])
        return RayReplica(self, actor, info)

    async def _start_actor(
        self, actor: Any, spec: LaunchSpec, max_restarts: int, args: tuple[Any, ...]
    ) -> dict[str, Any]:
        """``actor.start(...)``, waiting through a restart Ray has under way; the worker's own
        failure (a failed setup()), an actor that died in this start leaving word of where (a
        co-located pool's barrier), and a lost actor as errors naming the replica."""
        ray = import_ray()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout

        def failed(why: str) -> StartError:
            return StartError(
                f"worker {spec.replica_id} (role(s) {list(spec.roles)}) died before ready: {why}",
                roles=list(spec.roles),
                replica=spec.replica_id,
            )

        try:
            while True:
                try:
                    info: dict[str, Any] = await actor.start.remote(
                        list(spec.modules), list(spec.roles), spec.replica_id, *args
                    )
                    return info
                except ray.exceptions.ActorUnavailableError:
                    said = _start_error(_words_file(spec))
                    if said:  # it died in this start: Ray's restarts would end the same way
                        raise failed(f"{said}; Ray restarts its actor") from None
                    # Ray is restarting the actor (a respawn came first): wait for it, do
                    # not count a failed respawn (that would back off as for a crash loop).
                    if loop.time() > deadline:
                        raise
                    await asyncio.sleep(0.02)
        except ray.exceptions.RayTaskError as exc:
            raise failed(_cause(exc)) from None
        except ray.exceptions.RayError as exc:
            said = _start_error(_words_file(spec))
            if said:
                raise failed(f"{said}; Ray lost its actor") from None
            raise OmniflowError(
                f"worker {spec.replica_id} (role(s) {list(spec.roles)}): Ray lost its actor "
                f"(max_restarts={max_restarts}): {_brief(exc)}"
            ) from None

    async def stop(self, handle: ReplicaHandle, grace: float) -> None:
        """Wait ``grace`` seconds for a replica asked to stop (over the wire) to leave, then
        kill its actor for good (no Ray restart)."""
        if not self.alive(handle):
            return
        try:
            await asyncio.wait_for(handle.wait(), grace)
        except TimeoutError:
            assert isinstance(handle, RayReplica)
            handle.end()
            await handle.wait()

    def kill(self, actor: Any, *, restart: bool) -> None:
        ray = import_ray()
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=not restart)

    def replicas(self) -> list[dict[str, Any]]:
        """What Ray placed where: one dict per replica slot (role, slot, bundle, node, pid,
        CUDA_VISIBLE_DEVICES, gpu ids), from each actor's last start."""
        out = []
        for (role, slot), info in sorted(self.reports.items()):
            anchor, bundle = self.plan.slot(role, slot)
            out.append({"role": role, "slot": slot, "group": anchor, "bundle": bundle, **info})
        return out

    async def close(self) -> None:
        """Kill every actor (no restart) and wait until Ray has them dead, remove every
        placement group, and shut Ray down when this launcher started it."""
        self._closed = True
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
            with contextlib.suppress(BaseException):
                await self._ready
        with contextlib.suppress(ImportError):
            import ray

            if not ray.is_initialized():
                return
            from ray.util.placement_group import remove_placement_group

            actors = list(self.actors.values())
            for actor in actors:
                self.kill(actor, restart=False)
            self.actors.clear()
            await self._until_gone(actors)
            for pg in self.groups.values():
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
            self.groups.clear()
            if self.owns_ray:
                self.owns_ray = False
                _OWNED["users"] -= 1
                if _OWNED["users"] <= 0:
                    _OWNED["started"] = False
                    ray.shutdown()

    @staticmethod
    async def _until_gone(actors: list[Any], timeout: float = GONE_TIMEOUT) -> None:
        """Wait until a call to each killed actor fails, ``timeout`` s in all. ``ray.kill``
        only asks: a call made before the kill lands is still answered, and the actor's
        resources (its GPUs) are Ray's again only once it is dead. A caller that closes a
        Runtime and starts another on the same cluster expects them free."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for actor in actors:
            while (left := deadline - loop.time()) > 0:
                try:  # (a call behind the front's open ``wait`` runs once that one ends)
                    await asyncio.wait_for(actor.__ray_ready__.remote(), left)
                except Exception:  # RayActorError: dead (or the deadline: warned below)
                    break
                await asyncio.sleep(GONE_POLL)  # answered: the kill has not landed yet
            if deadline - loop.time() <= 0:
                logger.warning(
                    "Ray has not reported %d killed actor(s) dead after %g s; closing anyway",
                    len(actors), timeout,
                )  # fmt: skip
                return


def _resources(res: dict[str, float]) -> str:
    keep = {k: v for k, v in sorted(res.items()) if not k.startswith(("node:", "memory",
            "object_store_memory", "bundle_group"))}  # fmt: skip
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in keep.items() if "_group_" not in k) + "}"
