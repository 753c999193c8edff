"""What a worker tells its front when it does not start.

>>> facts = worker_colocation(["llm"], "deploy:slot0")          # doctest: +SKIP
>>> await setup_role("llm", role.setup, facts)                   # doctest: +SKIP

A worker that raises writes why to the file its front reads (``record_start_error``); one that
dies without a word (killed, ``os._exit``) leaves there what it said last it was doing
(``Colocation.last_words``: a co-located pool's barrier says "role 'dit' died during the
barrier of pool 't2i-kv'" while that role loads its weights), so the front's ``StartError``
names the role and the pool either way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from omniflow.cluster._launch import START_ERROR_ENV
from omniflow.dsl._context import Colocation

__all__ = ["record_start_error", "worker_colocation"]


def _write(path: str, text: str) -> None:
    with contextlib.suppress(OSError), open(path, "w") as f:
        f.write(text)


def record_start_error(exc: BaseException) -> None:
    """Tell the front that spawned this worker why it did not start (it reads the file)."""
    path = os.environ.get(START_ERROR_ENV)
    if path:
        _write(path, str(exc))


def worker_colocation(roles: Iterable[str], key: str) -> Colocation:
    """A worker's co-location facts; what a role leaves as its last words (``last_words``) goes
    to the file its front reads when the process dies before it is ready (a kill, ``os._exit``:
    nothing else could say why)."""
    path = os.environ.get(START_ERROR_ENV)

    def last_words(text: str | None) -> None:
        if path:
            _write(path, text or "")

    return Colocation(frozenset(roles), key, last_words=last_words if path else None)
