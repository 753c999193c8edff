"""EncoderCache: LRU keyed by the payload's hash; concurrent misses encode once."""

from __future__ import annotations

import asyncio
from pathlib import Path

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
    assert cache.statistics() == {"size": 2, "maxsize": 2, "hits": 1, "misses": 4}
    assert cache.stats() == cache.statistics()  # (its first name)


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


def _png(color: tuple[int, int, int], size: int = 48) -> bytes:
    import io

    from PIL import Image

    img = Image.new("RGB", (size, size), color)
    img.putpixel((3, 5), (255 - color[0], 0, 255))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_vision_encoder_loads_from_safetensors_and_is_deterministic(tmp_path: Path) -> None:
    from omniflow.compute._vision import VisionConfig, VisionEncoder, make_tiny_vision

    a = make_tiny_vision(tmp_path / "a", projection_dim=48, num_layers=1)
    b = make_tiny_vision(tmp_path / "b", projection_dim=48, num_layers=1)  # same seed
    enc_a, enc_b = VisionEncoder.from_dir(a), VisionEncoder.from_dir(b)
    assert enc_a.cfg == VisionConfig.from_dir(a) and enc_a.cfg.num_patches == 16
    red, blue = _png((250, 0, 0)), _png((0, 0, 250))
    rows = enc_a.encode(red)
    assert rows.shape == (16, 48) and rows.dtype == torch.float32
    assert torch.equal(rows, enc_a.encode(red)) and torch.equal(rows, enc_b.encode(red))
    assert not torch.allclose(rows, enc_a.encode(blue), atol=1e-3)
    # another seed is another encoder
    c = VisionEncoder.from_dir(make_tiny_vision(tmp_path / "c", projection_dim=48, seed=1))
    assert not torch.allclose(rows, c.encode(red), atol=1e-3)


def test_vision_encoder_errors_name_what_is_wrong(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from omniflow.compute._vision import VisionEncoder, make_tiny_vision

    path = make_tiny_vision(tmp_path / "v", projection_dim=32)
    enc = VisionEncoder.from_dir(path)
    with pytest.raises(of.RequestError, match="cannot decode"):
        enc.encode(b"not an image at all")
    weights = load_file(str(path / "model.safetensors"))
    weights["pos_embed"] = weights["pos_embed"][:3]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="'pos_embed' has shape"):
        VisionEncoder.from_dir(path)
    (path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="expected 'omniflow_vit'"):
        VisionEncoder.from_dir(path)


def test_a_cache_hit_skips_the_encoder(tmp_path: Path) -> None:
    from omniflow.compute._vision import VisionEncoder, make_tiny_vision

    enc = VisionEncoder.from_dir(make_tiny_vision(tmp_path / "v", projection_dim=32))
    cache = of.EncoderCache(maxsize=4)
    runs: list[bytes] = []

    def encode(img: bytes) -> torch.Tensor:
        runs.append(img)
        return enc.encode(img)

    red = _png((250, 0, 0))
    first = cache.get_or_compute(red, encode)
    again = cache.get_or_compute(bytes(red), encode)  # equal bytes, another object
    assert again is first and len(runs) == 1
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 1
