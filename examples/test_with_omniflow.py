"""How to test your own graph with pytest: run it in-process and check what it streams.

    pytest examples/test_with_omniflow.py

``Runtime(validate=True)`` checks the scheduler's invariants after every step, and
``rt.stats()`` must be all zeros once a call has ended: nothing of it stays in memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import omniflow as of

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"


@pytest.mark.parametrize("n_images", [0, 2])
async def test_t2i_draws_one_picture(n_images: int) -> None:
    (graph,) = of.load_graphs(GRAPHS / "t2i.py")
    images = [[1, 2]] * n_images
    async with of.Runtime(graph, validate=True) as rt:
        out = await rt.run("t2i", {"request": {"prompt": "a red cat", "images": images}})
        assert len(out["picture"]) == 1
        assert out["picture"][0]["n_cond"] == n_images
        assert all(v == 0 for v in rt.stats().values())
