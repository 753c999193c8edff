"""Embed the omniflow runtime in your own program: run the Fig. 3 graph in-process.

    python examples/embed_runtime.py

Frames stream as they are produced; the call ends with a status and the errors of its nodes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import omniflow as of

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"


async def main() -> None:
    (graph,) = of.load_graphs(GRAPHS / "fig3.py")
    request = {"parts": [{"text": "a red cat"}, {"image": [1, 2, 3]}]}
    async with of.Runtime(graph) as rt:
        call = rt.call("fig3", {"request": request}, session="demo")
        async for frame in call:
            print(f"{frame.field}[{frame.seq}] from {frame.node}: {frame.value}")
        print("status:", call.status, "errors:", call.errors)
        # The same call, collected: {field: [values]}; raises NodeError if a node failed.
        out = await rt.run("fig3", {"request": request}, session="demo")
        print("pictures:", out["picture"])


if __name__ == "__main__":
    asyncio.run(main())
