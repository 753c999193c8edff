"""How a replica process is started: the launcher seam of the multi-process runtime.

>>> launcher = SubprocessLauncher()                          # doctest: +SKIP
>>> handle = await launcher.start(spec)                      # doctest: +SKIP
>>> handle.address, handle.pid                               # doctest: +SKIP
('uds:///tmp/omniflow-x/w0.sock', 4242)

``RemoteRoles`` (``_remote``) asks a :class:`Launcher` to start one replica per slot of each
process group and then talks to it only over the authenticated wire, at ``handle.address``.
A launcher owns nothing else: it starts a replica, says whether it still runs, waits for its
end, and kills it. :class:`SubprocessLauncher` (``omniflow worker`` as a process on this host,
forked by a fork server where the fast path is on: ``_forkserver``) is the default;
``_ray.RayLauncher`` (``placement=of.Ray(...)``: a Ray actor per replica, in its
placement-group bundle) plugs in with the same interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass

from omniflow.cluster._forkserver import Forked, ForkServer, ForkServerError, forking_supported
from omniflow.transport._auth import KEY_ENV
from omniflow.transport._fastpath import fast_path_enabled, local_url

__all__ = [
    "ForkedHandle",
    "LaunchSpec",
    "Launcher",
    "ReplicaHandle",
    "SubprocessHandle",
    "SubprocessLauncher",
]

logger = logging.getLogger("omniflow.runtime")

#: Environment variable naming the file where a worker writes why it could not start.
START_ERROR_ENV = "OMNIFLOW_START_ERROR_FILE"
#: Environment variable naming a worker's co-location group on its node (see ``colocation_key``).
COLOCATE_ENV = "OMNIFLOW_COLOCATE"
#: Set to "1" by a front with metrics on in the workers it starts: they count the bytes they
#: forward and read per edge and report them in their heartbeats (``EDGES_KEY``).
EDGE_BYTES_ENV = "OMNIFLOW_EDGE_BYTES"
#: Set by a front that exports traces over OTLP/HTTP (``otlp_provider``) in the workers it
#: starts: the collector's URL, where a worker exports the spans its methods make themselves.
OTLP_ENV = "OMNIFLOW_OTLP_ENDPOINT"
#: The key of the heartbeat's ``st`` under which the edge bytes ride (no node is named so).
EDGES_KEY = "<edges>"


def colocation_group(owner: str, where: str) -> str:
    """The co-location group of the replicas of one deployment (``owner``: the front's token,
    hashed, never shown) that fill ``where`` (a replica slot, a Ray bundle): processes of one
    node in one group share their co-located pools."""
    import hashlib

    return f"{hashlib.sha256(owner.encode()).hexdigest()[:16]}/{where}"


def colocation_key() -> str:
    """This worker's co-location group: what its launcher said, else (a worker started by hand)
    one group per node and user."""
    return os.environ.get(COLOCATE_ENV) or f"node/{os.getuid()}"


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """Everything a launcher needs to start one replica of a process group."""

    #: Unique among every replica the front knows (registry ones included).
    replica_id: str
    #: The process group's name, its roles and the graph modules that declare them.
    group: str
    roles: tuple[str, ...]
    modules: tuple[str, ...]
    #: A number unique to this start within the front (names its socket).
    index: int
    #: A private directory of the front for sockets and start-error files.
    workdir: str
    #: The front's token: only a front that says it may stop the worker.
    owner: str
    heartbeat_interval: float
    registry_url: str | None
    #: The deployment's key; never on a command line.
    cluster_key: bytes
    #: The slot of the group this replica fills (a restart fills the dead one's slot again:
    #: a launcher that keeps per-slot state, such as a Ray actor, reuses it).
    slot: int = 0


class ReplicaHandle(ABC):
    """A started replica: where to connect, whether it runs, how it ended."""

    #: Where the replica's worker binds (``uds://``, ``ipc://``, ``tcp://``).
    address: str

    @property
    @abstractmethod
    def pid(self) -> int | None:
        """Its process id, where the launcher knows one."""

    @property
    @abstractmethod
    def returncode(self) -> int | None:
        """Its exit code once it ended; None while it runs."""

    @abstractmethod
    async def wait(self) -> int:
        """Wait for its end; the exit code."""

    @abstractmethod
    def kill(self) -> None:
        """Stop it now, without a word (it must not come back half-alive)."""

    def start_error(self) -> str | None:
        """Why it failed to start, as the replica wrote it (a failed ``setup()``, a bad
        module), or None."""
        return None


class Launcher(ABC):
    """Starts replicas of process groups; see the module docstring."""

    #: Whether the replicas count the bytes they move per edge (``EDGE_BYTES_ENV``: the
    #: front's metrics are on).
    edge_bytes = False
    #: The collector the replicas export their methods' own spans to (``OTLP_ENV``; None:
    #: the front does not export over OTLP).
    otlp_endpoint: str | None = None

    @abstractmethod
    async def start(self, spec: LaunchSpec) -> ReplicaHandle:
        """Start one replica; returns once it is started (not once it is ready)."""

    def alive(self, handle: ReplicaHandle) -> bool:
        return handle.returncode is None

    async def stop(self, handle: ReplicaHandle, grace: float) -> None:
        """Wait ``grace`` seconds for a replica asked to stop (over the wire) to exit, then
        kill it."""
        if not self.alive(handle):
            return
        try:
            await asyncio.wait_for(handle.wait(), grace)
        except TimeoutError:
            handle.kill()
            await handle.wait()

    async def close(self) -> None:
        """Release what the launcher itself holds, once every replica it started is stopped
        (nothing for subprocesses; placement groups and actors for Ray)."""
        return None


class SubprocessHandle(ReplicaHandle):
    """A worker started as a child process of the front."""

    def __init__(self, process: asyncio.subprocess.Process, address: str, err_file: str):
        self.process = process
        self.address = address
        #: Where the worker writes why it could not start.
        self.err_file = err_file

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    async def wait(self) -> int:
        return await self.process.wait()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)

    def start_error(self) -> str | None:
        return _start_error(self.err_file)


class ForkedHandle(ReplicaHandle):
    """A worker forked by the launcher's fork server (``_forkserver``): the server reaps it
    and reports its exit code; the front kills it through a pidfd."""

    def __init__(self, child: Forked, address: str, err_file: str):
        self.child = child
        self.address = address
        self.err_file = err_file

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def returncode(self) -> int | None:
        return self.child.returncode

    async def wait(self) -> int:
        return await self.child.wait()

    def kill(self) -> None:
        self.child.kill()

    def start_error(self) -> str | None:
        return _start_error(self.err_file)


def _start_error(err_file: str) -> str | None:
    with contextlib.suppress(OSError), open(err_file) as f:
        return f.read(4000).strip() or None
    return None


class SubprocessLauncher(Launcher):
    """``python -m omniflow worker`` as a process of its own, bound to a socket in the front's
    private directory: ``uds://`` (the same-node fast path), or ``ipc://`` when
    ``OMNIFLOW_FAST_PATH=0``. With the fast path on (on Linux) the launcher's fork server
    forks it instead of spawning it (``_forkserver``: the same command line, environment and
    working directory); where a fork server cannot start or fork, it is spawned, with a
    warning."""

    def __init__(self) -> None:
        #: The fork servers started, one per working directory and environment they serve.
        self._servers: list[ForkServer] = []
        self._starting = asyncio.Lock()  # (starts come concurrently: one server each)

    async def start(self, spec: LaunchSpec) -> SubprocessHandle | ForkedHandle:
        address = local_url(f"{spec.workdir}/w{spec.index}.sock")
        err_file = os.path.join(spec.workdir, f"{spec.replica_id}.err")
        cmd = ["worker", *spec.modules]
        for role in spec.roles:
            cmd += ["--role", role]
        # --parent-pid: the worker leaves when this process is gone (it runs in a session
        # of its own, so nothing else would stop it after a crash of the front). --owner:
        # only this front may stop it. The key goes in the environment, never in argv.
        cmd += ["--bind", address, "--replica-id", spec.replica_id]
        cmd += ["--parent-pid", str(os.getpid()), "--owner", spec.owner]
        cmd += ["--heartbeat", str(spec.heartbeat_interval)]
        if spec.registry_url:
            cmd += ["--registry", spec.registry_url]
        # The cluster key travels in the environment (never argv), with the file where the
        # worker writes why it could not start (a failed setup(), a bad module).
        env = {
            **os.environ,
            KEY_ENV: spec.cluster_key.decode(),
            START_ERROR_ENV: err_file,
            COLOCATE_ENV: colocation_group(spec.owner, f"slot{spec.slot}"),
        }
        if self.edge_bytes:
            env[EDGE_BYTES_ENV] = "1"
        if self.otlp_endpoint:
            env[OTLP_ENV] = self.otlp_endpoint
        if fast_path_enabled() and forking_supported():
            try:
                child = await self._fork(cmd, env)
            except ForkServerError as exc:
                logger.warning("worker %s is spawned, not forked: %s", spec.replica_id, exc)
            else:
                return ForkedHandle(child, address, err_file)
        # A session of its own: Ctrl-C in the front's terminal must not kill the workers
        # before the front drains; the front stops them itself.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "omniflow", *cmd,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True, env=env,
        )  # fmt: skip
        return SubprocessHandle(proc, address, err_file)

    async def _fork(self, argv: list[str], env: dict[str, str]) -> Forked:
        """Fork ``omniflow ARGV`` by the fork server for this directory and environment
        (started on first use; one that is lost is replaced)."""
        cwd = os.getcwd()
        async with self._starting:
            for server in self._servers:
                if server.serves(cwd, env):
                    break
            else:
                server = ForkServer(cwd, env, vary=(KEY_ENV, START_ERROR_ENV))
                await server.start()
                self._servers.append(server)
        return await server.fork(argv, env)

    async def close(self) -> None:
        """Close the fork servers (the replicas they forked were stopped before)."""
        servers, self._servers = self._servers, []
        for server in servers:
            await server.close()
