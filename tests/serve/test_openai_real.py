"""Issue 35's acceptance on the real graphs: ``omniflow serve graphs/voice_chat.py
graphs/read_aloud.py graphs/omni_chat.py graphs/t2i_unified.py``, driven by the official
``openai`` client. The speech and vision models are the pretrained ones (pocketsphinx,
rapidocr, espeak-ng); the LLM is the tiny random-init one (its words are noise, its plumbing
real). tests/serve/test_openai_media.py tests the same endpoints on small synthetic graphs."""

from __future__ import annotations

import asyncio
import base64
import io
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image as PILImage
from PIL import ImageDraw, ImageFont

import omniflow as of
from tests.roles._sentences import SENTENCES

from ._openai_client import OPENAI_WS_WARNING, STATS, respond, runtime_stats, turn, until, user
from .conftest import ROOT, ServerProc, run_server

pytest.importorskip("pocketsphinx")
pytest.importorskip("rapidocr_onnxruntime")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng"),
    OPENAI_WS_WARNING,
]

GRAPHS = [str(ROOT / "graphs" / g) for g in ("voice_chat.py", "read_aloud.py", "omni_chat.py",
                                             "t2i_unified.py")]  # fmt: skip
WAV = {"voice": "alloy", "format": "wav"}
PCM = {"voice": "alloy", "format": "pcm16"}
GREEDY = {"temperature": 0, "seed": 7}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("real")
    # OMNIFLOW_MODEL empty: the tiny LLM whatever the environment says
    env = {"OMNIFLOW_MODEL": "", "OMNIFLOW_T2I_LLM": "", "OMNIFLOW_T2I_DIT": ""}
    with run_server(*GRAPHS, tmp=tmp, env=env, start_timeout=120) as srv:
        yield srv


@pytest.fixture
def client(server: ServerProc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0) as c:
        yield c


def speech_pcm(text: str) -> bytes:
    """``text`` spoken by espeak-ng, as 16-bit 24 kHz PCM (a realtime turn)."""
    clip = asyncio.run(of.roles.Tts().synthesize(text))
    return clip.resample(24000).pcm16().astype("<i2").tobytes()


def chunk_audio(chunk: Any) -> dict[str, Any] | None:
    if not chunk.choices:
        return None
    delta = chunk.choices[0].delta
    audio = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
    return audio if isinstance(audio, dict) or audio is None else audio.model_dump()


# -- chat with audio --------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["voice_chat", "omni_chat"])
def test_chat_audio_whole_and_streamed(client: openai.OpenAI, model: str, tmp_path: Path) -> None:
    ask = user("tell me a story about a cat")
    r = client.chat.completions.create(
        model=model, messages=ask, modalities=["text", "audio"], audio=WAV, max_tokens=24, **GREEDY
    )
    message = r.choices[0].message
    assert message.content and message.audio is not None
    assert message.audio.transcript == message.content
    path = tmp_path / "answer.wav"
    path.write_bytes(base64.b64decode(message.audio.data))
    soxi = subprocess.run(["soxi", "-D", str(path)], capture_output=True, text=True, check=False)
    assert soxi.returncode == 0, soxi.stderr
    assert float(soxi.stdout) > 0.2
    # pcm16: the whole answer's 24 kHz samples ...
    r = client.chat.completions.create(
        model=model, messages=ask, modalities=["text", "audio"], audio=PCM, max_tokens=24, **GREEDY
    )
    whole = base64.b64decode(r.choices[0].message.audio.data)  # type: ignore[union-attr]
    assert r.choices[0].message.content == message.content
    # ... are the streamed chunks' samples, in order
    stream = client.chat.completions.create(
        model=model, messages=ask, modalities=["text", "audio"], audio=PCM, max_tokens=24,
        stream=True, **GREEDY,
    )  # fmt: skip
    text, pcm, ids = [], [], set()
    for chunk in stream:
        audio = chunk_audio(chunk)
        if audio is not None:
            ids.add(audio["id"])
            pcm.append(base64.b64decode(audio.get("data") or ""))
        elif chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    assert "".join(text) == message.content
    assert len(ids) == 1 and len([p for p in pcm if p]) >= 1
    streamed = np.frombuffer(b"".join(pcm), "<i2")
    assert len(streamed) > 0 and np.array_equal(streamed, np.frombuffer(whole, "<i2"))


