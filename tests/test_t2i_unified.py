"""graphs/t2i_unified.py end to end with tiny random models: previews stream, a valid PNG comes."""

from __future__ import annotations

import asyncio
import struct
import zlib

import pytest

import omniflow as of
from omniflow._loader import load_graphs


@pytest.mark.timeout(300)
def test_t2i_unified_writes_a_valid_png() -> None:
    graph = load_graphs("graphs/t2i_unified.py")[0]
    mod = __import__("sys").modules[type(graph.roles["llm"]).__module__]

    async def go() -> tuple[list[str], list[bytes], dict[str, int]]:
        async with of.Runtime(graph) as rt:
            llm, dit = graph.roles["llm"].engine, graph.roles["dit"].engine
            assert isinstance(llm, of.TorchEngine) and isinstance(dit, of.DiTEngine)
            fields, pngs = [], []
            for _ in range(2):  # a second call reuses the pool and leaks no pins
                inputs = {"prompt": "a red cube on a blue table", "size": None}
                call = rt.call("t2i_unified", inputs)
                async for frame in call:
                    fields.append(frame.field)
                    if frame.field == "image":
                        pngs.append(frame.value.to_png())
                assert call.status == "ok", call.errors
            pool = mod._SHARED["barrier"].pool
            assert llm.kv_pool is pool and dit.kv_pool is pool  # one co-located pool
            assert dit.statistics()["steps"] == 2 * mod.STEPS
            stats = pool.stats()
        assert pool.closed  # both engines stopped at teardown: the co-located pool is freed
        return fields, pngs, stats

    fields, pngs, stats = asyncio.run(go())
    assert fields == ["preview", "image"] * 2
    assert stats["pinned"] == 0
    assert stats["bytes_moved"] == 0  # the DiT read the LLM's pages where they were
    assert pngs[0] == pngs[1]  # same prompt, same seed: the same picture
    png = pngs[1]
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos : pos + 4])
        tag, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", png[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(tag + data)
        chunks[tag] = data
        pos += 12 + n
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (w, h, depth, color) == (32, 32, 8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == h * (1 + 3 * w)
    assert len(set(raw)) > 16  # not a flat image
