"""Where a page is: a replica's location as the metadata writes it, a view of another
process's page on this host (``Foreign``), and the owner check every pin makes.

>>> loc(1, 42, 16)
'1:42:16'
>>> parse_loc("1:42:16")
(1, 42, 16)
"""

from __future__ import annotations

from typing import Any

from omniflow._exceptions import DataError

__all__ = ["Foreign", "check_owner", "loc", "parse_loc"]


def loc(tier: int, index: int, fill: int) -> str:
    """A replica's location in the metadata."""
    return f"{tier}:{index}:{fill}"


def parse_loc(text: str) -> tuple[int, int, int]:
    tier, index, fill = text.split(":")
    return int(tier), int(index), int(fill)


def check_owner(pool: str, owner: Any) -> str:
    if not isinstance(owner, str) or not owner:
        raise DataError(
            f"pool '{pool}': an owner must be a non-empty str (a call id), got {owner!r}"
        )
    return owner


class Foreign:
    """A page of another process's shared tier (its L2, or a co-located pool's shared L1) on
    this host, viewed in place and locked for readers."""

    __slots__ = ("fill", "index", "key", "owners", "provider", "tier")

    def __init__(self, provider: str, index: int, key: str, fill: int, tier: int = 1) -> None:
        #: The node whose shared tier holds it, the tier (1: L2, 0: a shared L1), the index
        #: there, its hash and fill.
        self.provider = provider
        self.tier = tier
        self.index = index
        self.key = key
        self.fill = fill
        #: Owners here that pin it (the replica lock is given back when none is left).
        self.owners: set[str] = set()
