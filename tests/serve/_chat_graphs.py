"""A chat graph for the OpenAI validation tests: it takes ``temperature`` and a ``mode``.

``mode`` (not an OpenAI field: clients pass it with ``extra_body``) picks what the node does:

* ``"echo"``: one text frame, ``"<last message> at <temperature>"``.
* ``"refuse"``: raises ``of.InputError`` (field ``mode``) before saying anything: a 400.
* ``"crash"``: raises ``RuntimeError`` before saying anything: a 500.
* ``"late"``: says ``"partial"``, then raises ``of.InputError`` (a stream already under way
  ends with an error event).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import omniflow as of


class Picky(of.Role):
    @of.interface(inputs_or=[["messages", "temperature", "mode"]], outputs=["text"])
    async def answer(
        self, messages: list[dict[str, Any]], temperature: float | None, mode: str
    ) -> AsyncIterator[dict[str, Any]]:
        if mode == "refuse":
            raise of.InputError("mode 'refuse' refuses every request; use 'echo'", field="mode")
        if mode == "crash":
            raise RuntimeError("picky crashed on purpose")
        if mode == "late":
            yield {"text": "partial"}
            raise of.InputError("refused after speaking", field="mode")
        yield {"text": f"{messages[-1]['content']} at {temperature}"}


picky = of.Graph(
    "picky",
    roles={"picky": Picky()},
    inputs=[of.Placeholder(n) for n in ("messages", "temperature", "mode")],
    outputs=["text"],
)
