"""graphs/t2i_unified.py end to end with tiny random models: previews stream, a valid PNG comes."""

from __future__ import annotations

import asyncio
import struct
import zlib
from pathlib import Path
from typing import Any

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
            assert pool is mod.KV  # the graph's pool, sized by the barrier
            assert llm.kv_pool is pool and dit.kv_pool is pool  # one co-located pool
            assert pool.capacity["l1"] == mod._SHARED["barrier"].size == 128  # min(256, 128)
            assert dit.statistics()["steps"] == 2 * mod.STEPS
            stats = pool.stats()
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


def _readme_deploy(tmp_path: Any) -> dict[str, dict[str, Any]]:
    """The README's deploy file for this graph, as a user would save it."""
    from omniflow.cluster._ray_plan import load_deploy

    text = Path("README.md").read_text()
    block = text.split("```yaml\n# deploy.yaml", 1)[1].split("```", 1)[0]
    path = tmp_path / "deploy.yaml"
    path.write_text("# deploy.yaml" + block)
    return load_deploy(path)


def _segments() -> set[str]:
    """The shared memory of the graph's pool ``t2i-kv`` on this node (``ofkv_t2i-kv_*``:
    its L1 shared across processes, its L2)."""
    return {p.name for p in Path("/dev/shm").glob("ofkv_t2i-kv_*")}


def _png(placement: Any) -> bytes:
    """The picture of one call; every process of ``placement`` left the pool's shared memory
    behind it (a Ray actor is killed after its replica stopped: no exit hook runs there)."""
    graph = load_graphs("graphs/t2i_unified.py")[0]
    before = _segments()

    async def go() -> bytes:
        async with of.Runtime(graph, placement=placement) as rt:
            out = await rt.run(
                "t2i_unified", {"prompt": "a red cube on a blue table", "size": None}
            )
        image: of.Image = out["image"][-1]
        return image.to_png()

    png = asyncio.run(go())
    assert _segments() - before == set(), placement
    return png


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["process", "deploy", "ray"])
def test_t2i_unified_runs_unchanged_in_every_placement(where: str, tmp_path: Any) -> None:
    """The same file, the same picture bit for bit (float32): inproc, each role in its own
    process (the DiT reads the LLM's pages in its shared L1), llm and dit in one Deploy process
    group, and on a local Ray with the README's deploy file (dit at layer 1 in llm's bundle)."""
    placement: Any = where
    started = False
    if where == "deploy":
        placement = of.Deploy({"llm": {"process": "gpu0"}, "dit": {"process": "gpu0"}})
    elif where == "ray":
        ray = pytest.importorskip("ray")
        deploy = _readme_deploy(tmp_path)
        assert deploy["dit"] == {"layer": 1, "colocate": "llm"}
        assert deploy["llm"]["num_gpus"] == 1 and deploy["llm"]["replicas"] == 2
        if not ray.is_initialized():  # fake GPUs: the file's num_gpus: 1 per llm replica fit
            ray.init(num_cpus=16, num_gpus=2, include_dashboard=False)
            started = True
        placement = of.Ray(deploy)
    try:
        assert _png(placement) == _png("inproc")
    finally:
        if started:
            ray.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["process", "deploy"])
def test_across_processes_the_dit_reads_the_llms_pages_in_its_shared_memory(where: str) -> None:
    """Each role in its own process: after a call, the DiT's pool viewed the LLM's published
    pages in place (``shared`` > 0, ``bytes_moved`` 0 on both) and every segment it viewed is
    one of the LLM pool's own shared L1 segments (``rt.params_pool_stats()``). Both in one
    Deploy process group: one pool instance, the DiT's match hits, nothing moved."""
    graph = load_graphs("graphs/t2i_unified.py")[0]
    placement: Any = where
    if where == "deploy":
        placement = of.Deploy({"llm": {"process": "gpu0"}, "dit": {"process": "gpu0"}})

    async def go() -> dict[str, dict[str, Any]]:
        async with of.Runtime(graph, placement=placement) as rt:
            await rt.run("t2i_unified", {"prompt": "a red cube on a blue table", "size": None})
            return await rt.params_pool_stats()

    stats = asyncio.run(go())
    # The roles' processes open the pool (a "<front>" entry is this test process's own
    # instance, left by an inproc run of the same module before, if any).
    pools = [p["t2i-kv"] for rid, p in stats.items() if rid != "<front>"]
    if where == "deploy":  # one process group: one pool instance, the DiT hits the LLM's pages
        assert len(pools) == 1, stats
        assert pools[0]["hits"] > 0 and pools[0]["bytes_moved"] == 0
        assert pools[0]["foreign_segments"] == [] and pools[0]["pinned"] == 0
        return
    assert len(pools) == 2, stats  # one instance per process, both opened
    dit = [p for p in pools if p["foreign_segments"]]
    llm = [p for p in pools if not p["foreign_segments"]]
    assert len(dit) == len(llm) == 1, stats
    assert dit[0]["shared"] > 0  # pages viewed in place, not pulled
    assert dit[0]["pulled"] == 0
    assert dit[0]["bytes_moved"] == llm[0]["bytes_moved"] == 0
    assert llm[0]["l1_segments"] and dit[0]["l1_segments"]  # both L1s in shared memory
    assert set(dit[0]["foreign_segments"]) <= set(llm[0]["l1_segments"])
    assert dit[0]["pinned"] == llm[0]["pinned"] == 0
