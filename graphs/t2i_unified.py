"""Text to image on the LLM path: LLM prefill -> DiT denoising over the LLM's KV pages -> decoder.

    OMNIFLOW_T2I_LLM=ckpt/llm OMNIFLOW_T2I_DIT=ckpt/dit OMNIFLOW_T2I_OUT=cat.png \
        python graphs/t2i_unified.py "a cat on a mat"

``llm.prefill`` runs the prompt through ``TorchEngine.prefill``: its KV goes straight into pages
of the co-located pool and the full pages are published under the call's session; the role
passes on the chain (``PublishedPrefix.as_dict()``: session, page hashes, tokens), never the KV.
``dit.denoise`` hands that chain to ``DiTEngine``, which matches it in the same pool (the pages
are pinned, not copied) and denoises ``STEPS`` Euler steps whose attention reads those pages in
place, batching the steps of concurrent calls; a ``preview`` PNG streams every ``EVERY`` steps.
``vae.decode`` turns the final latents into the ``image`` (an ``of.Image``, resized to ``size``
"WIDTHxHEIGHT" when one is given; None or "auto": the decoder's own size). Both engines take a
seat at one ``KvPoolBarrier`` over the graph's pool ``t2i-kv`` (``barrier.member(role,
max_pages=...)``): each measures what is free after loading its weights and proposes, and the
pool is sized by the smaller proposal once both did. The same file runs unchanged inproc, with
``placement="process"``, in one ``of.Deploy`` process group, and on Ray with ``dit`` at layer 1
colocated with ``llm``: where the two roles are in different processes of a node, they meet in
the node's shared memory, and the DiT reads the LLM's pages there in place. Without the
environment variables the roles make tiny random-init checkpoints, the same in every process
(the picture is noise); with real ones the same code runs. ``omniflow serve
graphs/t2i_unified.py`` answers ``/v1/images/generations`` with it (Placeholders ``prompt`` and
``size``; docs/contract.md §9).
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
    """Encode an (H, W, 3) uint8 tensor or array as a PNG (zlib + struct; no numpy, which
    ``omniflow[compute]`` does not install)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + bytes(rgb[y].reshape(-1).tolist()) for y in range(h))

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
    """The checkpoints: from the environment, or tiny random-init ones made once per process
    (seeded: every process makes the same weights)."""
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


#: The co-located KV pool: declared in the graph, so every process has its instance with the
#: deployment's metadata; its L1 is sized by the barrier (the 1 here is a placeholder).
KV = of.TorchEngine.pool(
    _dirs()[0], "t2i-kv", capacity={"l1": 1, "l2": 0, "l3": 0}, page_tokens=PAGE_TOKENS,
    dtype="float32", device="cpu",
)  # fmt: skip


def _barrier(member: str) -> Any:
    """The LLM's and the DiT's co-located pool barrier (one per process). A runtime that sets
    the graph up again in this process (its roles' ``setup()`` run once more) gets a fresh
    barrier: a member that already took a seat at the current one starts the next."""
    current = _SHARED.get("barrier")
    if current is None or member in current.proposals:
        current = _SHARED["barrier"] = of.KvPoolBarrier("t2i-kv", None, members=("llm", "dit"))
    return current


class Llm(of.Role):
    """The prompt's prefill on ``TorchEngine``: its full KV pages are published in the
    co-located pool under the call's session (nothing is generated)."""

    async def setup(self) -> None:
        llm_dir = _dirs()[0]
        seat = _barrier("llm").member("llm", max_pages=256)
        self.engine = of.TorchEngine(
            llm_dir, pool=seat, dtype="float32", device="cpu", page_tokens=PAGE_TOKENS
        )
        await self.engine.start()  # weights loaded, free memory measured and proposed

    async def teardown(self) -> None:
        await self.engine.stop()

    @of.interface(inputs_or=[["prompt"]], outputs=["context"])
    async def prefill(self, prompt: str) -> dict[str, Any]:
        tok = self.engine.tokenizer
        assert tok is not None
        ids = tok.encode(prompt)
        if len(ids) < PAGE_TOKENS:  # condition on at least one page: repeat a short prompt
            ids = (ids * PAGE_TOKENS)[:PAGE_TOKENS]
        session = of.context().session or of.context().call_id
        prefix = await self.engine.prefill(of.GenerateRequest(input_ids=ids, session=session))
        return {"context": prefix.as_dict()}


