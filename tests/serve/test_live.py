"""The live page (``GET /ui``, drawn in headless Chromium), its feeds, a call's story (route
and ``omniflow story``), all behind the same checks as every route."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from omniflow._cli_story import fetch_story, format_story
from omniflow.cli import main
from omniflow.plan import parse_graphs
from omniflow.serve._live import layout
from tests.serve.conftest import FIG3, ROOT, run_server

REQUEST = {"parts": [{"text": "ab"}, {"image": [1, 2]}]}


def test_layout_follows_plan_order() -> None:
    import graphs.fig3 as fig3

    plan = parse_graphs([fig3.graph])["fig3"]
    drawn = layout(plan)
    x = {n["name"]: n["x"] for n in drawn["nodes"]}
    assert [n["name"] for n in drawn["nodes"]][1:-1] == list(plan.nodes)
    for e in drawn["edges"]:
        assert x[e["src"]] < x[e["dst"]], e  # fig3 has no cycle: every edge goes right
    assert {(e["src"], e["dst"]) for e in drawn["edges"]} >= {
        ("parse.run", "vit.encode"), ("vae.decode", "<output>"), ("<input>", "parse.run"),
    }  # fmt: skip
    assert len({(n["x"], n["y"]) for n in drawn["nodes"]}) == len(drawn["nodes"])


async def test_story_route_and_protection(inproc: Any) -> None:
    s = await inproc(FIG3, api_key="k3y")
    auth = {"authorization": "Bearer k3y"}
    r = await s.client.post(
        "/v1/graphs/fig3/call",
        json={"inputs": {"request": REQUEST}, "stream": False},
        headers=auth,
    )
    call_id = r.json()["call_id"]
    got = await s.client.get(f"/v1/calls/{call_id}/story", headers=auth)
    assert got.status_code == 200
    story = got.json()["story"]
    assert story[0]["event"] == "start" and story[-1] == {
        "event": "finish", "stimulus": story[-1]["stimulus"], "status": "ok",
    }  # fmt: skip
    assert any(e["event"] == "fire" and e["node"] == "llm.generate" for e in story)
    assert "#1   start" in format_story(story)
    missing = await s.client.get("/v1/calls/nope/story", headers=auth)
    assert missing.status_code == 404 and "nope" in missing.json()["error"]
    for path in ("/ui", "/ui/graphs", "/ui/events", f"/v1/calls/{call_id}/story"):
        assert (await s.client.get(path)).status_code == 401, path
        foreign = {**auth, "origin": "http://evil.example"}
        assert (await s.client.get(path, headers=foreign)).status_code == 403, path
        assert (
            await s.client.get(path, headers={**auth, "host": "evil.example"})
        ).status_code == 403
    page = await s.client.get("/ui", headers=auth)
    assert page.status_code == 200 and "<svg" not in page.text  # drawn by the page's script
    assert _external_refs(page.text) == []  # no CDN: every asset ships in the package


#: Where a page names something to load: an attribute, a CSS ``url()`` or ``@import``, a JS
#: ``import``, or what the script fetches or subscribes to.
_REFS = re.compile(
    r"""\b(?:src|href|action|poster|data|srcset)\s*=\s*["']?([^"'\s>]+)"""
    r"""|url\(\s*["']?([^"')\s]+)"""
    r"""|@import\s+(?:url\(\s*)?["']?([^"');\s]+)"""
    r"""|\bimport\s*(?:\(\s*|[\w{}*,\s]+\bfrom\s*)?["'`]([^"'`]+)"""
    r"""|\b(?:fetch|EventSource|WebSocket|importScripts)\s*\(\s*["'`]([^"'`]+)""",
    re.IGNORECASE,
)
#: A URL that leaves the server: a scheme (``http:``, ``https:``, ``ws:`` ...) or
#: protocol-relative (``//host``).
_EXTERNAL = re.compile(r"^\s*(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)
#: The one absolute URL a self-contained SVG page names without loading it.
_SVG_NS = "http://www.w3.org/2000/svg"


def _external_refs(html: str) -> list[str]:
    """Every external URL ``html`` would load, and any absolute URL written anywhere else."""
    refs = [next(g for g in m.groups() if g) for m in _REFS.finditer(html)]
    bad = [r for r in refs if _EXTERNAL.match(r)]
    anywhere = re.findall(r"(?:https?|wss?|ftp):[^\s\"'`<>)]*", html, re.IGNORECASE)
    return bad + [u for u in anywhere if u != _SVG_NS and u not in bad]


@pytest.mark.parametrize(
    "snippet",
    [
        '<script src="https://cdn.example/d3.js"></script>',
        "<link rel=stylesheet href=//fonts.example/css>",
        "<style>body { background: url( 'HTTP://img.example/a.png' ) }</style>",
        '<style>@import "//css.example/x.css";</style>',
        '<script type=module>import * as d3 from "https://esm.example/d3";</script>',
        '<script>import("//esm.example/m.js")</script>',
        '<script>new EventSource("https://elsewhere.example/ui/events")</script>',
        '<script>const u = "wss://elsewhere.example/ws";</script>',
    ],
)
def test_the_no_cdn_check_catches_external_urls(snippet: str) -> None:
    assert _external_refs(snippet), snippet
    ok = '<script src="ui/app.js"></script><style>a{background:url(#arrow)}</style>'
    assert _external_refs(ok + f'<script>const SVG = "{_SVG_NS}";</script>') == []


@pytest.mark.slow
def test_story_cli_against_a_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with run_server(FIG3, "--api-key", "k3y", tmp=tmp_path) as server:
        r = httpx.post(
            f"{server.url}/v1/graphs/fig3/call",
            json={"inputs": {"request": REQUEST}, "stream": False},
            headers={"authorization": "Bearer k3y"},
        )
        call_id = r.json()["call_id"]
        assert main(["story", call_id, "--url", server.url, "--api-key", "k3y"]) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[0].startswith("#1   start") and "finish    status=ok" in out
        assert main(["story", call_id, "--url", server.url]) == 1  # no key
        assert "401" in capsys.readouterr().err
        assert main(["story", "c999999", "--url", server.url, "--api-key", "k3y"]) == 1
        assert fetch_story(server.url, call_id, api_key="k3y")["call_id"] == call_id


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (scripts/test.sh installs it)"
)
def test_ui_in_headless_chromium(tmp_path: Path) -> None:
    """A screenshot while calls run shows fig3's nodes with non-zero counters (read from the
    page's DOM); with ``OMNIFLOW_UPDATE_DOCS_IMG=1`` the PNG becomes docs/img/ui.png (shown in
    the README), so a test run leaves the checkout clean."""
    assert CHROMIUM is not None
    with run_server(FIG3, tmp=tmp_path) as server:
        stop = threading.Event()

        def load() -> None:
            with httpx.Client(base_url=server.url, timeout=30) as c:
                while not stop.is_set():
                    c.post("/v1/graphs/fig3/call",
                           json={"inputs": {"request": REQUEST}, "stream": False})  # fmt: skip

        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--virtual-time-budget=20000"]  # fmt: skip
            url = f"{server.url}/ui#updates=4"
            dom = subprocess.run(
                [*base, "--dump-dom", url], capture_output=True, text=True, timeout=60
            ).stdout
            png = tmp_path / "ui.png"
            subprocess.run(
                [*base, "--window-size=1600,440", f"--screenshot={png}", url],
                capture_output=True, timeout=60, check=True,
            )  # fmt: skip
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    nodes = dict(re.findall(r'data-node="([^"]+)"[^>]*data-completed="(\d+)"', dom))
    assert set(nodes) == {"parse.run", "embedding.embed", "vit.encode", "vae.encode",
                          "llm.generate", "diffusion.generate_image", "vae.decode"}  # fmt: skip
    assert all(int(v) > 0 for v in nodes.values()), nodes
    assert "stopped after 4 updates" in dom
    rates = re.findall(r'data-key="rate"[^>]*data-value="([0-9.]+)"', dom)
    assert rates and any(float(v) > 0 for v in rates)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("OMNIFLOW_UPDATE_DOCS_IMG"):  # (the README's picture, refreshed on ask)
        shutil.copyfile(png, ROOT / "docs" / "img" / "ui.png")
