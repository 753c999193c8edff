"""Read aloud: a picture's text read out, or text spoken (pretrained models only).

    ocr.read         image -> text: rapidocr-onnxruntime's PP-OCRv4 models (``of.roles.Ocr``)
    tts.read_out     text -> speech: espeak-ng (``of.roles.Tts``), one ``of.Audio`` per sentence
    tts.say          input -> speech: the same voice for text given directly (the OpenAI
                     ``/v1/audio/speech`` endpoint's shape: ``input``, ``voice``, ``speed``)

A call fills ``image`` or ``input`` and leaves the other None (that branch then produces
nothing); ``voice`` is an OpenAI voice name or an espeak-ng voice, None for the default.

    omniflow run graphs/read_aloud.py -i input='"Hello there."' -i image=null -i voice=null \\
        -i speed=null -i instructions=null
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import omniflow as of


class Speaker(of.Role):
    """espeak-ng for the OCR'd text (``read_out``) and for text given as ``input`` (``say``)."""

    def __init__(self) -> None:
        self.tts = of.roles.Tts()

    async def setup(self) -> None:
        await self.tts.setup()

    @of.interface(inputs_or=[["text", "voice"]], outputs=["speech"])
    async def read_out(self, text: str, voice: str | None) -> AsyncIterator[dict[str, Any]]:
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
    roles={"ocr": of.roles.Ocr(), "tts": Speaker()},
    inputs=[of.Placeholder(n) for n in ("image", "input", "voice", "speed", "instructions")],
    outputs=["text", "speech"],
)
