"""Audio on the wire: 16-bit PCM at a fixed rate, a streaming resampler, WAV headers.

>>> import numpy as np
>>> r = Resampler(16000, 24000)
>>> a = r.feed(np.arange(4, dtype=np.int16) * 100)
>>> b = r.feed(np.arange(4, 8, dtype=np.int16) * 100)
>>> np.concatenate([a, b]).tolist() == resample(np.arange(8, dtype=np.int16) * 100,
...                                             16000, 24000).tolist()
True

OpenAI's ``pcm16`` is raw 16-bit little-endian mono PCM at 24 kHz; a graph's ``of.Audio`` has
its own rate and dtype. ``Resampler`` converts a stream of sample blocks by **linear
interpolation**: output sample ``k`` sits at source position ``k * src / dst`` (exact rational
arithmetic, no drift) and is the straight line between the two source samples around it; the
stream ends at the last source sample (no extrapolation past it). It keeps the one sample and
the position it needs between blocks, so resampling a clip in blocks gives exactly the samples
of resampling it whole: a streamed answer and a non-streamed one carry the same audio. Linear
interpolation has no anti-aliasing filter; it is meant for speech going up or slightly down in
rate (16 or 22.05 kHz TTS to 24 kHz), where it is inaudible.

Float samples (``[-1, 1]``) become int16 as ``of.Audio.pcm16`` does (clip, scale by 32767,
round). numpy is imported on first use (``import omniflow.serve`` works without it).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from omniflow._media import Audio

__all__ = [
    "PCM16_RATE",
    "PcmStream",
    "Resampler",
    "pcm16_of",
    "resample",
    "wav_header",
    "whole_audio",
]

#: The rate of OpenAI's ``pcm16`` (chat and realtime audio).
PCM16_RATE = 24000


def pcm16_of(samples: Any) -> np.ndarray:
    """``samples`` (int16, or float in [-1, 1]) as int16."""
    import numpy as np

    arr = np.asarray(samples)
    if arr.dtype == np.int16:
        return arr
    return np.rint(np.clip(arr.astype(np.float64), -1.0, 1.0) * 32767.0).astype(np.int16)


class Resampler:
    """Streaming linear-interpolation resampler of int16 blocks from ``src`` to ``dst`` Hz."""

    __slots__ = ("_consumed", "_k", "_last", "dst", "src")

    def __init__(self, src: int, dst: int) -> None:
        if src <= 0 or dst <= 0:
            raise ValueError(f"sample rates must be positive, got {src} -> {dst}")
        #: Source and destination rates (Hz).
        self.src, self.dst = src, dst
        #: Index of the next output sample.
        self._k = 0
        #: Source samples fed so far.
        self._consumed = 0
        #: The last source sample fed (the left end of the next interpolation), or None.
        self._last: int | None = None

    def feed(self, block: Any) -> np.ndarray:
        """The output samples (int16) that ``block`` (int16 or float samples) completes."""
        import numpy as np

        x = pcm16_of(block)
        if self.src == self.dst:
            return x
        if len(x) == 0:
            return x
        start = self._consumed  # source index of x[0]
        if self._last is None:
            ext, base = x.astype(np.float64), start
        else:
            ext = np.concatenate(([float(self._last)], x.astype(np.float64)))
            base = start - 1
        self._consumed += len(x)
        last_index = self._consumed - 1
        # Output k sits at k*src/dst; it is ready while k*src/dst <= last_index.
        k_end = (last_index * self.dst) // self.src + 1
        ks = np.arange(self._k, k_end, dtype=np.int64)
        self._k = k_end
        self._last = int(x[-1])
        if len(ks) == 0:
            return np.empty(0, dtype=np.int16)
        num = ks * self.src
        i = num // self.dst  # integer part of the position
        frac = (num - i * self.dst).astype(np.float64) / self.dst
        j = i - base
        left = ext[j]
        right = ext[np.minimum(j + 1, len(ext) - 1)]
        out = left + (right - left) * frac
        return np.clip(np.rint(out), -32768, 32767).astype(np.int16)


def resample(samples: Any, src: int, dst: int) -> np.ndarray:
    """``samples`` resampled whole (the same samples ``Resampler`` gives in blocks)."""
    return Resampler(src, dst).feed(samples)


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """The 44-byte header of a 16-bit mono PCM WAV; ``data_bytes=None`` writes the sizes of a
    stream of unknown length (0xFFFFFFFF, as streamed WAV answers do)."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )


class PcmStream:
    """Audio frames -> raw 16-bit little-endian PCM at ``rate``, resampled by a ``Resampler``
    (one per run of frames at the same source rate), so the bytes of a stream of frames are the
    bytes of the same frames at once."""

    __slots__ = ("_resampler", "rate", "rates")

    def __init__(self, rate: int) -> None:
        #: The output rate (Hz).
        self.rate = rate
        #: Source rates seen, in order of first use.
        self.rates: list[int] = []
        self._resampler: Resampler | None = None

    def feed(self, clip: Audio) -> bytes:
        r = self._resampler
        if r is None or r.src != clip.sample_rate:
            r = self._resampler = Resampler(clip.sample_rate, self.rate)
            if clip.sample_rate not in self.rates:
                self.rates.append(clip.sample_rate)
        return r.feed(clip.samples).astype("<i2", copy=False).tobytes()


def whole_audio(clips: list[Audio], fmt: str) -> bytes:
    """``clips`` as one ``wav`` (at their rate when they share one, else 24 kHz) or ``pcm16``
    (24 kHz) file."""
    import numpy as np

    rates = {c.sample_rate for c in clips}
    if fmt == "wav" and len(rates) == 1:
        pcm = np.concatenate([pcm16_of(c.samples) for c in clips]).astype("<i2").tobytes()
        return wav_header(rates.pop(), len(pcm)) + pcm
    stream = PcmStream(PCM16_RATE)
    pcm = b"".join(stream.feed(c) for c in clips)
    return wav_header(PCM16_RATE, len(pcm)) + pcm if fmt == "wav" else pcm
