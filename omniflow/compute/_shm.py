"""Per-node shared weight segments in host shared memory, and their lifetime.

>>> _names("llm/qwen2-7b").data.startswith(str(SHM_DIR) + "/omniflow-w-")
True

A key names four files under ``/dev/shm`` (``omniflow-w-<sha256(key)[:24]>.*``):

- ``.users``  every process using the key holds ``flock(LOCK_SH)`` on it for its lifetime; the
  kernel drops the lock when the process exits, SIGKILL included.
- ``.reaper`` a tiny stdlib-only process (spawned detached) holds ``LOCK_EX`` on it while it waits
  for ``LOCK_EX`` on ``.users``, i.e. for the last user to be gone; then it unlinks all four files
  (``.users`` last) and exits. Every user makes sure one reaper is alive after it joined.
- ``.load``   whoever writes the weights holds ``LOCK_EX`` on it; a loader that dies releases it
  and the next poller takes over the load (the data is not ready until the header says so).
- ``.data``   the segment: a header (magic, state, manifest) followed by every tensor, aligned.

A joiner validates that the ``.users`` file it locked is still the linked one (same inode) so a
reaper that just unlinked it is never joined. Everything here is synchronous and non-blocking
(``LOCK_NB``); the async shell polls.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SHM_DIR", "Names", "Segment", "join_users", "sweep_orphans"]

SHM_DIR = Path(os.environ.get("OMNIFLOW_SHM_DIR", "/dev/shm"))
PREFIX = "omniflow-w-"
MAGIC = b"OFSHMW01"
READY = 1
HEADER = struct.Struct("<8sQQ")  # magic, state, manifest length
ALIGN = 64

#: The reaper: stdlib only, started with ``python -I -S`` so it never imports torch.
_REAPER = r"""
import fcntl, os, sys
if os.fork():  # detach: the user that spawned us only waits for this first process
    os._exit(0)
users, reaper, ino = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    rfd = os.open(reaper, os.O_RDWR)
    fcntl.flock(rfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    sys.exit(0)
try:
    ufd = os.open(users, os.O_RDWR)
except FileNotFoundError:
    ufd = -1
if ufd >= 0 and os.fstat(ufd).st_ino == ino:
    fcntl.flock(ufd, fcntl.LOCK_EX)
    base = users[: -len(".users")]
    for suffix in (".data", ".load", ".reaper", ".users"):
        try:
            os.unlink(base + suffix)
        except FileNotFoundError:
            pass
"""


@dataclass(frozen=True, slots=True)
class Names:
    """The four paths of one key."""

    users: str
    reaper: str
    load: str
    data: str


def _names(key: str) -> Names:
    base = str(SHM_DIR / (PREFIX + hashlib.sha256(key.encode()).hexdigest()[:24]))
    return Names(base + ".users", base + ".reaper", base + ".load", base + ".data")


def _try_flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


#: Spawned reaper launchers not yet waited for (each exits right after forking the reaper).
_LAUNCHED: list[subprocess.Popen[bytes]] = []


def _wait_launched() -> None:
    for proc in _LAUNCHED:
        with contextlib.suppress(subprocess.TimeoutExpired):  # a stuck launcher is left alone
            proc.wait(timeout=5)
    _LAUNCHED.clear()


atexit.register(_wait_launched)


def _spawn_reaper(names: Names, ino: int) -> None:
    _LAUNCHED[:] = [p for p in _LAUNCHED if p.poll() is None]
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _REAPER, names.users, names.reaper, str(ino)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    _LAUNCHED.append(proc)


def join_users(key: str) -> tuple[Names, int] | None:
    """Register this process as a user of ``key``: ``(names, users_fd)``, or None to retry later
    (a reaper holds the key while it unlinks it)."""
    names = _names(key)
    fd = os.open(names.users, os.O_RDWR | os.O_CREAT, 0o600)
    if not _try_flock(fd, fcntl.LOCK_SH):
        os.close(fd)
        return None
    try:
        linked = os.stat(names.users).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        linked = False
    if not linked:  # a reaper unlinked it between our open and our lock
        os.close(fd)
        return None
    rfd = os.open(names.reaper, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if _try_flock(rfd, fcntl.LOCK_EX):  # nobody holds it: no reaper alive, start one
            fcntl.flock(rfd, fcntl.LOCK_UN)
            _spawn_reaper(names, os.fstat(fd).st_ino)
    finally:
        os.close(rfd)
    return names, fd


def sweep_orphans() -> list[str]:
    """Unlink the files of keys no process uses and no reaper watches (a user killed in the few
    instructions between creating ``.users`` and starting its reaper). Returns what was removed."""
    removed: list[str] = []
    for users in SHM_DIR.glob(PREFIX + "*.users"):
        base = str(users)[: -len(".users")]
        try:
            fd = os.open(users, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            if not _try_flock(fd, fcntl.LOCK_EX):
                continue
            rfd = os.open(base + ".reaper", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if not _try_flock(rfd, fcntl.LOCK_EX):  # a reaper is about to do it
                    continue
                for suffix in (".data", ".load", ".reaper", ".users"):
                    try:
                        os.unlink(base + suffix)
                        removed.append(base + suffix)
                    except FileNotFoundError:
                        pass
            finally:
                os.close(rfd)
        finally:
            os.close(fd)
    return removed


# Not data/_shm.Segment: weights outlive their loader until the last user is gone (``.reaper``)
# and carry a ready flag and manifest; a data pool's blocks die with their one owner.
class Segment:
    """The mapped ``.data`` file: header, JSON manifest, then the tensors' bytes."""

    __slots__ = ("buf", "manifest", "offset", "writable")

    def __init__(self, buf: mmap.mmap, manifest: bytes, offset: int, writable: bool) -> None:
        self.buf = buf
        self.manifest = manifest  #: the canonical JSON bytes of the manifest
        self.offset = offset  #: where tensor bytes start
        self.writable = writable

    @staticmethod
    def data_offset(manifest: bytes) -> int:
        raw = HEADER.size + len(manifest)
        return (raw + ALIGN - 1) // ALIGN * ALIGN

    @classmethod
    def create(cls, path: str, manifest: bytes, nbytes: int) -> Segment:
        """Create (or reset) the segment for loading; state stays not-ready until ``mark_ready``."""
        offset = cls.data_offset(manifest)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 0)  # a dead loader's partial data must not survive
            os.ftruncate(fd, max(offset + nbytes, 1))
            buf = mmap.mmap(fd, offset + nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        buf[: HEADER.size] = HEADER.pack(MAGIC, 0, len(manifest))
        buf[HEADER.size : HEADER.size + len(manifest)] = manifest
        return cls(buf, manifest, offset, True)

    def mark_ready(self) -> None:
        self.buf.flush()
        struct.pack_into("<Q", self.buf, 8, READY)

    @classmethod
    def open_ready(cls, path: str) -> Segment | None:
        """Map a ready segment read-only, or None when it is absent or not ready yet."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER.size:
                return None
            head = os.pread(fd, HEADER.size, 0)
            magic, state, mlen = HEADER.unpack(head)
            if magic != MAGIC or state != READY:
                return None
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        manifest = bytes(buf[HEADER.size : HEADER.size + mlen])
        return cls(buf, manifest, cls.data_offset(manifest), False)


def manifest_bytes(entries: list[tuple[str, str, list[int], int, int]]) -> bytes:
    """Canonical manifest: (name, dtype, shape, offset, nbytes) per tensor, in order."""
    return json.dumps(entries, separators=(",", ":")).encode()
