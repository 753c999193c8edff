"""Module-level graphs for the bucket-semantics regressions of issues 10 and 18, run in every
placement by test_placement.py (same rules as scenario_graphs.py: module-level objects, graph
names start with ``sm_``, role names unique across graphs, values are plain JSON-like data,
no state a later test could see).

Each graph is also checked against the sequential reference evaluator (reference.py) by
tests/runtime/test_regressions.py, through ``behave`` functions that mirror the methods.
"""

from __future__ import annotations

import asyncio
from typing import Any

import omniflow as of

# ---------------------------------------------------------------- issue 10, defect 1
#
# <input> -x-> a.run -y-> s.run (collect y) -s-> j.run [y, s], and a.run -y-> j.run directly:
# j.run's bucket is rooted at a.run; s.run's frame must keep a.run's entry to meet y there.


class D1A(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: Any) -> Any:
        await asyncio.sleep(0)
        return {"y": f"y{x}"}


class D1S(of.Role):
    @of.interface(inputs_or=[["y"]], outputs=["s"], collect=["y"])
    async def run(self, y: list[Any]) -> Any:
        return {"s": y}


class D1SAll(of.Role):
    @of.interface(inputs_or=[["y"]], outputs=["s"], activate_by_count={"y": of.ALL})
    async def run(self, y: list[Any]) -> Any:
        return {"s": y}


class D1J(of.Role):
    @of.interface(inputs_or=[["y", "s"]], outputs=["out"])
    async def run(self, y: Any, s: Any) -> Any:
        return {"out": [y, s]}


d1_collect = of.Graph(
    "sm_d1_collect",
    roles={"d1a": D1A(), "d1s": D1S(), "d1j": D1J()},
    inputs=[of.Placeholder("x")],
    outputs=["out"],
)


class D1A2(D1A):
    pass


class D1J2(D1J):
    pass


d1_all = of.Graph(
    "sm_d1_all",
    roles={"d1a2": D1A2(), "d1s2": D1SAll(), "d1j2": D1J2()},
    inputs=[of.Placeholder("x")],
    outputs=["out"],
)

# A collect of a field produced by both a.run and s.run fires once, with both frames.


class D1Sz(of.Role):
    @of.interface(inputs_or=[["y"]], outputs=["z"], collect=["y"])
    async def run(self, y: list[Any]) -> Any:
        return {"z": f"s{len(y)}"}


