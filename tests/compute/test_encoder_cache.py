"""EncoderCache: LRU keyed by the payload's hash; concurrent misses encode once."""

from __future__ import annotations

import asyncio

import pytest
import torch

import omniflow as of
from omniflow.compute._encoder_cache import payload_key


def test_lru_keeps_the_most_recent() -> None:
    cache = of.EncoderCache(maxsize=2)
    calls: list[object] = []

    def enc(p: object) -> str:
        calls.append(p)
        return f"emb({p!r})"

    for p in (b"a", "b", b"a", "c", "b"):
        cache.get_or_compute(p, enc)
    # b"a" was used again before "c" came, so "b" was the one dropped, then encoded again
    assert calls == [b"a", "b", "c", "b"]
    assert len(cache) == 2 and b"a" not in cache and "b" in cache
    assert cache.stats() == {"size": 2, "maxsize": 2, "hits": 1, "misses": 4}


def test_keys_depend_on_content_and_kind() -> None:
    t = torch.arange(6.0).reshape(2, 3)
    assert payload_key(t) == payload_key(t.clone())
    assert payload_key(t) != payload_key(t.reshape(3, 2))
    assert payload_key(b"x") != payload_key("x")
    with pytest.raises(TypeError, match="raw payloads"):
        payload_key(object())


async def test_concurrent_misses_share_one_encode() -> None:
    cache = of.EncoderCache(maxsize=4)
    gate = asyncio.Event()
    calls = 0

    async def enc(p: bytes) -> int:
        nonlocal calls
        calls += 1
        await gate.wait()
        return len(p)

    tasks = [asyncio.ensure_future(cache.aget_or_compute(b"img", enc)) for _ in range(5)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*tasks) == [3] * 5
    assert calls == 1 and cache.stats()["misses"] == 1


async def test_a_failed_encode_is_not_cached() -> None:
    cache = of.EncoderCache(maxsize=4)

    async def boom(p: bytes) -> int:
        raise ValueError("bad image")

    with pytest.raises(ValueError):
        await cache.aget_or_compute(b"img", boom)
    assert len(cache) == 0
