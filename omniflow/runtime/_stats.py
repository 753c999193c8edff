"""What a Runtime tells about itself: its calls, batchers, wire, data plane and readiness.

``RuntimeStatistics`` is a mixin of ``Runtime``, not a part it holds: these are the runtime's
own public methods (``rt.stats()``, ``rt.readiness()``, what ``/metrics`` and ``/readyz``
read), all read-only over its fields; a part would only forward each one.
"""

from __future__ import annotations

from typing import Any

from omniflow.data._plane import STATISTICS_KEYS, DataPlane
from omniflow.data.kv._pool import opened_pool_statistics
from omniflow.runtime._batcher import Batcher
from omniflow.runtime._call import Call
from omniflow.runtime._executor import Remote
from omniflow.runtime._metrics import RuntimeMetrics
from omniflow.transport._auth import WireStats

__all__ = ["RuntimeStatistics"]


class RuntimeStatistics:
    """The statistics methods of ``Runtime`` (the fields below are the runtime's)."""

    _calls: dict[str, Call]
    _batchers: dict[str, Batcher]
    remote: Remote | None
    plane: DataPlane | None
    _pools: dict[str, Any]
    metrics: RuntimeMetrics | None

    def stats(self) -> dict[str, int]:
        """Open buckets, in-flight activations and active calls, over the whole runtime."""
        buckets = inflight = 0
        for call in self._calls.values():
            core = call.core
            if core is not None:
                buckets += len(core.buckets)
                inflight += core.n_acts
        held = 0
        for call in self._calls.values():
            if call.core is not None and call.core.refcounts:
                held += sum(ref.nbytes for ref in call.core.refcounts)
        return {
            "open_buckets": buckets,
            "inflight": inflight,
            "active_calls": len(self._calls),
            "data_plane_bytes": held,
        }

    def calls_in_flight(self) -> dict[str, int]:
        """Calls started or queued and not finished, per graph (graphs with none left out)."""
        out: dict[str, int] = {}
        for call in self._calls.values():
            out[call.graph] = out.get(call.graph, 0) + 1
        return out

    def batch_stats(self) -> dict[str, dict[str, Any]]:
        """Per batched node that runs in this process, its batcher's ``statistics()``:
        ``{"batches", "activations", "mean_size", "full", "removed", "queued", "running",
        "mean_wait_s", "max_wait_s"}``."""
        return {n: b.statistics() for n, b in sorted(self._batchers.items())}

    def replica_batch_stats(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``batch_stats()`` of this process (``"<front>"``) and of each live worker replica
        with batched nodes, as its last heartbeat said, by replica id."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        mine = self.batch_stats()
        if mine:
            out["<front>"] = mine
        if self.remote is not None:
            out.update(self.remote.replica_batch_statistics())
        return out

    def edge_bytes(self) -> dict[tuple[str, str, str, str], int]:
        """Bytes moved between processes per edge (graph, producer, field, consumer) while
        metrics are on, both ways, data-plane payloads included: what the front counted and
        what its workers reported ({}: none; ``cluster._remote_edges``)."""
        if self.remote is None or self.metrics is None:
            return {}
        return self.remote.edge_byte_totals()

    def readiness(self) -> list[str]:
        """Roles that have no live replica right now (sorted); [] when every role can serve.

        In-process roles are always ready; a role placed in workers is missing while every
        replica of it is dead, respawning or leaving (``/readyz`` answers 503 naming them).
        """
        return [] if self.remote is None else self.remote.readiness()

    def wire_stats(self) -> dict[str, Any]:
        """The authenticated wire and worker supervision (all zeros in-process).

        ``accepted`` and ``dropped_<reason>`` count the messages from replicas that this front
        took and refused (reasons: ``bad_mac``, ``replay``, ``malformed``, ``unknown_kind``,
        ``foreign``); ``forged_records`` the registry records ignored for a bad signature;
        ``restarts`` the replicas respawned per role; ``live_replicas`` per role.
        """
        if self.remote is None:
            return {**WireStats().statistics(), "forged_records": 0, "restarts": {},
                    "live_replicas": {}}  # fmt: skip
        return self.remote.wire_statistics()

    async def params_pool_stats(self, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        """Each opened Params Pool's ``stats()`` by pool name, of this process (``"<front>"``)
        and of each live worker replica that has opened one (its ``StatsReply.pools``), by
        replica id: how a co-located node's pools read each other's pages (``shared``,
        ``bytes_moved``, ``l1_segments``, ``foreign_segments``). A replica that does not answer
        within ``timeout`` is left out."""
        out: dict[str, dict[str, Any]] = {}
        mine = opened_pool_statistics(self._pools.values())
        if mine:
            out["<front>"] = mine
        if self.remote is not None:
            for name, body in sorted((await self.remote.worker_statistics(timeout)).items()):
                if body.get("pools"):
                    out[name] = body["pools"]
        return out

    def data_plane_stats(self) -> dict[str, int]:
        """This process's buffer pool (all zeros while no role runs in a worker process)."""
        if self.plane is None:
            return dict.fromkeys(STATISTICS_KEYS, 0)
        return self.plane.statistics()

    async def pool_stats(self) -> dict[str, dict[str, int]]:
        """The data plane of every process: ``{"<front>": ..., replica id: ...}``.

        >>> stats = await rt.pool_stats()                                # doctest: +SKIP
        >>> [s["pool_live_blocks"] for s in stats.values()]              # after every call
        [0, 0, 0]

        Each value is ``DataPlane.statistics()`` (pool gauges and data-plane counters); a
        worker's also carries its ``pid``. A worker's answer reflects every message the front
        sent it before (releases, ends of calls); one that does not answer in 5 s is left out.
        """
        out = {"<front>": self.data_plane_stats()}
        if self.remote is not None:
            out.update(await self.remote.data_plane_statistics())
        return out
