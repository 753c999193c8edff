"""Text to speech on Debian's espeak-ng (``apt-get install espeak-ng``), as ``of.Audio``.

import omniflow as of
tts = of.roles.Tts()                    # a role: text -> audio, one frame per sentence
await tts.setup(); clip = await tts.synthesize("Hello there.")   # Audio(... 22050 Hz ...)
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import AsyncIterator
from typing import Any

from omniflow._exceptions import InputError
from omniflow._media import Audio
from omniflow.dsl import Role, interface
from omniflow.roles._sentences import Sentences

__all__ = ["VOICES", "Tts"]

#: OpenAI's voice names -> espeak-ng voices. ``en-us+klatt2`` is what pocketsphinx's en-US
#: model understands best (68% of the words of tests/roles' six sentences at 150 words/min,
#: against 36% for plain ``en-us``).
VOICES = {
    "alloy": "en-us+klatt2",
    "ash": "en-us+klatt4",
    "ballad": "en-us+klatt3",
    "coral": "en-us+f2",
    "echo": "en-us+klatt",
    "fable": "en-gb+klatt2",
    "nova": "en-us+f3",
    "onyx": "en-us+m3",
    "sage": "en-us+m1",
    "shimmer": "en-us+f4",
    "verse": "en-us+m7",
}
#: Control characters: espeak-ng stops reading at a NUL and may spell the others; spoken as
#: spaces (an LLM's text can hold any of them).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
#: An espeak-ng voice given by name (``en-us``, ``en-gb+klatt2``): letters, digits, - and +.
_ESPEAK_VOICE = re.compile(r"[a-z]{2,3}(-[a-z0-9]+)*(\+[a-z0-9]+)?")


class Tts(Role):
    """Two nodes, one model:

    ``speak``: ``sentence`` (+ latched ``voice``, ``modalities``) -> ``speech``, one ``of.Audio``
    per sentence; nothing unless ``"audio"`` is in ``modalities`` (OpenAI's default is text).
    ``say``: ``input`` (+ ``voice``, ``speed``, ``instructions``) -> ``speech``, one frame per
    sentence of the text as each is synthesized (the speech endpoint streams them).

    The output is ``speech``, not ``audio``: fields match by name, and ``audio`` is the
    transcription endpoint's input in a graph that serves both.
    """

    def __init__(self, voice: str = "alloy", words_per_minute: int = 150) -> None:
        self.voice = voice
        self.words_per_minute = words_per_minute

    async def setup(self) -> None:
        if shutil.which("espeak-ng") is None:
            raise RuntimeError("tts: espeak-ng is not installed (apt-get install espeak-ng)")

    def espeak_voice(self, voice: str | None) -> str:
        """The espeak-ng voice for an OpenAI voice name or an espeak-ng voice name."""
        name = (voice or self.voice).strip().lower()
        found = VOICES.get(name) or (name if _ESPEAK_VOICE.fullmatch(name) else None)
        if found is None:
            raise InputError(
                f"tts: unknown voice {voice!r}; use one of {', '.join(VOICES)} or an espeak-ng "
                "voice such as 'en-us+klatt2'",
                field="voice",
            )
        return found

    async def synthesize(
        self, text: str, voice: str | None = None, speed: float | None = None
    ) -> Audio:
        """``text`` spoken by espeak-ng (22050 Hz int16 mono)."""
        if speed is not None and (isinstance(speed, bool) or not 0.25 <= float(speed) <= 4.0):
            raise InputError(f"tts: speed must be in [0.25, 4.0], got {speed!r}", field="speed")
        wpm = round(self.words_per_minute * (1.0 if speed is None else float(speed)))
        # the text goes through stdin, never argv: any bytes are safe to speak
        proc = await asyncio.create_subprocess_exec(
            "espeak-ng", "--stdin", "--stdout", "-v", self.espeak_voice(voice), "-s", str(wpm),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        wav, err = await proc.communicate(_CONTROL.sub(" ", text).encode("utf-8", "replace"))
        if proc.returncode != 0:
            raise RuntimeError(f"tts: espeak-ng failed ({proc.returncode}): {err.decode()[:200]}")
        return await asyncio.to_thread(Audio.from_bytes, wav)

    @interface(
        inputs_or=[["sentence", "voice", "modalities"]],
        outputs=["speech"],
        latch=["voice", "modalities"],
    )
    async def speak(
        self, sentence: str, voice: str | None = None, modalities: list[str] | None = None
    ) -> dict[str, Any] | None:
        if not modalities or "audio" not in modalities:
            return None
        return {"speech": await self.synthesize(sentence, voice)}

    @interface(inputs_or=[["input", "voice", "speed", "instructions"]], outputs=["speech"])
    async def say(
        self,
        input: str | None,
        voice: str | None = None,
        speed: float | None = None,
        instructions: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        if input is None:
            return
        if not isinstance(input, str) or not input.strip():
            raise InputError("tts: 'input' must be non-empty text", field="input")
        self.espeak_voice(voice)  # an unknown voice fails before any audio
        split = Sentences()
        for sentence in [*split.feed(input), *split.flush()]:
            yield {"speech": await self.synthesize(sentence, voice, speed)}
