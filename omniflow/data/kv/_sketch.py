"""TinyLFU's frequency estimate: a count-min sketch of 4-bit counters with periodic halving.

>>> s = CountMinSketch(64)
>>> for _ in range(5): _ = s.add("a")
>>> s.estimate("a"), s.estimate("b")
(5, 0)
"""

from __future__ import annotations

import hashlib

__all__ = ["CountMinSketch"]

_DEPTH = 4
_MAX = 15
_HALF = bytes(v >> 1 for v in range(256))


class CountMinSketch:
    """``depth`` rows of ``width`` saturating counters; after ``sample`` adds every counter halves.

    The halving (TinyLFU's reset) makes the estimate a recent frequency: a page hot an hour ago
    but idle since loses to one hot now.
    """

    __slots__ = ("_adds", "_mask", "_rows", "sample", "width")

    def __init__(self, width: int, sample: int | None = None) -> None:
        w = 16
        while w < width:
            w <<= 1
        #: Counters per row (a power of two).
        self.width = w
        self._mask = w - 1
        #: Adds between two halvings.
        self.sample = sample if sample is not None else 10 * w
        self._rows = [bytearray(w) for _ in range(_DEPTH)]
        self._adds = 0

    def _cells(self, key: str) -> list[int]:
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return [int.from_bytes(digest[2 * i : 2 * i + 2], "little") & self._mask for i in range(4)]

    def add(self, key: str) -> int:
        """Count one access of ``key``; returns its new estimate."""
        cells = self._cells(key)
        low = min(row[c] for row, c in zip(self._rows, cells, strict=True))
        if low < _MAX:
            for row, c in zip(self._rows, cells, strict=True):
                if row[c] == low:  # conservative update: raise only the minima
                    row[c] = low + 1
        self._adds += 1
        if self._adds >= self.sample:
            self._halve()
        return min(low + 1, _MAX)

    def estimate(self, key: str) -> int:
        cells = self._cells(key)
        return min(row[c] for row, c in zip(self._rows, cells, strict=True))

    def _halve(self) -> None:
        self._adds //= 2
        for row in self._rows:
            row[:] = row.translate(_HALF)