class D1Az(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y", "z"])
    async def run(self, x: Any) -> Any:
        await asyncio.sleep(0)
        return {"y": "y", "z": "a"}


class D1Cz(of.Role):
    @of.interface(inputs_or=[["z"]], outputs=["out"], collect=["z"])
    async def run(self, z: list[Any]) -> Any:
        return {"out": sorted(z)}


d1_two_producers = of.Graph(
    "sm_d1_two",
    roles={"d1az": D1Az(), "d1sz": D1Sz(), "d1cz": D1Cz()},
    inputs=[of.Placeholder("x")],
    outputs=["out"],
)


# ---------------------------------------------------------------- issue 18
#
# m.run fires twice: group 1 at once with c, group 0 once the d stream ended; j.run collects
# both e frames (or joins them with ALL). ``x`` says how often m.run sends ``back``.


class I18A(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["a", "b"])
    async def run(self, x: Any) -> Any:
        return {"a": "a", "b": x}


class I18Loop(of.Role):
    @of.interface(inputs_or=[["b"], ["back"]], outputs=["c", "d"])
    async def run(self, **kw: Any) -> Any:
        n = kw["b"] if "b" in kw else kw["back"]
        return {"c": n, "d": n}


class I18M(of.Role):
    @of.interface(inputs_or=[["d"], ["c"]], outputs=["e", "back"], collect=["d"])
    async def run(self, **kw: Any) -> Any:
        await asyncio.sleep(0)  # any await in group 1 is enough
        g = of.context().or_group
        if g == 1 and kw["c"] > 0:
            return {"e": f"e1.{kw['c']}", "back": kw["c"] - 1}
        if g == 1:
            return {"e": "e1"}
        return {"e": "e0" if len(kw["d"]) == 1 else f"e0x{len(kw['d'])}"}


class I18J(of.Role):
    @of.interface(inputs_or=[["a", "e"]], outputs=["out"], collect=["e"])
    async def run(self, a: Any, e: list[Any]) -> Any:
        return {"out": sorted(e)}


class I18JAll(of.Role):
    @of.interface(inputs_or=[["a", "e"]], outputs=["out"], activate_by_count={"e": of.ALL})
    async def run(self, a: Any, e: list[Any]) -> Any:
        return {"out": sorted(e)}


i18 = of.Graph(
    "sm_i18",
    roles={"i18a": I18A(), "i18l": I18Loop(), "i18m": I18M(), "i18j": I18J()},
    inputs=[of.Placeholder("x")],
    outputs=["out"],
)


class I18A2(I18A):
    pass


class I18Loop2(I18Loop):
    pass


class I18M2(I18M):
    pass


i18_all = of.Graph(
    "sm_i18_all",
    roles={"i18a2": I18A2(), "i18l2": I18Loop2(), "i18m2": I18M2(), "i18j2": I18JAll()},
    inputs=[of.Placeholder("x")],
    outputs=["out"],
)


# Two loops deep: an outer loop around the issue-18 loop, the collects nested inside.


class N2Outer(of.Role):
    @of.interface(inputs_or=[["x"], ["again"]], outputs=["a", "b"])
    async def run(self, **kw: Any) -> Any:
        n = kw["x"] if "x" in kw else kw["again"]
        return {"a": n, "b": n}


class N2Loop(I18Loop):
    pass


class N2M(I18M):
    pass


class N2J(of.Role):
    @of.interface(inputs_or=[["a", "e"]], outputs=["out", "again"], collect=["e"])
    async def run(self, a: Any, e: list[Any]) -> Any:
        if a > 0:
            return {"out": sorted(e), "again": a - 1}
        return {"out": sorted(e)}


nested = of.Graph(
    "sm_nested",
    roles={"n2o": N2Outer(), "n2l": N2Loop(), "n2m": N2M(), "n2j": N2J()},
    inputs=[of.Placeholder("x")],
    outputs=["out"],
)


# ---------------------------------------------------------------- issue 10, defect 3
#
# A collect whose stream is re-entered by a loop after its bucket fired: the error says so
# (it used to advise declaring the collect it already had); same for an ALL join.


class D3Src(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["seed"])
    async def run(self, x: Any) -> Any:
        return {"seed": x}


class D3Gen(of.Role):
    @of.interface(inputs_or=[["seed"], ["again"]], outputs=["y"])
    async def run(self, **kw: Any) -> Any:
        yield {"y": 1}
        yield {"y": 2}


class D3Col(of.Role):
    @of.interface(inputs_or=[["y"]], outputs=["out", "again"], collect=["y"])
    async def run(self, y: list[Any]) -> Any:
        return {"out": y, "again": 1}


class D3All(of.Role):
    @of.interface(inputs_or=[["y"]], outputs=["out", "again"], activate_by_count={"y": of.ALL})
    async def run(self, y: list[Any]) -> Any:
        return {"out": y, "again": 1}


d3_collect = of.Graph(
    "sm_d3_collect",
    roles={"d3src": D3Src(), "d3gen": D3Gen(), "d3col": D3Col()},
    inputs=[of.Placeholder("x")],
    outputs=["out"],
)


class D3Src2(D3Src):
    pass


class D3Gen2(D3Gen):
    pass


d3_all = of.Graph(
    "sm_d3_all",
    roles={"d3src2": D3Src2(), "d3gen2": D3Gen2(), "d3all": D3All()},
    inputs=[of.Placeholder("x")],
    outputs=["out"],
)


# ---------------------------------------------------------------- AND rule, optional, latch
#
# c.run [p, q]: q has two producers that may both send nothing. ``x`` picks what happens:
# 1: nobody sends q (DEAD, warning); 2: a.run sends q.


class AndA(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["p", "q"])
    async def run(self, x: int) -> Any:
        await asyncio.sleep(0)
        return {"p": "p", "q": "qa"} if x == 2 else {"p": "p"}


class AndB(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["q"])
    async def run(self, x: int) -> Any:
        return None


class AndC(of.Role):
    @of.interface(inputs_or=[["p", "q"]], outputs=["out"])
    async def run(self, p: Any, q: Any) -> Any:
        return {"out": [p, q]}


class AndCOpt(of.Role):
    @of.interface(inputs_or=[["p", "q"]], outputs=["out"], optional=["q"])
    async def run(self, p: Any, q: Any) -> Any:
        return {"out": [p, q]}


class AndA2(AndA):
    pass


class AndB2(AndB):
    pass


and_rule = of.Graph(
    "sm_and",
    roles={"anda": AndA(), "andb": AndB(), "andc": AndC()},
    inputs=[of.Placeholder("x")],
    outputs=["out"],
)
and_optional = of.Graph(
    "sm_and_optional",
    roles={"anda2": AndA2(), "andb2": AndB2(), "andc2": AndCOpt()},
    inputs=[of.Placeholder("x")],
    outputs=["out"],
)


# Latch: a token stream turned into audio in one voice. The voice comes from a node that
# answers after the first tokens (activations wait for it), or never ("mute": every token's
# activation is DEAD and reported).


class LtLlm(of.Role):
    @of.interface(inputs_or=[["prompt"]], outputs=["token"])
    async def gen(self, prompt: str) -> Any:
        for t in prompt.split():
            yield {"token": t}


class LtVoice(of.Role):
    @of.interface(inputs_or=[["prompt"]], outputs=["voice"])
    async def pick(self, prompt: str) -> Any:
        for _ in range(5):
            await asyncio.sleep(0)
        return None if prompt.startswith("mute") else {"voice": "alto"}


class LtTts(of.Role):
    @of.interface(inputs_or=[["token", "voice"]], outputs=["audio"], latch=("voice",))
    async def speak(self, token: str, voice: str) -> Any:
        return {"audio": f"{token}/{voice}"}


latch = of.Graph(
    "sm_latch",
    roles={"ltllm": LtLlm(), "ltvoice": LtVoice(), "lttts": LtTts()},
    inputs=[of.Placeholder("prompt")],
    outputs=["audio"],
)


# ---------------------------------------------------------------- session order across groups
#
# Each frame carries both fields of a session node's two OR groups (b first in the dict): the
# two activations of one SeqId index run in declaration order, group 0 (a) first.


class SoGen(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["a", "b"])
    async def run(self, x: int) -> Any:
        for i in range(x):
            yield {"b": f"b{i}", "a": f"a{i}"}


class SoSession(of.Role):
    @of.interface(inputs_or=[["a"], ["b"]], outputs=["o"], lb="session")
    async def run(self, **kw: Any) -> Any:
        await asyncio.sleep(0)
        return {"o": next(iter(kw.values()))}


session_order = of.Graph(
    "sm_session_order",
    roles={"sogen": SoGen(), "sosession": SoSession()},
    inputs=[of.Placeholder("x")],
    outputs=["o"],
)
