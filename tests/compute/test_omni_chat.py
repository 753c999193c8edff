"""graphs/omni_chat.py end to end: in one process (template, real engine, encoder cache, WAVs)
and behind ``omniflow serve`` with the official ``openai`` client (sampling fields, usage)."""

from __future__ import annotations

import base64
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

import omniflow as of
from tests.serve.conftest import run_server

GRAPH = Path(__file__).resolve().parents[2] / "graphs" / "omni_chat.py"
#: The sampling Placeholders left unset (the role's defaults: greedy, 64 new tokens).
UNSET = dict.fromkeys(("max_tokens", "temperature", "top_p", "seed", "stop"))

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        shutil.which("espeak-ng") is None or shutil.which("soxi") is None,
        reason="needs espeak-ng and sox (apt-get install espeak-ng sox)",
    ),
]


async def test_two_turns_with_an_image(
    model_dirs: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OMNIFLOW_MODEL", str(model_dirs("llama")))
    monkeypatch.setenv("OMNIFLOW_AUDIO_DIR", str(tmp_path))
    (graph,) = of.load_graphs(GRAPH)
    image = "data:image/png;base64," + base64.b64encode(bytes(range(256)) * 3).decode()
    turn1 = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Hello, what is in this picture?"},
                {"type": "image_url", "image_url": {"url": image}},
            ],
        }
    ]
    async with of.Runtime(graph) as rt:
        out = await rt.run("omni_chat", {"messages": turn1, **UNSET}, session="s1")
        text = "".join(out["text"])
        (usage,) = out["usage"]
        assert usage["completion_tokens"] == 64 or usage["finish_reason"] == "stop"
        assert usage["cached_tokens"] == 0
        assert out["audio"], "no sentence was spoken"
        for wav in out["audio"]:
            info = subprocess.run(["soxi", "-D", wav], capture_output=True, text=True, check=True)
            assert float(info.stdout) > 0
        turn2 = [
            *turn1,
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Why?"},
        ]
        out2 = await rt.run("omni_chat", {"messages": turn2, **UNSET}, session="s1")
        # the image was encoded once; its rows and the first turn's pages were reused
        assert graph.roles["vision"].calls == 1
        assert graph.roles["vision"].cache.stats()["hits"] == 1
        assert out2["usage"][0]["cached_tokens"] >= 32


def _valid_wavs(audio_dir: Path) -> list[Path]:
    wavs = sorted(audio_dir.glob("*.wav"))
    for wav in wavs:
        info = subprocess.run(["soxi", "-D", str(wav)], capture_output=True, text=True, check=True)
        assert float(info.stdout) > 0, wav
    return wavs


@pytest.mark.slow
def test_served_to_the_openai_client(tmp_path: Path) -> None:
    """``omniflow serve graphs/omni_chat.py`` with the tiny model made on first use."""
    audio = tmp_path / "audio"
    env = {"OMNIFLOW_CACHE": str(tmp_path / "cache"), "OMNIFLOW_AUDIO_DIR": str(audio)}
    env_unset = {"OMNIFLOW_MODEL": ""}  # the graph treats an empty value as unset
    with run_server(str(GRAPH), tmp=tmp_path, env={**env, **env_unset}, start_timeout=240) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["omni_chat"]
        turn1: Any = [{"role": "user", "content": "Hello there. Tell me a story!"}]
        # non-streamed, greedy, max_tokens honoured; the session comes from extra_body
        done = client.chat.completions.create(
            model="omni_chat",
            messages=turn1,
            max_tokens=7,
            temperature=0,
            extra_body={"session": "s1"},
        )
        choice, usage = done.choices[0], done.usage
        assert usage is not None and choice.message.content
        assert usage.prompt_tokens > 16  # the chat template was applied around the text
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == 0
        if choice.finish_reason == "length":
            assert usage.completion_tokens == 7
        else:  # the random model said EOS first
            assert choice.finish_reason == "stop" and usage.completion_tokens < 7
        # the same request streamed gives the same text (greedy), usage in a last chunk
        stream = client.chat.completions.create(
            model="omni_chat",
            messages=turn1,
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        deltas, finish, s_usage = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                assert not chunk.choices
                s_usage = chunk.usage
            if chunk.choices:
                deltas.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        assert "".join(deltas) == choice.message.content
        assert finish == choice.finish_reason
        assert s_usage is not None and s_usage.completion_tokens == usage.completion_tokens
        assert s_usage.prompt_tokens == usage.prompt_tokens
        # turn 2 of session s1 (header this time) reuses the first turn's pages
        turn2 = [
            *turn1,
            {"role": "assistant", "content": choice.message.content},
            {"role": "user", "content": "And then?"},
        ]
        again = client.chat.completions.create(
            model="omni_chat",
            messages=turn2,
            max_tokens=4,
            extra_headers={"X-Omniflow-Session": "s1"},
        )
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert again.usage.prompt_tokens > usage.prompt_tokens
        # sampled: the same seed gives the same text; a stop string ends the text before it
        kw: Any = {"model": "omni_chat", "messages": turn1, "temperature": 1.5, "top_p": 0.9}
        a = client.chat.completions.create(**kw, seed=3, max_tokens=12)
        b = client.chat.completions.create(**kw, seed=3, max_tokens=12)
        assert a.choices[0].message.content == b.choices[0].message.content
        text = a.choices[0].message.content or ""
        if len(text) > 4:
            cut = text[3:5]
            c = client.chat.completions.create(**kw, seed=3, max_tokens=12, stop=[cut])
            assert c.choices[0].message.content == text[: text.index(cut)]
            assert c.choices[0].finish_reason == "stop"
        # a bad sampling value is the graph's error, named
        with pytest.raises(openai.InternalServerError, match="top_p"):
            client.chat.completions.create(model="omni_chat", messages=turn1, top_p=0)
        client.close()
    wavs = _valid_wavs(audio)
    assert wavs, "the TTS wrote no WAV"
