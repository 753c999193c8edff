"""A co-located role whose process dies during its pool's barrier fails ``rt.start()`` with a
``StartError`` naming it and the pool: in processes, in Deploy process groups, and on Ray.

The role dies deterministically (``os._exit`` right after it took its seat, before it
proposed: ``colocate_graphs.CgB``). Nothing here waits on time: the error is asserted by type
and text, and a regression (partners failing only at their first request, or at the start
timeout) shows as a plain ``TimeoutError`` from the fleet or as the test's own timeout.
"""

from __future__ import annotations

from typing import Any

import pytest

import omniflow as of
from omniflow.compute._nodebarrier import PREFIX
from omniflow.compute._shm import SHM_DIR

from . import colocate_graphs as cg

WORDS = "kv_pool_barrier 'cg-kv': role 'cg_b' died during the barrier"


def _barriers() -> set[str]:
    """This module's barrier directories in the node's shared memory."""
    return {str(p.parent) for p in SHM_DIR.glob(PREFIX + "*/cg_a.alive")}


async def _start_fails(placement: Any) -> of.StartError:
    before = _barriers()
    rt = of.Runtime(cg.dies, placement=placement)
    with pytest.raises(of.StartError) as info:
        await rt.start()
    assert rt.state.value == "closed"
    assert _barriers() == before  # the partner left as it stopped: nothing stays in /dev/shm
    return info.value


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["process", "deploy"])
async def test_a_role_dying_in_the_barrier_fails_the_start_naming_it_and_the_pool(
    where: str,
) -> None:
    placement: Any = where
    if where == "deploy":  # two process groups of one deployment slot: one node, two processes
        placement = of.Deploy({"cg_a": {"process": "p1"}, "cg_b": {"process": "p2"}})
    err = await _start_fails(placement)
    assert WORDS in str(err), err
    assert "exited with code 3" in str(err)
    assert err.roles == ["cg_b"]  # the dead role's replica, not its partner's
    assert err.replica is not None and err.replica.startswith(
        "p2-" if where == "deploy" else "cg_b-"
    )


@pytest.mark.timeout(120)
async def test_on_ray_a_colocated_role_dying_in_the_barrier_fails_the_start(
    ray_local: Any,
) -> None:
    """Ray restarts the dead actor; the front does not wait through the restarts to its start
    timeout: the actor's last words name the role and the pool."""
    placement = of.Ray({"cg_a": {}, "cg_b": {"layer": 1, "colocate": "cg_a"}})
    err = await _start_fails(placement)
    assert WORDS in str(err), err
    assert err.roles == ["cg_b"]
