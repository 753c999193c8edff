"""TorchEngine against transformers' generate, on one random-init Llama, same process, same threads.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_engine.py            # ~4 min on 2 cores
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_engine.py --quick    # smaller, ~1.5 min
    #   --hidden N --layers N --threads N --rounds N --no-http --http-only (4b alone)
    #   --launches N (4b with fresh server processes N times: the median over launches)
    #   --fake-step MS (4b with a model-less engine: the serving path's own CPU per token)
    #   --base CHECKOUT (4b also serves with the omniflow of another checkout, same rounds)
    #   --executor process (every engine runs its forward pass in a process of its own)

Measures (goals from issue 13):
  1. decode tokens/s of one request, TorchEngine vs transformers generate   (goal >= 1.0x)
  2. aggregate tokens/s, 16 concurrent requests vs one                        (goal >= 4x)
  3. time to first token of turn 2 with a 2,048-token history,
     prefix hit (same session) vs no reuse (a fresh session)                  (goal >= 5x)
  4. the engine as an omniflow role vs calling it directly, 16 concurrent requests streaming
     a frame per token, aggregate tokens/s                                  (goal <= 5% slower)
     a. in-process: rt.call on an of.Runtime in this process vs engine.generate here;
     b. over HTTP: an `omniflow serve benchmarks/engine_role.py` process streaming NDJSON to a
        minimal asyncio HTTP client here, vs a process of its own calling the same engine
        directly and streaming the same bytes to the same client from a bare asyncio HTTP
        server (benchmarks/engine_role.py --direct-http: no runtime, no ASGI, a socket write
        per token): the same work on both sides, so the difference is what omniflow adds.
        For reference, also vs the engine alone in a process that sends no token anywhere
        (--direct): that gap includes the HTTP stream itself. All processes are up for the
        whole measure, one works while the others wait.
Every round runs every contender once, in alternating order (ABBA), so machine load hits them
alike; ratios are the median of the per-round ratios, with their spread (min..max).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import select
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

import omniflow as of
from omniflow.compute._tiny import make_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from engine_role import direct as engine_concurrent
from engine_role import prompts

ROOT = Path(__file__).resolve().parents[1]


def hf_decode(model: Any, ids: list[int], n: int) -> float:
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    dt = time.perf_counter() - t
    assert out.shape[1] == len(ids) + n
    return n / dt


async def engine_decode(engine: of.TorchEngine, ids: list[int], n: int) -> float:
    req = of.GenerateRequest(
        input_ids=ids, sampling=of.SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    )
    t = time.perf_counter()
    count = 0
    async for _ in engine.generate(req):
        count += 1
    dt = time.perf_counter() - t
    assert count == n
    return n / dt


async def role_concurrent(rt: of.Runtime, k: int, n: int, plen: int) -> float:
    async def one(ids: list[int]) -> int:
        return sum([1 async for _ in rt.call("llm", {"ids": ids, "n": n})])

    t = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts(k, plen)))
    dt = time.perf_counter() - t
    assert sum(counts) == k * n, counts
    return sum(counts) / dt


class _Http:
    """A minimal keep-alive HTTP/1.1 client (costs the load generator little)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def stream_tokens(self, ids: list[int], n: int) -> int:
        body = json.dumps({"inputs": {"ids": ids, "n": n}, "stream": True}).encode()
        head = (
            "POST /v1/graphs/llm/call HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        assert raw.split(b" ", 2)[1] == b"200", raw
        tokens, buf = 0, b""
        while True:  # chunked NDJSON: one line per frame, then the done line
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            buf += (await self.reader.readexactly(size + 2))[:-2]
            *lines, buf = buf.split(b"\n")
            tokens += sum(1 for line in lines if line.startswith(b'{"field":"token"'))
            if size == 0:
                return tokens


class HttpContenders:
    """`omniflow serve` with the engine role, the bare HTTP server calling the engine directly,
    and the direct worker (engine alone), all on the same model; with ``base``, also
    `omniflow serve` of the omniflow in that checkout (same role file)."""

    def __init__(
        self, model: Path, threads: int, fake_step: float | None = None, base: Path | None = None
    ) -> None:
        env = {**os.environ, "OMNIFLOW_BENCH_MODEL": str(model)}
        env |= {"OMNIFLOW_BENCH_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        if fake_step is not None:
            env["OMNIFLOW_BENCH_FAKE_STEP"] = str(fake_step)
        role_file = str(Path(__file__).parent / "engine_role.py")
        self.server = subprocess.Popen(
            [sys.executable, "-m", "omniflow", "serve", role_file, "--port", "0"],
            stdout=subprocess.PIPE, cwd=ROOT, env=env,
        )  # fmt: skip
        self.bare = subprocess.Popen(
            [sys.executable, role_file, "--direct-http"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env,
        )  # fmt: skip
        self.worker = subprocess.Popen(
            [sys.executable, role_file, "--direct"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env,
        )  # fmt: skip
        self.base: subprocess.Popen[bytes] | None = None
        if base is not None:
            self.base = subprocess.Popen(
                [sys.executable, "-m", "omniflow", "serve", role_file, "--port", "0"],
                stdout=subprocess.PIPE, cwd=base, env={**env, "PYTHONPATH": str(base)},
            )  # fmt: skip
        self.url = self._line(self.server, r"http://\S+")
        self.bare_url = self._line(self.bare, r"http://\S+")
        self._line(self.worker, r"ready")
        self.base_url = None if self.base is None else self._line(self.base, r"http://\S+")

    @staticmethod
    def _line(proc: subprocess.Popen[bytes], pattern: str) -> str:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline().decode() if ready else ""
        m = re.search(pattern, line)
        if m is None:
            raise SystemExit(f"{proc.args} did not start: {line!r}")
        return m.group(0)

    async def http(self, k: int, n: int, plen: int, url: str | None = None) -> float:
        """``k`` concurrent streamed calls to ``url`` (default: the omniflow server), each on a
        fresh connection (the server closes keep-alive connections idle for 5 s, as long as
        the other contenders' turns)."""
        m = re.match(r"http://([^:/]+):(\d+)", url or self.url)
        assert m is not None
        conns = [_Http(*await asyncio.open_connection(m[1], int(m[2]))) for _ in range(k)]
        try:
            t = time.perf_counter()
            counts = await asyncio.gather(
                *(c.stream_tokens(p, n) for c, p in zip(conns, prompts(k, plen), strict=True))
            )
            dt = time.perf_counter() - t
        finally:
            for c in conns:
                c.writer.close()
        assert sum(counts) == k * n, counts
        return sum(counts) / dt

    async def bare_http(self, k: int, n: int, plen: int) -> float:
        return await self.http(k, n, plen, self.bare_url)

    async def base_http(self, k: int, n: int, plen: int) -> float:
        return await self.http(k, n, plen, self.base_url)

    async def direct(self, k: int, n: int, plen: int) -> float:
        assert self.worker.stdin is not None and self.worker.stdout is not None
        self.worker.stdin.write(f"{k} {n} {plen}\n".encode())
        self.worker.stdin.flush()
        line = await asyncio.get_running_loop().run_in_executor(None, self.worker.stdout.readline)
        return float(line)

    async def close(self) -> None:
        for proc in (self.server, self.bare, self.worker, self.base):
            if proc is None:
                continue
            if proc in (self.bare, self.worker) and proc.stdin is not None:
                proc.stdin.close()
            else:
                proc.terminate()
            proc.wait(30)


async def interleaved(
    rounds: int, *runs: Callable[[], Awaitable[float]]
) -> tuple[list[float], ...]:
    """``rounds`` runs of each, in order then reversed, alternately (ABBA for two: a drift in
    load hits them all alike)."""
    out: tuple[list[float], ...] = tuple([] for _ in runs)
    for r in range(rounds):
        order = range(len(runs)) if r % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            out[i].append(await runs[i]())
    return out


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process and its live descendants (the engine
    process of ``--executor process``) have used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread or child that just exited
            for child in (task / "children").read_text().split():
                own += proc_cpu(int(child))
    return own


def loop_cpu(pid: int) -> float:
    """CPU seconds the process's main thread (its event loop: the runtime and, in the server,
    the HTTP stream) has run so far, to the nanosecond (schedstat, not 10 ms clock ticks).
    Unlike the process total it leaves out torch's threads, whose OpenMP spin-waiting on a
    loaded machine swamps everything else."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


def with_cpu(
    run: Callable[[], Awaitable[float]],
    pid: int,
    tokens: int,
    cpu: list[float],
    loop: list[float] | None = None,
) -> Callable[[], Awaitable[float]]:
    """``run`` that also appends the process's CPU ms per token to ``cpu`` (and its main
    thread's to ``loop``)."""

    async def measured() -> float:
        c0, l0 = proc_cpu(pid), loop_cpu(pid)
        rate = await run()
        cpu.append(1000 * (proc_cpu(pid) - c0) / tokens)
        if loop is not None:
            loop.append(1000 * (loop_cpu(pid) - l0) / tokens)
        return rate

    return measured


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(min(values))}..{fmt.format(max(values))}"


async def ttft(engine: of.TorchEngine, ids: list[int], session: str) -> tuple[float, int]:
    req = of.GenerateRequest(
        input_ids=ids,
        session=session,
        sampling=of.SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True),
    )
    t = time.perf_counter()
    async for out in engine.generate(req):
        return time.perf_counter() - t, out.cached_tokens
    raise AssertionError("no token")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument(
        "--launches",
        type=int,
        default=1,
        help="4b: start the server processes this many times, --rounds each, and report the "
        "median over launches too (a run's processes carry a bias of their own: where the "
        "OS put their threads, their memory; runs of 30 rounds ranged +1..+18%% on one box)",
    )
    ap.add_argument("--http-only", action="store_true", help="measure 4b only")
    ap.add_argument(
        "--executor",
        choices=("thread", "process"),
        default="thread",
        help="where every contender's TorchEngine runs its forward pass (executor=): its own "
        "thread (default) or its own process (the serving loop no longer shares a GIL with it)",
    )
    ap.add_argument(
        "--base",
        type=Path,
        metavar="CHECKOUT",
        help="4b also runs `omniflow serve` of the omniflow in CHECKOUT (e.g. a worktree of "
        "main) in the same rounds: a change to serving compared round by round",
    )
    ap.add_argument(
        "--fake-step",
        type=float,
        metavar="MS",
        help="4b only, with engine_role.StepClock (a token per request every MS ms, no model) "
        "instead of the model: the loop-thread CPU columns are then the serving path's alone",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMNIFLOW_BENCH_EXECUTOR"] = args.executor  # engine_role.py's processes too
    n_decode = 64 if args.quick else 128
    rounds = 4 if args.quick else args.rounds
    k, plen, history = 16, 32, 2048
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = make_tiny_model(
            Path(tmp) / "m", hidden_size=args.hidden, layers=args.layers, heads=8, kv_heads=4
        )
        if args.http_only or args.fake_step is not None:
            fake = None if args.fake_step is None else args.fake_step / 1000
            await measure_launches(
                args.launches, path, args.threads, k, n_decode, plen, rounds, fake, args.base
            )
            return
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(path).eval()
        engine = of.TorchEngine(
            path,
            max_batch=16,
            max_step_tokens=2048 + 64,
            pool_pages=2048,
            executor=args.executor,
        )
        await engine.start()
        prompt = [5 + i % 300 for i in range(32)]
        await engine_decode(engine, prompt, 8)  # warm-up both
        hf_decode(ref, prompt, 8)
        print(
            f"model: llama hidden={args.hidden} layers={args.layers} heads=8/4 float32, "
            f"torch threads={torch.get_num_threads()}, device={engine._runner.model.device}, "
            f"rounds={rounds}, {k} concurrent x {n_decode} new tokens (prompts of {plen})",
            flush=True,
        )

        # 1 and 2: each round runs one request on both engines, then 16 concurrent
        ours, theirs, agg = [], [], []
        for _ in range(rounds):
            ours.append(await engine_decode(engine, prompt, n_decode))
            theirs.append(hf_decode(ref, prompt, n_decode))
            agg.append(await engine_concurrent(engine, k, n_decode, plen))
        one = statistics.median(ours)
        r1 = [a / b for a, b in zip(ours, theirs, strict=True)]
        r2 = [a / b for a, b in zip(agg, ours, strict=True)]
        print(
            f"1. decode, one request, {n_decode} tokens: TorchEngine {one:.0f} tok/s, "
            f"transformers {statistics.median(theirs):.0f} tok/s -> "
            f"{statistics.median(r1):.2f}x [{spread(r1)}] (goal >= 1.0x)"
        )
        print(
            f"2. aggregate, {k} concurrent x {n_decode} tokens: {statistics.median(agg):.0f} "
            f"tok/s vs one request {one:.0f} tok/s -> {statistics.median(r2):.2f}x "
            f"[{spread(r2)}] (goal >= 4x)",
            flush=True,
        )

        # 4a: in process, ABBA
        async with of.Runtime(bench_graph(engine)) as rt:
            await role_concurrent(rt, 2, 4, plen)  # warm-up
            me, toks, c_role, c_dir = os.getpid(), k * n_decode, [], []
            role, dir_ = await interleaved(
                rounds,
                with_cpu(lambda: role_concurrent(rt, k, n_decode, plen), me, toks, c_role),
                with_cpu(lambda: engine_concurrent(engine, k, n_decode, plen), me, toks, c_dir),
            )
        over = [100 * (1 - a / b) for a, b in zip(role, dir_, strict=True)]
        c_over = [100 * (a / b - 1) for a, b in zip(c_role, c_dir, strict=True)]
        print(
            f"4a. as a role, in-process Runtime: {statistics.median(role):.0f} tok/s vs direct "
            f"{statistics.median(dir_):.0f} tok/s -> {statistics.median(over):+.1f}% slower "
            f"[{spread(over, '{:+.1f}')}] (goal <= 5%); CPU per token "
            f"{statistics.median(c_role):.3f} vs {statistics.median(c_dir):.3f} ms -> "
            f"{statistics.median(c_over):+.1f}% [{spread(c_over, '{:+.1f}')}]",
            flush=True,
        )

        # 3: TTFT of turn 2
        hit, miss = [], []
        for r in range(rounds):
            turn1 = [5 + (i * 13 + r) % 300 for i in range(history)]
            first = of.GenerateRequest(
                input_ids=turn1,
                session=f"s{r}",
                sampling=of.SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True),
            )
            reply = [out.token_id async for out in engine.generate(first)]
            turn2 = [*turn1, *reply, *range(40, 56)]
            t_hit, cached = await ttft(engine, turn2, f"s{r}")
            assert cached >= history, cached
            t_miss, cached0 = await ttft(engine, turn2, f"fresh{r}")
            assert cached0 == 0
            hit.append(t_hit)
            miss.append(t_miss)
        h, m = statistics.median(hit), statistics.median(miss)
        r3 = [b / a for a, b in zip(hit, miss, strict=True)]
        print(
            f"3. TTFT of turn 2 ({len(turn2)} tokens, {history}-token history): prefix hit "
            f"{h * 1000:.1f} ms vs no reuse {m * 1000:.1f} ms -> {statistics.median(r3):.1f}x "
            f"[{spread(r3, '{:.1f}')}] (goal >= 5x)",
            flush=True,
        )
        await engine.stop()

        if not args.no_http:
            await measure_launches(
                args.launches, path, args.threads, k, n_decode, plen, rounds, None, args.base
            )
        print(f"load average after: {os.getloadavg()[0]:.1f}")


async def measure_launches(launches: int, *args: Any) -> None:
    """4b ``launches`` times, each with processes of its own (``measure_http``); with more
    than one, the median over launches of each launch's median slowdown against the bare
    server."""
    overs = [await measure_http(*args) for _ in range(launches)]
    if launches > 1:
        each = ", ".join(f"{o:+.1f}" for o in overs)
        print(
            f"4b over {launches} launches: {statistics.median(overs):+.1f}% slower than the bare "
            f"server (median of the launches' medians; launches {each}) (goal <= 5%)",
            flush=True,
        )


async def measure_http(
    path: Path,
    threads: int,
    k: int,
    n_decode: int,
    plen: int,
    rounds: int,
    fake_step: float | None = None,
    base: Path | None = None,
) -> float:
    """4b: over HTTP, three processes of their own (four with ``base``), in alternating
    order. Returns the median per-round slowdown against the bare server (%)."""
    procs = HttpContenders(path, threads, fake_step, base)
    try:
        await procs.http(2, 4, plen)  # warm-up (connections, first compile paths)
        await procs.bare_http(2, 4, plen)
        await procs.direct(2, 4, plen)
        toks = k * n_decode
        names = ("serve", "bare", "alone") + (("base",) if base is not None else ())
        cpu: dict[str, list[float]] = {name: [] for name in names}
        loop: dict[str, list[float]] = {name: [] for name in cpu}
        pids = {"serve": procs.server.pid, "bare": procs.bare.pid, "alone": procs.worker.pid}
        runs = {
            "serve": lambda: procs.http(k, n_decode, plen),
            "bare": lambda: procs.bare_http(k, n_decode, plen),
            "alone": lambda: procs.direct(k, n_decode, plen),
        }
        if procs.base is not None:
            await procs.base_http(2, 4, plen)
            pids["base"] = procs.base.pid
            runs["base"] = lambda: procs.base_http(k, n_decode, plen)
        rates = await interleaved(
            rounds,
            *(with_cpu(runs[c], pids[c], toks, cpu[c], loop[c]) for c in cpu),
        )
    finally:
        await procs.close()
    http, bare, alone = rates[:3]

    def versus(rates: list[float], name: str, what: str, goal: str) -> str:
        over = [100 * (1 - a / b) for a, b in zip(http, rates, strict=True)]
        # (the process total is in clock ticks: a model-less engine may show none)
        c_over = [100 * (a / b - 1) for a, b in zip(cpu["serve"], cpu[name], strict=True) if b]
        c_over = c_over or [float("nan")]
        l_over = [1000 * (a - b) for a, b in zip(loop["serve"], loop[name], strict=True)]
        return (
            f"   vs {what} {statistics.median(rates):.0f} tok/s -> "
            f"{statistics.median(over):+.1f}% slower [{spread(over, '{:+.1f}')}]{goal}; "
            f"process CPU/token {statistics.median(cpu['serve']):.3f} vs "
            f"{statistics.median(cpu[name]):.3f} ms -> {statistics.median(c_over):+.1f}% "
            f"[{spread(c_over, '{:+.1f}')}]; event-loop thread CPU/token "
            f"{1000 * statistics.median(loop['serve']):.1f} vs "
            f"{1000 * statistics.median(loop[name]):.1f} us -> "
            f"{statistics.median(l_over):+.1f} us [{spread(l_over, '{:+.1f}')}]"
        )

    print(
        f"4b. as a role behind omniflow serve (HTTP, NDJSON stream): "
        f"{statistics.median(http):.0f} tok/s\n"
        + versus(bare, "bare", "the engine directly behind a bare HTTP server", " (goal <= 5%)")
        + "\n"
        + versus(alone, "alone", "the engine alone, no HTTP", ""),
        flush=True,
    )
    if base is not None:
        print(versus(rates[3], "base", f"omniflow serve of {base}", ""), flush=True)
    return statistics.median(100 * (1 - a / b) for a, b in zip(http, bare, strict=True))


def bench_graph(engine: of.TorchEngine) -> of.Graph:
    """engine_role.py's graph on this process's engine (no second model load)."""
    from engine_role import Llm

    return of.Graph(
        "llm", roles={"llm": Llm(engine)}, inputs=[of.Placeholder("ids"), of.Placeholder("n")],
        outputs=["token"],
    )  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
