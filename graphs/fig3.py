"""The Omni-Flow paper's Fig. 3 graph, with small pure-Python roles.

parse.run streams one frame per request part: a text part goes to embedding.embed, an image
part goes to both vit.encode and vae.encode, whose features join at llm.generate (a bucket
rooted at parse.run). llm.generate streams tokens back to the caller and, once every token
of the call is in (a multi-stream join), diffusion.generate_image draws a latent that
vae.decode turns into a picture.

    omniflow plan graphs/fig3.py
    omniflow run graphs/fig3.py --input 'request={"parts": [{"text": "a cat"}, {"image": [1, 2]}]}'
"""

from __future__ import annotations

from typing import Any

import omniflow as of


class Parser(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["text", "image"])
    async def run(self, request: dict[str, Any]):
        for part in request.get("parts", []):
            if "text" in part:
                yield {"text": str(part["text"])}
            if "image" in part:
                yield {"image": list(part["image"])}


class Embedding(of.Role):
    @of.interface(inputs_or=[["text"]], outputs=["text_emb"])
    async def embed(self, text: str) -> dict[str, Any]:
        return {"text_emb": [float(ord(c) % 7) for c in text]}


class Vit(of.Role):
    @of.interface(inputs_or=[["image"]], outputs=["vit_feat"])
    async def encode(self, image: list[float]) -> dict[str, Any]:
        return {"vit_feat": [v * 2.0 for v in image]}


class Vae(of.Role):
    @of.interface(inputs_or=[["image"]], outputs=["vae_feat"])
    async def encode(self, image: list[float]) -> dict[str, Any]:
        return {"vae_feat": [v + 0.5 for v in image]}

    @of.interface(inputs_or=[["latent"]], outputs=["picture"])
    async def decode(self, latent: list[float]) -> dict[str, Any]:
        return {"picture": [round(v, 3) for v in latent]}


class Llm(of.Role):
    """Streams one token per input feature; keeps the session's history in GlobalParameters."""

    @of.interface(
        inputs_or=[["text_emb"], ["vit_feat", "vae_feat"]],
        outputs=["token"],
        lb="session",
    )
    async def generate(
        self,
        text_emb: list[float] | None = None,
        vit_feat: list[float] | None = None,
        vae_feat: list[float] | None = None,
    ):
        history = of.context().params["history"]
        if text_emb is not None:
            feats = text_emb
            kind = "txt"
        else:
            assert vit_feat is not None and vae_feat is not None
            feats = [a + b for a, b in zip(vit_feat, vae_feat, strict=True)]
            kind = "img"
        history.append(kind)
        for i, v in enumerate(feats):
            yield {"token": f"{kind}{i}:{v:g}"}


class Diffusion(of.Role):
    @of.interface(inputs_or=[["token"]], outputs=["latent"], activate_by_count={"token": of.ALL})
    async def generate_image(self, token: list[str]) -> dict[str, Any]:
        return {"latent": [len(t) / 10 for t in token]}


graph = of.Graph(
    "fig3",
    roles={
        "parse": Parser(),
        "embedding": Embedding(),
        "vit": Vit(),
        "vae": Vae(),
        "llm": Llm(),
        "diffusion": Diffusion(),
    },
    inputs=[of.Placeholder("request")],
    outputs=["token", "picture"],
    params=[of.GlobalParameters("history", factory=list)],
)
