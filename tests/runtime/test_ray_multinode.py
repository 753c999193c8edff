"""of.Ray across nodes: a ``ray.cluster_utils.Cluster`` of two simulated nodes on this
machine, each with its own Ray node id and a custom resource that pins roles to it.

Values between roles on different Ray nodes take the cross-node connector (a ZMQ pull from
the producer), on one node the shm pool; losing an actor fails its calls with the same
NodeError as losing a worker process, and the actor Ray restarts serves the next call.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import pytest

import omniflow as of
from omniflow.cluster._ray import RayReplica
from omniflow.cluster._replica import Lifecycle, ReplicaState

from . import ray_graphs as rg
from .test_placement import eventually

DEPLOY = {
    "mn_src": {"resources": {"node_a": 1}},
    "mn_near": {"resources": {"node_a": 1}},
    "mn_far": {"resources": {"node_b": 1}},
    "mn_hold": {"resources": {"node_b": 1}, "max_restarts": -1},
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Node A (the head, where this driver runs) and node B."""
    ray = pytest.importorskip("ray", reason="of.Ray needs the 'ray' extra")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 8, "resources": {"node_a": 8}, "include_dashboard": False},
    )
    try:
        nodes.add_node(num_cpus=8, resources={"node_b": 8})
        nodes.wait_for_nodes()
        ray.init(address=nodes.address)
        yield ray
    finally:
        ray.shutdown()
        nodes.shutdown()


def placed(rt: of.Runtime) -> dict[str, dict[str, Any]]:
    assert rt.remote is not None
    return {r["role"]: r for r in rt.remote.fleet.launcher.replicas()}


async def test_a_64mb_array_crosses_nodes_bit_exact(cluster: Any) -> None:
    async with of.Runtime(rg.nodes, rg.hold, placement=of.Ray(DEPLOY), validate=True) as rt:
        where = placed(rt)
        assert where["mn_src"]["node"] == where["mn_near"]["node"] != where["mn_far"]["node"]
        assert where["mn_src"]["node"] == cluster.get_runtime_context().get_node_id()
        assert where["mn_far"]["address"].startswith("tcp://")  # not this node's ipc
        out = await rt.run("ray_nodes", {"seed": 7})
        want = rg.digest(rg.blob(7))
        [far_out], [near_out] = out["far_digest"], out["near_digest"]
        assert far_out[:2] == near_out[:2] == (want, 64 * 2**20)
        stats = {
            s["pid"]: s
            for s in (await rt.remote.data_plane_statistics()).values()  # type: ignore[union-attr]
        }
        far, near, src = (stats[where[r]["pid"]] for r in ("mn_far", "mn_near", "mn_src"))
        # Node B pulled the block over ZMQ; node A's consumer mapped it from shared memory.
        assert far["pulls"] == 1 and far["pulled_bytes"] == 64 * 2**20 and far["reads_shm"] == 0
        assert near["reads_shm"] == 1 and near["pulls"] == 0
        assert src["offloaded"] == 1 and src["pulls_served"] == 1
        assert src["pool_live_blocks"] == 0  # released once both consumers finished


def steps(life: Lifecycle) -> list[tuple[str, str, str]]:
    """A replica's story as (state, event, next state) steps."""
    out = []
    for line in life.story():
        m = re.fullmatch(r"(\w+) --(\w+)(?: \(.*\))?--> (\w+)", line)
        assert m is not None, line
        out.append((m[1], m[2], m[3]))
    return out


async def test_losing_an_actor_fails_its_calls_and_the_restarted_one_serves(cluster: Any) -> None:
    async with of.Runtime(rg.nodes, rg.hold, placement=of.Ray(DEPLOY), validate=True) as rt:
        assert rt.remote is not None
        fleet = rt.remote.fleet
        [old] = [r for r in fleet.replicas.values() if r.roles == ["mn_hold"]]
        call = rt.call("ray_hold", {"hold": 3600})
        stream = aiter(call)
        victim = (await anext(stream)).value
        assert victim == placed(rt)["mn_hold"]["pid"] == old.pid
        os.kill(victim, signal.SIGKILL)
        rest = [f async for f in stream]
        assert rest == []
        assert call.status == "error"
        [err] = call.errors
        assert err.node == "mn_hold.hold" and "replica lost" in err.message
        assert "role 'mn_hold'" in err.message

        def back() -> bool:
            return rt.readiness() == [] and placed(rt)["mn_hold"]["pid"] != victim

        await eventually(back, "Ray to restart the actor and the front to reconnect", 45)
        out = await rt.run("ray_hold", {"hold": 0})
        assert out["held"] == [placed(rt)["mn_hold"]["pid"]] != [victim]
        assert rt.wire_stats()["restarts"]["mn_hold"] == 1
        # The replica lifecycle of every launcher (_replica): the lost replica went DEAD and
        # RESTARTING; its slot is served by a new replica (STARTING -> READY) on the same actor,
        # which Ray restarted.
        assert old.life.state is ReplicaState.RESTARTING
        assert steps(old.life) == [
            ("starting", "ready", "ready"),
            ("ready", "lost", "dead"),
            ("dead", "respawn", "restarting"),
        ]
        [new] = [r for r in fleet.replicas.values() if r.roles == ["mn_hold"]]
        assert new.replica_id != old.replica_id and new.slot == old.slot == 0
        assert new.life.state is ReplicaState.READY
        assert steps(new.life) == [("starting", "ready", "ready")]
        assert isinstance(new.process, RayReplica) and isinstance(old.process, RayReplica)
        assert new.process.actor is old.process.actor and new.pid != old.pid
