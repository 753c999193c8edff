"""A chat answer's ``usage`` and ``finish_reason``: the graph's own ``usage`` frame when it emits
one (the last one wins), else the text frames counted as completion tokens.

>>> tally = Usage()
>>> tally.see({"prompt_tokens": 5, "completion_tokens": 2, "finish_reason": "length"})
>>> tally.usage(9), tally.finish_reason()
({'prompt_tokens': 5, 'completion_tokens': 2, 'total_tokens': 7}, 'length')
"""

from __future__ import annotations

from typing import Any

__all__ = ["Usage"]


class Usage:
    """The graph's own ``usage`` frame, if it emits one, in OpenAI's shape."""

    __slots__ = ("reported",)

    def __init__(self) -> None:
        self.reported: dict[str, Any] | None = None

    def see(self, value: Any) -> None:
        if isinstance(value, dict):
            self.reported = value

    def finish_reason(self) -> str:
        reason = (self.reported or {}).get("finish_reason")
        return "length" if reason == "length" else "stop"

    def usage(self, frames: int) -> dict[str, Any]:
        got = self.reported
        if got is None:
            return {"prompt_tokens": 0, "completion_tokens": frames, "total_tokens": frames}
        prompt, completion = _count(got, "prompt_tokens"), _count(got, "completion_tokens")
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if "cached_tokens" in got:
            out["prompt_tokens_details"] = {"cached_tokens": _count(got, "cached_tokens")}
        return out


def _count(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0
