"""Small deterministic media graphs for the OpenAI endpoint tests (docs/contract.md §9).

* ``talker`` (chat, realtime): says the last user message's text word by word; with
  ``"audio"`` in ``modalities`` each word is followed by an ``of.Audio`` of it: ``SAMPLES``
  samples of a sine per character (frequency from the character) at ``RATE`` Hz. A user
  message holding media is described instead ("heard 4800 samples at 24000 Hz", "saw 8x6").
  The text "forever" speaks until the call is cancelled (cancel and barge-in tests).
* ``talker16``: the same at 16 kHz (the server resamples pcm16 to 24 kHz).
* ``speaker`` (speech): ``input`` -> one ``of.Audio`` per word at 22050 Hz (``voice`` "float"
  gives float32 samples).
* ``asr`` (transcriptions): describes the ``of.Audio`` it got, with ``language`` and ``prompt``.
* ``painter`` (images): ``n`` (default 1) images of ``size`` (default 8x8), colour from the
  prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

import omniflow as of

RATE = 24000
#: Samples per character of a word's audio.
SAMPLES = 240


def word_audio(word: str, rate: int, dtype: str = "int16") -> of.Audio:
    """A sine per character, ``SAMPLES`` samples each: the same word, the same samples."""
    t = np.arange(SAMPLES, dtype=np.float64) / rate
    parts = [np.sin(2 * np.pi * (200 + 10 * (ord(c) % 64)) * t) * 0.5 for c in word]
    wave = np.concatenate(parts) if parts else np.zeros(0)
    if dtype == "float32":
        return of.Audio(wave.astype(np.float32), sample_rate=rate)
    return of.Audio(np.rint(wave * 32767).astype(np.int16), sample_rate=rate)


def describe(content: Any) -> str:
    """The text of a message, or what its media parts hold."""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if part.get("type") == "text":
            out.append(part["text"])
        elif part.get("type") == "input_audio":
            clip = part["input_audio"]
            assert isinstance(clip, of.Audio), type(clip)
            out.append(f"heard {len(clip)} samples at {clip.sample_rate} Hz")
        elif part.get("type") == "image_url":
            pic = part["image_url"]
            assert isinstance(pic, of.Image), type(pic)
            out.append(f"saw {pic.width}x{pic.height}")
    return " ".join(out)


class Talker(of.Role):
    def __init__(self, rate: int) -> None:
        self.rate = rate

    @of.interface(
        inputs_or=[["messages", "modalities", "voice", "audio_format"]],
        outputs=["text", "audio"],
    )
    async def talk(
        self, messages: list[Any], modalities: Any, voice: Any, audio_format: Any
    ) -> AsyncIterator[dict[str, Any]]:
        users = [m for m in messages if m.get("role") == "user"]
        said = describe(users[-1]["content"]) if users else ""
        speak = modalities is not None and "audio" in modalities
        if said == "forever":
            for i in range(100_000):  # until cancelled (the test's hang guard bounds it)
                yield {"text": f"{i} "}
                if speak:
                    yield {"audio": word_audio("forever", self.rate)}
                await asyncio.sleep(0.001)
            return
        for i, word in enumerate(said.split()):
            yield {"text": word if i == 0 else " " + word}
            if speak:
                yield {"audio": word_audio(word, self.rate)}


def _talker(name: str, rate: int) -> of.Graph:
    return of.Graph(
        name,
        roles={name: Talker(rate)},
        inputs=[of.Placeholder(n) for n in ("messages", "modalities", "voice", "audio_format")],
        outputs=["text", "audio"],
    )


talker = _talker("talker", RATE)
talker16 = _talker("talker16", 16000)


class Speaker(of.Role):
    @of.interface(inputs_or=[["input", "voice", "speed", "instructions"]], outputs=["audio"])
    async def speak(
        self, input: str, voice: Any, speed: Any, instructions: Any
    ) -> AsyncIterator[dict[str, Any]]:
        if input == "refuse":
            raise of.InputError("this speaker refuses to say 'refuse'", field="input")
        dtype = "float32" if voice == "float" else "int16"
        for word in input.split():
            yield {"audio": word_audio(word, 22050, dtype)}


speaker = of.Graph(
    "speaker",
    roles={"speaker": Speaker()},
    inputs=[of.Placeholder(n) for n in ("input", "voice", "speed", "instructions")],
    outputs=["audio"],
)


class Asr(of.Role):
    @of.interface(inputs_or=[["audio", "language", "prompt"]], outputs=["text"])
    async def hear(self, audio: of.Audio, language: Any, prompt: Any) -> dict[str, Any]:
        text = f"{len(audio)} samples at {audio.sample_rate} Hz, {language}, {prompt}"
        return {"text": text}


asr = of.Graph(
    "asr",
    roles={"asr": Asr()},
    inputs=[of.Placeholder(n) for n in ("audio", "language", "prompt")],
    outputs=["text"],
)


class Painter(of.Role):
    @of.interface(inputs_or=[["prompt", "size", "n"]], outputs=["image"])
    async def paint(self, prompt: str, size: Any, n: Any) -> AsyncIterator[dict[str, Any]]:
        w, h = (int(v) for v in (size or "8x8").split("x"))
        for i in range(n or 1):
            colour = [(len(prompt) * 40 + i * 50) % 256, 128, i * 30 % 256]
            yield {"image": of.Image(np.full((h, w, 3), colour, dtype=np.uint8))}


painter = of.Graph(
    "painter",
    roles={"painter": Painter()},
    inputs=[of.Placeholder(n) for n in ("prompt", "size", "n")],
    outputs=["image"],
)
