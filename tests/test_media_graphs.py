"""graphs/voice_chat.py and graphs/read_aloud.py: each endpoint's default path, in process,
on the pretrained models (pocketsphinx, rapidocr, espeak-ng) and the tiny random-init LLM."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import omniflow as of

pytest.importorskip("pocketsphinx")
pytest.importorskip("rapidocr_onnxruntime")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng"),
]

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"


async def test_voice_chat_hears_answers_and_speaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNIFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OMNIFLOW_MODEL", raising=False)
    (graph,) = of.load_graphs(GRAPHS / "voice_chat.py")
    unset = {p.name: None for p in graph.inputs}
    clip = await of.roles.Tts().synthesize("tell me a story about a cat")
    turn = [{"role": "user", "content": [{"type": "input_audio", "input_audio": clip}]}]
    async with of.Runtime(graph) as rt:
        # chat with audio: heard, answered (random-init words), each sentence spoken
        out = await rt.run(
            "voice_chat",
            {**unset, "messages": turn, "modalities": ["text", "audio"], "max_tokens": 16},
        )
        assert out["text"] and out["usage"][0]["completion_tokens"] > 0
        assert out["speech"] and all(isinstance(a, of.Audio) for a in out["speech"])
        assert all(a.duration > 0 for a in out["speech"])
        # text only (OpenAI's default modalities): no audio is made
        out = await rt.run("voice_chat", {**unset, "messages": turn, "max_tokens": 4})
        assert out["text"] and "speech" not in out
        # audio/speech: one of.Audio per sentence
        out = await rt.run("voice_chat", {**unset, "input": "Hello there. How are you?"})
        assert list(out) == ["speech"] and len(out["speech"]) == 2
        # audio/transcriptions: the words come back
        out = await rt.run("voice_chat", {**unset, "audio": clip})
        assert {"tell", "me", "story"} <= set(out["text"][0].split())
        assert rt.stats()["active_calls"] == 0


async def test_read_aloud_reads_a_picture_and_speaks_text() -> None:
    from tests.roles.test_roles import stop_here

    (graph,) = of.load_graphs(GRAPHS / "read_aloud.py")
    unset = {p.name: None for p in graph.inputs}
    async with of.Runtime(graph) as rt:
        picture = [{"type": "image_url", "image_url": stop_here()}]
        messages = [{"role": "user", "content": picture}]
        out = await rt.run("read_aloud", {**unset, "messages": messages})
        assert "STOP" in out["text"][0] and "HERE" in out["text"][0]
        assert len(out["speech"]) == 1 and out["speech"][0].duration > 0.5
        heard = await of.roles.Asr().transcribe_audio(out["speech"][0])
        assert "here" in heard.split()  # what was read is what is said
        out = await rt.run("read_aloud", {**unset, "input": "Hi. Bye.", "voice": "echo"})
        assert list(out) == ["speech"] and len(out["speech"]) == 2
