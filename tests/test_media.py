"""of.Audio and of.Image (docs/contract.md §9): construction, validation, bytes, equality."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import wave

import numpy as np
import pytest
from PIL import Image as PILImage

import omniflow as of


def _tone(n: int = 2400, rate: int = 24000) -> np.ndarray:
    t = np.arange(n) / rate
    return (np.sin(2 * np.pi * 440 * t) * 12000).astype(np.int16)


def test_audio_fields_and_wav_round_trip() -> None:
    clip = of.Audio(_tone(), sample_rate=24000)
    assert clip.sample_rate == 24000
    assert clip.duration == pytest.approx(0.1)
    wav = clip.to_wav()
    with wave.open(io.BytesIO(wav)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == 2400
    again = of.Audio.from_bytes(wav)
    assert again == clip
    assert again.samples.dtype == np.int16 and again.samples.flags.writeable


def test_audio_default_rate_and_float_samples() -> None:
    x = np.array([0.0, 0.5, -1.0, 2.0], dtype=np.float32)
    clip = of.Audio(x)
    assert clip.sample_rate == 24000
    back = of.Audio.from_bytes(clip.to_wav())
    assert back.samples.tolist() == [0, 16384, -32767, 32767]  # clipped, rounded


def test_audio_equality_is_by_content() -> None:
    a = of.Audio(_tone(), 24000)
    assert a == of.Audio(_tone().copy(), 24000)
    assert a != of.Audio(_tone(), 16000)
    assert a != of.Audio(_tone().astype(np.float32), 24000)  # another dtype is another value
    b = _tone()
    b[7] += 1
    assert a != of.Audio(b, 24000)
    assert a != "audio"


def test_audio_from_stereo_and_other_widths() -> None:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(np.array([16384, 0, -16384, -16384], dtype="<i2").tobytes())
    clip = of.Audio.from_bytes(out.getvalue())
    assert clip.samples.dtype == np.float32
    assert clip.samples.tolist() == [0.25, -0.5]
    for width, frames, expected in [
        (1, bytes([128, 255]), [0.0, 127 / 128]),
        (3, b"\x00\x00\x40\x00\x00\xc0", [0.5, -0.5]),
        (4, np.array([1 << 30], dtype="<i4").tobytes(), [0.5]),
    ]:
        out = io.BytesIO()
        with wave.open(out, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(width)
            w.setframerate(8000)
            w.writeframes(frames)
        assert of.Audio.from_bytes(out.getvalue()).samples.tolist() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("samples", "rate", "field", "words"),
    [
        ([1, 2, 3], 24000, "samples", "numpy array"),
        (np.zeros((4, 2), dtype=np.int16), 24000, "samples", "1-D"),
        (np.zeros(4, dtype=np.int32), 24000, "samples", "int32"),
        (np.zeros(4, dtype=np.float64), 24000, "samples", "float64"),
        (np.zeros(4, dtype=np.int16), 0, "sample_rate", "positive"),
        (np.zeros(4, dtype=np.int16), 24000.0, "sample_rate", "int"),
        (np.zeros(4, dtype=np.int16), True, "sample_rate", "int"),
    ],
)
def test_audio_rejects_what_it_cannot_hold(samples, rate, field, words) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(of.MediaError, match=words) as info:
        of.Audio(samples, sample_rate=rate)
    assert info.value.field == field
    assert isinstance(info.value, of.InputError)


def test_audio_from_bad_bytes() -> None:
    wav = of.Audio(_tone()).to_wav()
    with pytest.raises(of.MediaError, match=r"truncated|readable") as info:
        of.Audio.from_bytes(wav[: len(wav) - 100])
    assert info.value.field == "audio"
    with pytest.raises(of.MediaError, match="readable PCM WAV"):
        of.Audio.from_bytes(b"not a wav at all")
    with pytest.raises(of.MediaError, match="bytes"):
        of.Audio.from_bytes("a str")  # type: ignore[arg-type]


def test_audio_resample_keeps_dtype_and_length_ratio() -> None:
    clip = of.Audio(_tone(24000), 24000)
    down = clip.resample(16000)
    assert down.sample_rate == 16000 and len(down) == 16000 and down.samples.dtype == np.int16
    assert clip.resample(24000) is clip
    f = of.Audio(np.linspace(-1, 1, 11, dtype=np.float32), 10).resample(20)
    assert f.samples.dtype == np.float32 and len(f) == 22
    assert f.samples[2] == pytest.approx(-0.8)


def _pixels(h: int = 4, w: int = 5) -> np.ndarray:
    return np.arange(h * w * 3, dtype=np.uint8).reshape(h, w, 3)


def test_image_fields_and_png_round_trip() -> None:
    pic = of.Image(_pixels())
    assert (pic.width, pic.height) == (5, 4)
    png = pic.to_png()
    assert png.startswith(b"\x89PNG")
    again = of.Image.from_bytes(png)
    assert again == pic and again.pixels.flags.writeable
    assert of.Image(_pixels()) == pic
    assert of.Image(_pixels(5, 4)) != pic
    assert pic != "image"


def test_image_from_jpeg_and_other_modes() -> None:
    out = io.BytesIO()
    PILImage.new("L", (8, 6), 200).save(out, format="JPEG")
    pic = of.Image.from_bytes(out.getvalue())
    assert (pic.width, pic.height) == (8, 6) and pic.pixels.dtype == np.uint8
    out = io.BytesIO()
    PILImage.new("RGBA", (3, 2), (10, 20, 30, 40)).save(out, format="PNG")
    assert of.Image.from_bytes(out.getvalue()).pixels[0, 0].tolist() == [10, 20, 30]


@pytest.mark.parametrize(
    ("pixels", "words"),
    [
        ("pixels", "numpy array"),
        (np.zeros((4, 4), dtype=np.uint8), "shape"),
        (np.zeros((4, 4, 4), dtype=np.uint8), "shape"),
        (np.zeros((4, 4, 3), dtype=np.float32), "uint8"),
        (np.zeros((0, 4, 3), dtype=np.uint8), "empty"),
    ],
)
def test_image_rejects_what_it_cannot_hold(pixels, words) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(of.MediaError, match=words) as info:
        of.Image(pixels)
    assert info.value.field == "pixels"


def test_image_from_bad_bytes() -> None:
    with pytest.raises(of.MediaError, match="PNG or JPEG") as info:
        of.Image.from_bytes(b"GIF89a not really")
    assert info.value.field == "image"
    out = io.BytesIO()
    PILImage.new("RGB", (3, 2)).save(out, format="BMP")
    with pytest.raises(of.MediaError, match="BMP"):
        of.Image.from_bytes(out.getvalue())
    png = of.Image(_pixels()).to_png()
    with pytest.raises(of.MediaError):
        of.Image.from_bytes(png[:20])


def test_media_pickle_by_content() -> None:
    clip, pic = of.Audio(_tone(), 16000), of.Image(_pixels())
    assert pickle.loads(pickle.dumps(clip)) == clip
    assert pickle.loads(pickle.dumps(pic)) == pic
    err = pickle.loads(pickle.dumps(of.MediaError("bad", field="audio")))
    assert err.field == "audio" and str(err) == "bad"


def test_repr_names_the_shape() -> None:
    assert repr(of.Audio(_tone(), 24000)) == "Audio(2400 int16 samples, 24000 Hz, 0.100 s)"
    assert repr(of.Image(_pixels())) == "Image(5x4 RGB)"


def test_import_omniflow_imports_neither_numpy_nor_pillow() -> None:
    code = (
        "import sys, omniflow as of; of.Audio; print('numpy' in sys.modules, 'PIL' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


def test_a_streamed_wav_is_read_to_its_end() -> None:
    wav = bytearray(of.Audio(_tone()).to_wav())
    for size in (0xFFFFFFFF, 0x7FFFF000, 0):  # what espeak-ng --stdout and ffmpeg write
        wav[40:44] = size.to_bytes(4, "little")
        assert of.Audio.from_bytes(bytes(wav)) == of.Audio(_tone())


def test_downsampling_filters_what_the_new_rate_cannot_hold() -> None:
    t = np.arange(22050) / 22050
    high = of.Audio((np.sin(2 * np.pi * 10000 * t) * 10000).astype(np.int16), 22050)
    low = of.Audio((np.sin(2 * np.pi * 1000 * t) * 10000).astype(np.int16), 22050)
    # 10 kHz is above 16 kHz's Nyquist rate: removed, not folded back to 6 kHz
    assert np.abs(high.resample(16000).samples[100:-100]).max() < 1000
    assert np.abs(low.resample(16000).samples[100:-100]).max() > 9000
