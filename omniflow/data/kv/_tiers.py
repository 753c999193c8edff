"""The physical paging layer: one array per (sub_name, slice) per tier, and batched copies.

L1 lives on the compute device (cuda when present, else host memory), L2 in named POSIX
shared memory (another process on the host maps it by name: ``attach_l2``), L3 in files under
``l3_dir`` mapped with mmap. Every array has shape ``(pages, page_tokens, *slice_shape)``, so a
page of one (sub_name, slice) is ``store[index]``: a zero-copy view.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from omniflow._exceptions import DataError
from omniflow.data._shm import Segment
from omniflow.data.kv._layout import PageLayout
from omniflow.data.kv._slots import L1, L2, L3, Move

__all__ = ["TierStore", "attach_l2", "default_device"]

#: At most this many contiguous runs are copied run by run; more go through one gather.
_MAX_RUNS = 16


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name)
    assert isinstance(dt, torch.dtype)
    return dt


def _shaped(buf: Any, layout: PageLayout, pages: int, slice_name: str) -> torch.Tensor:
    shape = (pages, layout.page_tokens, *layout.slice_shape(slice_name))
    flat = torch.frombuffer(buf, dtype=_dtype(layout.dtype), count=_count(shape))
    return flat.view(shape)


def _count(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class TierStore:
    """The arrays of one pool on this process: ``store(tier, sub_name, slice)``."""

    def __init__(
        self,
        layout: PageLayout,
        capacity: Sequence[int],
        *,
        prefix: str,
        l3_dir: str | None = None,
        device: str | torch.device | None = None,
        shared_l1: bool = False,
    ) -> None:
        self.layout = layout
        self.capacity = tuple(capacity)
        #: Name prefix of the L2 segments and L3 files (``{prefix}_{coord index}``).
        self.prefix = prefix
        self.device = torch.device(device) if device is not None else default_device()
        if shared_l1 and self.device.type != "cpu":
            raise DataError(
                f"params pool '{prefix}': a shared L1 on {self.device} needs CUDA IPC, which this "
                "build does not implement (no GPU to test it on); co-locate such roles in one "
                "process (one Deploy process group) or keep the pool's L1 private"
            )
        #: L1 in named shared memory (``{prefix}l1_{i}``): co-located processes view it in place.
        self.shared_l1 = shared_l1
        coords = layout.coords()
        self._index = {c: i for i, c in enumerate(coords)}
        self._stores: list[dict[tuple[str, str], torch.Tensor]] = [{}, {}, {}]
        self._segments: list[Segment] = []
        self._maps: list[mmap.mmap] = []
        #: Names of the shared-memory segments of a shared L1 (empty when L1 is private).
        self.l1_segments: list[str] = []
        self._l3_tmp: tempfile.TemporaryDirectory[str] | None = None
        self.l3_dir = l3_dir
        try:
            dt = _dtype(layout.dtype)
            for c in coords:
                shape = (self.capacity[L1], layout.page_tokens, *layout.slice_shape(c[1]))
                if shared_l1 and self.capacity[L1]:
                    nbytes = self.capacity[L1] * layout.coord_bytes(c[1])
                    seg = Segment.create(f"{prefix}l1_{self._index[c]}", nbytes)
                    self._segments.append(seg)
                    self.l1_segments.append(seg.name)
                    self._stores[L1][c] = _shaped(seg._mmap, layout, self.capacity[L1], c[1])
                    continue
                # Not zeroed: a page is always written (by its owner, a readback or a pull)
                # before it is read, and zeroing every L1 page at startup costs a full pass.
                self._stores[L1][c] = torch.empty(shape, dtype=dt, device=self.device)
            if self.capacity[L2]:
                for c, i in self._index.items():
                    nbytes = self.capacity[L2] * layout.coord_bytes(c[1])
                    seg = Segment.create(f"{prefix}_{i}", nbytes)
                    self._segments.append(seg)
                    self._stores[L2][c] = _shaped(seg._mmap, layout, self.capacity[L2], c[1])
            if self.capacity[L3]:
                if l3_dir is None:
                    self._l3_tmp = tempfile.TemporaryDirectory(prefix="omniflow-kv-")
                    self.l3_dir = self._l3_tmp.name
                assert self.l3_dir is not None
                os.makedirs(self.l3_dir, exist_ok=True)
                for c, i in self._index.items():
                    nbytes = self.capacity[L3] * layout.coord_bytes(c[1])
                    path = os.path.join(self.l3_dir, f"{prefix}_{i}.l3")
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                    try:
                        os.ftruncate(fd, nbytes)
                        mm = mmap.mmap(fd, nbytes)
                    finally:
                        os.close(fd)
                    self._maps.append(mm)
                    self._stores[L3][c] = _shaped(mm, layout, self.capacity[L3], c[1])
        except BaseException:
            self.close()
            raise
        self._finalizer = weakref.finalize(self, _unlink_leaked, list(self._segments))

    def store(self, tier: int, sub_name: str, slice_name: str) -> torch.Tensor:
        return self._stores[tier][(sub_name, slice_name)]

    def coord_index(self, sub_name: str, slice_name: str) -> int:
        return self._index[(sub_name, slice_name)]

    def copy(self, moves: Iterable[Move]) -> int:
        """Copy the bytes of a plan's moves (deepest source first); returns bytes moved."""
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for m in moves:
            if m.dst_tier is not None and m.dst_index is not None:
                groups.setdefault((m.src_tier, m.dst_tier), []).append((m.src_index, m.dst_index))
        moved = 0
        # Down moves from the deepest tier first (L2->L3 frees what L1->L2 fills), then ups.
        order = sorted(groups, key=lambda sd: (sd[1] < sd[0], -sd[0]))
        for src, dst in order:
            pairs = groups[(src, dst)]
            runs = Runs(pairs)
            for c in self._stores[L1]:
                runs.apply(self._stores[src][c], self._stores[dst][c])
            moved += len(pairs) * self.layout.page_bytes
        return moved

    def read_out(self, tier: int, indices: Sequence[int]) -> list[Any]:
        """The bytes of ``indices`` of ``tier``, one contiguous uint8 array per (sub_name, slice)
        (a zero-copy view of the tier when the indices are one ascending run)."""
        out = []
        start = _run_start(indices)
        idx = None if start is not None else torch.tensor(list(indices), dtype=torch.long)
        for c in self._stores[L1]:
            src = self._stores[tier][c]
            if start is not None:
                data = src[start : start + len(indices)]
            else:
                assert idx is not None
                data = src.index_select(0, idx.to(src.device))
            out.append(data.cpu().contiguous().view(torch.uint8).numpy().reshape(-1))
        return out

    def read_mixed(self, locs: Sequence[tuple[int, int]]) -> list[Any]:
        """Like ``read_out`` for pages spread over several tiers."""
        out = []
        for c in self._stores[L1]:
            data = torch.stack([self._stores[t][c][i].cpu() for t, i in locs]).contiguous()
            out.append(data.view(torch.uint8).numpy().reshape(-1))
        return out

    def write_in(self, tier: int, indices: Sequence[int], data: Sequence[Any]) -> int:
        """Write buffers made by ``read_out`` (any process, same layout) into ``indices``."""
        if len(data) != len(self._stores[L1]):
            raise DataError(f"pool {self.prefix}: a pull brought {len(data)} arrays, not "
                            f"{len(self._stores[L1])}")  # fmt: skip
        start = _run_start(indices)
        idx = torch.tensor(list(indices), dtype=torch.long)
        for buf, c in zip(data, self._stores[L1], strict=True):
            dst = self._stores[tier][c]
            with warnings.catch_warnings():  # a received frame is read-only; we only read it
                warnings.simplefilter("ignore", UserWarning)
                src = _shaped(buf, self.layout, len(indices), c[1])
            if start is not None:
                dst[start : start + len(indices)].copy_(src)
            else:
                dst.index_copy_(0, idx.to(dst.device), src.to(dst.device))
        return len(indices) * self.layout.page_bytes

    def close(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        self._stores = [{}, {}, {}]
        for seg in self._segments:
            seg.close()
            seg.unlink()
        self._segments = []
        self._maps = []  # unmapped when the last view goes
        if self.l3_dir is not None and self._l3_tmp is None:
            for i in self._index.values():
                path = os.path.join(self.l3_dir, f"{self.prefix}_{i}.l3")
                if os.path.exists(path):
                    os.unlink(path)
        if self._l3_tmp is not None:
            self._l3_tmp.cleanup()
            self._l3_tmp = None


def _unlink_leaked(segments: list[Segment]) -> None:
    for seg in segments:
        seg.close()
        seg.unlink()
    if segments:
        warnings.warn(
            f"params pool L2 '{segments[0].name.rsplit('_', 1)[0]}' was garbage-collected "
            "without aclose(); unlinked its shared memory",
            ResourceWarning,
            stacklevel=1,
        )


def _run_start(indices: Sequence[int]) -> int | None:
    """The first index when ``indices`` are one ascending run (``i, i+1, ...``), else None."""
    if not indices:
        return None
    first = indices[0]
    return first if all(v == first + k for k, v in enumerate(indices)) else None


class Runs:
    """The pairs ``(src, dst)`` of one tier-to-tier batch as contiguous runs, worked out once
    for every (sub_name, slice) they are applied to: at most ``_MAX_RUNS`` runs are copied as
    slices (one ``copy_`` each), more as one gather (``index_select`` + ``index_copy_``)."""

    __slots__ = ("_idx", "runs")

    def __init__(self, pairs: Sequence[tuple[int, int]]) -> None:
        runs: list[list[int]] = []  # [s0, d0, length]
        for s, d in sorted(pairs):
            if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([s, d, 1])
        #: ``(src_start, dst_start, length)`` per run, in source order.
        self.runs = [(s, d, n) for s, d, n in runs]
        self._idx: tuple[torch.Tensor, torch.Tensor] | None = None
        if len(runs) > _MAX_RUNS:
            self._idx = (
                torch.tensor([s for s, _ in pairs], dtype=torch.long),
                torch.tensor([d for _, d in pairs], dtype=torch.long),
            )

    def apply(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst[d] = src[s]`` for every pair."""
        if self._idx is None:
            for s, d, n in self.runs:
                dst[d : d + n].copy_(src[s : s + n])
            return
        sidx, didx = self._idx
        dst.index_copy_(
            0, didx.to(dst.device), src.index_select(0, sidx.to(src.device)).to(dst.device)
        )


class ForeignL2:
    """Another process's shared tiers on this host, mapped by name: zero-copy views of its
    pages. Its L2 always when it has one; its L1 too when that is shared (a co-located pool:
    ``l1_pages`` > 0, segments ``{prefix}l1_{i}``)."""

    def __init__(self, layout: PageLayout, prefix: str, pages: int, l1_pages: int = 0) -> None:
        self.prefix = prefix
        coords = layout.coords()
        self._segments: list[Segment] = []
        self._stores: list[dict[tuple[str, str], torch.Tensor]] = [{}, {}]
        #: Names of the mapped segments by tier (``[L1, L2]``).
        self.segments: list[list[str]] = [[], []]
        try:
            for tier, count, fmt in ((L2, pages, "{}_{}"), (L1, l1_pages, "{}l1_{}")):
                if count <= 0:
                    continue
                for i, c in enumerate(coords):
                    seg = Segment.attach(fmt.format(prefix, i))
                    self._segments.append(seg)
                    self.segments[tier].append(seg.name)
                    self._stores[tier][c] = _shaped(seg._mmap, layout, count, c[1])
        except BaseException:
            self.close()
            raise

    def view(self, index: int, sub_name: str, slice_name: str, tier: int = L2) -> torch.Tensor:
        return self._stores[tier][(sub_name, slice_name)][index]

    def close(self) -> None:
        self._stores = [{}, {}]
        for seg in self._segments:
            seg.close()


def attach_l2(layout: PageLayout, prefix: str, pages: int) -> ForeignL2:
    return ForeignL2(layout, prefix, pages)
