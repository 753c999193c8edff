"""Stage metrics (``/metrics``, issue 37): per-node queue wait (admitted -> handed out) and per
call and output field time to first frame, in-process and with every role in a worker.

The test holds an ``flock`` that the gated node takes before it yields: a lock the test
controls across processes, so which activations wait, and for how long at least, is known
without trusting any wall-time threshold.
"""

from __future__ import annotations

import asyncio
import fcntl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import omniflow as of
from omniflow.serve._metrics import HttpMetrics, render

ITEMS = 3


def _take_and_let_go(path: str) -> None:
    with open(path, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # waits while the test holds it
        fcntl.flock(f, fcntl.LOCK_UN)


class Gen(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["token", "item"])
    async def gen(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        yield {"token": "t0"}
        for i in range(request["n"]):
            yield {"item": {"lock": request["lock"], "i": i}}
        yield {"token": "t1"}


class Gate(of.Role):
    @of.interface(inputs_or=[["item"]], outputs=["done"], max_concurrency=1)
    async def gate(self, item: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        await asyncio.to_thread(_take_and_let_go, item["lock"])
        yield {"done": item["i"]}


graph = of.Graph(
    "stages", roles={"g": Gen(), "q": Gate()}, inputs=[of.Placeholder("request")],
    outputs=["token", "done"],
)  # fmt: skip


async def _gated_call(rt: of.Runtime, lock: Path) -> tuple[float, float, float, float]:
    """One call whose gate activations wait on the test's lock: returns (begin, held_from,
    held_until, end), all ``time.perf_counter``."""
    m = rt.metrics
    assert m is not None
    gen, gate = m.node("stages", "g.gen"), m.node("stages", "q.gate")
    gens, gates, started = gen.activations, gate.activations, gate.started
    with open(lock, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        begin = time.perf_counter()
        call = asyncio.ensure_future(rt.run("stages", {"request": {"lock": str(lock), "n": ITEMS}}))
        try:
            for _ in range(1200):  # the generator ends, its items are admitted (a hang guard)
                if gen.activations > gens:
                    break
                await asyncio.sleep(0.01)
            held_from = time.perf_counter()
            # max_concurrency=1: one gate activation runs (and waits on the lock), the rest
            # are admitted and not handed out.
            assert gen.activations == gens + 1 and gate.started == started + 1
            assert gate.activations == gates and not call.done()
            held_until = time.perf_counter()
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    out = await call
    end = time.perf_counter()
    assert out == {"token": ["t0", "t1"], "done": list(range(ITEMS))}
    return begin, held_from, held_until, end


@pytest.mark.parametrize("placement", ["inproc", pytest.param("process", marks=pytest.mark.slow)])
async def test_queue_wait_and_first_frame_per_node_and_field(
    placement: str, tmp_path: Path
) -> None:
    lock = tmp_path / "gate.lock"
    lock.write_bytes(b"")
    async with of.Runtime(graph, placement=placement, metrics=True) as rt:
        m = rt.metrics
        assert m is not None
        spans = [await _gated_call(rt, lock) for _ in range(2)]
        text = render(rt, HttpMetrics(), inflight=0, draining=False)
    gen, gate = m.nodes[("stages", "g.gen")], m.nodes[("stages", "q.gate")]
    # Queue wait: one observation per activation handed out, of every node.
    assert (sum(gen.queue_wait.counts), gen.activations) == (2, 2)
    assert (sum(gate.queue_wait.counts), gate.activations) == (2 * ITEMS, 2 * ITEMS)
    # Per call, ITEMS - 1 gate activations were admitted before the lock was held and handed
    # out only after it was let go: each waited longer than the test held it.
    held = sum(until - since for _, since, until, _ in spans)
    assert gate.queue_wait.total >= (ITEMS - 1) * held > 0
    # The generator was handed out as its call started: it waited less than its call took.
    assert gen.queue_wait.total <= sum(end - begin for begin, _, _, end in spans)
    # First frame: one observation per call and output field, labelled (graph, field).
    assert set(m.first_frame) == {("stages", "token"), ("stages", "done")}
    token, done = m.first_frame[("stages", "token")], m.first_frame[("stages", "done")]
    assert sum(token.counts) == sum(done.counts) == 2
    # The first token came before the generator ended; the first "done" after the test let
    # the lock go; neither after its call ended.
    assert token.total < done.total
    assert done.total >= held
    assert done.total <= sum(end - begin for begin, _, _, end in spans)
    assert ("stages", "token") not in m.first_audio  # text is not audio
    for name, labels in (
        ("omniflow_node_queue_wait_seconds_count", 'graph="stages",node="g.gen"'),
        ("omniflow_first_frame_seconds_count", 'field="token",graph="stages"'),
        ("omniflow_first_frame_seconds_count", 'field="done",graph="stages"'),
    ):
        assert f"{name}{{{labels}}} 2.0" in text, name
    gate_count = 'omniflow_node_queue_wait_seconds_count{graph="stages",node="q.gate"}'
    assert f"{gate_count} {2.0 * ITEMS}" in text
