"""Provider liveness as a pool sees it: the providers it shuns and a match's wait budget.

The metadata forgets a provider whose lease ran out (``_meta``), or at once when a pool proves
it gone (``leave``). Between the two, a provider may still be listed although it is dead, or
unreachable from here: a pull that fails or times out proves nothing on its own (a network
blip looks the same). The pool then *shuns* that provider for that chain (``Shunned``): later
matches of the chain skip it at no cost, until the entry is as old as a lease, by when the
metadata has forgotten a dead provider and a live one may be tried again.

A match waits for other nodes out of one ``Budget`` (the pool's ``pull_timeout``): every pull
of the match gets what is left of it, and a pull that times out spends it all, so a match that
meets dead providers pays one timeout at most, however many pages and providers it tries.

>>> now = [0.0]
>>> shunned = Shunned(ttl=30.0, clock=lambda: now[0])
>>> shunned.add("s:chat", "node-a")
>>> shunned.usable("s:chat", {"node-a": "1:0:16", "node-b": "0:3:16"})
{'node-b': '0:3:16'}
>>> now[0] = 30.0
>>> shunned.blocked("s:chat", "node-a")
False
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

__all__ = ["Budget", "Shunned"]

#: Most (chain, provider) entries a pool remembers (the oldest go first).
MAX_SHUNNED = 4096


class Shunned:
    """(chain, provider) pairs a match found vanished, each skipped for ``ttl`` seconds."""

    __slots__ = ("_clock", "_entries", "limit", "ttl")

    def __init__(
        self, ttl: float, *, limit: int = MAX_SHUNNED, clock: Callable[[], float] = time.monotonic
    ) -> None:
        #: Seconds an entry lasts (the providers' lease: a dead one is forgotten by then).
        self.ttl = ttl
        #: Most entries kept.
        self.limit = limit
        self._clock = clock
        #: (chain, provider) -> clock time the entry lapses, oldest first.
        self._entries: OrderedDict[tuple[str, str], float] = OrderedDict()

    def add(self, chain: str, provider: str) -> None:
        entry = (chain, provider)
        self._entries.pop(entry, None)
        self._entries[entry] = self._clock() + self.ttl
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def blocked(self, chain: str, provider: str) -> bool:
        until = self._entries.get((chain, provider))
        if until is None:
            return False
        if until <= self._clock():
            del self._entries[(chain, provider)]
            return False
        return True

    def usable(self, chain: str, providers: Mapping[str, str]) -> dict[str, str]:
        """``providers`` (node -> location) without those shunned for ``chain``."""
        if not self._entries:
            return dict(providers)
        return {n: loc for n, loc in providers.items() if not self.blocked(chain, n)}

    def forget(self, provider: str) -> None:
        """``provider`` answered again (or registered anew): try it everywhere."""
        for entry in [e for e in self._entries if e[1] == provider]:
            del self._entries[entry]

    def __len__(self) -> int:
        return len(self._entries)

    def validate(self) -> None:
        assert len(self._entries) <= self.limit, "more shunned providers than the limit"
        times = list(self._entries.values())
        assert times == sorted(times), "shunned entries out of order"


class Budget:
    """One match's time to wait for other nodes, shared by all of its pulls."""

    __slots__ = ("_clock", "deadline", "spent")

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: Clock time after which the match waits for no other node.
        self.deadline = clock() + seconds
        #: Set when a wait ran out: the match has waited all it may (no clock reading needed).
        self.spent = False

    def left(self) -> float:
        """Seconds a pull may still wait (0.0 once spent)."""
        if self.spent:
            return 0.0
        left = self.deadline - self._clock()
        if left <= 0:
            self.spent = True
            return 0.0
        return left

    def spend(self) -> None:
        """A wait ran to its end: nothing is left for the rest of the match."""
        self.spent = True
