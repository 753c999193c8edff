"""Text to image on the LLM path: LLM prefill -> DiT denoising over the LLM's KV pages -> decoder.

    OMNIFLOW_T2I_LLM=ckpt/llm OMNIFLOW_T2I_DIT=ckpt/dit OMNIFLOW_T2I_OUT=cat.png \
        python graphs/t2i_unified.py "a cat on a mat"

``llm.prefill`` tokenizes the prompt and runs the Llama-family prefill straight into pages of
the co-located KV pool, then publishes the prompt's full pages under the call's session.
``dit.denoise`` matches that chain in the same pool and denoises ``STEPS`` Euler steps whose
attention reads those pages in place (no copy between the roles), streaming a ``preview`` PNG
every ``EVERY`` steps; ``vae.decode`` turns the final latents into the ``png`` bytes. The LLM and
the DiT join one ``KvPoolBarrier`` after loading their weights, so the pool they share is sized
by the smaller of their proposals. Without the environment variables the roles make tiny
random-init checkpoints (the picture is noise); with real ones the same code runs.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import omniflow as of

STEPS, EVERY, PAGE_TOKENS = 8, 4, 16
_SHARED: dict[str, Any] = {}


def png_bytes(rgb: Any) -> bytes:
    """Encode an (H, W, 3) uint8 array as a PNG (zlib + struct; no imaging dependency)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw))
        + (chunk(b"IEND", b""))
    )


def _dirs() -> tuple[Path, Path]:
    """The checkpoints: from the environment, or tiny random-init ones made once per process."""
    if "dirs" not in _SHARED:
        llm, dit = os.environ.get("OMNIFLOW_T2I_LLM"), os.environ.get("OMNIFLOW_T2I_DIT")
        if llm and dit:
            _SHARED["dirs"] = (Path(llm), Path(dit))
        else:
            from omniflow.compute._config import ModelConfig
            from omniflow.compute._dit import make_tiny_dit
            from omniflow.compute._tiny import make_tiny_model

            root = Path(tempfile.mkdtemp(prefix="of-t2i-"))
            llm_dir = make_tiny_model(root / "llm", hidden_size=64, layers=2, heads=4, kv_heads=2)
            cfg = ModelConfig.from_dir(llm_dir)
            dit_dir = make_tiny_dit(
                root / "dit",
                heads=cfg.num_heads,
                kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                layers=cfg.num_layers,
            )
            _SHARED["dirs"] = (llm_dir, dit_dir)
    return _SHARED["dirs"]  # type: ignore[no-any-return]


def _barrier() -> Any:
    if "barrier" not in _SHARED:
        from omniflow.compute._colocate import KvPoolBarrier
        from omniflow.compute._config import ModelConfig
        from omniflow.compute._kv import kv_slices, layer_names

        cfg = ModelConfig.from_dir(_dirs()[0])
        layout = of.PageLayout(
            sub_names=layer_names(cfg.num_layers),
            slices=kv_slices(cfg),
            page_tokens=PAGE_TOKENS,
            dtype="float32",
        )
        _SHARED["barrier"] = KvPoolBarrier("t2i-kv", layout, members=("llm", "dit"))
    return _SHARED["barrier"]


