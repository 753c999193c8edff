"""The fast path's pure machine (docs/fast-path.md): ``FastPathCore.handle(event) ->
instructions`` for every decision the front takes about runs workers forwarded to each other;
the router and fleet only carry its instructions out."""

from omniflow.cluster.fastpath._core import FastPathCore
from omniflow.cluster.fastpath._events import LEGAL, RunState

__all__ = ["LEGAL", "FastPathCore", "RunState"]
