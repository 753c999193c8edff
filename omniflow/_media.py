"""Media values: ``of.Audio`` (mono PCM samples) and ``of.Image`` (RGB pixels).

>>> import numpy as np, omniflow as of
>>> clip = of.Audio(np.zeros(2400, dtype=np.int16), sample_rate=24000)
>>> clip.duration
0.1
>>> of.Audio.from_bytes(clip.to_wav()) == clip
True

They are plain values: returned in frames, received by methods, equal by content, and moved
between processes on the data plane like the numpy arrays they hold (``data/_plane.py`` places
the array, the control message carries a handle). numpy (and Pillow for images) is imported on
first use, so ``import omniflow`` works without the ``media`` extra.

WAV is read and written with the stdlib ``wave`` module (PCM only); PNG and JPEG with Pillow.
A value that is not what its constructor needs raises ``MediaError`` (an ``InputError``, so the
server answers 400) naming what is wrong.
"""

from __future__ import annotations

import io
import wave
from typing import TYPE_CHECKING, Any, cast

from omniflow._exceptions import MediaError

if TYPE_CHECKING:
    from numpy import ndarray

__all__ = ["Audio", "Image"]

#: Sample dtypes an ``Audio`` holds as given (anything else is an error, not a silent cast).
_SAMPLE_DTYPES = ("int16", "float32")


#: Half-length of the resampling low-pass filter, in input samples.
_LOWPASS_TAPS = 32
#: A data chunk this big (or 0) was written by a streaming writer that did not know its length.
_STREAMED = 0x7FFF0000


def _streamed_data(data: bytes, frame_bytes: int) -> bytes:
    """The bytes after the ``data`` chunk header, cut to whole frames."""
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if cid == b"data":
            raw = data[pos + 8 :]
            return raw[: len(raw) - len(raw) % frame_bytes]
        pos += 8 + size + (size & 1)
    return b""  # pragma: no cover - wave.open found a data chunk, so this loop does too


def _numpy() -> Any:
    try:
        import numpy
    except ImportError as exc:  # pragma: no cover - numpy is in every extra we test
        raise ImportError(
            "of.Audio and of.Image need numpy: pip install 'omniflow[media]'"
        ) from exc
    return numpy


def _pillow() -> Any:
    try:
        from PIL import Image as PILImage
    except ImportError as exc:  # pragma: no cover - Pillow is in every extra we test
        raise ImportError(
            "decoding and encoding images needs Pillow: pip install 'omniflow[media]'"
        ) from exc
    return PILImage


