"""A graph for the coalescing tests: ``burst`` yields its frames with no await in between, so
they are all queued for the caller before the HTTP response gets to write any of them.

``plan`` is a list of ``[field, value]``; a value ``"SET"`` becomes a ``set`` (no JSON form),
and a value ``"PAUSE"`` yields no frame but lets the event loop run once (the response's task
and the runtime then interleave with the producer).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import omniflow as of


class Burst(of.Role):
    @of.interface(inputs_or=[["plan"]], outputs=["a", "b"])
    async def emit(self, plan: list[list[Any]]) -> AsyncIterator[dict[str, Any]]:
        for field, value in plan:
            if value == "PAUSE":
                await asyncio.sleep(0)
                continue
            yield {field: {1, 2} if value == "SET" else value}


graph = of.Graph(
    "burst", roles={"burst": Burst()}, inputs=[of.Placeholder("plan")], outputs=["a", "b"]
)