class Llm(of.Role):
    async def setup(self) -> None:
        from omniflow.compute._loader import load_model
        from omniflow.compute._tokenizer import Tokenizer

        llm_dir = _dirs()[0]
        self.model = load_model(llm_dir, device="cpu", dtype="float32")
        self.tokenizer = Tokenizer.from_dir(llm_dir)
        _barrier().propose("llm", 256)  # weights loaded: propose; the pool comes at first use

    async def _pool(self) -> Any:
        pool = await _barrier().wait("llm")
        await pool.open()
        return pool

    @of.interface(inputs_or=[["prompt"]], outputs=["context"])
    async def prefill(self, prompt: str) -> dict[str, Any]:
        import torch

        from omniflow.compute._kv import layer_names
        from omniflow.compute._model import ForwardBatch, SeqSlice

        ids = self.tokenizer.encode(prompt)
        full = len(ids) // PAGE_TOKENS * PAGE_TOKENS
        if full == 0:  # condition on at least one page: pad short prompts by repeating them
            ids = (ids * PAGE_TOKENS)[:PAGE_TOKENS]
            full = PAGE_TOKENS
        pool = await self._pool()
        owner = of.context().call_id
        slots = await pool.alloc(owner, -(-len(ids) // PAGE_TOKENS))
        names = layer_names(self.model.cfg.num_layers)
        kp = [[pool.view(s, n, "k") for s in slots] for n in names]
        vp = [[pool.view(s, n, "v") for s in slots] for n in names]
        batch = ForwardBatch(
            torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(0, len(ids), kp, vp)]
        )
        try:
            self.model.forward(batch)
        except BaseException:
            await pool.release(owner)
            raise
        pages = [ids[i : i + PAGE_TOKENS] for i in range(0, full, PAGE_TOKENS)]
        hashes = of.chain_hashes(pages)
        session = of.context().session or owner
        await pool.publish(session, hashes, slots[: len(pages)])
        await pool.release(owner)  # published pages stay cached; nothing stays pinned
        return {"context": {"session": session, "hashes": hashes, "tokens": full}}


class Dit(of.Role):
    async def setup(self) -> None:
        from omniflow.compute._dit import load_dit

        self.dit = load_dit(_dirs()[1])
        _barrier().propose("dit", 128)

    @of.interface(inputs_or=[["context"]], outputs=["preview", "latents"])
    async def denoise(self, context: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:

        from omniflow.compute._kv import layer_names

        pool = await _barrier().wait("dit")
        owner = of.context().call_id
        m = await pool.match(context["session"], context["hashes"], owner)
        names = layer_names(self.dit.cfg.num_layers)
        kp = [[pool.view(s, n, "k") for s in m.slots] for n in names]
        vp = [[pool.view(s, n, "v") for s in m.slots] for n in names]
        try:
            async for out in self._steps(m, kp, vp):
                yield out
        finally:
            await pool.release(owner)

    async def _steps(self, m: Any, kp: Any, vp: Any) -> AsyncIterator[dict[str, Any]]:
        import torch

        cfg = self.dit.cfg
        x = torch.randn(cfg.num_tokens, cfg.latent_dim, generator=torch.Generator().manual_seed(0))
        ctx_len = m.pages * PAGE_TOKENS
        for start in range(0, STEPS, EVERY):  # EVERY steps at a time, a preview in between
            with torch.inference_mode():
                for s in range(start, min(start + EVERY, STEPS)):
                    t, t2 = 1.0 - s / STEPS, 1.0 - (s + 1) / STEPS
                    x = x + (t2 - t) * self.dit.velocity(x, t, kp, vp, ctx_len)
            if start + EVERY < STEPS:
                yield {"preview": png_bytes(decode(x))}
        yield {"latents": x}


def decode(latents: Any, patch: int = 8) -> Any:
    """A VAE-like decoder: each latent token becomes a patch x patch RGB tile through a fixed
    random projection; tokens tile a square image."""
    import torch

    n, dim = latents.shape
    side = int(n**0.5)
    proj = torch.randn(dim, patch * patch * 3, generator=torch.Generator().manual_seed(7))
    tiles = torch.sigmoid(latents.float() @ proj / dim**0.5).view(side, side, patch, patch, 3)
    img = tiles.permute(0, 2, 1, 3, 4).reshape(side * patch, side * patch, 3)
    return (img * 255).round().to(torch.uint8).numpy()


class Vae(of.Role):
    @of.interface(inputs_or=[["latents"]], outputs=["png"])
    async def decode(self, latents: Any) -> dict[str, Any]:
        return {"png": png_bytes(decode(latents))}


graph = of.Graph(
    "t2i_unified",
    roles={"llm": Llm(), "dit": Dit(), "vae": Vae()},
    inputs=[of.Placeholder("prompt")],
    outputs=["preview", "png"],
)


async def _main(prompt: str, out: str) -> None:
    async with of.Runtime(graph) as rt:
        previews = 0
        call = rt.call("t2i_unified", {"prompt": prompt})
        async for frame in call:
            if frame.field == "preview":
                previews += 1
            elif frame.field == "png":
                Path(out).write_bytes(frame.value)
        if call.status != "ok":
            raise SystemExit(f"t2i failed: {call.errors}")
    print(f"wrote {out} ({previews} preview frames)")


if __name__ == "__main__":
    import asyncio

    asyncio.run(
        _main(
            sys.argv[1] if len(sys.argv) > 1 else "a cat on a mat",
            os.environ.get("OMNIFLOW_T2I_OUT", "t2i.png"),
        )
    )
