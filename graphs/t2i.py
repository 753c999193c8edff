"""Text-to-image and text+image-to-image with any number of condition images (0..N).

parse.run streams the prompt once, then one frame per condition image. Each image goes to
both vit.encode and vae.encode; their features join per image at adapter.fuse (a bucket rooted
at parse.run, so the two features of one image always pair up). diffusion.denoise is a
multi-stream join: one text embedding plus the list of every fused condition of the call
(``activate_by_count={"cond": ALL}``, so ``[]`` for plain text-to-image). vae.decode turns the
latent into the "picture" output.

The roles are tiny integer arithmetic, so a test can compute the picture by hand:

    text_emb = [len(word) for word in prompt.split()]
    cond_i   = [3 * v + 1 for v in image_i]            # vit 2v, vae v + 1, fused a + b
    bias     = sum of every element of every cond_i
    latent   = [len(conds)] + [e + bias for e in text_emb]
    picture  = {"n_cond": latent[0], "pixels": [10 * v for v in latent[1:]]}

For {"prompt": "a red cat", "images": [[1, 2], [0]]}: conds [[4, 7], [1]], bias 12,
text_emb [1, 3, 3], latent [2, 13, 15, 15], picture {"n_cond": 2, "pixels": [130, 150, 150]}.
With no images: conds [], bias 0, latent [0, 1, 3, 3],
picture {"n_cond": 0, "pixels": [10, 30, 30]}.

    omniflow plan graphs/t2i.py
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import omniflow as of


class Parser(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["prompt", "cond_image"])
    async def run(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        yield {"prompt": str(request["prompt"])}
        for image in request.get("images", []):
            yield {"cond_image": [int(v) for v in image]}


class TextEncoder(of.Role):
    @of.interface(inputs_or=[["prompt"]], outputs=["text_emb"])
    async def encode(self, prompt: str) -> dict[str, Any]:
        return {"text_emb": [len(word) for word in prompt.split()]}


class Vit(of.Role):
    @of.interface(inputs_or=[["cond_image"]], outputs=["vit_feat"])
    async def encode(self, cond_image: list[int]) -> dict[str, Any]:
        return {"vit_feat": [2 * v for v in cond_image]}


class Vae(of.Role):
    @of.interface(inputs_or=[["cond_image"]], outputs=["vae_feat"])
    async def encode(self, cond_image: list[int]) -> dict[str, Any]:
        return {"vae_feat": [v + 1 for v in cond_image]}

    @of.interface(inputs_or=[["latent"]], outputs=["picture"])
    async def decode(self, latent: list[int]) -> dict[str, Any]:
        return {"picture": {"n_cond": latent[0], "pixels": [10 * v for v in latent[1:]]}}


class Adapter(of.Role):
    """Fuses the two features of one condition image."""

    @of.interface(inputs_or=[["vit_feat", "vae_feat"]], outputs=["cond"])
    async def fuse(self, vit_feat: list[int], vae_feat: list[int]) -> dict[str, Any]:
        return {"cond": [a + b for a, b in zip(vit_feat, vae_feat, strict=True)]}


class Diffusion(of.Role):
    @of.interface(
        inputs_or=[["text_emb", "cond"]],
        outputs=["latent"],
        activate_by_count={"cond": of.ALL},
    )
    async def denoise(self, text_emb: list[int], cond: list[list[int]]) -> dict[str, Any]:
        bias = sum(sum(c) for c in cond)
        return {"latent": [len(cond), *(e + bias for e in text_emb)]}


graph = of.Graph(
    "t2i",
    roles={
        "parse": Parser(),
        "text": TextEncoder(),
        "vit": Vit(),
        "vae": Vae(),
        "adapter": Adapter(),
        "diffusion": Diffusion(),
    },
    inputs=[of.Placeholder("request")],
    outputs=["picture"],
)
