"""Omni chat: text (+ images) in, a real LLM streaming text, speech out per sentence.

    vision.encode  messages -> segment and image frames (segmented emission, paper §5.1): the
                   prompt as an ordered list of segments, images first (LLaVA-style), the
                   conversation last. An image the EncoderCache holds (the same image coming back)
                   rides as rows in a segment with its ready neighbours, sent at once; an image
                   it lacks becomes an ``image`` frame of its own, holding its segment's place.
    vision.embed   image -> segment, batched (``of.Batch(16, 5)``): the images waiting, of every
                   call, decoded and run through the ViT-style patch encoder in one forward pass
                   (into the cache), each back as its own segment frame. ``llm.generate`` takes
                   the segments of a call in their order whichever node sent them.
    llm.generate   segment -> text (token deltas, OpenAI-style) + sentence + usage. One
                   activation per segment frame (lb="session": in order): the first opens a
                   TorchEngine request (its cached prefix is matched in the ParamsPool), every
                   frame is fed to it and prefilled at once, so a ready segment is prefilled while
                   the encoder works on a later one; the last frame closes the input and streams.
    tts.speak      sentence -> audio (an ``of.Audio`` per sentence, spoken by espeak-ng)

The model directory comes from ``$OMNIFLOW_MODEL`` (any Llama/Qwen2/Mistral instruct checkpoint
in Hugging Face format: config.json, *.safetensors, tokenizer.json with a chat template). Without
it a tiny random-init Llama with a locally trained tokenizer is created on first use under
``$OMNIFLOW_CACHE`` (default ~/.cache/omniflow): **its words are noise** until a real checkpoint
is pointed to; the plumbing (template, streaming, prefix reuse, TTS) is real either way. The
vision encoder comes from ``$OMNIFLOW_VISION_MODEL`` (``config.json`` with ``"model_type":
"omniflow_vit"`` and ``model.safetensors``; its ``projection_dim`` must equal the LLM's hidden
size); without it a random-init one (32x32 images, 8x8 patches: 16 rows per image) is created
next to the tiny LLM. Random weights make the rows depend on the image's pixels, but they carry
no meaning a real LLM was trained on; point both variables to a matched pair for that.

``$OMNIFLOW_ENGINE_EXECUTOR=process`` runs the LLM's forward pass in a process of its own
(``TorchEngine(executor="process")``: the serving loop and the forward no longer take turns on
the GIL; CPU only); the default is the engine's thread.

    OMNIFLOW_MODEL=/models/Qwen2-0.5B-Instruct omniflow serve graphs/omni_chat.py
    omniflow run graphs/omni_chat.py --input 'messages=[{"role": "user", "content": "Hi!"}]' \
        -i max_tokens=16 -i temperature=null -i top_p=null -i seed=null -i stop=null

Images are OpenAI ``image_url`` parts holding ``data:`` URLs (base64 PNG/JPEG/...); remote
URLs are refused (the server fetches nothing on a client's behalf). The OpenAI endpoint
(Placeholder ``messages``, output ``text``) fills the Placeholders ``max_tokens``,
``temperature``, ``top_p``, ``seed`` and ``stop`` from the same-named request fields (None when
the request leaves them out: the role's defaults then apply, greedy decoding and 64 new tokens),
and turns the final ``usage`` frame ({prompt_tokens, completion_tokens, cached_tokens,
finish_reason}) into the response's ``usage``. Called directly, every Placeholder is an input:
pass None for the ones you do not set (``SAMPLING_DEFAULTS``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import omniflow as of

#: The sampling Placeholders (OpenAI request fields) and their "not set" value.
SAMPLING_DEFAULTS: dict[str, Any] = dict.fromkeys(
    ("max_tokens", "temperature", "top_p", "seed", "stop")
)


def _cache_dir() -> Path:
    cache = Path(os.environ.get("OMNIFLOW_CACHE", Path.home() / ".cache" / "omniflow"))
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def model_dir() -> Path:
    """``$OMNIFLOW_MODEL``, or the tiny random-init Llama (created once)."""
    given = os.environ.get("OMNIFLOW_MODEL")  # empty counts as unset
    if given:
        return Path(given)
    cache = _cache_dir()
    path = cache / "tiny-llama"
    if not (path / "config.json").exists():
        from omniflow.compute._tiny import make_tiny_model

        tmp = Path(tempfile.mkdtemp(dir=cache))
        make_tiny_model(tmp, arch="llama", hidden_size=64, layers=2)
        if not (path / "config.json").exists():
            tmp.rename(path)
    return path


def vision_dir(hidden_size: int) -> Path:
    """``$OMNIFLOW_VISION_MODEL``, or a random-init ViT projecting to ``hidden_size`` (once)."""
    given = os.environ.get("OMNIFLOW_VISION_MODEL")
    if given:
        return Path(given)
    cache = _cache_dir()
    path = cache / f"tiny-vit-{hidden_size}"
    if not (path / "config.json").exists():
        from omniflow.compute._vision import make_tiny_vision

        tmp = Path(tempfile.mkdtemp(dir=cache))
        make_tiny_vision(tmp, projection_dim=hidden_size)
        if not (path / "config.json").exists():
            tmp.rename(path)
    return path


def _content_parts(content: Any) -> tuple[str, list[str]]:
    """(text, image payloads) of an OpenAI message content (a string or a list of parts)."""
    if isinstance(content, str):
        return content, []
    text, images = [], []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "text":
            text.append(str(part.get("text", "")))
        elif part.get("type") == "image_url":
            url = part.get("image_url")
            images.append(str(url.get("url") if isinstance(url, dict) else url))
    return " ".join(text), images


def image_bytes(payload: str) -> bytes:
    """The file bytes of a ``data:`` URL (or bare base64); remote URLs are refused."""
    if payload.startswith(("http://", "https://", "file:", "ftp://")):
        raise ValueError(
            "image_url: only data: URLs (base64 image bytes) are accepted; this server does "
            f"not fetch {payload.split(':', 1)[0]} URLs"
        )
    raw = payload.split(",", 1)[1] if payload.startswith("data:") else payload
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"image_url: not valid base64 data ({exc})") from exc


class VisionEncoder(of.Role):
    """The prefix-matching role: messages -> segment frames, images through a cached ViT that
    encodes the waiting images of every call together."""

    def __init__(self, cache_size: int = 64) -> None:
        self.cache = of.EncoderCache(cache_size)
        self.calls = 0  #: images actually run through the encoder (cache misses)
        self.batches = 0  #: encoder forward passes run (one per batch of misses)

    async def setup(self) -> None:
        from omniflow.compute._config import ModelConfig
        from omniflow.compute._vision import VisionEncoder as Vit

        hidden = ModelConfig.from_dir(model_dir()).hidden_size
        self.vit = Vit.from_dir(vision_dir(hidden))
        if self.vit.cfg.projection_dim != hidden:
            raise ValueError(
                f"vision: the encoder projects to {self.vit.cfg.projection_dim} but the LLM's "
                f"hidden_size is {hidden}; point OMNIFLOW_VISION_MODEL to a matching encoder"
            )

    def _decode(self, payload: str) -> Any:
        """An image's pixels at the encoder's size, or the error that refuses it."""
        from omniflow.compute._vision import decode_image

        try:
            return decode_image(image_bytes(payload), self.vit.cfg.image_size)
        except Exception as exc:  # (one bad image fails its own activation only)
            return exc

    def _forward(self, pixels: list[Any]) -> list[Any]:
        """One encoder forward pass over the stacked images: rows for each."""
        import torch

        return [r.contiguous() for r in self.vit.forward_batch(torch.stack(pixels)).unbind(0)]

    async def _encode_batch(self, payloads: list[str]) -> list[Any]:
        """Several images, rows or an error each: decoded side by side in threads (Pillow lets
        go of the GIL), then one forward pass over those that decode, off the event loop."""
        self.calls += len(payloads)
        self.batches += 1
        out = list(await asyncio.gather(*(asyncio.to_thread(self._decode, p) for p in payloads)))
        good = [i for i, x in enumerate(out) if not isinstance(x, Exception)]
        if good:
            rows = await asyncio.to_thread(self._forward, [out[i] for i in good])
            for i, r in zip(good, rows, strict=True):
                out[i] = r
        return out

    @of.interface(inputs_or=[["messages"]], outputs=["segment", "image"])
    async def encode(self, messages: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        convo, images = [], []
        for m in messages:
            text, imgs = _content_parts(m.get("content"))
            convo.append({"role": m["role"], "content": text})
            images.extend(imgs)
        pending: list[Any] = []  # parts ready to go, not yet yielded
        index = 0
        for img in images:
            rows = self.cache.get(img)
            if rows is not None:
                pending.append(rows)
                continue
            image_bytes(img)  # a payload that is no image's is refused here, before the encoder
            if pending:  # what is ready is prefilled while this image is encoded
                yield {"segment": {"index": index, "parts": pending, "last": False}}
                index, pending = index + 1, []
            yield {"image": {"index": index, "payload": img}}
            index += 1
        pending.append({"chat": convo})
        yield {"segment": {"index": index, "parts": pending, "last": True}}

    @of.interface(inputs_or=[["image"]], outputs=["segment"], batch=of.Batch(16, 5))
    async def embed(self, image: list[dict[str, Any]]) -> list[Any]:
        """The images of a batch (any calls) -> one segment frame each, one forward pass for
        the ones the cache lacks (an image twice in the batch is encoded once)."""
        rows: dict[str, Any] = {}
        for job in image:
            p = job["payload"]
            if p not in rows:
                rows[p] = self.cache.get(p)  # (filled by an earlier batch meanwhile: a hit)
        misses = [p for p, r in rows.items() if r is None]
        if misses:
            self.cache.misses += len(misses)
            for p, r in zip(misses, await self._encode_batch(misses), strict=True):
                rows[p] = r
                if not isinstance(r, Exception):
                    self.cache.put(p, r)
        out: list[Any] = []
        for job in image:
            r = rows[job["payload"]]
            seg = {"index": job["index"], "parts": [r], "last": False}
            out.append(r if isinstance(r, Exception) else {"segment": seg})
        return out


class Llm(of.Role):
    """The TorchEngine: prefills segments as they come, streams token text and sentences."""

    def __init__(self, max_new_tokens: int = 64) -> None:
        self.max_new_tokens = max_new_tokens
        self.engine: of.TorchEngine | None = None
        #: (session, call id) -> (open request id, next segment index) between activations
        self._open: dict[tuple[str | None, str], tuple[str, int]] = {}

    async def setup(self) -> None:
        executor = os.environ.get("OMNIFLOW_ENGINE_EXECUTOR") or "thread"
        self.engine = of.TorchEngine(model_dir(), max_batch=16, executor=executor)
        await self.engine.start()

    async def teardown(self) -> None:
        if self.engine is not None:
            await self.engine.stop()

    def sampling(
        self, max_tokens: Any, temperature: Any, top_p: Any, seed: Any, stop: Any
    ) -> of.SamplingParams:
        """The request's OpenAI sampling fields (None: not set) as ``SamplingParams``."""

        def number(name: str, value: Any, kind: type) -> Any:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"'{name}' must be a number or null, got {value!r}")
            if kind is int and value != int(value):
                raise ValueError(f"'{name}' must be an integer, got {value!r}")
            return kind(value)

        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (
            isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
        ):
            raise ValueError(f"'stop' must be a non-empty string, a list of them or null: {stop!r}")
        return of.SamplingParams(
            max_new_tokens=self.max_new_tokens
            if max_tokens is None
            else number("max_tokens", max_tokens, int),
            temperature=0.0 if temperature is None else number("temperature", temperature, float),
            top_p=1.0 if top_p is None else number("top_p", top_p, float),
            seed=None if seed is None else number("seed", seed, int),
            stop=tuple(stop) if stop else None,
        )

    def _parts(self, parts: list[Any]) -> list[Any]:
        """A segment's parts as the engine takes them (the chat part rendered to ids)."""
        assert self.engine is not None and self.engine.tokenizer is not None
        out = []
        for part in parts:
            if isinstance(part, dict) and "chat" in part:
                out.append(self.engine.tokenizer.apply_chat_template(part["chat"]))
            else:
                out.append(part)
        return out

    @of.interface(
        inputs_or=[["segment", *SAMPLING_DEFAULTS]],
        outputs=["text", "sentence", "usage"],
        lb="session",
        latch=tuple(SAMPLING_DEFAULTS),
    )
    async def generate(
        self,
        segment: dict[str, Any],
        max_tokens: Any = None,
        temperature: Any = None,
        top_p: Any = None,
        seed: Any = None,
        stop: Any = None,
    ) -> AsyncIterator[dict[str, Any]]:
        assert self.engine is not None
        ctx = of.context()
        key = (ctx.session, ctx.call_id)
        index, last = segment.get("index"), bool(segment.get("last"))
        parts = self._parts(list(segment.get("parts") or []))
        if index == 0:
            sampling = self.sampling(max_tokens, temperature, top_p, seed, stop)
            for stale in [k for k in self._open if k[0] == ctx.session and k[0] is not None]:
                # calls of a session run one after another: an open request of an earlier
                # call of this session lost its producer
                self.engine.abort(self._open.pop(stale)[0])
            req = of.GenerateRequest(embeds=parts, session=ctx.session, sampling=sampling)
            if last:
                outputs = self.engine.generate(req)
            else:
                self._open[key] = (await self.engine.open(req), 1)
                return
        else:
            rid, expected = self._open.get(key, (None, 0))
            if rid is None or index != expected:
                raise ValueError(
                    f"llm.generate: segment index {index} of call {ctx.call_id} arrived, "
                    f"expected {expected if rid is not None else 0}"
                )
            self.engine.feed(rid, parts, last=last)
            if not last:
                self._open[key] = (rid, expected + 1)
                return
            del self._open[key]
            outputs = self.engine.outputs(rid)
        split, final = of.roles.Sentences(), None
        async for out in outputs:
            final = out
            if out.text:
                yield {"text": out.text}
                for sentence in split.feed(out.text):
                    yield {"sentence": sentence}
        for sentence in split.flush():
            yield {"sentence": sentence}
        if final is not None:
            yield {
                "usage": {
                    "prompt_tokens": final.prompt_tokens,
                    "completion_tokens": final.index + 1,
                    "cached_tokens": final.cached_tokens,
                    "finish_reason": final.finish_reason,
                }
            }


class Tts(of.Role):
    """espeak-ng speaks each sentence (one ``of.Audio`` frame per sentence, as it completes)."""

    def __init__(self) -> None:
        self.tts = of.roles.Tts()

    async def setup(self) -> None:
        await self.tts.setup()

    @of.interface(inputs_or=[["sentence"]], outputs=["audio"])
    async def speak(self, sentence: str) -> dict[str, Any]:
        return {"audio": await self.tts.synthesize(sentence)}


graph = of.Graph(
    "omni_chat",
    roles={"vision": VisionEncoder(), "llm": Llm(), "tts": Tts()},
    inputs=[of.Placeholder("messages"), *(of.Placeholder(n) for n in SAMPLING_DEFAULTS)],
    outputs=["text", "audio", "usage"],
)
