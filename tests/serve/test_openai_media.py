"""The media endpoints of docs/contract.md §9 on a real ``omniflow serve``, with the official
``openai`` client: chat audio out (stream and not) and media parts in, speech, transcriptions,
images, realtime (a turn, cancel, barge-in), and the WebSocket's protections."""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import websockets.sync.client as ws_client
from PIL import Image as PILImage

import omniflow as of
from omniflow.serve._pcm import resample

from ._media_graphs import RATE, word_audio
from ._openai_client import OPENAI_WS_WARNING, STATS, respond, runtime_stats, turn, until, user
from .conftest import ServerProc, run_server

MEDIA = str(Path(__file__).with_name("_media_graphs.py"))
AUDIO_WAV = {"voice": "alloy", "format": "wav"}
AUDIO_PCM = {"voice": "alloy", "format": "pcm16"}
TEXT = "the quick brown fox"
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("media")
    with run_server(MEDIA, "--max-body-mb", "1", "--api-key", KEY, tmp=tmp) as srv:
        yield srv


@pytest.fixture
def client(server: ServerProc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def _wav(data: bytes) -> tuple[int, np.ndarray]:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        return w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")


def _expected(text: str, rate: int) -> np.ndarray:
    return np.concatenate([word_audio(w, rate).samples for w in text.split()])


# -- chat -------------------------------------------------------------------------------------


def test_models_list_endpoints(client: openai.OpenAI) -> None:
    got = {m.id: m.model_extra["endpoints"] for m in client.models.list()}  # type: ignore[index]
    assert got == {
        "talker": ["chat.completions", "realtime"],
        "talker16": ["chat.completions", "realtime"],
        "speaker": ["audio.speech"],
        "asr": ["audio.transcriptions"],
        "painter": ["images.generations"],
    }


def test_chat_audio_wav(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="talker", messages=user(TEXT), modalities=["text", "audio"], audio=AUDIO_WAV
    )
    msg = r.choices[0].message
    assert msg.content == TEXT
    assert msg.audio is not None and msg.audio.transcript == TEXT
    rate, samples = _wav(base64.b64decode(msg.audio.data))
    assert rate == RATE and len(samples) / rate > 0
    assert np.array_equal(samples, _expected(TEXT, RATE))
    assert msg.audio.expires_at > r.created


def test_chat_without_audio_modality_sends_none(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="talker", messages=user(TEXT))
    assert r.choices[0].message.content == TEXT and r.choices[0].message.audio is None


@pytest.mark.parametrize("model", ["talker", "talker16"])
def test_chat_audio_stream_equals_whole(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(
        model=model, messages=user(TEXT), modalities=["text", "audio"], audio=AUDIO_PCM
    )
    assert whole.choices[0].message.audio is not None
    want = np.frombuffer(base64.b64decode(whole.choices[0].message.audio.data), "<i2")
    order, pcm, transcripts = [], [], []
    expiry = None
    stream = client.chat.completions.create(
        model=model,
        messages=user(TEXT),
        modalities=["text", "audio"],
        audio=AUDIO_PCM,
        stream=True,
    )
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            order.append("text")
        if delta.audio is not None and delta.audio.data is not None:
            order.append("audio")
            pcm.append(base64.b64decode(delta.audio.data))
            transcripts.append(delta.audio.transcript)
        elif delta.audio is not None:
            expiry = delta.audio.expires_at  # the last audio update
    assert order == ["text", "audio"] * 4  # in production order
    assert expiry is not None and expiry > 0
    assert "".join(transcripts) == TEXT
    got = np.frombuffer(b"".join(pcm), "<i2")
    assert np.array_equal(got, want)  # streamed pcm16 == the non-streamed audio
    rate = 16000 if model == "talker16" else RATE
    assert np.array_equal(got, resample(_expected(TEXT, rate), rate, 24000))


def test_chat_audio_format_unsupported(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="talker",
            messages=user(TEXT),
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "mp3"},
        )
    body: Any = err.value.body
    assert body["param"] == "audio.format" and "'wav'" in body["message"]
    assert "'pcm16'" in body["message"]


def _png(w: int, h: int) -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", (w, h), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


def test_chat_media_parts_reach_the_graph(client: openai.OpenAI) -> None:
    clip = of.Audio(np.zeros(1600, np.int16), sample_rate=16000)
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                            + base64.b64encode(_png(8, 6)).decode()}},
        {"type": "input_audio",
         "input_audio": {"data": base64.b64encode(clip.to_wav()).decode(), "format": "wav"}},
    ]  # fmt: skip
    r = client.chat.completions.create(model="talker", messages=user(content))
    assert r.choices[0].message.content == "look saw 8x6 heard 1600 samples at 16000 Hz"


