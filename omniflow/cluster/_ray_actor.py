"""The Ray actor that hosts one replica: the existing worker loop, in the actor's process.

The front (``_ray.RayLauncher``) creates one ``ReplicaHost`` actor per replica and calls
``start``: the actor names its node for the data plane (the Ray node id), binds the worker's
ROUTER endpoint (``uds://`` on the front's node, ``ipc://`` there when the front runs with
``OMNIFLOW_FAST_PATH=0``, ``tcp://<node ip>:0`` elsewhere) and runs
``Worker.run`` in a thread of its own, with its own event loop, so Ray's calls into the actor
(``wait``) never queue behind the worker's work. From there the front talks to it over ZMQ
exactly as to a spawned worker: same protocol, same authentication, same data plane, and the
same ``stop`` message to end it.

The constructor's ``env`` is applied before anything else runs in the process, so a layer >= 1
replica gets its bundle's ``CUDA_VISIBLE_DEVICES`` before any CUDA import (Ray leaves it unset
for zero-GPU actors, and torch caches the device count on first use). The cluster key arrives
as a ``start`` argument wrapped in ``Secret`` (never argv, never the environment, never a log).
When the front exports traces over OTLP, ``env`` names its collector (``OTLP_ENV``): the worker
loop makes an OTLP provider to it the process's global one (once per actor: a restarted worker
keeps it) and flushes it as the loop ends, before ``wait`` returns and the front kills the actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ReplicaHost", "Secret"]


class Secret:
    """A value that does not print (the cluster key on its way to an actor)."""

    __slots__ = ("value",)

    def __init__(self, value: bytes) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Secret, (self.value,))


class ReplicaHost:
    """One replica of one role, as a Ray actor (wrapped with ``ray.remote`` by the front)."""

    def __init__(self, env: dict[str, str]) -> None:
        # First thing in the process: a colocated role's CUDA_VISIBLE_DEVICES must be in place
        # before the graph module (and torch) is imported by ``start``.
        os.environ.update(env)
        #: The thread that runs the worker loop (None before ``start``).
        self._thread: threading.Thread | None = None
        #: Why the worker loop ended, when it failed.
        self._error: BaseException | None = None
        #: Asks the running worker loop to leave (set once its loop runs).
        self._halt: Callable[[], Any] | None = None
        #: The OTLP tracer provider the worker loop exports its methods' spans with (None
        #: until a loop made it, or when the front does not export).
        self._provider: Any = None

    def start(
        self,
        modules: list[str],
        roles: list[str],
        replica_id: str,
        owner: str,
        heartbeat_interval: float,
        registry: str | None,
        key: Secret,
        ipc_dir: str,
        front_node: str,
        start_timeout: float,
    ) -> dict[str, Any]:
        """Load, set up and bind the worker; return where it listens and what it runs on.

        Raises the worker's own error (a failed ``setup()``, a missing module) when it does
        not get that far.
        """
        import ray

        from omniflow.cluster._worker import Worker
        from omniflow.data import _plane
        from omniflow.data.kv import _shell as kv_shell
        from omniflow.transport._fastpath import local_url

        old = self._thread
        if old is not None and old.is_alive():
            # The front lost sight of this actor while its worker ran on (a transient Ray
            # error): end that worker, so the replica starts over on a fresh connection.
            halt = self._halt
            if halt is not None:
                with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                    halt()
            old.join(start_timeout)
            if old.is_alive():
                raise RuntimeError(f"replica {replica_id}: the previous worker did not leave")
        ctx = ray.get_runtime_context()
        node = ctx.get_node_id()
        # Node identity from Ray: refs from another Ray node are pulled over ZMQ, refs from
        # this one are mapped from shared memory (simulated nodes on one host included).
        _plane.set_node_id(node)
        kv_shell.HOST = node  # the Params Pool's node records (data/kv/_shell.py)
        if node == front_node:
            address = local_url(f"{ipc_dir}/{replica_id}.sock")
        else:
            ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            address = f"tcp://{ip}:0"
        worker = Worker(
            modules,
            roles,
            address,
            replica_id=replica_id,
            registry=registry,
            heartbeat_interval=heartbeat_interval,
            cluster_key=key.value,
            owner=owner,
        )
        self._error = None
        self._thread = threading.Thread(
            target=self._serve, args=(worker,), name=f"omniflow-{replica_id}", daemon=True
        )
        self._thread.start()
        # The worker binds after setup(); its endpoint URL (the bound port for tcp) is the
        # data plane's source from then on.
        deadline = time.monotonic() + start_timeout
        while not worker.plane.shm.source:
            if not self._thread.is_alive():
                raise self._error or RuntimeError("the worker loop ended before binding")
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {replica_id}: not bound after {start_timeout}s")
            time.sleep(0.002)
        return {
            "address": worker.plane.shm.source,
            "pid": os.getpid(),
            "node": node,
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def _serve(self, worker: Any) -> None:
        loop = asyncio.new_event_loop()
        self._halt = lambda: loop.call_soon_threadsafe(worker._stop.set)
        try:
            self._trace()
            loop.run_until_complete(worker.run())
        except BaseException as exc:
            self._error = exc
        finally:
            self._halt = None
            loop.close()
            if self._provider is not None:
                self._provider.force_flush()  # (the front kills the actor once ``wait`` returns)

    def _trace(self) -> None:
        """Make the front's collector (``OTLP_ENV``) the global provider's, once per actor:
        spans the methods start themselves nest under their activations and are exported."""
        from omniflow.cluster._launch import OTLP_ENV
        from omniflow.runtime._tracing import global_otlp_provider

        endpoint = os.environ.get(OTLP_ENV)
        if endpoint and self._provider is None:
            self._provider = global_otlp_provider(endpoint)

    def wait(self) -> str | None:
        """Block until the worker loop ends: None when it left cleanly, else why it failed.

        The front holds this call open as its view of the replica: it returns when the worker
        stops, and fails (RayActorError) when Ray loses the actor.
        """
        thread = self._thread
        if thread is not None:
            thread.join()
        return None if self._error is None else f"{type(self._error).__name__}: {self._error}"
