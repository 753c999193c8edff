"""Named POSIX shared-memory segments: created and unlinked by one owner, mapped by name anywhere.

Why not just ``multiprocessing.shared_memory.SharedMemory`` everywhere: before Python 3.13,
*attaching* a segment registers it with the attaching process's resource tracker, which then
unlinks it (with a "leaked shared_memory" warning) when that process exits, under the owner's
feet (cpython#82300). And ``SharedMemory.close()`` closes its mmap: a ``BufferError`` while a
tensor views it (also from ``__del__``), a segfault later if a numpy array does (see ``close``).
So the owner uses ``SharedMemory`` only to create the segment (registered with the resource
tracker, which unlinks it if the owner dies) and to unlink it; every process, owner included,
maps the segment itself, untracked, and a mapping still viewed at close lives on until its last
view is collected.

>>> seg = Segment.create("omniflow_doc", 4096)
>>> Segment.attach("omniflow_doc").buf.nbytes >= 4096
True
>>> seg.close(); seg.unlink()
"""

from __future__ import annotations

import ctypes
import mmap
import os
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

from omniflow._exceptions import DataError

try:
    import _posixshmem  # type: ignore[import-not-found]  # what SharedMemory uses on POSIX
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

__all__ = ["Segment"]


# Not compute/_shm.Segment: a pool's blocks die with their one owner (it unlinks them); weights
# outlive their loader until the last user is gone (a reaper unlinks them) and carry a manifest.
class Segment:
    """One mapping of a named shared-memory segment."""

    def __init__(self, name: str, mapping: mmap.mmap, creator: SharedMemory | None) -> None:
        #: Segment name, without the leading slash.
        self.name = name
        #: Writable view of the whole mapping; slices of it are the blocks.
        self.buf: memoryview | None = memoryview(mapping)
        #: Virtual address of the mapping in this process (maps pointers back to offsets).
        self.address = _address_of(self.buf)
        self._mmap: mmap.mmap | None = mapping
        #: The creating ``SharedMemory`` (owner only), kept to unlink the segment.
        self._creator = creator

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        try:
            creator = SharedMemory(name=name, create=True, size=size)
        except FileExistsError as exc:
            raise DataError(f"a shared-memory segment named '{name}' already exists") from exc
        try:
            mapping = _map(name)
        except BaseException:
            creator.close()
            creator.unlink()
            raise
        creator.close()  # its own mapping is never exported, so this cannot fail
        return cls(name, mapping, creator)

    @classmethod
    def attach(cls, name: str, *, private: bool = False) -> Segment:
        """Map an existing segment; ``private``: copy-on-write (MAP_PRIVATE)."""
        return cls(name, _map(name, private), None)

    def close(self) -> None:
        """Drop this mapping; it is unmapped as soon as no view of it is left.

        Never ``mmap.close()``: a numpy array made from a view keeps a reference to the mmap
        object but no buffer export, so an explicit close would unmap memory under it (a
        segfault, not a BufferError). Dropping our reference lets refcounting unmap at once
        when nothing else uses the mapping, and later when the last array goes.
        """
        if self.buf is not None:
            self.buf.release()
            self.buf = None
            self._mmap = None

    def unlink(self) -> None:
        """Remove the segment's name (owner only); mappings stay valid until unmapped."""
        if self._creator is not None:
            creator, self._creator = self._creator, None
            try:
                creator.unlink()
            except FileNotFoundError:  # removed behind our back; still stop tracking it
                resource_tracker.unregister(creator._name, "shared_memory")  # type: ignore[attr-defined]


def _map(name: str, private: bool = False) -> mmap.mmap:
    if _posixshmem is None:  # pragma: no cover - Windows
        raise DataError("shared-memory buffer pools need a POSIX system (Linux, macOS)")
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError as exc:
        raise DataError(
            f"no shared-memory segment named '{name}': the pool that owns it is closed or was "
            "never created on this host"
        ) from exc
    try:
        access = mmap.ACCESS_COPY if private else mmap.ACCESS_DEFAULT
        return mmap.mmap(fd, os.fstat(fd).st_size, access=access)
    finally:
        os.close(fd)


def _address_of(buf: memoryview) -> int:
    anchor = ctypes.c_char.from_buffer(buf)  # holds an export only while it lives
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor
