"""Module-level graphs for the placement-parametrized scenario tests (test_placement.py).

With ``placement="process"`` every role runs in a worker process that rebuilds it by importing
this file by path and looking its Graph up by name. So everything here is a module-level
object, this module imports nothing but the standard library and omniflow, and a test observes
a role only through what comes back: frames (values, nodes, seqs), call status and errors,
``rt.stats()``, ``rt.story()``, session GlobalParameters copied into outputs, wall-clock
timestamps (``time.time()`` is comparable across processes of one machine) and marker files
whose paths arrive as inputs.

Rules that keep one Runtime per test possible:
- graph names start with ``sc_`` and are unique; role names are unique across every graph of
  this module (a Runtime must never bind one role name to two instances); ``of.RoleRef`` is
  used only where a role is shared on purpose (``sc_g1`` / ``sc_g2``);
- values that cross nodes or reach the caller are lists, dicts, str, int, float, bool or
  None only: the wire codec turns tuples into lists;
- role state is only ever state the test may see again in the next test of the same process
  (inproc reuses these instances across Runtimes), so it is per-call or returns to its start.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import omniflow as of


def _mark(path: str, text: str) -> None:
    """Append one line to a marker file (a signal that crosses processes)."""
    with Path(path).open("a") as f:
        f.write(text + "\n")


# ---------------------------------------------------------------- Fig. 3, with an observer


class F3Parse(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["text", "image"])
    async def run(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        for part in request.get("parts", []):
            if "text" in part:
                yield {"text": str(part["text"])}
            if "image" in part:
                yield {"image": list(part["image"])}


class F3Embed(of.Role):
    @of.interface(inputs_or=[["text"]], outputs=["text_emb"])
    async def embed(self, text: str) -> dict[str, Any]:
        return {"text_emb": [float(ord(c) % 7) for c in text]}


class F3Vit(of.Role):
    @of.interface(inputs_or=[["image"]], outputs=["vit_feat"])
    async def encode(self, image: list[float]) -> dict[str, Any]:
        return {"vit_feat": [v * 2.0 for v in image]}


class F3Vae(of.Role):
    @of.interface(inputs_or=[["image"]], outputs=["vae_feat"])
    async def encode(self, image: list[float]) -> dict[str, Any]:
        return {"vae_feat": [v + 0.5 for v in image]}

    @of.interface(inputs_or=[["latent"]], outputs=["picture"])
    async def decode(self, latent: list[float]) -> dict[str, Any]:
        return {"picture": [round(v, 3) for v in latent]}


class F3Llm(of.Role):
    """graphs/fig3.py's llm, whose first frame per activation also reports what it was given:
    ``llm_seen = [or_group, sorted kwarg names, their values in that order]``."""

    @of.interface(
        inputs_or=[["text_emb"], ["vit_feat", "vae_feat"]],
        outputs=["token", "llm_seen"],
        lb="session",
    )
    async def generate(
        self,
        text_emb: list[float] | None = None,
        vit_feat: list[float] | None = None,
        vae_feat: list[float] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        given = {
            k: v
            for k, v in (("text_emb", text_emb), ("vit_feat", vit_feat), ("vae_feat", vae_feat))
            if v is not None
        }
        keys = sorted(given)
        seen = [of.context().or_group, keys, [given[k] for k in keys]]
        if text_emb is not None:
            feats, kind = text_emb, "txt"
        else:
            assert vit_feat is not None and vae_feat is not None
            feats = [a + b for a, b in zip(vit_feat, vae_feat, strict=True)]
            kind = "img"
        of.context().params["f3_history"].append(kind)
        for i, v in enumerate(feats):
            frame: dict[str, Any] = {"token": f"{kind}{i}:{v:g}"}
            if i == 0:
                frame["llm_seen"] = seen
            yield frame


class F3Diffusion(of.Role):
    @of.interface(inputs_or=[["token"]], outputs=["latent"], activate_by_count={"token": of.ALL})
    async def generate_image(self, token: list[str]) -> dict[str, Any]:
        return {"latent": [len(t) / 10 for t in token]}


fig3 = of.Graph(
    "sc_fig3",
    roles={
        "f3_parse": F3Parse(),
        "f3_embed": F3Embed(),
        "f3_vit": F3Vit(),
        "f3_vae": F3Vae(),
        "f3_llm": F3Llm(),
        "f3_diffusion": F3Diffusion(),
    },
    inputs=[of.Placeholder("request")],
    outputs=["token", "picture", "llm_seen"],
    params=[of.GlobalParameters("f3_history", factory=list)],
)


# ---------------------------------------------------------------- many calls, jittered diamonds


class MixParse(of.Role):
    def __init__(self) -> None:
        self.rng = random.Random(7)

    @of.interface(inputs_or=[["req"]], outputs=["image"])
    async def run(self, req: list[int]) -> AsyncIterator[dict[str, Any]]:
        for v in req:
            await asyncio.sleep(self.rng.random() / 2000)
            yield {"image": v}


class MixEncA(of.Role):
    def __init__(self) -> None:
        self.rng = random.Random(8)

    @of.interface(inputs_or=[["image"]], outputs=["feat"])
    async def encode(self, image: int) -> dict[str, Any]:
        await asyncio.sleep(self.rng.random() / 1000)
        return {"feat": ["a", image]}


class MixEncB(of.Role):
    def __init__(self) -> None:
        self.rng = random.Random(9)

    @of.interface(inputs_or=[["image"]], outputs=["feat_b"])
    async def encode(self, image: int) -> dict[str, Any]:
        await asyncio.sleep(self.rng.random() / 1000)
        return {"feat_b": ["b", image]}


class MixJoin(of.Role):
    @of.interface(inputs_or=[["feat", "feat_b"]], outputs=["pair"])
    async def join(self, feat: list[Any], feat_b: list[Any]) -> dict[str, Any]:
        return {"pair": [feat, feat_b]}


mix = of.Graph(
    "sc_mix",
    roles={"mix_parse": MixParse(), "mix_a": MixEncA(), "mix_b": MixEncB(), "mix_join": MixJoin()},
    inputs=[of.Placeholder("req")],
    outputs=["pair"],
)


# ---------------------------------------------------------------- ordering

#: Per-token delay (ms) of tok_detok, by token index modulo 6: finishes out of order.
TOKEN_DELAYS_MS = [5, 1, 3, 0, 2, 4]


class TokLlm(of.Role):
    @of.interface(inputs_or=[["prompt"]], outputs=["tok"])
    async def gen(self, prompt: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(prompt):
            yield {"tok": i}


class TokDetok(of.Role):
    """Stateless, and finishes out of order on purpose."""

    @of.interface(inputs_or=[["tok"]], outputs=["text"])
    async def run(self, tok: int) -> dict[str, Any]:
        await asyncio.sleep(TOKEN_DELAYS_MS[tok % len(TOKEN_DELAYS_MS)] / 1000)
        return {"text": f"t{tok}"}


class TokSink(of.Role):
    """A session node: reports the order in which it ran, kept in the session's params."""

    @of.interface(inputs_or=[["text"]], outputs=["echo", "sink_order"], lb="session")
    async def take(self, text: str) -> dict[str, Any]:
        order = of.context().params["tok_order"]
        order.append(int(text[1:]))
        await asyncio.sleep(0)
        return {"echo": text, "sink_order": list(order)}