async def test_first_audio_leaves_before_the_last_text(inproc: Any) -> None:
    """Sentences are spoken as they come: the first sentence's audio leaves while the answer
    is still being generated. Deterministic: the scripted answer (``_ttfa_graph``) goes on
    only once the real TTS made the first sentence's speech, so were it not streamed the call
    would hang (a hang guard fails it); the first audio chunk precedes the last text chunk."""

    s = await inproc(str(Path(__file__).with_name("_ttfa_graph.py")))
    transport = httpx.ASGITransport(app=s.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
        client = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="-", http_client=http)
        stream = await client.chat.completions.create(
            model="ttfa", messages=user("hello"), modalities=["text", "audio"], audio=PCM,
            stream=True,
        )  # fmt: skip
        kinds = []
        async for chunk in stream:
            if chunk_audio(chunk) is not None:
                kinds.append("audio")
            elif chunk.choices and chunk.choices[0].delta.content:
                kinds.append("text")
    last_text = len(kinds) - 1 - kinds[::-1].index("text")
    assert "audio" in kinds and kinds.index("audio") < last_text, kinds


# -- speech, transcriptions, images -----------------------------------------------------------


def test_speech_then_transcription_recovers_half_the_words(client: openai.OpenAI) -> None:
    hit = total = 0
    for sentence in SENTENCES:
        wav = client.audio.speech.create(model="voice_chat", voice="alloy", input=sentence)
        assert wav.content[:4] == b"RIFF"
        heard = client.audio.transcriptions.create(
            model="voice_chat", file=("turn.wav", wav.content, "audio/wav")
        ).text.split()
        hit += sum(word in heard for word in sentence.split())
        total += len(sentence.split())
    assert hit / total >= 0.5, (hit, total)


def stop_here_url() -> str:
    im = PILImage.new("RGB", (400, 120), "white")
    ImageDraw.Draw(im).text((20, 30), "STOP HERE", fill="black", font=ImageFont.load_default(48))
    out = io.BytesIO()
    im.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_image_url_reaches_the_ocr_role(client: openai.OpenAI) -> None:
    picture = {"type": "image_url", "image_url": {"url": stop_here_url()}}
    ask = user([{"type": "text", "text": "read this"}, picture])
    r = client.chat.completions.create(model="read_aloud", messages=ask)
    text = r.choices[0].message.content or ""
    assert "STOP" in text and "HERE" in text
    assert r.choices[0].message.audio is None
    # with audio: read aloud, and what is said is what was read
    r = client.chat.completions.create(
        model="read_aloud", messages=ask, modalities=["text", "audio"], audio=WAV
    )
    audio = r.choices[0].message.audio
    assert audio is not None and audio.transcript == r.choices[0].message.content
    heard = client.audio.transcriptions.create(
        model="voice_chat", file=("said.wav", base64.b64decode(audio.data), "audio/wav")
    )
    assert "here" in heard.text.split()


def test_images_generate_a_png_of_the_requested_size(client: openai.OpenAI) -> None:
    for size in ("96x64", "auto"):
        r = client.images.generate(
            model="t2i_unified",
            prompt="a red cube",
            response_format="b64_json",
            size=size,
        )
        assert r.data is not None and len(r.data) == 1
        pic = PILImage.open(io.BytesIO(base64.b64decode(r.data[0].b64_json or "")))
        assert pic.format == "PNG"
        if size != "auto":
            assert pic.size == (96, 64)
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model="t2i_unified", prompt="x", size="0x64")
    assert err.value.status_code == 400


