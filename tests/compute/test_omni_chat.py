"""graphs/omni_chat.py end to end: in one process (template, real engine, encoder cache, WAVs)
and behind ``omniflow serve`` with the official ``openai`` client (sampling fields, usage)."""

from __future__ import annotations

import asyncio
import base64
import io
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


def png_url(color: tuple[int, int, int], size: int = 40) -> str:
    """A real PNG (a colour gradient) as a data: URL."""
    from PIL import Image

    img = Image.new("RGB", (size, size))
    img.putdata([(color[0], (color[1] + 5 * x) % 256, (color[2] + 5 * y) % 256)
                 for y in range(size) for x in range(size)])  # fmt: skip
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(text: str, *images: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return {"role": "user", "content": parts}


#: The sampling Placeholders left unset (the role's defaults: greedy, 64 new tokens).
UNSET = dict.fromkeys(("max_tokens", "temperature", "top_p", "seed", "stop"))

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        shutil.which("espeak-ng") is None or shutil.which("soxi") is None,
        reason="needs espeak-ng and sox (apt-get install espeak-ng sox)",
    ),
]


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_two_turns_with_an_image(
    model_dirs: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    executor: str,
) -> None:
    monkeypatch.setenv("OMNIFLOW_ENGINE_EXECUTOR", executor)  # image rows cross in shm
    monkeypatch.setenv("OMNIFLOW_MODEL", str(model_dirs("llama")))
    monkeypatch.setenv("OMNIFLOW_AUDIO_DIR", str(tmp_path))
    monkeypatch.setenv("OMNIFLOW_CACHE", str(tmp_path / "cache"))
    (graph,) = of.load_graphs(GRAPH)
    # a picture of its own per case: the encoder cache lives as long as the loaded module
    color = (200, 30, 60) if executor == "thread" else (30, 60, 200)
    turn1 = [user("Hello, what is in this picture?", png_url(color))]
    vision = graph.roles["vision"]
    calls, hits = vision.calls, vision.cache.stats()["hits"]
    async with of.Runtime(graph) as rt:
        out = await rt.run("omni_chat", {"messages": turn1, **UNSET}, session="s1")
        text = "".join(out["text"])
        (usage,) = out["usage"]
        assert usage["completion_tokens"] == 64 or usage["finish_reason"] == "stop"
        assert usage["cached_tokens"] == 0
        assert out["audio"], "no sentence was spoken"
        for n, clip in enumerate(out["audio"]):
            assert isinstance(clip, of.Audio)
            wav = tmp_path / f"{n}.wav"
            wav.write_bytes(clip.to_wav())
            info = subprocess.run(["soxi", "-D", wav], capture_output=True, text=True, check=True)
            assert float(info.stdout) > 0
        turn2 = [
            *turn1,
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Why?"},
        ]
        out2 = await rt.run("omni_chat", {"messages": turn2, **UNSET}, session="s1")
        # the image was encoded once; its rows and the first turn's pages were reused
        assert vision.calls == calls + 1
        assert vision.cache.stats()["hits"] == hits + 1
        # turn 2 arrives as one segment (cached image + text), so the whole first turn's
        # prefix is matched: the image's 16 rows and the template's tokens
        assert out2["usage"][0]["cached_tokens"] >= 32


def _engine_processes(pid: int) -> list[int]:
    """The engine processes (``executor="process"``) among ``pid``'s children."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"omniflow.compute._procrunner" in cmdline:
                found.append(int(child))
    return found


def _exited(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_served_to_the_openai_client(tmp_path: Path, executor: str) -> None:
    """``omniflow serve graphs/omni_chat.py`` with the tiny model made on first use."""
    audio = tmp_path / "audio"
    env = {"OMNIFLOW_CACHE": str(tmp_path / "cache"), "OMNIFLOW_AUDIO_DIR": str(audio)}
    env |= {"OMNIFLOW_ENGINE_EXECUTOR": executor}
    env_unset = {"OMNIFLOW_MODEL": ""}  # the graph treats an empty value as unset
    with run_server(str(GRAPH), tmp=tmp_path, env={**env, **env_unset}, start_timeout=240) as srv:
        engines = _engine_processes(srv.proc.pid)
        assert len(engines) == (executor == "process")
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
        assert srv.terminate() == 0  # the role's teardown stops the engine: its process too
        assert all(_exited(pid) for pid in engines)


async def test_segments_are_prefilled_while_the_next_image_is_encoded(
    model_dirs: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Segmented emission: the LLM prefills a ready segment (image A, cached by an earlier call)
    before the encoder has finished image B. The encoder of B waits for that prefill, so a
    serial pipeline (the LLM waiting for every segment) deadlocks here instead of passing; the
    events' order is then asserted."""
    monkeypatch.setenv("OMNIFLOW_MODEL", str(model_dirs("llama")))
    monkeypatch.setenv("OMNIFLOW_AUDIO_DIR", str(tmp_path))
    monkeypatch.setenv("OMNIFLOW_CACHE", str(tmp_path / "cache"))
    (graph,) = of.load_graphs(GRAPH)
    a, b = png_url((250, 0, 0)), png_url((0, 0, 250))
    vision, llm = graph.roles["vision"], graph.roles["llm"]
    events: list[str] = []
    async with of.Runtime(graph) as rt:
        await rt.run("omni_chat", {"messages": [user("Only A.", a)], **UNSET, "max_tokens": 1})
        loop = asyncio.get_running_loop()
        prefill_started = asyncio.Event()
        runner = llm.engine._runner
        step = runner.step

        def recording_step(plan: Any) -> Any:
            for seq, n in plan.items:
                first = seq.num_computed == 0
                msg = f"prefill {seq.request_id} from {seq.num_computed} +{n}"
                loop.call_soon_threadsafe(events.append, msg)
                if first:
                    loop.call_soon_threadsafe(prefill_started.set)
            return step(plan)

        runner.step = recording_step
        encode = vision._encode_batch

        async def gated_encode(payloads: list[str]) -> Any:
            assert payloads == [b]  # A comes from the cache
            events.append("encode B start")
            await asyncio.wait_for(prefill_started.wait(), 120)
            rows = await encode(payloads)
            events.append("encode B done")
            return rows

        vision._encode_batch = gated_encode
        msgs = [user("Compare these two pictures.", a, b)]
        out = await rt.run("omni_chat", {"messages": msgs, **UNSET, "max_tokens": 12}, session="p")
        runner.step = step
        vision._encode_batch = encode
        # the whole answer equals one request with every segment given at once
        rows = [vision.cache.get(a), vision.cache.get(b)]
        ids = llm.engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Compare these two pictures."}]
        )
        req = of.GenerateRequest(
            embeds=[*rows, ids], sampling=of.SamplingParams(max_new_tokens=12, temperature=0)
        )
        whole = "".join([o.text async for o in llm.engine.generate(req)])
    prefill = next(i for i, e in enumerate(events) if e.startswith("prefill"))
    assert "encode B start" in events and prefill < events.index("encode B done"), events
    # image A's rows (16) were prefilled before B's rows joined: all but the last held back
    assert events[prefill].endswith("from 0 +15"), events
    assert "".join(out["text"]) == whole
    assert out["usage"][0]["prompt_tokens"] == 32 + len(ids)


