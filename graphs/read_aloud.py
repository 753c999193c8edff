"""Read aloud: a picture's text read out, or text spoken (pretrained models only).

    ocr.look         messages -> text: the text of every ``image_url`` part (an ``of.Image``,
                     as the chat endpoint delivers it) of the last user message, one line per
                     box, read by rapidocr-onnxruntime's PP-OCRv4 models (``of.roles.Ocr``)
    tts.read_out     text -> speech: espeak-ng (``of.roles.Tts``), one ``of.Audio`` per line;
                     not when ``modalities`` is given without "audio" (a text-only chat)
    tts.say          input -> speech: the same voice for text given directly (the OpenAI
                     ``/v1/audio/speech`` endpoint's shape: ``input``, ``voice``, ``speed``)

A call fills ``messages`` or ``input`` and leaves the other None (that branch then produces
nothing); ``voice`` is an OpenAI voice name or an espeak-ng voice, None for the default. Served,
it answers chat (a picture in, its text out, spoken with ``modalities: ["text", "audio"]``) and
``/v1/audio/speech`` (docs/contract.md §9); on ``POST /v1/graphs/read_aloud/call`` a picture is
``{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"$image":
{"png_b64": ...}}}]}], ...}``.

    omniflow run graphs/read_aloud.py -i input='"Hello there."' -i messages=null \\
        -i modalities=null -i voice=null -i speed=null -i instructions=null
    omniflow serve graphs/read_aloud.py
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import omniflow as of


class Reader(of.Role):
    """rapidocr on the pictures of a chat's last user message."""

    def __init__(self) -> None:
        self.ocr = of.roles.Ocr()

    async def setup(self) -> None:
        await self.ocr.setup()

    @of.interface(inputs_or=[["messages"]], outputs=["text"])
    async def look(self, messages: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        if messages is None:
            return None
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        content = users[-1].get("content") if users else None
        pictures = [
            part["image_url"]
            for part in (content if isinstance(content, list) else [])
            if isinstance(part, dict) and isinstance(part.get("image_url"), of.Image)
        ]
        if not pictures:
            raise of.InputError(
                "read_aloud: the last user message has no image_url part; send a picture to "
                "read (a data: URL of a PNG or JPEG)",
                field="messages",
            )
        lines = [await self.ocr.read_image(pic) for pic in pictures]
        return {"text": "\n".join(line for line in lines if line)}


class Speaker(of.Role):
    """espeak-ng for the OCR'd text (``read_out``) and for text given as ``input`` (``say``)."""

    def __init__(self) -> None:
        self.tts = of.roles.Tts()

    async def setup(self) -> None:
        await self.tts.setup()

    @of.interface(
        inputs_or=[["text", "voice", "modalities"]],
        outputs=["speech"],
        latch=["voice", "modalities"],
    )
    async def read_out(
        self, text: str, voice: str | None = None, modalities: list[str] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        if modalities is not None and "audio" not in modalities:
            return  # a chat that asked for text only
        split = of.roles.Sentences()
        for line in text.splitlines():  # each OCR line is spoken as its own sentence
            for sentence in [*split.feed(line), *split.flush()]:
                yield {"speech": await self.tts.synthesize(sentence, voice)}

    @of.interface(inputs_or=[["input", "voice", "speed", "instructions"]], outputs=["speech"])
    async def say(
        self, input: str | None, voice: str | None, speed: float | None, instructions: str | None
    ) -> AsyncIterator[dict[str, Any]]:
        async for frame in self.tts.say(input, voice, speed, instructions):
            yield frame


graph = of.Graph(
    "read_aloud",
    roles={"ocr": Reader(), "tts": Speaker()},
    inputs=[
        of.Placeholder(n)
        for n in ("messages", "modalities", "input", "voice", "speed", "instructions")
    ],
    outputs=["text", "speech"],
)