@pytest.mark.parametrize(
    ("part", "param"),
    [
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            "messages[0].content[1].image_url.url",
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGEgcG5n"}},
            "messages[0].content[1].image_url.url",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}},
            "messages[0].content[1].input_audio.data",
        ),
        (  # a truncated WAV: its header promises more samples than it holds
            {"type": "input_audio", "input_audio": {"format": "wav", "data": base64.b64encode(
                of.Audio(np.zeros(800, np.int16), 16000).to_wav()[:-100]).decode()}},
            "messages[0].content[1].input_audio.data",
        ),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_bad_media_is_400_naming_the_part(
    client: openai.OpenAI, part: dict[str, Any], param: str, stream: bool
) -> None:
    content = [{"type": "text", "text": "x"}, part]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="talker", messages=user(content), stream=stream)
    body: Any = err.value.body
    assert body["param"] == param, body


# -- speech, transcriptions, images -----------------------------------------------------------


def test_speech_wav_streamed(client: openai.OpenAI, server: ServerProc) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="speaker", voice="alloy", input=TEXT
    ) as r:
        assert r.headers["content-type"] == "audio/wav"
        chunks = list(r.iter_bytes())
        data = b"".join(chunks)
    assert data[:4] == b"RIFF" and data[36:40] == b"data"
    samples = np.frombuffer(data[44:], "<i2")
    assert np.array_equal(samples, _expected(TEXT, 22050))
    # The streamed WAV transcribes as it is (sizes of a stream of unknown length).
    t = client.audio.transcriptions.create(model="asr", file=("s.wav", data, "audio/wav"))
    assert t.text.startswith(f"{len(samples)} samples at 22050 Hz")


def test_speech_pcm_and_float_samples(client: openai.OpenAI) -> None:
    r = client.audio.speech.with_raw_response.create(
        model="speaker", voice="float", input="hi there", response_format="pcm"
    )
    assert r.headers["x-sample-rate"] == "22050"
    got = np.frombuffer(r.content, "<i2")
    want = np.concatenate([word_audio(w, 22050, "float32").pcm16() for w in ("hi", "there")])
    assert np.array_equal(got, want)


def test_speech_sse(client: openai.OpenAI, server: ServerProc) -> None:
    body = {"model": "speaker", "input": TEXT, "response_format": "pcm", "stream_format": "sse"}
    r = httpx.post(server.url + "/v1/audio/speech", json=body, headers={"x-api-key": KEY})
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 4 + ["speech.audio.done"]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert np.array_equal(np.frombuffer(pcm, "<i2"), _expected(TEXT, 22050))


def test_speech_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.speech.create(model="speaker", voice="a", input="x", response_format="mp3")
    assert (err.value.body or {})["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.speech.create(model="speaker", voice="a", input="refuse")
    assert (err.value.body or {})["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="talker", voice="a", input="x")


@pytest.mark.parametrize(
    ("model", "status", "code"),
    [(None, 400, "missing_required_parameter"), ("", 400, "missing_required_parameter"),
     (3, 400, "missing_required_parameter"), ("nope", 404, "model_not_found")],
)  # fmt: skip
def test_speech_transcriptions_and_images_name_a_missing_or_unknown_model_alike(
    server: ServerProc, model: Any, status: int, code: str
) -> None:
    wav = of.Audio(np.zeros(320, np.int16), sample_rate=16000).to_wav()
    given = {} if model is None else {"model": model}
    answers = [
        httpx.post(server.url + path, json={**given, **body}, headers={"x-api-key": KEY})
        for path, body in (
            ("/v1/audio/speech", {"input": "x"}),
            ("/v1/images/generations", {"prompt": "x"}),
        )
    ]
    if not isinstance(model, int):  # (a form field is text)
        answers.append(
            httpx.post(
                server.url + "/v1/audio/transcriptions",
                data=given,
                files={"file": ("a.wav", wav, "audio/wav")},
                headers={"x-api-key": KEY},
            )
        )
    for r in answers:
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("model", code), error


def test_transcriptions_multipart(client: openai.OpenAI) -> None:
    wav = of.Audio(np.zeros(3200, np.int16), sample_rate=16000).to_wav()
    t = client.audio.transcriptions.create(
        model="asr", file=("a.wav", wav, "audio/wav"), language="en", prompt="hint"
    )
    assert t.text == "3200 samples at 16000 Hz, en, hint"
    plain = client.audio.transcriptions.create(
        model="asr", file=("a.wav", wav, "audio/wav"), response_format="text"
    )
    assert plain == "3200 samples at 16000 Hz, None, None"
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(model="asr", file=("a.wav", b"RIFFjunk", "audio/wav"))
    assert (err.value.body or {})["param"] == "file"  # type: ignore[index]


def test_images_b64_png(client: openai.OpenAI) -> None:
    r = client.images.generate(model="painter", prompt="a square", size="64x32", n=2)
    assert r.data is not None and len(r.data) == 2
    for d in r.data:
        assert d.b64_json is not None
        pic = PILImage.open(io.BytesIO(base64.b64decode(d.b64_json)))
        assert pic.format == "PNG" and pic.size == (64, 32)
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model="painter", prompt="x", response_format="url")
    assert (err.value.body or {})["param"] == "response_format"  # type: ignore[index]


# -- realtime ---------------------------------------------------------------------------------


def _pcm(n: int) -> bytes:
    return (np.sin(np.arange(n) / 5) * 900).astype("<i2").tobytes()


@OPENAI_WS_WARNING
def test_realtime_turn(client: openai.OpenAI, server: ServerProc) -> None:
    with client.realtime.connect(model="talker") as rt:
        assert rt.recv().type == "session.created"
        rt.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
        assert rt.recv().type == "session.updated"
        events = respond(rt, _pcm(4800))
        said = "".join(e.delta for e in events if e.type.endswith("transcript.delta"))
        assert said == "heard 4800 samples at 24000 Hz"
        pcm = b"".join(
            base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
        )
        assert np.array_equal(np.frombuffer(pcm, "<i2"), _expected(said, RATE))
        assert events[-1].response.status == "completed"
        # A second turn sees the conversation so far (its last user message is the new one).
        rt.conversation.item.create(
            item={"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": "again"}]}
        )  # fmt: skip
        rt.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        rt.response.create()
        events = until(rt, "response.done")
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
            "again"
        )
        assert not any(e.type == "response.output_audio.delta" for e in events)


