"""The engine's seam onto the ``ParamsPool``: which pages hold which layer's keys and values.

>>> # kv = KvCache(pool, num_layers=2)
>>> # k_pages, v_pages = kv.views(slot)      # one (page_tokens, kv_heads, head_dim) view per layer

The pool owns the pages (allocation, hit/miss, publication, release, eviction). The engine keeps
one sub_name per layer (``layer0`` ...) with slices ``k`` and ``v`` and only computes and writes
into the slots it is handed. Page identity for prefix reuse is a chained hash of each page's
content: its token ids, plus the bytes of any embedding rows it holds (so an image's hidden
states key the cache exactly like tokens do).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from omniflow._exceptions import OmniflowError
from omniflow.compute._bytes import tensor_bytes
from omniflow.compute._config import ModelConfig
from omniflow.compute._sequence import Sequence

__all__ = ["KvCache", "L1Pages", "PagePool", "layer_names", "page_keys"]


class PagePool(Protocol):
    """The part of ``of.ParamsPool`` (docs/contract.md §7) the engine uses."""

    async def alloc(self, owner: str, n: int) -> list[int]: ...

    def view(self, slot: int, sub_name: str, slice: str) -> torch.Tensor: ...

    async def release(self, owner: str) -> Any: ...

    async def publish(self, session: str | None, hashes: list[Any], slots: list[int]) -> Any: ...

    async def match(self, session: str | None, hashes: list[Any], owner: str) -> Any: ...

    def stats(self) -> dict[str, Any]: ...


def layer_names(num_layers: int) -> tuple[str, ...]:
    return tuple(f"layer{i}" for i in range(num_layers))


def kv_slices(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Per-token shape of each slice of a layer's page."""
    shape = (cfg.num_kv_heads, cfg.head_dim)
    return {"k": shape, "v": shape}


class KvCache:
    """Maps pool slots to per-layer key/value page views."""

    __slots__ = ("names", "page_tokens", "pool")

    def __init__(self, pool: PagePool, num_layers: int, page_tokens: int) -> None:
        self.pool = pool  #: the ParamsPool holding the pages
        self.names = layer_names(num_layers)  #: sub_name of each layer
        self.page_tokens = page_tokens  #: tokens per page

    def stores(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer the pool's whole L1 (k, v) arrays, or None when the pool has no such form."""
        storage = getattr(self.pool, "storage", None)
        if storage is None:
            return None
        return [(storage(n, "k"), storage(n, "v")) for n in self.names]

    def block(self, slots: list[int]) -> torch.Tensor | None:
        """L1 indices of ``slots``; None when some page is not a local L1 page (then the
        per-page views are used)."""
        table = getattr(self.pool, "block_table", None)
        if table is None:
            return None
        try:
            block: torch.Tensor = table(slots)
        except OmniflowError:
            return None
        return block

    def views(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zero-copy views of ``slot``'s key and value pages, one per layer."""
        ks = [self.pool.view(slot, name, "k") for name in self.names]
        vs = [self.pool.view(slot, name, "v") for name in self.names]
        return ks, vs

    def zero(self, slots: list[int]) -> None:
        """Zero freshly allocated pages: batched attention reads whole pages and masks the
        positions not written yet, and the pool's memory may hold NaN patterns (0 * NaN is
        NaN). Between steps only (an engine process sees it through the shared arrays)."""
        for slot in slots:
            ks, vs = self.views(slot)
            for t in (*ks, *vs):
                t.zero_()


class L1Pages:
    """``KvCache``'s seam for a process that holds only the pool's L1 arrays (the engine's own
    process): a page is named by its L1 index, which the engine's ``KvCache.block`` gave."""

    __slots__ = ("_stores", "names")

    def __init__(self, stores: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._stores = stores  #: per layer the (k, v) L1 arrays
        self.names = layer_names(len(stores))  #: sub_name of each layer

    def stores(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._stores

    def block(self, indices: list[int]) -> torch.Tensor:
        return torch.tensor(indices, dtype=torch.long, device=self._stores[0][0].device)

    def views(self, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [k[index] for k, _ in self._stores], [v[index] for _, v in self._stores]


def page_keys(seq: Sequence, n_pages: int, page_tokens: int) -> list[list[int] | bytes]:
    """What each of the first ``n_pages`` full pages holds, for ``chain_hashes``: its token ids,
    or (when embedding rows are on it) bytes of the ids and the rows."""
    keys: list[list[int] | bytes] = []
    for p in range(n_pages):
        lo, hi = p * page_tokens, (p + 1) * page_tokens
        rows = seq.embed_rows(lo, hi)
        if not rows:
            keys.append(seq.tokens[lo:hi])
            continue
        key = b"e" + tensor_bytes(torch.tensor(seq.tokens[lo:hi], dtype=torch.int64))
        for offset, part in rows:
            data = tensor_bytes(part)
            key += offset.to_bytes(4, "little") + str(part.dtype).encode() + data
        keys.append(key)
    return keys
