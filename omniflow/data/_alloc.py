"""The buffer pool's allocator core: chunks, blocks, reference counts and the LRU cache.

Pure bookkeeping over chunk indices: no shared memory, no locks, no I/O, so every rule is tested
without a slab (``SharedBufferPool`` in ``_pool.py`` is the thin shell around it).

>>> core = PoolCore(capacity=8 * 4096, chunk_size=4096)
>>> block = core.alloc(5000, cache_key="img:42")   # two chunks, ref 1, cached
>>> core.release(block.block_id)                    # ref 0: stays resident, idle
0
>>> core.lookup("img:42").refs                      # lent again, still cached
1
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from omniflow._exceptions import InvalidBlockError, PoolExhaustedError
from omniflow.data._chunks import ChunkMap, _check

__all__ = ["Block", "PoolCore"]


@dataclass(slots=True, eq=False)
class Block:
    """One allocation: a contiguous run of chunks, live while referenced or cached."""

    #: Unique for the pool's lifetime and never reused, so a stale handle names no new block.
    block_id: int
    #: Index of the first chunk.
    start: int
    #: Number of chunks (at least one, even for a zero-byte request).
    nchunks: int
    #: Bytes requested; the tail of the last chunk is padding.
    nbytes: int
    #: Live references; always ``sum(owners.values())``.
    refs: int = 0
    #: References by owner tag (``None``: untagged); never holds a zero count.
    owners: dict[Hashable, int] = field(default_factory=dict)
    #: Key in the LRU cache, or ``None`` when the block is not cached.
    cache_key: Hashable | None = None
    #: Tick of the last cache insert or lookup; increases along the LRU order.
    last_use: int = 0
    #: Opaque metadata set by the shell (dtype and shape of an array written into the block).
    meta: Any = None


class PoolCore:
    """Carves ``capacity // chunk_size`` chunks into blocks; evicts idle cached ones under pressure.

    Reference rules: ``alloc`` and ``lookup`` give the caller one reference, ``add_ref`` one more
    to a block that already has a holder; ``release`` gives one back under the same owner tag.
    A block at zero references is freed, unless it is cached: then it stays resident and idle
    until a ``lookup`` lends it again or an ``alloc`` that does not fit evicts it (LRU first).
    """

    def __init__(self, capacity: int, chunk_size: int = 64 * 1024, *, name: str = "pool") -> None:
        if chunk_size <= 0 or capacity < chunk_size:
            raise ValueError(f"pool '{name}': need chunk_size > 0 and capacity >= chunk_size")
        #: Name used in error messages (the shared-memory segment name in the shell).
        self.name = name
        #: Bytes per chunk, the unit of allocation.
        self.chunk_size = chunk_size
        #: Chunks in the slab.
        self.nchunks = capacity // chunk_size
        #: Live blocks (referenced, or idle in the cache) by id.
        self._blocks: dict[int, Block] = {}
        #: Free runs and block placement.
        self._chunks = ChunkMap(self.nchunks)
        #: Cached block ids by key, least recently used first.
        self._cache: OrderedDict[Hashable, int] = OrderedDict()
        #: Ids of the blocks each (non-None) owner tag holds references to.
        self._by_owner: dict[Hashable, set[int]] = {}
        self._next_id = 1
        self._tick = 0
        self._counts = dict.fromkeys(
            ("allocs", "frees", "evictions", "cache_hits", "cache_misses"), 0
        )

    # -- references -------------------------------------------------------------------------

    def alloc(
        self, nbytes: int, cache_key: Hashable | None = None, owner: Hashable = None
    ) -> Block:
        """A new block of at least ``nbytes`` with one reference held by ``owner``."""
        if nbytes < 0:
            raise ValueError(f"pool '{self.name}': cannot allocate {nbytes} bytes")
        need = max(1, -(-nbytes // self.chunk_size))
        start = self._chunks.take(need)
        if start is None:
            self._make_room(need, nbytes)
            start = self._chunks.take(need)
            assert start is not None, "eviction freed less than its dry run promised"
        block = Block(self._next_id, start, need, nbytes)
        self._next_id += 1
        self._blocks[block.block_id] = block
        self._chunks.place(start, need, block.block_id)
        self._ref(block, owner)
        self._counts["allocs"] += 1
        if cache_key is not None:
            self.cache(block.block_id, cache_key)
        return block

    def add_ref(self, block_id: int, owner: Hashable = None) -> Block:
        """One more reference to a block that is already held (for another consumer)."""
        block = self.block(block_id)
        if block.refs == 0:
            raise self._invalid(
                f"add_ref of block #{block_id} that nobody holds (idle in the cache under "
                f"{block.cache_key!r}); borrow it with lookup(key) instead",
                block,
            )
        self._ref(block, owner)
        return block

    def release(self, block_id: int, owner: Hashable = None) -> int:
        """Give back one reference held by ``owner``; returns the references left."""
        block = self.block(block_id)
        if block.owners.get(owner, 0) == 0:
            held = f"held by {dict(block.owners)!r}" if block.refs else "it holds no references"
            raise self._invalid(
                f"release of block #{block_id} (offset {block.start * self.chunk_size}) below "
                f"zero for owner {owner!r}: {held}",
                block,
            )
        self._unref(block, owner, 1)
        return block.refs

    def release_owner(self, owner: Hashable) -> int:
        """Drop every reference ``owner`` holds (a cancelled call); returns how many."""
        if owner is None:
            raise ValueError("release_owner needs an owner tag; untagged references have none")
        dropped = 0
        for block_id in sorted(self._by_owner.get(owner, ())):
            block = self._blocks[block_id]
            count = block.owners[owner]
            self._unref(block, owner, count)
            dropped += count
        return dropped

    # -- cache ------------------------------------------------------------------------------

    def cache(self, block_id: int, key: Hashable) -> None:
        """Publish a written block under ``key`` (most recently used); replaces an older entry."""
        block = self.block(block_id)
        old_id = self._cache.pop(key, None)
        if old_id is not None and old_id != block_id:
            old = self._blocks[old_id]
            old.cache_key = None
            if old.refs == 0:
                self._free_block(old)
        if block.cache_key is not None and block.cache_key != key:
            del self._cache[block.cache_key]
        block.cache_key = key
        self._cache[key] = block_id
        self._touch(block)

    def lookup(self, key: Hashable, owner: Hashable = None) -> Block | None:
        """Lend the block cached under ``key`` (one reference; it stays cached) or ``None``."""
        block_id = self._cache.get(key)
        if block_id is None:
            self._counts["cache_misses"] += 1
            return None
        block = self._blocks[block_id]
        self._ref(block, owner)
        self._touch(block)
        self._counts["cache_hits"] += 1
        return block

    def _invalid(self, message: str, block: Block) -> InvalidBlockError:
        """The error for a misuse of the live ``block`` (its id and byte offset attached)."""
        return InvalidBlockError(
            f"pool '{self.name}': {message}",
            pool=self.name,
            block_id=block.block_id,
            offset=block.start * self.chunk_size,
        )

    # -- queries ----------------------------------------------------------------------------

    def block(self, block_id: int) -> Block:
        """The live block ``block_id``; a freed or unknown id is an ``InvalidBlockError``."""
        block = self._blocks.get(block_id)
        if block is None:
            raise InvalidBlockError(
                f"pool '{self.name}': block #{block_id} is not live (released, evicted or never "
                "allocated); the handle is stale",
                pool=self.name,
                block_id=block_id,
            )
        return block

    def find(self, offset: int) -> Block:
        """The live block whose chunks contain byte ``offset``, in O(log N)."""
        chunk = offset // self.chunk_size
        block_id = self._chunks.owner_of(chunk) if offset >= 0 else None
        if block_id is not None:
            return self._blocks[block_id]
        where = "in free space" if 0 <= chunk < self.nchunks else "outside the pool"
        raise InvalidBlockError(
            f"pool '{self.name}': byte offset {offset} lies {where}, not inside a live block",
            pool=self.name,
            offset=offset,
        )

    def blocks(self) -> list[Block]:
        """Every live block, by address."""
        return [self._blocks[i] for i in self._chunks.placed_ids()]

    # -- internals --------------------------------------------------------------------------

    def _ref(self, block: Block, owner: Hashable) -> None:
        block.refs += 1
        block.owners[owner] = block.owners.get(owner, 0) + 1
        if owner is not None:
            self._by_owner.setdefault(owner, set()).add(block.block_id)

    def _unref(self, block: Block, owner: Hashable, count: int) -> None:
        block.refs -= count
        left = block.owners[owner] - count
        if left:
            block.owners[owner] = left
        else:
            del block.owners[owner]
            if owner is not None:
                held = self._by_owner[owner]
                held.discard(block.block_id)
                if not held:
                    del self._by_owner[owner]
        if block.refs == 0 and block.cache_key is None:
            self._free_block(block)

    def _touch(self, block: Block) -> None:
        self._tick += 1
        block.last_use = self._tick
        self._cache.move_to_end(block.cache_key)

    def _make_room(self, need: int, nbytes: int) -> None:
        """Evict idle cached blocks, LRU first, until a run of ``need`` chunks is free."""
        idle = [b for b in (self._blocks[i] for i in self._cache.values()) if b.refs == 0]
        # Dry run first: an alloc that cannot fit even with every idle block gone must leave
        # the cache intact.
        best = self._chunks.largest_free((b.start, b.nchunks) for b in idle)
        if best < need:
            cs = self.chunk_size
            free = self._chunks.free_chunks() * cs
            largest = self._chunks.largest_free() * cs
            raise PoolExhaustedError(
                f"pool '{self.name}': cannot allocate {nbytes:,} bytes ({need} chunks of {cs:,}):"
                f" {free:,} bytes free, largest free run {largest:,} bytes, and evicting all "
                f"{len(idle)} idle cached blocks would give at most {best * cs:,} contiguous "
                f"bytes; release blocks (or their owners) or create the pool with a larger "
                f"capacity (now {self.nchunks * cs:,} bytes)",
                pool=self.name,
                requested=nbytes,
                free=free,
                largest_free=largest,
                capacity=self.nchunks * cs,
            )
        for block in idle:
            del self._cache[block.cache_key]
            block.cache_key = None
            self._counts["evictions"] += 1
            if self._free_block(block)[1] >= need:
                return

    def _free_block(self, block: Block) -> tuple[int, int]:
        """Return a block's chunks to the free runs; returns the merged run."""
        del self._blocks[block.block_id]
        self._chunks.remove(block.start)
        self._counts["frees"] += 1
        return self._chunks.give_back(block.start, block.nchunks)

    # -- checks -----------------------------------------------------------------------------

    def validate(self) -> None:
        """Check every invariant; raise ``AssertionError`` naming the first one broken."""
        self._chunks.validate({i: (b.start, b.nchunks) for i, b in self._blocks.items()})
        for block in self._blocks.values():
            name = f"block #{block.block_id}"
            _check(block.refs >= 0, f"{name} has {block.refs} references")
            _check(block.refs == sum(block.owners.values()), f"{name}: refs != owner counts")
            _check(all(n > 0 for n in block.owners.values()), f"{name}: zero owner count")
            _check(block.refs > 0 or block.cache_key is not None, f"{name}: unreferenced leak")
            _check(block.nbytes <= block.nchunks * self.chunk_size, f"{name}: nbytes > chunks")
            key = block.cache_key
            _check(key is None or self._cache.get(key) == block.block_id, f"{name}: not cached")
            for owner in block.owners:
                ok = owner is None or block.block_id in self._by_owner.get(owner, ())
                _check(ok, f"{name}: owner {owner!r} not indexed")
        ticks = []
        for key, block_id in self._cache.items():
            cached = self._blocks.get(block_id)
            if cached is None:
                raise AssertionError(f"cache key {key!r} names dead block #{block_id}")
            _check(cached.cache_key == key, f"cache key {key!r}: block has {cached.cache_key!r}")
            ticks.append(cached.last_use)
        _check(ticks == sorted(set(ticks)), "LRU order disagrees with last-use ticks")
        for owner, ids in self._by_owner.items():
            _check(bool(ids), f"owner {owner!r} indexed with no blocks")
            for block_id in ids:
                ok = block_id in self._blocks and owner in self._blocks[block_id].owners
                _check(ok, f"owner {owner!r} indexed on block #{block_id} it does not hold")

    def statistics(self) -> dict[str, int]:
        """Sizes and counters, for dashboards and tests; O(live blocks)."""
        cs = self.chunk_size
        used = sum(b.nchunks for b in self._blocks.values())
        return {
            "capacity": self.nchunks * cs,
            "chunk_size": cs,
            "used_bytes": used * cs,
            "requested_bytes": sum(b.nbytes for b in self._blocks.values()),
            "free_bytes": (self.nchunks - used) * cs,
            "largest_free": self._chunks.largest_free() * cs,
            "live_blocks": len(self._blocks),
            "cached_blocks": len(self._cache),
            "idle_cached": sum(1 for i in self._cache.values() if self._blocks[i].refs == 0),
            "owners": len(self._by_owner),
            **self._counts,
        }
