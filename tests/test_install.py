"""``pip install 'omniflow[compute]'`` runs every example graph's default path.

A subprocess in which only the distributions that extra installs can be imported (worked out from
the installed packages' metadata: omniflow's requirements with ``[compute]``, and theirs, down to
the leaves) runs each graph in ``graphs/`` as its docstring says, with no environment variable
set: ``omni_chat`` makes its tiny Llama and vision encoder, ``t2i_unified`` its LLM and DiT.
Everything else the dev venv holds (transformers, pytest, pocketsphinx, ...) fails to import
there, as it would in a fresh ``[compute]`` venv (README, "Install").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

#: Not a dependency but a measuring tool: its .pth starts it in every process under coverage.
TOOLS = {"coverage"}

BLOCKER = """\
import importlib.abc
import sys

BLOCKED = frozenset({blocked!r})


class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {{name!r}} (omniflow[compute] does not install it)", name=name
            )
        return None


sys.meta_path.insert(0, _NotInstalled())
"""

SCRIPT = """\
import asyncio, base64, io, json, sys
import omniflow as of
from PIL import Image

def png_url():
    img = Image.new("RGB", (40, 40))
    img.putdata([(200, (5 * x) % 256, (5 * y) % 256) for y in range(40) for x in range(40)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

def user(text, *images):
    parts = [{"type": "text", "text": text}]
    return {"role": "user", "content": parts + [
        {"type": "image_url", "image_url": {"url": u}} for u in images]}

SAMPLING = {"max_tokens": 8, "temperature": None, "top_p": None, "seed": None, "stop": None}
TURN1 = [user("Hello, what is in this picture?", png_url())]
CASES = {
    "chat.py": [{"messages": [{"role": "user", "content": "hi there"}]}],
    "fig3.py": [{"request": {"parts": [{"text": "a cat"}, {"image": [1, 2]}]}}],
    "agent_loop.py": [{"prompt": "2 + 3 * 4"}],
    "t2i.py": [{"request": {"prompt": "a red cat", "images": [[1, 2], [0]]}}],
    "t2i_unified.py": [{"prompt": "a cat on a mat", "size": "40x24"}],
    # two turns of one session: the second reuses the pages of the first, image rows included
    "omni_chat.py": [
        {"messages": TURN1, **SAMPLING},
        {"messages": [*TURN1, {"role": "assistant", "content": "A picture."},
                      user("Why?")], **SAMPLING},
    ],
}

async def main(names):
    got = {}
    for name in names:
        (graph,) = of.load_graphs(f"graphs/{name}")
        async with of.Runtime(graph) as rt:
            got[name] = [await rt.run(graph.name, inputs, session="s") for inputs in CASES[name]]
    leaked = [m for m in ("transformers",) if m in sys.modules]
    sized = lambda o: len(o) if isinstance(o, bytes) else [o.width, o.height] if isinstance(
        o, of.Image) else str(o)  # PNGs: their size; images: theirs
    print(json.dumps({"outputs": got, "leaked": leaked}, default=sized))

asyncio.run(main(sys.argv[1:]))
"""


def compute_closure() -> set[str]:
    """The distributions ``pip install 'omniflow[compute]'`` installs (canonical names)."""
    seen: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [("omniflow", frozenset({"compute"}))]
    expanded: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, extras) in expanded:
            continue
        expanded.add((key, extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement this platform skips: nothing to import
        seen.add(key)
        envs = [{"extra": e} for e in sorted(extras)] + [{"extra": ""}]
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return seen


def blocked_modules() -> set[str]:
    """Top-level modules of installed distributions outside the closure."""
    allowed = compute_closure() | {canonicalize_name(t) for t in TOOLS}
    blocked = set()
    for module, dists in metadata.packages_distributions().items():
        if not any(canonicalize_name(d) in allowed for d in dists):
            blocked.add(module)
    return blocked


def test_the_closure_leaves_out_what_only_dev_installs() -> None:
    closure = compute_closure()
    assert {"torch", "safetensors", "tokenizers", "jinja2", "pillow", "pyzmq"} <= closure
    assert not {"transformers", "pytest", "pocketsphinx"} & closure
    assert {"transformers", "pytest", "pocketsphinx"} <= blocked_modules()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_example_graph_runs_with_only_the_compute_extra(tmp_path: Path) -> None:
    names = sorted(p.name for p in (ROOT / "graphs").glob("*.py"))
    speaks = shutil.which("espeak-ng") is not None
    if not speaks:  # omni_chat's TTS is the espeak-ng binary, a system package
        names.remove("omni_chat.py")
    # their pretrained models are the audio and vision extras (tests/test_media_graphs.py)
    names.remove("voice_chat.py")
    names.remove("read_aloud.py")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(blocked_modules())))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIFLOW_")}
    env.update(
        PYTHONPATH=str(site),
        OMNIFLOW_CACHE=str(tmp_path / "cache"),  # nothing made before: the tiny models are made
        OMNIFLOW_AUDIO_DIR=str(tmp_path / "audio"),
    )
    probe = subprocess.run(
        [sys.executable, "-c", "import transformers"], env=env, capture_output=True, text=True
    )
    assert "omniflow[compute] does not install it" in probe.stderr  # the blocker is in force
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *names],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["leaked"] == []
    out = report["outputs"]
    assert set(out) == set(names)
    assert out["agent_loop.py"][0]["answer"] == [20]
    assert out["t2i.py"][0]["picture"] == [{"n_cond": 2, "pixels": [130, 150, 150]}]
    assert out["chat.py"][0]["text"]
    assert out["t2i_unified.py"][0]["image"] == [[40, 24]]
    if speaks:
        first, second = out["omni_chat.py"]
        assert first["usage"][0]["completion_tokens"] > 0
        assert second["usage"][0]["cached_tokens"] >= 32  # the image's pages were matched
