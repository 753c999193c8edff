"""Session-scoped GlobalParameters, created lazily by their factories (front and workers)."""

from __future__ import annotations

from typing import Any

from omniflow.dsl._graph import GlobalParameters

__all__ = ["SessionParams"]


class SessionParams(dict[str, Any]):
    """A session's GlobalParameters, each created by its factory on first use.

    >>> p = SessionParams({"history": GlobalParameters("history", factory=list)})
    >>> p["history"].append("hi"); p["history"]
    ['hi']
    """

    def __init__(self, factories: dict[str, GlobalParameters]) -> None:
        super().__init__()
        self._factories = factories

    def __missing__(self, name: str) -> Any:
        p = self._factories.get(name)
        if p is None:
            raise KeyError(
                f"no GlobalParameters named {name!r}; declared: {sorted(self._factories)}"
            )
        value = self[name] = p.factory()
        return value
