"""Omni chat: text (+ an optional image) in, a real LLM streaming text, speech out per sentence.

    vision.encode  messages -> prompt (the conversation) + image_embeds (one segment per image,
                   through an EncoderCache: the same image coming back skips the encoder)
    llm.generate   prompt + image_embeds -> text (token deltas, OpenAI-style) + sentence
                   (TorchEngine: continuous batching, KV cache in a ParamsPool, the session's
                   prefix reused across turns)
    tts.speak      sentence -> audio (a WAV file per sentence, written by espeak-ng)

The model directory comes from ``$OMNIFLOW_MODEL`` (any Llama/Qwen2/Mistral instruct checkpoint
in Hugging Face format: config.json, *.safetensors, tokenizer.json with a chat template). Without
it a tiny random-init Llama with a locally trained tokenizer is created on first use under
``$OMNIFLOW_CACHE`` (default ~/.cache/omniflow): **its words are noise** until a real checkpoint
is pointed to; the plumbing (template, streaming, prefix reuse, TTS) is real either way. The
vision encoder here is a fixed random projection of image bytes to the LLM's hidden size, a
stand-in with the real interface (raw payload -> hidden-state rows) for a ViT.

    OMNIFLOW_MODEL=/models/Qwen2-0.5B-Instruct omniflow serve graphs/omni_chat.py
    omniflow run graphs/omni_chat.py --input 'messages=[{"role": "user", "content": "Hi!"}]' \
        -i max_tokens=16 -i temperature=null -i top_p=null -i seed=null -i stop=null

The OpenAI endpoint (Placeholder ``messages``, output ``text``) fills the Placeholders
``max_tokens``, ``temperature``, ``top_p``, ``seed`` and ``stop`` from the same-named request
fields (None when the request leaves them out: the role's defaults then apply, greedy decoding
and 64 new tokens), and turns the final ``usage`` frame ({prompt_tokens, completion_tokens,
cached_tokens, finish_reason}) into the response's ``usage``. Called directly, every
Placeholder is an input: pass None for the ones you do not set (``SAMPLING_DEFAULTS``).
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import omniflow as of

#: Sentence ends: the TTS speaks each sentence as soon as it is complete.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
#: Bytes of image per embedding row of the stand-in encoder, and rows per image at most.
_PATCH, _MAX_ROWS = 48, 32
#: The sampling Placeholders (OpenAI request fields) and their "not set" value.
SAMPLING_DEFAULTS: dict[str, Any] = dict.fromkeys(
    ("max_tokens", "temperature", "top_p", "seed", "stop")
)


def model_dir() -> Path:
    """``$OMNIFLOW_MODEL``, or the tiny random-init Llama (created once)."""
    given = os.environ.get("OMNIFLOW_MODEL")  # empty counts as unset
    if given:
        return Path(given)
    cache = Path(os.environ.get("OMNIFLOW_CACHE", Path.home() / ".cache" / "omniflow"))
    path = cache / "tiny-llama"
    if not (path / "config.json").exists():
        from omniflow.compute._tiny import make_tiny_model

        tmp = Path(tempfile.mkdtemp(dir=cache.mkdir(parents=True, exist_ok=True) or cache))
        make_tiny_model(tmp, arch="llama", hidden_size=64, layers=2)
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


class VisionEncoder(of.Role):
    """Image payloads (data: URLs or any string) -> hidden-state rows, cached by payload hash."""

    def __init__(self, cache_size: int = 64) -> None:
        self.cache = of.EncoderCache(cache_size)
        self.calls = 0  #: encoder forward passes actually run (cache misses)

    async def setup(self) -> None:
        import torch

        from omniflow.compute._config import ModelConfig

        hidden = ModelConfig.from_dir(model_dir()).hidden_size
        gen = torch.Generator().manual_seed(0)
        self.proj = torch.randn(_PATCH, hidden, generator=gen) / _PATCH**0.5

    def _encode(self, payload: str) -> Any:
        import torch

        self.calls += 1
        raw = payload.split(",", 1)[1] if payload.startswith("data:") else payload
        try:
            data = base64.b64decode(raw, validate=True)
        except ValueError:
            data = raw.encode()
        data = data[: _PATCH * _MAX_ROWS].ljust(_PATCH * ((len(data) - 1) // _PATCH + 1), b"\0")
        patches = torch.frombuffer(bytearray(data), dtype=torch.uint8).float().view(-1, _PATCH)
        return (patches / 255.0 - 0.5) @ self.proj

    @of.interface(inputs_or=[["messages"]], outputs=["prompt", "image_embeds"])
    async def encode(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        convo, segments = [], []
        for m in messages:
            text, images = _content_parts(m.get("content"))
            convo.append({"role": m["role"], "content": text})
            segments.extend(self.cache.get_or_compute(img, self._encode) for img in images)
        return {"prompt": convo, "image_embeds": segments}


class Llm(of.Role):
    """The TorchEngine: streams token text, and complete sentences for the TTS."""

    def __init__(self, max_new_tokens: int = 64) -> None:
        self.max_new_tokens = max_new_tokens
        self.engine: of.TorchEngine | None = None

    async def setup(self) -> None:
        self.engine = of.TorchEngine(model_dir(), max_batch=16)
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

    @of.interface(
        inputs_or=[["prompt", "image_embeds", *SAMPLING_DEFAULTS]],
        outputs=["text", "sentence", "usage"],
        lb="session",
    )
    async def generate(
        self,
        prompt: list[dict[str, Any]],
        image_embeds: list[Any],
        max_tokens: Any = None,
        temperature: Any = None,
        top_p: Any = None,
        seed: Any = None,
        stop: Any = None,
    ) -> AsyncIterator[dict[str, Any]]:
        assert self.engine is not None and self.engine.tokenizer is not None
        sampling = self.sampling(max_tokens, temperature, top_p, seed, stop)
        ids = self.engine.tokenizer.apply_chat_template(prompt)
        # images enter as segments before the conversation's text (LLaVA-style layout)
        req = of.GenerateRequest(
            input_ids=None if image_embeds else ids,
            embeds=[*image_embeds, ids] if image_embeds else None,
            session=of.context().session,
            sampling=sampling,
        )
        pending, last = "", None
        async for out in self.engine.generate(req):
            last = out
            if out.text:
                yield {"text": out.text}
                pending += out.text
                *done, pending = _SENTENCE_END.split(pending)
                for sentence in done:
                    if sentence.strip():
                        yield {"sentence": sentence.strip()}
        if pending.strip():
            yield {"sentence": pending.strip()}
        if last is not None:
            yield {
                "usage": {
                    "prompt_tokens": last.prompt_tokens,
                    "completion_tokens": last.index + 1,
                    "cached_tokens": last.cached_tokens,
                    "finish_reason": last.finish_reason,
                }
            }


class Tts(of.Role):
    """espeak-ng speaks each sentence into a WAV file (one audio frame per sentence)."""

    def __init__(self, out_dir: str | None = None) -> None:
        self.out_dir = out_dir
        self.n = 0

    async def setup(self) -> None:
        if shutil.which("espeak-ng") is None:
            raise RuntimeError("tts: espeak-ng is not installed (apt-get install espeak-ng)")
        root = self.out_dir or os.environ.get("OMNIFLOW_AUDIO_DIR") or tempfile.mkdtemp()
        self.dir = Path(root)
        self.dir.mkdir(parents=True, exist_ok=True)

    @of.interface(inputs_or=[["sentence"]], outputs=["audio"])
    async def speak(self, sentence: str) -> dict[str, Any]:
        self.n += 1
        path = self.dir / f"speech-{os.getpid()}-{self.n}.wav"
        # the text goes through stdin, never argv: any bytes are safe to speak
        proc = await asyncio.create_subprocess_exec(
            "espeak-ng", "--stdin", "-w", str(path),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate(sentence.encode("utf-8", "replace"))
        if proc.returncode != 0:
            raise RuntimeError(f"tts: espeak-ng failed ({proc.returncode}): {err.decode()[:200]}")
        return {"audio": str(path)}


graph = of.Graph(
    "omni_chat",
    roles={"vision": VisionEncoder(), "llm": Llm(), "tts": Tts()},
    inputs=[of.Placeholder("messages"), *(of.Placeholder(n) for n in SAMPLING_DEFAULTS)],
    outputs=["text", "audio", "usage"],
)
