"""A chat graph whose answer waits, after its first sentence, until that sentence's speech
was made (test_openai_real.py, time to first audio): were sentences not spoken as they come,
the answer would never go on. The TTS is the real one (``of.roles.Tts``, espeak-ng)."""

from __future__ import annotations

import asyncio
from typing import Any

import omniflow as of

#: call id -> set once the first sentence's speech left the TTS.
SPOKEN: dict[str, asyncio.Event] = {}

FIRST = "The first sentence is here."
REST = "And the rest of the answer comes only after it was spoken."


def _spoken(call_id: str) -> asyncio.Event:
    event = SPOKEN.get(call_id)
    if event is None:
        event = SPOKEN[call_id] = asyncio.Event()
    return event


class Scripted(of.Role):
    @of.interface(inputs_or=[["messages"]], outputs=["text", "sentence"])
    async def generate(self, messages: list[dict[str, Any]]) -> Any:
        call_id = of.context().call_id
        try:
            for word in FIRST.split():
                yield {"text": word + " "}
            yield {"sentence": FIRST}
            async with asyncio.timeout(60):  # (a hang guard: the speech comes long before)
                await _spoken(call_id).wait()
            for word in REST.split():
                yield {"text": word + " "}
            yield {"sentence": REST}
        finally:
            SPOKEN.pop(call_id, None)


class Speaking(of.roles.Tts):
    @of.interface(
        inputs_or=[["sentence", "voice", "modalities"]],
        outputs=["speech"],
        latch=["voice", "modalities"],
    )
    async def speak(
        self, sentence: str, voice: str | None = None, modalities: list[str] | None = None
    ) -> dict[str, Any] | None:
        out = await super().speak(sentence, voice, modalities)
        _spoken(of.context().call_id).set()  # its frame leaves as this returns
        return out


graph = of.Graph(
    "ttfa",
    roles={"llm": Scripted(), "tts": Speaking()},
    inputs=[
        of.Placeholder(n)
        for n in (
            "messages",
            "modalities",
            "voice",
            "audio_format",
            "input",
            "speed",
            "instructions",
        )
    ],
    outputs=["text", "speech"],
)