class Dit(of.Role):
    """Denoising on ``DiTEngine``: concurrent calls' pictures step together; its attention reads
    the prompt's pages where the LLM wrote them."""

    async def setup(self) -> None:
        seat = _barrier("dit").member("dit", max_pages=128)
        self.engine = of.DiTEngine(
            _dirs()[1], pool=seat, dtype="float32", device="cpu", page_tokens=PAGE_TOKENS
        )
        await self.engine.start()

    async def teardown(self) -> None:
        await self.engine.stop()

    @of.interface(inputs_or=[["context"]], outputs=["preview", "latents"])
    async def denoise(self, context: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        req = of.DenoiseRequest(context=context, steps=STEPS, preview_every=EVERY, seed=0)
        async for out in self.engine.generate(req):
            if out.finished:
                yield {"latents": out.latents.float().cpu()}
            else:
                yield {"preview": png_bytes(decode(out.latents))}


def decode(latents: Any, patch: int = 8) -> Any:
    """A VAE-like decoder: each latent token becomes a patch x patch RGB tile through a fixed
    random projection; tokens tile a square image."""
    import torch

    n, dim = latents.shape
    side = int(n**0.5)
    proj = torch.randn(dim, patch * patch * 3, generator=torch.Generator().manual_seed(7))
    lat = latents.detach().float().cpu()
    tiles = torch.sigmoid(lat @ proj / dim**0.5).view(side, side, patch, patch, 3)
    img = tiles.permute(0, 2, 1, 3, 4).reshape(side * patch, side * patch, 3)
    return (img * 255).round().to(torch.uint8)


def decode_batch(latents: list[Any], patch: int = 8) -> list[Any]:
    """``decode`` of several latents of one shape in one matmul (others one by one)."""
    import torch

    if len({tuple(lat.shape) for lat in latents}) > 1:
        return [decode(lat, patch) for lat in latents]
    b, (n, dim) = len(latents), latents[0].shape
    side = int(n**0.5)
    proj = torch.randn(dim, patch * patch * 3, generator=torch.Generator().manual_seed(7))
    lat = torch.stack([x.detach().float().cpu() for x in latents])
    tiles = torch.sigmoid(lat @ proj / dim**0.5).view(b, side, side, patch, patch, 3)
    img = tiles.permute(0, 1, 3, 2, 4, 5).reshape(b, side * patch, side * patch, 3)
    return list((img * 255).round().to(torch.uint8).unbind(0))


def parse_size(size: Any) -> tuple[int, int] | None:
    """``"WIDTHxHEIGHT"`` -> (width, height); None or ``"auto"`` -> None (the decoder's size)."""
    if size is None or size == "auto":
        return None
    w, _, h = size.partition("x") if isinstance(size, str) else ("", "", "")
    if not (w.isdigit() and h.isdigit() and 1 <= int(w) <= 4096 and 1 <= int(h) <= 4096):
        raise of.InputError(
            f"size must be 'WIDTHxHEIGHT' with sides in 1..4096 (like '256x256'), got {size!r}",
            field="size",
        )
    return int(w), int(h)


def sized(pixels: Any, size: Any) -> Any:
    """The decoded picture as an ``of.Image`` of the requested size (an InputError instance
    for a bad size: it fails that activation only)."""
    try:
        wh = parse_size(size)
    except of.InputError as exc:
        return exc
    image = of.Image(pixels.numpy())
    if wh is not None and wh != (image.width, image.height):
        import numpy as np
        from PIL import Image as PILImage

        image = of.Image(np.asarray(image.to_pil().resize(wh, PILImage.Resampling.BICUBIC)))
    return {"image": image}


class Vae(of.Role):
    # Batched across calls (docs/api-graphs.md, "of.Batch"): concurrent calls' latents decode in
    # one matmul; a call alone waits at most 2 ms for company.
    @of.interface(
        inputs_or=[["latents", "size"]], outputs=["image"], latch=["size"],
        batch=of.Batch(8, 2),
    )  # fmt: skip
    async def decode(self, latents: list[Any], size: list[Any]) -> list[Any]:
        return [sized(px, sz) for px, sz in zip(decode_batch(latents), size, strict=True)]


graph = of.Graph(
    "t2i_unified",
    roles={"llm": Llm(), "dit": Dit(), "vae": Vae()},
    inputs=[of.Placeholder("prompt"), of.Placeholder("size")],
    outputs=["preview", "image"],
    pools=[KV],
)


async def _main(prompt: str, out: str) -> None:
    async with of.Runtime(graph) as rt:
        previews = 0
        call = rt.call("t2i_unified", {"prompt": prompt, "size": None})
        async for frame in call:
            if frame.field == "preview":
                previews += 1
            elif frame.field == "image":
                Path(out).write_bytes(frame.value.to_png())
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
