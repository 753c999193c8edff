"""Graphs the serve tests call, in-process and through ``omniflow serve`` subprocesses.

Role names are distinct from graphs/chat.py's so that one server serves both files.

* ``echo``: x -> y, one frame.
* ``gated``: yields ``"started"``, waits until the file named by its ``gate`` input exists,
  then yields ``"released"``. Cancelled while waiting, it writes ``<gate>.cancelled``: how a
  test in another process sees that the producer got CancelledError.
* ``values``: streams ``"before"``, a value chosen by ``kind``, then ``"after"`` (or raises
  for ``kind="fail"``).
* ``inspect``: returns the type and a JSON-friendly view of its input (checks input decoding).

With ``$OMNIFLOW_TEST_MARKERS`` set to a directory, the gate role writes ``setup`` and
``teardown`` files there (role setup / teardown ran).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import omniflow as of


def _mark(name: str) -> None:
    where = os.environ.get("OMNIFLOW_TEST_MARKERS")
    if where:
        Path(where, name).write_text(name)


class Echo(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: Any) -> dict[str, Any]:
        return {"y": x}


class Gate(of.Role):
    async def setup(self) -> None:
        _mark("setup")

    async def teardown(self) -> None:
        _mark("teardown")

    @of.interface(inputs_or=[["gate"]], outputs=["step"])
    async def wait(self, gate: str) -> AsyncIterator[dict[str, Any]]:
        yield {"step": "started"}
        try:
            while not os.path.exists(gate):
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            Path(gate + ".cancelled").write_text("cancelled")
            raise
        yield {"step": "released"}


class Values(of.Role):
    @of.interface(inputs_or=[["kind"]], outputs=["value", "never"])
    async def make(self, kind: str) -> AsyncIterator[dict[str, Any]]:
        yield {"value": "before"}
        if kind == "set":
            yield {"value": {1, 2}}
        elif kind == "nan":
            yield {"value": [1.0, float("nan")]}
        elif kind == "bytes":
            yield {"value": b"\x00\xffomni"}
        elif kind == "tensor":
            import numpy as np

            yield {"value": np.arange(6, dtype=np.float32).reshape(2, 3)}
        elif kind == "fail":
            raise RuntimeError("boom on purpose")
        yield {"value": "after"}


class Inspect(of.Role):
    @of.interface(inputs_or=[["data"]], outputs=["report"])
    async def run(self, data: Any) -> dict[str, Any]:
        report: dict[str, Any] = {"type": type(data).__name__}
        if isinstance(data, bytes):
            report["hex"] = data.hex()
        elif hasattr(data, "dtype"):
            report.update(dtype=str(data.dtype), shape=list(data.shape), sum=float(data.sum()))
            report["writable"] = bool(data.flags.writeable)
        return {"report": report}


echo = of.Graph("echo", roles={"echo": Echo()}, inputs=[of.Placeholder("x")], outputs=["y"])
gated = of.Graph("gated", roles={"gate": Gate()}, inputs=[of.Placeholder("gate")], outputs=["step"])
values = of.Graph(
    "values",
    roles={"values": Values()},
    inputs=[of.Placeholder("kind")],
    outputs=["value", "never"],
)
inspect = of.Graph(
    "inspect", roles={"inspect": Inspect()}, inputs=[of.Placeholder("data")], outputs=["report"]
)
