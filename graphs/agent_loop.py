"""An agent loop with tool calls: llm.think <-> calc.run, a cycle bounded by max_iterations.

The "llm" reads an arithmetic prompt such as ``"2 + 3 * 4"`` and, like a tool-using agent,
never computes itself: it asks the calculator tool for one operation at a time, strictly left
to right, and answers once nothing is left. The plan still to execute rides along with each
tool call and comes back with the result (a real agent keeps it in its conversation).

    "2 + 3 * 4"  ->  tool_call {"op": "+", "a": 2, "b": 3, "pending": [["*", 4]]}
                 ->  tool_result {"value": 5, "pending": [["*", 4]]}
                 ->  tool_call {"op": "*", "a": 5, "b": 4, "pending": []}
                 ->  tool_result {"value": 20, "pending": []}
                 ->  answer 20

Every llm.think activation first yields a "step" event (streamed to the caller), then either
a "tool_call" or the "answer": a prompt with k operators makes k tool calls, k + 1 steps and
one answer. Steps read "call 2 + 3", "call 5 * 4", "answer 20". With max_iterations=16 a
prompt may hold up to 15 operators; one more ends the call with a NodeError of llm.think.

    omniflow plan graphs/agent_loop.py
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import omniflow as of

#: The calculator's operations.
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _tokenize(prompt: str) -> tuple[int, list[list[Any]]]:
    """``"2 + 3 * 4"`` -> ``(2, [["+", 3], ["*", 4]])``."""
    words = prompt.split()
    if len(words) % 2 == 0 or any(op not in OPS for op in words[1::2]):
        raise ValueError(f"cannot read {prompt!r}: expected 'n (op n)*' with op in + - *")
    pending = [[op, int(n)] for op, n in zip(words[1::2], words[2::2], strict=True)]
    return int(words[0]), pending


class Llm(of.Role):
    @of.interface(
        inputs_or=[["prompt"], ["tool_result"]],
        outputs=["step", "tool_call", "answer"],
        lb="session",
    )
    async def think(
        self, prompt: str | None = None, tool_result: dict[str, Any] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        if prompt is not None:
            value, pending = _tokenize(prompt)
        else:
            assert tool_result is not None
            value, pending = tool_result["value"], tool_result["pending"]
        if not pending:
            yield {"step": f"answer {value}"}
            yield {"answer": value}
            return
        (op, b), rest = pending[0], pending[1:]
        yield {"step": f"call {value} {op} {b}"}
        yield {"tool_call": {"op": op, "a": value, "b": b, "pending": rest}}


class Calculator(of.Role):
    @of.interface(inputs_or=[["tool_call"]], outputs=["tool_result"])
    async def run(self, tool_call: dict[str, Any]) -> dict[str, Any]:
        value = OPS[tool_call["op"]](tool_call["a"], tool_call["b"])
        return {"tool_result": {"value": value, "pending": tool_call["pending"]}}


graph = of.Graph(
    "agent",
    roles={"llm": Llm(), "calc": Calculator()},
    inputs=[of.Placeholder("prompt")],
    outputs=["answer", "step"],
    max_iterations=16,
)