@OPENAI_WS_WARNING
@pytest.mark.parametrize("how", ["cancel", "barge_in"])
def test_realtime_cancel_and_barge_in(client: openai.OpenAI, server: ServerProc, how: str) -> None:
    with client.realtime.connect(model="talker") as rt:
        assert rt.recv().type == "session.created"
        rt.conversation.item.create(
            item={"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": "forever"}]}
        )  # fmt: skip
        rt.response.create()
        deltas = 0
        while deltas < 3:
            deltas += rt.recv().type == "response.output_audio.delta"
        if how == "cancel":
            rt.response.cancel()
        else:
            turn(rt, _pcm(2400))
        done = until(rt, "response.done")[-1]
        assert done.response.status == "cancelled"
        reason = "client_cancelled" if how == "cancel" else "turn_detected"
        assert done.response.status_details.reason == reason
        # Nothing of the cancelled response follows its response.done.
        rt.session.update(session={"type": "realtime", "instructions": "be brief"})
        after = until(rt, "session.updated")
        assert [e.type for e in after if e.type.startswith("response.")] == []
        # The session goes on: a new response runs (the conversation holds the user's turn).
        rt.conversation.item.create(
            item={"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": "ok"}]}
        )  # fmt: skip
        rt.response.create()
        last = until(rt, "response.done")[-1]
        assert last.response.status == "completed"
    # The cancelled call was cancelled, not left running: the server's rt.stats() is empty.
    assert runtime_stats(server, KEY) == dict.fromkeys(STATS, 0.0)


def test_realtime_needs_the_api_key(server: ServerProc) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/realtime?model=talker"
    with pytest.raises(Exception) as err:
        ws_client.connect(url)
    assert "401" in str(err.value)
    with pytest.raises(Exception) as err:  # a foreign page's Origin, even with the key
        ws_client.connect(url, origin="http://evil.example", additional_headers={"x-api-key": KEY})  # type: ignore[arg-type]
    assert "403" in str(err.value)
    with pytest.raises(Exception) as err:
        ws_client.connect(url.replace("talker", "speaker"), additional_headers={"x-api-key": KEY})
    assert "404" in str(err.value)


def test_realtime_oversize_message_closes_only_that_connection(server: ServerProc) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/realtime?model=talker"
    headers = {"x-api-key": KEY}
    with ws_client.connect(url, additional_headers=headers) as other:
        assert json.loads(other.recv(timeout=10))["type"] == "session.created"
        with ws_client.connect(url, additional_headers=headers, max_size=None) as big:
            assert json.loads(big.recv(timeout=10))["type"] == "session.created"
            event = {"type": "input_audio_buffer.append", "audio": "A" * (2 * 2**20)}
            big.send(json.dumps(event))
            with pytest.raises(websockets_closed()) as closed:
                big.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        # The other session still works.
        other.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "hi"}],
                    },
                }
            )
        )
        other.send(json.dumps({"type": "response.create"}))
        kinds = []
        while not kinds or kinds[-1] != "response.done":
            kinds.append(json.loads(other.recv(timeout=10))["type"])
        assert "response.output_audio.delta" in kinds


def websockets_closed() -> type[Exception]:
    from websockets.exceptions import ConnectionClosed

    return ConnectionClosed
