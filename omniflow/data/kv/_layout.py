"""The physical paging layout of a Params Pool, its id, chain hashes and the match record.

>>> layout = PageLayout(("layer0",), {"k": (2, 4), "v": (2, 4)}, page_tokens=16, dtype="float16")
>>> len(layout.layout_id), layout.page_bytes
(16, 512)
>>> a, b = chain_hashes([[1, 2], [3, 4]])
>>> chain_hashes([[1, 2], [3, 5]])[0] == a, chain_hashes([[1, 2], [3, 5]])[1] == b
(True, False)
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omniflow._exceptions import DataError

__all__ = ["DTYPES", "Match", "PageLayout", "chain_hashes"]

#: dtype name -> bytes per element (names as torch spells them).
DTYPES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}


@dataclass(frozen=True, slots=True, init=False)
class PageLayout:
    """``sub_names`` (e.g. layers) x ``slices`` (e.g. k, v: per-token shapes), per page.

    One page holds ``page_tokens`` tokens of every (sub_name, slice); each tier stores one
    array per (sub_name, slice) of shape ``(pages, page_tokens, *slice_shape)``.
    """

    sub_names: tuple[str, ...]
    slices: tuple[tuple[str, tuple[int, ...]], ...]
    page_tokens: int
    dtype: str
    #: First 16 hex digits of the SHA-256 of the canonical JSON (equal layouts, equal ids).
    layout_id: str = field(compare=False)

    def __init__(
        self,
        sub_names: Iterable[str],
        slices: Mapping[str, Sequence[int]],
        page_tokens: int,
        dtype: str = "float16",
    ) -> None:
        subs = tuple(sub_names)
        if (
            not subs
            or not all(isinstance(s, str) and s for s in subs)
            or len(set(subs)) != len(subs)
        ):
            raise DataError(f"PageLayout.sub_names must be distinct non-empty strs, got {subs!r}")
        if not isinstance(slices, Mapping) or not slices:
            raise DataError("PageLayout.slices must be a non-empty dict of name -> per-token shape")
        norm: list[tuple[str, tuple[int, ...]]] = []
        for name, shape in slices.items():
            dims = tuple(shape)
            if (
                not isinstance(name, str)
                or not name
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)
            ):
                raise DataError(
                    f"PageLayout.slices['{name}']: need a non-empty name and a tuple of positive "
                    f"ints, got {shape!r}"
                )
            norm.append((name, dims))
        if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1:
            raise DataError(f"PageLayout.page_tokens must be an int >= 1, got {page_tokens!r}")
        if dtype not in DTYPES:
            raise DataError(f"PageLayout.dtype '{dtype}' is not one of {sorted(DTYPES)}")
        object.__setattr__(self, "sub_names", subs)
        object.__setattr__(self, "slices", tuple(norm))
        object.__setattr__(self, "page_tokens", page_tokens)
        object.__setattr__(self, "dtype", dtype)
        digest = hashlib.sha256(self.canonical_json().encode()).hexdigest()
        object.__setattr__(self, "layout_id", digest[:16])

    def canonical_json(self) -> str:
        doc = {
            "dtype": self.dtype,
            "page_tokens": self.page_tokens,
            "slices": [[n, list(s)] for n, s in self.slices],
            "sub_names": list(self.sub_names),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> PageLayout:
        doc: dict[str, Any] = json.loads(text)
        return cls(doc["sub_names"], dict(doc["slices"]), doc["page_tokens"], doc["dtype"])

    def slice_shape(self, name: str) -> tuple[int, ...]:
        for n, shape in self.slices:
            if n == name:
                return shape
        raise DataError(f"layout {self.layout_id}: no slice '{name}' (has {self.slice_names})")

    @property
    def slice_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.slices)

    def coords(self) -> list[tuple[str, str]]:
        """Every (sub_name, slice), the unit of storage."""
        return [(s, n) for s in self.sub_names for n, _ in self.slices]

    def coord_bytes(self, slice_name: str) -> int:
        """Bytes of one page of one (sub_name, slice)."""
        return self.page_tokens * math.prod(self.slice_shape(slice_name)) * DTYPES[self.dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes of one whole page (every sub_name and slice)."""
        return sum(self.coord_bytes(n) for _s, n in self.coords())

    def check_coord(self, sub_name: str, slice_name: str) -> None:
        if sub_name not in self.sub_names:
            raise DataError(
                f"layout {self.layout_id}: no sub_name '{sub_name}' (has {list(self.sub_names)})"
            )
        self.slice_shape(slice_name)


def chain_hashes(pages: Iterable[Sequence[int] | bytes]) -> list[str]:
    """One hash per page, each covering its predecessor's: equal only for an equal prefix.

    A page is its token ids (ints) or raw bytes; hashes are 32 hex digits of BLAKE2b.
    """
    out: list[str] = []
    prev = b""
    for i, page in enumerate(pages):
        if isinstance(page, bytes | bytearray | memoryview):
            body = bytes(page)
        else:
            try:
                body = b"t" + b",".join(str(int(t)).encode() for t in page)
            except (TypeError, ValueError) as exc:
                raise DataError(f"chain_hashes: page {i} is neither bytes nor token ids") from exc
        digest = hashlib.blake2b(prev + b"|" + body, digest_size=16).digest()
        out.append(digest.hex())
        prev = digest
    return out


@dataclass(frozen=True, slots=True)
class Match:
    """The longest published prefix found by ``ParamsPool.match``, pinned for its owner."""

    #: Number of pages matched.
    pages: int
    #: Their slots, in chain order.
    slots: tuple[int, ...]
