"""Speech to text on pocketsphinx (its wheel carries an en-US acoustic model, dictionary and LM).

import omniflow as of
asr = of.roles.Asr()                    # a role: audio -> text
await asr.setup(); await asr.transcribe_audio(of.Audio.from_bytes(wav))  # 'hello world'
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import OrderedDict
from typing import Any

from omniflow._exceptions import MediaError
from omniflow._media import Audio
from omniflow.dsl import Role, interface

__all__ = ["Asr"]

#: The rate pocketsphinx's en-US acoustic model was trained on.
RATE = 16000


class Asr(Role):
    """``transcribe``: ``audio`` (an ``of.Audio``, any rate; None: nothing) -> ``text``.

    Input audio is resampled to 16 kHz mono (low-passed, then interpolated) before decoding.
    ``language`` and ``prompt`` (the transcriptions endpoint's optional fields) are accepted;
    only ``en``/None is served (the one model the wheel carries).

    The last ``cache_size`` transcripts are kept by the audio's content: pocketsphinx's
    decoder adapts to what it heard before, so the same clip decoded again later can come out
    differently. A conversation re-sends its earlier turns with every request; their text must
    stay what it was (or the LLM's cached prefix no longer matches), and need not be decoded
    again.
    """

    def __init__(self, cache_size: int = 256) -> None:
        self._decoder: Any = None
        #: A pocketsphinx Decoder decodes one utterance at a time.
        self._lock = threading.Lock()
        #: Most transcripts kept.
        self.cache_size = cache_size
        #: digest of the 16 kHz PCM -> transcript, least recently used first.
        self._heard: OrderedDict[bytes, str] = OrderedDict()

    async def setup(self) -> None:
        try:
            from pocketsphinx import Decoder  # type: ignore[import-untyped]
        except ImportError as exc:
            raise RuntimeError(
                "asr: pocketsphinx is missing: pip install 'omniflow[audio]'"
            ) from exc
        self._decoder = await asyncio.to_thread(Decoder, samprate=RATE, logfn="/dev/null")

    def _decode(self, pcm: bytes) -> str:
        with self._lock:
            dec = self._decoder
            dec.start_utt()
            dec.process_raw(pcm, full_utt=True)
            dec.end_utt()
            hyp = dec.hyp()
            return str(hyp.hypstr) if hyp is not None else ""

    async def transcribe_audio(self, audio: Audio) -> str:
        """The words pocketsphinx hears in ``audio`` (lower case, space-separated)."""
        if not isinstance(audio, Audio):
            raise MediaError(
                f"asr: 'audio' must be an of.Audio, got {type(audio).__name__}", field="audio"
            )
        if self._decoder is None:
            await self.setup()
        pcm = audio.resample(RATE).pcm16().astype("<i2", copy=False).tobytes()
        key = hashlib.blake2b(pcm, digest_size=16).digest()
        text = self._heard.get(key)
        if text is None:
            text = await asyncio.to_thread(self._decode, pcm)
            self._heard[key] = text
            while len(self._heard) > self.cache_size:
                self._heard.popitem(last=False)
        self._heard.move_to_end(key)
        return text

    @interface(inputs_or=[["audio", "language", "prompt"]], outputs=["text"])
    async def transcribe(
        self, audio: Audio | None, language: str | None = None, prompt: str | None = None
    ) -> dict[str, Any] | None:
        if audio is None:
            return None  # another endpoint's request: this branch produces nothing
        if language not in (None, "", "en", "en-US", "en-us", "english"):
            raise MediaError(
                f"asr: language {language!r} is not served; this model speaks en (English)",
                field="language",
            )
        return {"text": await self.transcribe_audio(audio)}