async def test_a_batch_of_images_is_encoded_in_one_forward_pass(
    model_dirs: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``vision.embed`` is batched: images of several calls in one batch run one forward pass
    and give each activation the rows it gets alone (an image twice in a batch is encoded once;
    one that is no image fails its own activation); concurrent calls through the graph get
    the rows an unbatched encoder computes."""
    import torch

    monkeypatch.setenv("OMNIFLOW_MODEL", str(model_dirs("llama")))
    monkeypatch.setenv("OMNIFLOW_AUDIO_DIR", str(tmp_path))
    monkeypatch.setenv("OMNIFLOW_CACHE", str(tmp_path / "cache"))
    (graph,) = of.load_graphs(GRAPH)
    vision = graph.roles["vision"]
    urls = [png_url((40 * i, 200 - 30 * i, 90)) for i in range(4)]
    junk = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    async with of.Runtime(graph) as rt:
        alone = [vision._forward([vision._decode(u)])[0] for u in urls]  # one image a pass
        batches, calls = vision.batches, vision.calls
        jobs = [{"index": 0, "payload": u} for u in [urls[0], urls[1], urls[0], junk]]
        out = await vision.embed(jobs)
        assert (vision.batches, vision.calls) == (batches + 1, calls + 3)
        for got, want in zip(out[:3], [alone[0], alone[1], alone[0]], strict=True):
            (rows,) = got["segment"]["parts"]
            assert torch.allclose(rows, want, atol=1e-5)
        assert isinstance(out[3], Exception)
        # through the graph: five concurrent calls, their images no longer cached; the junk
        # one fails alone
        vision.cache.clear()
        runs = [
            rt.run("omni_chat", {"messages": [user("What is it?", u)], **UNSET, "max_tokens": 2})
            for u in [*urls, junk]
        ]
        *outs, bad = await asyncio.gather(*runs, return_exceptions=True)
        assert all(o["usage"][0]["prompt_tokens"] > 16 for o in outs)
        assert isinstance(bad, of.NodeError) and bad.node == "vision.embed", bad
        stats = rt.batch_stats()["vision.embed"]
        assert stats["activations"] == 5 and stats["batches"] == vision.batches - batches - 1
        for u, want in zip(urls, alone, strict=True):
            assert torch.allclose(vision.cache.get(u), want, atol=1e-5)


async def test_an_image_changes_the_answer(
    model_dirs: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OMNIFLOW_MODEL", str(model_dirs("llama")))
    monkeypatch.setenv("OMNIFLOW_AUDIO_DIR", str(tmp_path))
    monkeypatch.setenv("OMNIFLOW_CACHE", str(tmp_path / "cache"))
    (graph,) = of.load_graphs(GRAPH)
    inputs = {**UNSET, "max_tokens": 16, "stop": None}
    answers = {}
    calls = graph.roles["vision"].calls
    async with of.Runtime(graph) as rt:
        for name, msg in {
            "none": user("What do you see?"),
            "red": user("What do you see?", png_url((250, 10, 10))),
            "red again": user("What do you see?", png_url((250, 10, 10))),
            "blue": user("What do you see?", png_url((10, 10, 250))),
        }.items():
            out = await rt.run("omni_chat", {"messages": [msg], **inputs})
            answers[name] = "".join(out["text"])
        with pytest.raises(of.NodeError, match="only data: URLs"):
            await rt.run("omni_chat", {"messages": [user("x", "http://e.x/a.png")], **inputs})
    assert answers["red"] != answers["none"] and answers["blue"] != answers["none"]
    assert answers["red"] == answers["red again"]  # deterministic, and from the cache
    assert answers["red"] != answers["blue"]
    assert graph.roles["vision"].calls == calls + 2
