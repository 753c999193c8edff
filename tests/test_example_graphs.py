"""The example graphs compute what their docstrings say, role by role and end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import omniflow as of

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"


def _graph(name: str) -> of.Graph:
    (graph,) = of.load_graphs(GRAPHS / name)
    return graph


async def _frames(agen: Any) -> list[dict[str, Any]]:
    return [frame async for frame in agen]


async def test_t2i_roles_by_hand() -> None:
    roles: dict[str, Any] = _graph("t2i.py").roles
    request = {"prompt": "a red cat", "images": [[1, 2], [0]]}
    frames = await _frames(roles["parse"].run(request))
    assert frames == [{"prompt": "a red cat"}, {"cond_image": [1, 2]}, {"cond_image": [0]}]
    assert await roles["text"].encode("a red cat") == {"text_emb": [1, 3, 3]}
    conds = []
    for frame in frames[1:]:
        vit = await roles["vit"].encode(frame["cond_image"])
        vae = await roles["vae"].encode(frame["cond_image"])
        conds.append((await roles["adapter"].fuse(**vit, **vae))["cond"])
    assert conds == [[4, 7], [1]]
    latent = await roles["diffusion"].denoise(text_emb=[1, 3, 3], cond=conds)
    assert latent == {"latent": [2, 13, 15, 15]}
    assert await roles["vae"].decode(latent["latent"]) == {
        "picture": {"n_cond": 2, "pixels": [130, 150, 150]}
    }
    assert await roles["diffusion"].denoise(text_emb=[1, 3, 3], cond=[]) == {"latent": [0, 1, 3, 3]}


async def test_agent_roles_by_hand() -> None:
    roles: dict[str, Any] = _graph("agent_loop.py").roles
    frames = await _frames(roles["llm"].think(prompt="2 + 3 * 4"))
    call = {"op": "+", "a": 2, "b": 3, "pending": [["*", 4]]}
    assert frames == [{"step": "call 2 + 3"}, {"tool_call": call}]
    result = await roles["calc"].run(call)
    assert result == {"tool_result": {"value": 5, "pending": [["*", 4]]}}
    frames = await _frames(roles["llm"].think(**result))
    assert frames[1] == {"tool_call": {"op": "*", "a": 5, "b": 4, "pending": []}}
    result = await roles["calc"].run(frames[1]["tool_call"])
    assert await _frames(roles["llm"].think(**result)) == [{"step": "answer 20"}, {"answer": 20}]
    with pytest.raises(ValueError, match="cannot read"):
        await _frames(roles["llm"].think(prompt="2 +"))


@pytest.mark.skipif(not hasattr(of, "Runtime"), reason="the runtime layer is not there yet")
async def test_examples_end_to_end() -> None:
    async with of.Runtime(_graph("t2i.py"), _graph("agent_loop.py")) as rt:
        out = await rt.run("t2i", {"request": {"prompt": "a red cat", "images": [[1, 2], [0]]}})
        assert out == {"picture": [{"n_cond": 2, "pixels": [130, 150, 150]}]}
        out = await rt.run("t2i", {"request": {"prompt": "a red cat"}})
        assert out == {"picture": [{"n_cond": 0, "pixels": [10, 30, 30]}]}
        out = await rt.run("agent", {"prompt": "2 + 3 * 4"})
        assert out == {"step": ["call 2 + 3", "call 5 * 4", "answer 20"], "answer": [20]}
        # max_iterations=16: 15 operators make 16 llm.think activations, 16 make one too many.
        out = await rt.run("agent", {"prompt": " + ".join(["1"] * 16)})
        assert out["answer"] == [16]
        with pytest.raises(of.NodeError, match="max_iterations"):
            await rt.run("agent", {"prompt": " + ".join(["1"] * 17)})
