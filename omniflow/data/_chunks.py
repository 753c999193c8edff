"""The chunk map under the buffer pool: which chunk runs are free and which block starts where.

Two sorted lists answer the two hot questions in O(log N): where a free run of ``n`` chunks is
(first fit over the coalesced free runs), and which block a chunk belongs to (bisect over block
starts). It knows nothing about references or caching (``_alloc.py``).

>>> chunks = ChunkMap(8)
>>> chunks.take(3), chunks.take(2)
(0, 3)
>>> chunks.place(0, 3, block_id=1); chunks.place(3, 2, block_id=2)
>>> chunks.owner_of(4)
2
>>> chunks.give_back(0, 3)                  # merged with nothing: chunks 3-4 are still taken
(0, 3)
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable

__all__ = ["ChunkMap"]


class ChunkMap:
    """Free runs and placed blocks over ``nchunks`` chunks."""

    def __init__(self, nchunks: int) -> None:
        #: Chunks in the slab.
        self.nchunks = nchunks
        #: First chunks of the free runs, sorted and coalesced (no two runs touch).
        self._free_starts: list[int] = [0]
        #: Length of the free run starting at each key.
        self._free_len: dict[int, int] = {0: nchunks}
        #: First chunks of the placed blocks, sorted; ``_ids[i]`` is the block at ``_starts[i]``.
        self._starts: list[int] = []
        self._ids: list[int] = []
        #: Length of the block starting at each key.
        self._len: dict[int, int] = {}

    # -- free runs --------------------------------------------------------------------------

    def take(self, need: int) -> int | None:
        """Carve ``need`` chunks from the first free run that fits; ``None`` if none does."""
        for i, start in enumerate(self._free_starts):
            length = self._free_len[start]
            if length >= need:
                del self._free_len[start]
                if length > need:
                    self._free_starts[i] = start + need
                    self._free_len[start + need] = length - need
                else:
                    del self._free_starts[i]
                return start
        return None

    def give_back(self, start: int, length: int) -> tuple[int, int]:
        """Free a run, merging it with its neighbours; returns the merged run."""
        i = bisect_left(self._free_starts, start)
        if i < len(self._free_starts) and self._free_starts[i] == start + length:
            length += self._free_len.pop(self._free_starts.pop(i))
        if i > 0 and (prev := self._free_starts[i - 1]) + self._free_len[prev] == start:
            start, length = prev, self._free_len[prev] + length
        else:
            self._free_starts.insert(i, start)
        self._free_len[start] = length
        return start, length

    def free_chunks(self) -> int:
        return sum(self._free_len.values())

    def largest_free(self, also_free: Iterable[tuple[int, int]] = ()) -> int:
        """The longest free run, counting the runs ``also_free`` as if they were given back."""
        best = end = run = 0
        for start, length in sorted([*self._free_len.items(), *also_free]):
            run = run + length if start == end else length
            end = start + length
            best = max(best, run)
        return best

    # -- placed blocks ----------------------------------------------------------------------

    def place(self, start: int, length: int, block_id: int) -> None:
        i = bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._ids.insert(i, block_id)
        self._len[start] = length

    def remove(self, start: int) -> None:
        i = bisect_left(self._starts, start)
        del self._starts[i], self._ids[i], self._len[start]

    def owner_of(self, chunk: int) -> int | None:
        """The id of the block holding ``chunk``, or ``None`` for free space."""
        i = bisect_right(self._starts, chunk) - 1
        if i >= 0 and chunk < self._starts[i] + self._len[self._starts[i]]:
            return self._ids[i]
        return None

    def placed_ids(self) -> list[int]:
        """Block ids by address."""
        return list(self._ids)

    def validate(self, blocks: dict[int, tuple[int, int]]) -> None:
        """Check the map against ``blocks`` (id -> (start, length)); raise AssertionError."""
        _check(self._starts == sorted(self._starts), "block starts are not sorted")
        placed = {i: (s, self._len[s]) for s, i in zip(self._starts, self._ids, strict=True)}
        _check(placed == blocks, f"chunk map {placed} disagrees with the blocks {blocks}")
        _check(self._free_starts == sorted(self._free_len), "free runs are not sorted")
        runs = sorted([*blocks.values(), *self._free_len.items()])
        for (start, length), nxt in zip(runs, [*runs[1:], (self.nchunks, 0)], strict=True):
            _check(length > 0, f"empty run at chunk {start}")
            _check(start + length <= nxt[0], f"run at chunk {start} overlaps chunk {nxt[0]}")
        for start in self._free_starts:
            after = start + self._free_len[start]
            _check(after not in self._free_len, f"free runs at {start} and {after} not merged")
        used = sum(length for _, length in blocks.values())
        _check(used + self.free_chunks() == self.nchunks, "free + used chunks != total chunks")


def _check(ok: bool, message: str) -> None:
    # Not ``assert``: validate() must also work under ``python -O``.
    if not ok:
        raise AssertionError(message)
