"""Wire ids of forwarded runs and what their messages wait in before their binding.

A forwarded run's wire id is ``"<upstream wire id>.<frame index>.<route index>"`` (the front's
own runs carry its int activation id), so a run's parent, and its whole ancestry, is read off
its id (``parent_of``); ``Waiting`` keeps one call's unbound runs' messages indexed by parent.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Waiting", "parent_of", "wire_id"]


def wire_id(a: int | str, k: int, r: int) -> str:
    """The wire id of the run forwarded for frame ``k`` of activation ``a``, route ``r``."""
    return f"{a}.{k}.{r}"


def parent_of(wid: str) -> int | str:
    """The wire id of the activation whose frame ``wid`` was forwarded for."""
    parent = wid.rsplit(".", 2)[0]
    return int(parent) if parent.isdigit() else parent


class Waiting:
    """The messages of one call's forwarded runs that came before the front bound them.

    ``early`` maps a wire id to its replica and messages, in arrival order; ``kids`` indexes
    them by their parent's wire id, so when an activation ends, the forwarded runs of its
    frames that are still unbound (orphans now: every frame of it was handled) are found at
    once, and with them their own unbound descendants.
    """

    __slots__ = ("early", "kids")

    def __init__(self) -> None:
        self.early: dict[str, tuple[Any, list[Any]]] = {}
        self.kids: dict[int | str, set[str]] = {}

    def __len__(self) -> int:
        return len(self.early)

    def add(self, rep: Any, wid: str, msg: Any) -> None:
        """Keep ``msg`` of unbound run ``wid`` (from ``rep``)."""
        entry = self.early.get(wid)
        if entry is None:
            self.early[wid] = (rep, [msg])
            self.kids.setdefault(parent_of(wid), set()).add(wid)
        else:
            entry[1].append(msg)

    def take(self, wid: str) -> tuple[Any, list[Any]] | None:
        """The replica and messages of ``wid``, now bound (forgotten here); None if none."""
        entry = self.early.pop(wid, None)
        if entry is not None:
            self._unindex(wid)
        return entry

    def orphans_of(self, parent: int | str) -> list[tuple[str, Any, list[Any]]]:
        """Take the unbound runs below ``parent`` (which ended), descendants included."""
        out: list[tuple[str, Any, list[Any]]] = []
        todo = [parent]
        while todo:
            for wid in self.kids.pop(todo.pop(), ()):
                rep, msgs = self.early.pop(wid)
                out.append((wid, rep, msgs))
                todo.append(wid)
        return out

    def drop_replica(self, rep: Any) -> None:
        """Forget what ``rep`` sent (it was lost)."""
        for wid in [w for w, (r, _) in self.early.items() if r is rep]:
            del self.early[wid]
            self._unindex(wid)

    def _unindex(self, wid: str) -> None:
        parent = parent_of(wid)
        siblings = self.kids[parent]  # (every kept run is indexed under its parent)
        siblings.discard(wid)
        if not siblings:
            del self.kids[parent]