tok = of.Graph(
    "sc_tok",
    roles={"tok_llm": TokLlm(), "tok_detok": TokDetok(), "tok_sink": TokSink()},
    inputs=[of.Placeholder("prompt")],
    outputs=["text", "echo", "sink_order"],
    params=[of.GlobalParameters("tok_order", factory=list)],
)


class SkipGen(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["x"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            yield {"x": i}


class SkipFilter(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: int) -> dict[str, Any] | None:
        await asyncio.sleep((7 - x % 7) / 2000)
        return None if x % 3 == 0 else {"y": x}


class SkipSess(of.Role):
    @of.interface(inputs_or=[["y"]], outputs=["z", "skip_order"], lb="session")
    async def run(self, y: int) -> dict[str, Any]:
        order = of.context().params["skip_order"]
        order.append(y)
        return {"z": y, "skip_order": list(order)}


skip = of.Graph(
    "sc_skip",
    roles={"skip_gen": SkipGen(), "skip_filter": SkipFilter(), "skip_sess": SkipSess()},
    inputs=[of.Placeholder("n")],
    outputs=["y", "z", "skip_order"],
    params=[of.GlobalParameters("skip_order", factory=list)],
)


# ---------------------------------------------------------------- independence

#: How long sib_slow waits for its gate file before it gives up (s): about hangs, not speed.
GATE_S = 60.0


class SibSrc(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["a", "b"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"a": x, "b": x}


class SibSlow(of.Role):
    """Finishes only once the caller opened the gate (created the file), which the caller does
    after the fast frame arrived: if the fast branch waited for this one, the call would hang."""

    @of.interface(inputs_or=[["a", "gate"]], outputs=["slow"])
    async def run(self, a: int, gate: str) -> dict[str, Any]:
        end = time.monotonic() + GATE_S
        while not os.path.exists(gate) and time.monotonic() < end:
            await asyncio.sleep(0.01)
        return {"slow": [a, os.path.exists(gate)]}


class SibFast(of.Role):
    @of.interface(inputs_or=[["b"]], outputs=["fast1"])
    async def run(self, b: int) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"fast1": b + 1}


class SibFast2(of.Role):
    @of.interface(inputs_or=[["fast1"]], outputs=["fast"])
    async def run(self, fast1: int) -> dict[str, Any]:
        return {"fast": [fast1 + 1]}


sib = of.Graph(
    "sc_sib",
    roles={
        "sib_src": SibSrc(),
        "sib_slow": SibSlow(),
        "sib_fast": SibFast(),
        "sib_fast2": SibFast2(),
    },
    inputs=[of.Placeholder("x"), of.Placeholder("gate")],
    outputs=["slow", "fast"],
)


class SjRouter(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["even", "odd", "raw"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"even" if x % 2 == 0 else "odd": x, "raw": x}


class SjEven(of.Role):
    @of.interface(inputs_or=[["even"]], outputs=["branch"])
    async def run(self, even: int) -> dict[str, Any]:
        await asyncio.sleep(0.001)
        return {"branch": f"even:{even}"}


class SjOdd(of.Role):
    @of.interface(inputs_or=[["odd"]], outputs=["branch"])
    async def run(self, odd: int) -> dict[str, Any]:
        return {"branch": f"odd:{odd}"}


class SjJoin(of.Role):
    @of.interface(inputs_or=[["branch", "raw"]], outputs=["out"])
    async def run(self, branch: str, raw: int) -> dict[str, Any]:
        return {"out": [branch, raw]}


skipjoin = of.Graph(
    "sc_skipjoin",
    roles={"sj_router": SjRouter(), "sj_even": SjEven(), "sj_odd": SjOdd(), "sj_join": SjJoin()},
    inputs=[of.Placeholder("x")],
    outputs=["out"],
)


class DeadSrc(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["a", "b"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"a": x} if x else {"a": x, "b": x}


class DeadJoin(of.Role):
    @of.interface(inputs_or=[["a", "b"]], outputs=["y"])
    async def run(self, a: int, b: int) -> dict[str, Any]:
        return {"y": a + b}


class DeadAfter(of.Role):
    @of.interface(inputs_or=[["y"]], outputs=["z"])
    async def run(self, y: int) -> dict[str, Any]:
        return {"z": y}


dead = of.Graph(
    "sc_dead",
    roles={"dead_src": DeadSrc(), "dead_join": DeadJoin(), "dead_after": DeadAfter()},
    inputs=[of.Placeholder("x")],
    outputs=["z"],
)


# ---------------------------------------------------------------- joins


class BatchGen(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["x"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            yield {"x": i}


class Batch(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["batch"], activate_by_count={"x": 3})
    async def run(self, x: list[int]) -> dict[str, Any]:
        return {"batch": x}


batch = of.Graph(
    "sc_batch",
    roles={"batch_gen": BatchGen(), "batch_b": Batch()},
    inputs=[of.Placeholder("n")],
    outputs=["batch"],
)


class AppaRoot(of.Role):
    @of.interface(inputs_or=[["req"]], outputs=["item"])
    async def run(self, req: list[int]) -> AsyncIterator[dict[str, Any]]:
        for v in req:
            yield {"item": v}


class AppaMulti(of.Role):
    @of.interface(inputs_or=[["item"]], outputs=["piece"])
    async def run(self, item: int) -> AsyncIterator[dict[str, Any]]:
        for k in range(item):
            await asyncio.sleep(random.random() / 3000)
            yield {"piece": item * 10 + k}


class AppaSingle(of.Role):
    @of.interface(inputs_or=[["item"]], outputs=["tag"])
    async def run(self, item: int) -> dict[str, Any]:
        await asyncio.sleep(random.random() / 3000)
        return {"tag": f"#{item}"}


class AppaSink(of.Role):
    @of.interface(inputs_or=[["piece", "tag"]], outputs=["joined"], collect=["piece"], lb="session")
    async def run(self, piece: list[int], tag: str) -> dict[str, Any]:
        return {"joined": [tag, piece]}


appa = of.Graph(
    "sc_appa",
    roles={
        "appa_root": AppaRoot(),
        "appa_multi": AppaMulti(),
        "appa_single": AppaSingle(),
        "appa_sink": AppaSink(),
    },
    inputs=[of.Placeholder("req")],
    outputs=["joined"],
)


class TwA(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["a"])
    async def run(self, x: int) -> AsyncIterator[dict[str, Any]]:
        yield {"a": 1}
        yield {"a": 2}


class TwB(of.Role):
    @of.interface(inputs_or=[["y"]], outputs=["b"])
    async def run(self, y: int) -> dict[str, Any]:
        await asyncio.sleep(0.01)
        return {"b": y}


class TwJoin(of.Role):
    @of.interface(inputs_or=[["a", "b"]], outputs=["out"])
    async def run(self, a: int, b: int) -> dict[str, Any]:
        return {"out": a + b}


twice = of.Graph(
    "sc_twice",
    roles={"tw_a": TwA(), "tw_b": TwB(), "tw_join": TwJoin()},
    inputs=[of.Placeholder("x"), of.Placeholder("y")],
    outputs=["out"],
)


# ---------------------------------------------------------------- loops


class FvPing(of.Role):
    @of.interface(inputs_or=[["start"], ["pong"]], outputs=["ping"])
    async def run(self, start: int | None = None, pong: int | None = None) -> dict[str, Any]:
        return {"ping": (start if start is not None else pong or 0) + 1}


class FvPong(of.Role):
    @of.interface(inputs_or=[["ping"]], outputs=["pong", "seen"])
    async def run(self, ping: int) -> dict[str, Any]:
        return {"pong": ping, "seen": ping}


forever = of.Graph(
    "sc_forever",
    roles={"fv_ping": FvPing(), "fv_pong": FvPong()},
    inputs=[of.Placeholder("start")],
    outputs=["seen"],
    max_iterations=50,
)


class LongGen(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["x"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            yield {"x": i}


class LongInc(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"y": x + 1}


long = of.Graph(
    "sc_long",
    roles={"long_gen": LongGen(), "long_inc": LongInc()},
    inputs=[of.Placeholder("n")],
    outputs=["y"],
    max_iterations=10,
)


# ---------------------------------------------------------------- errors and cancellation


class ErrSrc(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["a", "b"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"a": x, "b": x}


class ErrBad(of.Role):
    @of.interface(inputs_or=[["a"]], outputs=["bad"])
    async def run(self, a: int) -> dict[str, Any]:
        await asyncio.sleep(0)
        raise ValueError(f"cannot handle {a}")


class ErrDep(of.Role):
    @of.interface(inputs_or=[["bad"]], outputs=["dep"])
    async def run(self, bad: int) -> dict[str, Any]:
        return {"dep": bad}


class ErrOk(of.Role):
    @of.interface(inputs_or=[["b"]], outputs=["ok"])
    async def run(self, b: int) -> dict[str, Any]:
        return {"ok": b}


err = of.Graph(
    "sc_err",
    roles={"err_src": ErrSrc(), "err_bad": ErrBad(), "err_dep": ErrDep(), "err_ok": ErrOk()},
    inputs=[of.Placeholder("x")],
    outputs=["dep", "ok"],
)


class InfGen(of.Role):
    """Streams forever; on cancellation writes the exception's name to the marker file."""

    @of.interface(inputs_or=[["marker"]], outputs=["x"])
    async def gen(self, marker: str) -> AsyncIterator[dict[str, Any]]:
        try:
            i = 0
            while True:
                yield {"x": i}
                i += 1
                await asyncio.sleep(0.001)
        except (asyncio.CancelledError, GeneratorExit) as exc:
            _mark(marker, type(exc).__name__)
            raise


inf = of.Graph(
    "sc_inf", roles={"inf_gen": InfGen()}, inputs=[of.Placeholder("marker")], outputs=["x"]
)


class CxSrc(of.Role):
    @of.interface(inputs_or=[["req"]], outputs=["a", "b"])
    async def run(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"a": req, "b": req["x"]}


class CxSlow(of.Role):
    """Sleeps far past any test; on cancellation writes the exception's name to the marker."""

    @of.interface(inputs_or=[["a"]], outputs=["sa"])
    async def run(self, a: dict[str, Any]) -> dict[str, Any]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError as exc:
            _mark(a["marker"], type(exc).__name__)
            raise
        return {"sa": a["x"]}


class CxJoin(of.Role):
    @of.interface(inputs_or=[["sa", "b"]], outputs=["out"])
    async def run(self, sa: int, b: int) -> dict[str, Any]:
        return {"out": sa + b}


cx = of.Graph(
    "sc_cx",
    roles={"cx_src": CxSrc(), "cx_slow": CxSlow(), "cx_join": CxJoin()},
    inputs=[of.Placeholder("req")],
    outputs=["out"],
)


class BadFrames(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: int) -> Any:
        return {"z": x} if x else [x]


bad = of.Graph("sc_bad", roles={"bad_b": BadFrames()}, inputs=[of.Placeholder("x")], outputs=["y"])


# ---------------------------------------------------------------- sessions

#: How long one sess_w activation sleeps (s): long enough that overlap (or its absence)
#: is far above process hop latency.
WORK_S = 0.15


class SessWork(of.Role):
    """Reports ``[job, session history after it, session, start time, end time, met]``.

    A job ``"NAME@DIR"`` meets its peers (the name is ``NAME``): it creates ``DIR/NAME`` when it
    starts, then waits (up to GATE_S) until every peer that ``DIR/meet.json`` lists for it has
    started; ``met`` says whether they all did (None for a plain job). Two jobs that meet
    provably ran at once, however loaded the machine. (In the job, not the environment: Ray
    actors do not inherit the test's environment.)"""

    @of.interface(inputs_or=[["job"]], outputs=["done"])
    async def run(self, job: str) -> dict[str, Any]:
        job, _, meet = job.partition("@")
        ctx = of.context()
        t0 = time.time()
        hist = ctx.params["sess_history"]
        hist.append(job)
        met = None
        if meet:
            (Path(meet) / job).touch()
            peers = json.loads((Path(meet) / "meet.json").read_text()).get(job, [])
            end = time.monotonic() + GATE_S
            while not (met := all((Path(meet) / p).exists() for p in peers)):
                if time.monotonic() > end:
                    break
                await asyncio.sleep(0.01)
        await asyncio.sleep(WORK_S)
        return {"done": [job, list(hist), ctx.session, t0, time.time(), met]}


sess = of.Graph(
    "sc_sess",
    roles={"sess_w": SessWork()},
    inputs=[of.Placeholder("job")],
    outputs=["done"],
    params=[of.GlobalParameters("sess_history", factory=list)],
)


# ---------------------------------------------------------------- concurrency limits


class McGen(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["x"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            yield {"x": i}


class McHeavy(of.Role):
    """Reports how many of its activations ran at once (itself included) when it started."""

    def __init__(self) -> None:
        #: Activations running now (back to 0 after every call).
        self.running = 0

    @of.interface(inputs_or=[["x"]], outputs=["h"], max_concurrency=2)
    async def run(self, x: int) -> dict[str, Any]:
        self.running += 1
        try:
            now = self.running
            await asyncio.sleep(0.02)
        finally:
            self.running -= 1
        return {"h": [x, now]}


class McLight(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["l"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"l": x}


mc = of.Graph(
    "sc_mc",
    roles={"mc_gen": McGen(), "mc_heavy": McHeavy(), "mc_light": McLight()},
    inputs=[of.Placeholder("n")],
    outputs=["h", "l"],
)


# ---------------------------------------------------------------- one role, two graphs


class Shared(of.Role):
    """Hosted by sc_g1 and (through RoleRef) sc_g2.

    Each activation reports ``[2 * x, setups not yet torn down, pid, id(self)]``; teardown
    appends ``teardown <setups still live>`` to the last marker path a call handed it.
    """

    def __init__(self) -> None:
        #: setup() calls not yet matched by a teardown() (1 while serving).
        self.live = 0
        #: Marker file of the last call, for teardown to write to.
        self.marker: str | None = None

    async def setup(self) -> None:
        self.live += 1

    async def teardown(self) -> None:
        self.live -= 1
        marker, self.marker = self.marker, None
        if marker is not None:
            _mark(marker, f"teardown {self.live}")

    @of.interface(inputs_or=[["x", "marker"]], outputs=["y"])
    async def run(self, x: int, marker: str) -> dict[str, Any]:
        self.marker = marker
        return {"y": [x * 2, self.live, os.getpid(), id(self)]}


g1 = of.Graph(
    "sc_g1",
    roles={"shared": Shared()},
    inputs=[of.Placeholder("x"), of.Placeholder("marker")],
    outputs=["y"],
)
g2 = of.Graph(
    "sc_g2",
    roles={"shared": of.RoleRef("shared")},
    inputs=[of.Placeholder("x"), of.Placeholder("marker")],
    outputs=["y"],
)
