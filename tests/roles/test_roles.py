"""The pretrained-model roles: espeak-ng -> pocketsphinx, and rapidocr reading Pillow text."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from PIL import Image as PILImage
from PIL import ImageDraw, ImageFont

import omniflow as of

from ._sentences import SENTENCES

pytest.importorskip("pocketsphinx")
pytest.importorskip("rapidocr_onnxruntime")
if shutil.which("espeak-ng") is None:  # pragma: no cover - scripts/test.sh installs it
    pytest.skip("espeak-ng is not installed", allow_module_level=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_tts_then_asr_recovers_at_least_half_the_words() -> None:
    tts, asr = of.roles.Tts(), of.roles.Asr()
    await tts.setup()
    await asr.setup()
    hit = total = 0
    for sentence in SENTENCES:
        clip = await tts.synthesize(sentence)
        assert isinstance(clip, of.Audio) and clip.duration > 0.5
        heard = (await asr.transcribe_audio(clip)).split()
        words = sentence.split()
        hit += sum(w in heard for w in words)
        total += len(words)
    assert hit / total >= 0.5, (hit, total)


async def test_tts_speaks_sentences_as_audio_frames() -> None:
    tts = of.roles.Tts()
    await tts.setup()
    frames = [f async for f in tts.say("Hello there. How are you?", "alloy", None, None)]
    assert len(frames) == 2 and all(isinstance(f["speech"], of.Audio) for f in frames)
    assert frames[0]["speech"].sample_rate == 22050
    assert await tts.speak("hi", None, ["text"]) is None  # no audio asked for
    with pytest.raises(of.InputError, match="unknown voice") as info:
        await tts.synthesize("hi", "no such voice!")
    assert info.value.field == "voice"
    with pytest.raises(of.InputError, match="speed"):
        await tts.synthesize("hi", None, 9.0)


async def test_tts_speaks_past_control_characters() -> None:
    # espeak-ng stops reading at a NUL: the words after it were silently dropped
    tts = of.roles.Tts()
    both = await tts.synthesize("hello there\x00 how are you today")
    first = await tts.synthesize("hello there")
    assert both.duration > first.duration + 0.5


@pytest.mark.slow
async def test_asr_hears_a_clip_again_as_it_did_the_first_time() -> None:
    """pocketsphinx adapts to what it decoded before; a clip sent again (a conversation's
    earlier turn) keeps its first transcript, from the cache, bounded by cache_size."""
    tts, asr = of.roles.Tts(), of.roles.Asr(cache_size=2)
    clips = [await tts.synthesize(s) for s in SENTENCES[:3]]
    first = await asr.transcribe_audio(clips[0])
    asr._decode = None  # type: ignore[assignment,method-assign]  # a hit decodes nothing
    assert await asr.transcribe_audio(clips[0].resample(16000)) == first
    del asr._decode
    for clip in clips[1:]:
        await asr.transcribe_audio(clip)
    assert len(asr._heard) == 2


def test_sentences_cut_a_run_on_sentence() -> None:
    split = of.roles.Sentences(max_chars=20)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    out = [s for w in words for s in split.feed(w + " ")] + split.flush()
    assert " ".join(out) == " ".join(words)
    assert all(len(s) <= 20 for s in out) and len(out) >= 3
    assert of.roles.Sentences(max_chars=8).feed("x" * 20) == ["x" * 8, "x" * 8]
    assert of.roles.Sentences().feed("Short. Still pending") == ["Short."]


async def test_asr_takes_any_rate_and_bad_input_names_the_field() -> None:
    asr = of.roles.Asr()
    await asr.setup()
    tts = of.roles.Tts()
    clip = await tts.synthesize("please open the front door for me")
    at_48k = clip.resample(48000)  # resampled to 16 kHz inside, whatever comes in
    assert {"please", "me"} <= set((await asr.transcribe(at_48k) or {})["text"].split())
    assert await asr.transcribe(None) is None
    with pytest.raises(of.MediaError, match=r"must be an of\.Audio") as info:
        await asr.transcribe_audio(b"RIFF")  # type: ignore[arg-type]
    assert info.value.field == "audio"
    with pytest.raises(of.MediaError, match="language"):
        await asr.transcribe(of.Audio(np.zeros(80, np.int16), 8000), "fr")


def stop_here() -> of.Image:
    im = PILImage.new("RGB", (400, 120), "white")
    ImageDraw.Draw(im).text((20, 30), "STOP HERE", fill="black", font=ImageFont.load_default(48))
    return of.Image(np.asarray(im).copy())


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_ocr_reads_text_rendered_with_pillow() -> None:
    ocr = of.roles.Ocr()
    await ocr.setup()
    text = (await ocr.read(stop_here()) or {})["text"]
    assert "STOP" in text and "HERE" in text
    blank = of.Image(np.full((60, 80, 3), 255, np.uint8))
    assert await ocr.read_image(blank) == ""
    assert await ocr.read(None) is None
