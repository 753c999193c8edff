"""A producer process for the data-plane unit tests (test_plane.py).

Kept apart from the test modules so a spawned child imports only this, numpy and omniflow.
The child owns a ``DataPlane``, offloads ``PRODUCED`` under call ``"c1"``, sends the DataRefs
to the parent and then obeys commands on its pipe until ``"close"``.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from omniflow.data._plane import DataPlane


def produced() -> dict[str, Any]:
    """What the child puts in its pool: a strided float64 view and bytes."""
    base = np.arange(40 * 60, dtype=np.float64).reshape(40, 60)
    return {"x": base[::2, ::3], "b": bytes(range(256)) * 64}


def producer(conn: Connection) -> None:
    plane = DataPlane(threshold=1024, capacity=2**20)
    try:
        frame = plane.offload("p.run", "c1", 1, 0, produced(), ["x", "b"])
        conn.send({"x": frame["x"], "b": frame["b"], "stats": plane.statistics()})
        while True:
            cmd, arg = conn.recv()
            if cmd == "poke":  # write into the block behind the reader's back
                ref = frame[arg]
                plane.shm.pool.view(ref.handle)[:8] = b"\xff" * 8
                conn.send(None)
            elif cmd == "release":
                plane.release(frame[arg])
                conn.send(plane.statistics())
            elif cmd == "cleanup":
                conn.send((plane.cleanup(arg), plane.statistics()))
            elif cmd == "close":
                break
    finally:
        plane.close()
        conn.send("closed")
