"""The co-located pool's barrier across the processes of one node, in host shared memory.

>>> decide(frozenset({"llm", "dit"}), {"llm": 300, "dit": 200}, {}, set())
(200, None)

Roles that a placement puts on one node but in different processes (``placement="process"``,
two Ray actors of one placement-group bundle) size their pool together: each, after loading
its weights, proposes a number of L1 pages; the pool is the minimum once every member proposed,
whichever loaded first. The processes meet in a directory of ``/dev/shm`` named after the
co-location group (the deployment and the replica slot or Ray bundle, ``OMNIFLOW_COLOCATE``)
and the pool name:

- ``<member>.alive``  the member's process holds ``flock(LOCK_EX)`` on it from its arrival
  (before it loads weights) until it leaves; it appears already locked (created under a temporary
  name, locked, then renamed), so a prober that finds it unlocked knows the process is gone --
  the kernel drops the lock of a dead process, SIGKILL included. No lease, no heartbeat: a
  partner's death is seen at the next poll, not after a timeout.
- ``<member>.pages``  its proposal, written once (a respawned member does not change a decision
  others may already have read).
- ``<member>.failed`` why its load failed (``abort``).

Co-location is a node fact, so the node's shared memory is where the members meet: it works
the same whichever metadata the pool uses (in memory, front-hosted, Redis) and before a worker's
front has attached (``setup()`` runs first). ``decide`` is the pure rule; the class polls files.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from omniflow.compute._errors import EngineError
from omniflow.compute._shm import SHM_DIR

__all__ = ["NodeBarrier", "decide", "died_during_barrier"]

PREFIX = "omniflow-kvb-"


def decide(
    members: frozenset[str],
    proposals: dict[str, int],
    failed: dict[str, str],
    dead: set[str],
) -> tuple[int | None, str | None]:
    """``(size, None)`` once every member proposed; ``(None, why)`` when a member failed or died
    before proposing; ``(None, None)`` while waiting."""
    for who in sorted(failed):
        return None, f"role {who!r} failed: {failed[who]}"
    for who in sorted(dead - set(proposals)):
        return None, died_during_barrier(who)
    if set(proposals) >= members:
        return min(proposals[m] for m in members), None
    return None, None


def died_during_barrier(member: str) -> str:
    """What a partner hears of ``member``, and its front too when its process dies unheard."""
    return (
        f"role {member!r} died during the barrier (its process exited before it proposed; see "
        "that role's log)"
    )


def _try_lock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class NodeBarrier:
    """One pool's barrier for one co-location group, shared by the processes of a node."""

    def __init__(self, group: str, pool: str, members: Iterable[str]) -> None:
        self.pool = pool
        self.members = frozenset(members)
        digest = hashlib.sha256(f"{group}\0{pool}".encode()).hexdigest()[:24]
        #: The directory the members meet in.
        self.path = Path(os.environ.get("OMNIFLOW_SHM_DIR", str(SHM_DIR))) / (PREFIX + digest)
        self.path.mkdir(mode=0o700, exist_ok=True)
        #: member -> the fd of its ``.alive`` file, locked while this process is that member.
        self._alive: dict[str, int] = {}

    def _file(self, member: str, kind: str) -> Path:
        return self.path / f"{member}.{kind}"

    def arrive(self, member: str) -> None:
        """This process is ``member`` from now on (call before loading the weights)."""
        if member in self._alive:
            return
        tmp = self.path / f".{member}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        if not _try_lock(fd, fcntl.LOCK_EX):  # pragma: no cover - a fresh private file
            os.close(fd)
            raise EngineError(f"kv_pool_barrier '{self.pool}': cannot lock {tmp}")
        probe = self._probe(member)
        if probe is True:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise EngineError(
                f"kv_pool_barrier '{self.pool}': role {member!r} is already at this barrier in "
                "another live process of the same co-location group; give each replica its own "
                "group (one process group or Ray bundle per replica)"
            )
        self._file(member, "failed").unlink(missing_ok=True)  # a respawned member starts over
        os.write(fd, str(os.getpid()).encode())
        os.rename(tmp, self._file(member, "alive"))  # appears locked: never mistaken for dead
        self._alive[member] = fd

    def propose(self, member: str, pages: int) -> None:
        """Write ``member``'s proposal (the first one stands: a decision is never changed)."""
        target = self._file(member, "pages")
        if target.exists():
            return
        tmp = self.path / f".{member}.{os.getpid()}.pages"
        tmp.write_text(str(int(pages)))
        os.rename(tmp, target)

    def abort(self, member: str, why: str) -> None:
        """``member`` will never propose: its partners fail now."""
        tmp = self.path / f".{member}.{os.getpid()}.failed"
        tmp.write_text(why[:2000])
        os.rename(tmp, self._file(member, "failed"))

    def _probe(self, member: str) -> bool | None:
        """Whether ``member``'s process is alive: True, False (its file is there, unlocked),
        None (it never arrived)."""
        try:
            fd = os.open(self._file(member, "alive"), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if member in self._alive:
                return True
            return not _try_lock(fd, fcntl.LOCK_SH)  # unlocked: its process is gone
        finally:
            os.close(fd)

    def snapshot(self) -> tuple[int | None, str | None, list[str]]:
        """``(size, failure, missing)`` as the files say now."""
        proposals: dict[str, int] = {}
        failed: dict[str, str] = {}
        dead: set[str] = set()
        for m in self.members:
            with contextlib.suppress(FileNotFoundError, ValueError):
                proposals[m] = int(self._file(m, "pages").read_text())
            with contextlib.suppress(FileNotFoundError):
                failed[m] = self._file(m, "failed").read_text()
            if m not in proposals and self._probe(m) is False:
                dead.add(m)
        size, why = decide(self.members, proposals, failed, dead)
        return size, why, sorted(self.members - set(proposals))

    async def wait(self, member: str, timeout: float | None) -> int:
        """The pool's size once every member proposed; an ``EngineError`` naming a member that
        failed or died, or those still loading at ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        delay = 0.002
        while True:
            size, why, missing = self.snapshot()
            if size is not None:
                return size
            if why is not None:
                raise EngineError(f"kv_pool_barrier '{self.pool}': {why}")
            if deadline is not None and loop.time() >= deadline:
                raise EngineError(
                    f"kv_pool_barrier '{self.pool}': {member!r} waited {timeout}s for "
                    f"{missing} to finish loading weights; check those roles"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def leave(self, member: str) -> None:
        """``member``'s engine stopped; the last process to leave removes the directory."""
        fd = self._alive.pop(member, None)
        if fd is not None:
            os.close(fd)
        if self._alive:
            return
        if all(self._probe(m) is not True for m in self.members):
            shutil.rmtree(self.path, ignore_errors=True)