# -- bad media --------------------------------------------------------------------------------


def test_bad_media_is_400_naming_the_part(client: openai.OpenAI) -> None:
    wav = client.audio.speech.create(model="voice_chat", voice="alloy", input="hi").content
    truncated = base64.b64encode(wav[:30]).decode()
    not_png = "data:image/png;base64," + base64.b64encode(b"GIF89a, not a PNG").decode()
    cases = [
        ("voice_chat", {"type": "input_audio", "input_audio": {"data": truncated, "format": "wav"}},
         "messages[0].content[0].input_audio.data"),
        ("read_aloud", {"type": "image_url", "image_url": {"url": not_png}},
         "messages[0].content[0].image_url.url"),
        ("read_aloud", {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
         "messages[0].content[0].image_url.url"),
    ]  # fmt: skip
    for model, part, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=user([part]))
        assert err.value.status_code == 400
        body: Any = err.value.body
        assert body["param"] == param, body
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(model="voice_chat", file=("a.wav", wav[:30]))
    assert err.value.status_code == 400 and "file" in str(err.value)


# -- realtime ---------------------------------------------------------------------------------


def test_realtime_voice_turns_reuse_the_cached_prefix(client: openai.OpenAI) -> None:
    with client.realtime.connect(model="voice_chat") as rt:
        assert rt.recv().type == "session.created"
        rt.session.update(
            session={"type": "realtime", "output_modalities": ["audio"], "max_output_tokens": 24}
        )
        assert rt.recv().type == "session.updated"
        usages = []
        for sentence in ("tell me a story about a cat", "how far is the moon from the earth"):
            events = respond(rt, speech_pcm(sentence))
            said = "".join(
                e.delta for e in events if e.type == "response.output_audio_transcript.delta"
            )
            pcm = b"".join(
                base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
            )
            assert said and len(pcm) > 24000  # > 0.5 s of 24 kHz 16-bit audio
            done = events[-1].response
            assert done.status == "completed"
            usages.append(done.usage)
        assert usages[0].input_token_details.cached_tokens == 0
        # the second turn's prompt starts with the first turn's: its pages were matched
        assert usages[1].input_token_details.cached_tokens > 0
        assert usages[1].input_tokens > usages[0].input_tokens


@pytest.mark.parametrize("how", ["cancel", "barge_in"])
def test_realtime_cancel_and_barge_in(client: openai.OpenAI, server: ServerProc, how: str) -> None:
    """Cancelled mid-response (after its first audio, with hundreds of tokens still to
    generate): the server's ``response.done`` says cancelled, and no event of that response
    follows it; the call was cancelled (``rt.stats()`` empty)."""
    with client.realtime.connect(model="voice_chat") as rt:
        assert rt.recv().type == "session.created"
        rt.session.update(
            session={"type": "realtime", "output_modalities": ["audio"], "max_output_tokens": 2000}
        )
        assert rt.recv().type == "session.updated"
        turn(rt, speech_pcm("tell me a story about a cat"))
        rt.response.create()
        running = until(rt, "response.output_audio.delta")[-1].response_id
        if how == "cancel":
            rt.response.cancel()
        else:
            turn(rt, speech_pcm("stop"))
        events = until(rt, "response.done")
        done = events[-1].response
        assert done.id == running and done.status == "cancelled"
        reason = "client_cancelled" if how == "cancel" else "turn_detected"
        assert done.status_details.reason == reason
        # Nothing of the cancelled response follows its response.done (where the server
        # processed the cancel): the next events are the session's own.
        rt.session.update(session={"type": "realtime", "max_output_tokens": 8})
        after = until(rt, "session.updated")
        assert [e.type for e in after if e.type.startswith("response.")] == []
        assert not any(getattr(e, "response_id", None) == running for e in after)
        # the session goes on
        rt.response.create()
        assert until(rt, "response.done")[-1].response.status == "completed"
    assert runtime_stats(server) == dict.fromkeys(STATS, 0.0)
