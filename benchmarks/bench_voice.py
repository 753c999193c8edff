"""Time to first audio byte and audio real-time factor of ``graphs/voice_chat.py`` over
``WS /v1/realtime``, at 1 and 8 concurrent sessions.

    .venv/bin/python benchmarks/bench_voice.py              # ~1 min on 2 cores
    .venv/bin/python benchmarks/bench_voice.py --sessions 1 --turns 2

A real ``omniflow serve graphs/voice_chat.py`` subprocess on a free port (the tiny random-init
LLM unless ``OMNIFLOW_MODEL`` is set; pocketsphinx hears, espeak-ng speaks). Each session is
one WebSocket (the OpenAI Realtime events, as the ``openai`` client sends them): per turn it
appends a spoken question (espeak-ng, 24 kHz 16-bit PCM), commits it, sends
``response.create`` and reads to ``response.done``. ``--sessions`` sessions run their turns
at once.

* **TTFA**: from sending ``response.create`` to the first ``response.output_audio.delta``
  (the question heard, the LLM's first sentence generated and spoken).
* **RTF**: a response's wall time (``response.create`` to ``response.done``) over the
  seconds of audio it returned; below 1 the server speaks faster than real time.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import re
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import omniflow as of

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = (
    "tell me a story about a cat",
    "what is the weather like today",
    "how far is the moon from the earth",
)
#: 16-bit mono PCM at 24 kHz: bytes per second of audio.
BYTES_PER_SECOND = 2 * 24000


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "omniflow", "serve", str(ROOT / "graphs" / "voice_chat.py"),
           "--port", "0", "--max-connections", "64"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline().decode() if ready else ""
    m = re.search(r"http://(\S+)", line)
    if m is None:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, m.group(1)


async def session(host: str, turns: list[bytes], max_tokens: int) -> list[tuple[float, float]]:
    """(TTFA seconds, RTF) per turn of one realtime session."""
    from websockets.asyncio.client import connect

    out = []
    async with connect(f"ws://{host}/v1/realtime?model=voice_chat", max_size=None) as ws:

        async def until(kind: str) -> dict[str, Any]:
            while True:
                event: dict[str, Any] = json.loads(await ws.recv())
                if event["type"] == "error":
                    raise RuntimeError(event)
                if event["type"] == kind:
                    return event

        await until("session.created")
        update = {"type": "realtime", "output_modalities": ["audio"],
                  "max_output_tokens": max_tokens}  # fmt: skip
        await ws.send(json.dumps({"type": "session.update", "session": update}))
        await until("session.updated")
        for pcm in turns:
            audio = base64.b64encode(pcm).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "response.create"}))
            first, nbytes = None, 0
            while True:
                event = json.loads(await ws.recv())
                kind = event["type"]
                if kind == "response.output_audio.delta":
                    if first is None:
                        first = time.perf_counter() - t0
                    nbytes += len(base64.b64decode(event["delta"]))
                elif kind == "response.done":
                    if event["response"]["status"] != "completed":
                        raise RuntimeError(event["response"])
                    break
                elif kind == "error":
                    raise RuntimeError(event)
            wall = time.perf_counter() - t0
            assert first is not None and nbytes, "a response without audio"
            out.append((first, wall / (nbytes / BYTES_PER_SECOND)))
    return out


async def run(host: str, sessions: int, turns: int, max_tokens: int) -> dict[str, float]:
    speech = [
        (await of.roles.Tts().synthesize(q)).resample(24000).pcm16().astype("<i2").tobytes()
        for q in QUESTIONS
    ]
    plans = [[speech[(s + t) % len(speech)] for t in range(turns)] for s in range(sessions)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(session(host, p, max_tokens) for p in plans))
    wall = time.perf_counter() - t0
    ttfa = sorted(t for r in results for t, _ in r)
    rtf = sorted(x for r in results for _, x in r)
    return {
        "ttfa_p50": statistics.median(ttfa),
        "ttfa_max": ttfa[-1],
        "rtf_p50": statistics.median(rtf),
        "rtf_max": rtf[-1],
        "responses": len(ttfa),
        "wall": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sessions", type=int, action="append", help="default: 1 and 8")
    ap.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    ap.add_argument("--max-tokens", type=int, default=48, help="LLM tokens per answer")
    args = ap.parse_args()
    proc, host = start_server()
    try:
        print(f"# voice_chat over WS /v1/realtime, {platform.python_version()}, "
              f"{os.cpu_count()} cores, {args.turns} turns/session, "
              f"max_output_tokens {args.max_tokens}")  # fmt: skip
        asyncio.run(run(host, 1, 1, args.max_tokens))  # warm-up: models loaded, caches made
        print("| sessions | responses | TTFA p50 (ms) | TTFA max (ms) | RTF p50 | RTF max |")
        print("|---:|---:|---:|---:|---:|---:|")
        for n in args.sessions or [1, 8]:
            r = asyncio.run(run(host, n, args.turns, args.max_tokens))
            print(
                f"| {n} | {r['responses']} | {r['ttfa_p50'] * 1e3:.0f} | "
                f"{r['ttfa_max'] * 1e3:.0f} | {r['rtf_p50']:.3f} | {r['rtf_max']:.3f} |"
            )
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