class Audio:
    """Mono audio: 1-D ``int16`` or ``float32`` samples (float in [-1, 1]) at ``sample_rate`` Hz.

    >>> import numpy as np, omniflow as of
    >>> clip = of.Audio(np.array([0, 16384, -16384], dtype=np.int16), sample_rate=16000)
    >>> clip.samples.dtype.name, clip.sample_rate, len(clip)
    ('int16', 16000, 3)
    """

    __slots__ = ("_sample_rate", "_samples")

    #: The samples, 1-D, ``int16`` or ``float32`` (kept as given: no copy, no cast).
    _samples: ndarray
    #: Samples per second.
    _sample_rate: int

    def __init__(self, samples: ndarray, sample_rate: int = 24000) -> None:
        np = _numpy()
        if not isinstance(samples, np.ndarray):
            raise MediaError(
                f"of.Audio: samples must be a 1-D numpy array, got {type(samples).__name__}; "
                "wrap a list with numpy.asarray(..., dtype=numpy.int16)",
                field="samples",
            )
        if samples.ndim != 1:
            raise MediaError(
                f"of.Audio: samples must be 1-D (mono), got shape {samples.shape}; "
                "mix channels down first, e.g. samples.mean(axis=1)",
                field="samples",
            )
        if samples.dtype.name not in _SAMPLE_DTYPES:
            raise MediaError(
                f"of.Audio: samples must be int16 or float32, got {samples.dtype.name}; "
                "cast with samples.astype(numpy.float32)",
                field="samples",
            )
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int | np.integer):
            raise MediaError(
                f"of.Audio: sample_rate must be an int, got {type(sample_rate).__name__}",
                field="sample_rate",
            )
        if sample_rate <= 0:
            raise MediaError(
                f"of.Audio: sample_rate must be positive, got {sample_rate}", field="sample_rate"
            )
        self._samples = samples
        self._sample_rate = int(sample_rate)

    @property
    def samples(self) -> ndarray:
        """The samples (1-D ``int16`` or ``float32``)."""
        return self._samples

    @property
    def sample_rate(self) -> int:
        """Samples per second."""
        return self._sample_rate

    @property
    def duration(self) -> float:
        """Length in seconds."""
        return len(self._samples) / self._sample_rate

    def __len__(self) -> int:
        return len(self._samples)

    def pcm16(self) -> ndarray:
        """The samples as ``int16`` (float samples clipped to [-1, 1] and scaled by 32767)."""
        np = _numpy()
        if self._samples.dtype == np.int16:
            return self._samples
        scaled = np.clip(self._samples, -1.0, 1.0) * 32767.0
        return cast("ndarray", np.rint(scaled).astype(np.int16))

    def to_wav(self) -> bytes:
        """The bytes of a 16-bit PCM mono WAV file."""
        out = io.BytesIO()
        with wave.open(out, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(self._sample_rate)
            w.writeframes(self.pcm16().astype("<i2", copy=False).tobytes())
        return out.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> Audio:
        """Decode a PCM WAV file (8, 16, 24 or 32-bit; several channels are averaged to mono).

        A streamed WAV (its data size 0 or 0x7FFFF000 and up, as ``espeak-ng --stdout`` and
        ``ffmpeg -f wav -`` write it) is read to its end.

        16-bit mono stays ``int16``; everything else becomes ``float32`` in [-1, 1].
        """
        np = _numpy()
        if not isinstance(data, bytes | bytearray | memoryview):
            raise MediaError(
                f"of.Audio.from_bytes: expected the bytes of a WAV file, got {type(data).__name__}",
                field="audio",
            )
        try:
            with wave.open(io.BytesIO(bytes(data)), "rb") as w:
                channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
                n = w.getnframes()
                raw = w.readframes(n)
        except (wave.Error, EOFError, ValueError) as exc:
            raise MediaError(
                f"of.Audio.from_bytes: not a readable PCM WAV file ({exc}); send a RIFF/WAVE "
                "file of 8, 16, 24 or 32-bit PCM samples",
                field="audio",
            ) from exc
        if rate <= 0 or channels <= 0:
            raise MediaError(
                f"of.Audio.from_bytes: WAV header says {channels} channel(s) at {rate} Hz",
                field="audio",
            )
        if n == 0 or n * channels * width >= _STREAMED:
            # A WAV written as a stream (espeak-ng --stdout, ffmpeg -f wav -) leaves its sizes
            # 0 or huge: its samples are whatever follows the data chunk's header.
            raw = _streamed_data(bytes(data), channels * width)
            n = len(raw) // (channels * width)
        if len(raw) != n * channels * width:
            raise MediaError(
                f"of.Audio.from_bytes: the WAV file is truncated: its header says {n} frames, "
                f"the data holds {len(raw) // max(1, channels * width)}",
                field="audio",
            )
        if width == 1:  # 8-bit WAV is unsigned
            frames = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
        elif width == 2:
            frames = np.frombuffer(raw, dtype="<i2").astype(np.int16)
        elif width == 3:
            b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
            v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
            v = np.where(v >= 1 << 23, v - (1 << 24), v)
            frames = v.astype(np.float32) / float(1 << 23)
        elif width == 4:
            frames = np.frombuffer(raw, dtype="<i4").astype(np.float32) / float(1 << 31)
        else:  # pragma: no cover - wave rejects other widths itself
            raise MediaError(f"of.Audio.from_bytes: {width}-byte samples", field="audio")
        if channels > 1:
            mixed = frames.reshape(-1, channels).astype(np.float32)
            if frames.dtype == np.int16:
                mixed /= 32768.0
            frames = mixed.mean(axis=1).astype(np.float32)
        return cls(frames, sample_rate=rate)

    def resample(self, sample_rate: int) -> Audio:
        """This audio at another rate; the dtype is kept.

        Going down, a windowed-sinc low-pass at the new Nyquist rate comes first (without it
        the aliases of 22 kHz speech cost pocketsphinx a tenth of its words), then linear
        interpolation.

        >>> import numpy as np, omniflow as of
        >>> of.Audio(np.zeros(24000, dtype=np.int16), 24000).resample(16000).samples.shape
        (16000,)
        """
        np = _numpy()
        if sample_rate == self._sample_rate:
            return self
        src = self._samples.astype(np.float64)
        if sample_rate < self._sample_rate and len(src):
            cutoff = 0.45 * sample_rate / self._sample_rate  # cycles per input sample
            n = np.arange(-_LOWPASS_TAPS, _LOWPASS_TAPS + 1)
            h = 2 * cutoff * np.sinc(2 * cutoff * n) * np.hamming(len(n))
            src = np.convolve(src, h / h.sum(), mode="same")
        n_out = round(len(src) * sample_rate / self._sample_rate)
        t = np.arange(n_out, dtype=np.float64) * (self._sample_rate / sample_rate)
        out = np.interp(t, np.arange(len(src), dtype=np.float64), src) if len(src) else t
        if self._samples.dtype == np.int16:
            return Audio(np.clip(np.rint(out), -32768, 32767).astype(np.int16), sample_rate)
        return Audio(out.astype(np.float32), sample_rate)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Audio):
            return NotImplemented
        return (
            self._sample_rate == other._sample_rate
            and self._samples.dtype == other._samples.dtype
            and bool(_numpy().array_equal(self._samples, other._samples))
        )

    __hash__ = None  # type: ignore[assignment]  # mutable content, like the array it holds

    def __repr__(self) -> str:
        return (
            f"Audio({len(self._samples)} {self._samples.dtype.name} samples, "
            f"{self._sample_rate} Hz, {self.duration:.3f} s)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (Audio, (self._samples, self._sample_rate))


class Image:
    """An RGB picture: an H x W x 3 ``uint8`` numpy array.

    >>> import numpy as np, omniflow as of
    >>> pic = of.Image(np.zeros((2, 3, 3), dtype=np.uint8))
    >>> pic.width, pic.height
    (3, 2)
    """

    __slots__ = ("_pixels",)

    #: The pixels, H x W x 3 ``uint8`` RGB (kept as given: no copy).
    _pixels: ndarray

    def __init__(self, pixels: ndarray) -> None:
        np = _numpy()
        if not isinstance(pixels, np.ndarray):
            raise MediaError(
                f"of.Image: pixels must be an H x W x 3 uint8 numpy array, got "
                f"{type(pixels).__name__}",
                field="pixels",
            )
        if pixels.ndim != 3 or pixels.shape[2] != 3:
            raise MediaError(
                f"of.Image: pixels must have shape (height, width, 3) (RGB), got "
                f"{pixels.shape}; convert with PIL's .convert('RGB') first",
                field="pixels",
            )
        if pixels.dtype != np.uint8:
            raise MediaError(
                f"of.Image: pixels must be uint8, got {pixels.dtype.name}",
                field="pixels",
            )
        if pixels.shape[0] == 0 or pixels.shape[1] == 0:
            raise MediaError(f"of.Image: the image is empty ({pixels.shape})", field="pixels")
        self._pixels = pixels

    @property
    def pixels(self) -> ndarray:
        """The H x W x 3 ``uint8`` RGB array."""
        return self._pixels

    @property
    def width(self) -> int:
        return int(self._pixels.shape[1])

    @property
    def height(self) -> int:
        return int(self._pixels.shape[0])

    def to_png(self) -> bytes:
        """The bytes of a PNG file of this image."""
        out = io.BytesIO()
        _pillow().fromarray(self._pixels, mode="RGB").save(out, format="PNG")
        return out.getvalue()

    def to_pil(self) -> Any:
        """A ``PIL.Image.Image`` of this image (a copy)."""
        return _pillow().fromarray(self._pixels, mode="RGB")

    @classmethod
    def from_bytes(cls, data: bytes) -> Image:
        """Decode PNG or JPEG bytes (any mode is converted to RGB)."""
        np = _numpy()
        pil = _pillow()
        if not isinstance(data, bytes | bytearray | memoryview):
            raise MediaError(
                f"of.Image.from_bytes: expected PNG or JPEG bytes, got {type(data).__name__}",
                field="image",
            )
        try:
            with pil.open(io.BytesIO(bytes(data))) as im:
                if im.format not in ("PNG", "JPEG"):
                    raise MediaError(
                        f"of.Image.from_bytes: the bytes are a {im.format} image; send PNG or JPEG",
                        field="image",
                    )
                rgb = im.convert("RGB")
        except MediaError:
            raise
        except Exception as exc:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError...
            raise MediaError(
                f"of.Image.from_bytes: not a readable PNG or JPEG image ({exc})", field="image"
            ) from exc
        return cls(np.array(rgb, dtype=np.uint8))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Image):
            return NotImplemented
        return bool(_numpy().array_equal(self._pixels, other._pixels))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Image({self.width}x{self.height} RGB)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Image, (self._pixels,))
