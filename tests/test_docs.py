"""Every code block of the docs runs as written; the committed plan pictures are current.

How each fenced block of ``DOCS`` (and each ``python`` block of the tutorial) runs
(``test_every_block_runs_or_says_why`` keeps the list whole: a block of another kind fails it):

* ``python``: every block of a page, in order, in one namespace (a page reads top to bottom);
  the pages of the API reference (``API_PAGES``) read as one page, in their index's order.
* ``bash`` (or no language): in bash, in a scratch directory that holds ``graphs/``, ``scripts/``
  and ``.venv`` of this checkout, with ``HOME`` and ``TMPDIR`` in it, no ``OMNIFLOW_*`` variable
  inherited and port 8000 replaced by a free one. A line that starts ``omniflow serve`` in the
  foreground (as a reader types it in one terminal before the ``curl`` in another) runs in the
  background and the block goes on once ``/readyz`` answers; what the block started gets
  SIGTERM at its end (then SIGKILL, with its process group, if it is still there). The block
  must exit 0 and print what ``SHELL_OUTPUT`` says it prints.
* ``yaml``: a deploy file (its first line ``# NAME: ...`` names it): loaded with
  ``of.Ray.from_file`` and planned against the graph ``YAML_GRAPH`` says it deploys, the checks
  ``omniflow serve --deploy`` makes before it asks Ray for anything.
* ``text``: the exception tree, checked against the classes.

A block whose first line is ``# not run by tests/test_docs.py: <reason>`` is not run; the
reason is in the doc for the reader to see. Keep those rare.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import omniflow as of
from omniflow._cli_plan import render_dot
from omniflow._loader import load_graphs, parse

ROOT = Path(__file__).resolve().parent.parent
#: The API reference's pages, in the order docs/api.md (their index) lists them: their python
#: blocks run as one page, each example building on those of the pages before it.
API_PAGES = (
    "docs/api-graphs.md",
    "docs/api-runtime.md",
    "docs/api-media.md",
    "docs/api-serving.md",
)
#: Pages every block of which runs. The tutorial's python blocks run too (its shell blocks
#: serve a module the reader saves and a Redis registry; they are not run yet).
DOCS = ("README.md", *API_PAGES)
TUTORIAL = "docs/tutorial.md"
NOT_RUN = "# not run by tests/test_docs.py:"
#: What a shell block prints, by a line of the block that names it: each string must appear.
SHELL_OUTPUT = {
    "/v1/graphs/fig3/call": ['{"done":true,"status":"ok"'],
    'graphs/t2i_unified.py "a cat on a mat"': ["wrote t2i.png (1 preview frames)"],
    "/v1/chat/completions": ['"object":"chat.completion"', '"finish_reason":'],
    "client.realtime.connect": ["realtime answer: ", " s of audio"],
}
#: The graph file each deploy file (yaml block) is written for.
YAML_GRAPH = {"deploy.yaml": "graphs/t2i_unified.py"}


@pytest.mark.parametrize("name", ["fig3"])
def test_committed_plan_picture_matches_the_graph(name: str) -> None:
    plans = parse(ROOT / "graphs" / f"{name}.py")
    committed = (ROOT / "docs" / f"{name}-plan.dot").read_text()
    assert render_dot(plans).rstrip("\n") == committed.rstrip("\n"), (
        f"docs/{name}-plan.dot is stale: run scripts/render_plans.sh and commit the result"
    )
    assert (ROOT / "docs" / f"{name}-plan.svg").stat().st_size > 0


#: The team's contract, beside the checkout; docs/contract.md is its copy in the repository.
SHARED_CONTRACT = ROOT.parent / "shared" / "CONTRACT.md"


@pytest.mark.skipif(
    not SHARED_CONTRACT.exists(), reason="no ../shared/CONTRACT.md beside this checkout"
)
def test_docs_contract_is_the_teams_contract() -> None:
    copy = (ROOT / "docs" / "contract.md").read_text()
    assert copy == SHARED_CONTRACT.read_text(), (
        "docs/contract.md differs from ../shared/CONTRACT.md, the team's contract: copy it "
        "over (cp ../shared/CONTRACT.md docs/contract.md) and commit"
    )


# -- the blocks ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  #: 1-based line of the opening fence
    lang: str  #: the fence's info string ("" when none)
    code: str  #: dedented to the fence's indentation

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def skipped_because(self) -> str | None:
        first = self.code.splitlines()[0] if self.code else ""
        return first.removeprefix(NOT_RUN).strip() if first.startswith(NOT_RUN) else None


_FENCE = re.compile(r"^(\s*)```\s*([\w-]*)\s*$")


def blocks(doc: str) -> list[Block]:
    out: list[Block] = []
    lines = (ROOT / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].rstrip() != indent + "```":
            assert lines[i].startswith(indent) or not lines[i].strip(), (
                f"{doc}:{i + 1}: a line of the block starting at line {start + 1} is indented "
                "less than its fence"
            )
            body.append(lines[i][len(indent) :])
            i += 1
        assert i < len(lines), f"{doc}:{start + 1}: the block is never closed"
        out.append(Block(doc, start + 1, lang, textwrap.dedent("\n".join(body))))
        i += 1
    return out


def _of(lang: str, *docs: str) -> list[Block]:
    return [b for d in docs for b in blocks(d) if b.lang in lang.split("|")]


def test_every_block_runs_or_says_why() -> None:
    known = {"python", "bash", "", "yaml", "text"}
    for doc in DOCS:
        found = blocks(doc)
        assert found, f"{doc} has no code block: is the fence parser broken?"
        for b in found:
            assert b.lang in known, f"{b.where}: no way to run a '{b.lang}' block; add one here"
            reason = b.skipped_because
            assert reason is None or len(reason) > 10, f"{b.where}: say why it is not run"
    skipped = [b.where for d in DOCS for b in blocks(d) if b.skipped_because]
    assert len(skipped) <= 4, f"keep blocks that are not run rare: {skipped}"
    assert set(YAML_GRAPH) == {_yaml_name(b) for b in _of("yaml", *DOCS)}
    shell = [b for b in _of("bash|", *DOCS) if not b.skipped_because]
    for key in SHELL_OUTPUT:
        assert any(key in b.code for b in shell), f"SHELL_OUTPUT names no block: {key!r}"


# -- python ----------------------------------------------------------------------------------


def test_the_api_index_lists_every_api_page() -> None:
    index = (ROOT / "docs" / "api.md").read_text()
    listed = [f"docs/{name}" for name in re.findall(r"\]\((api-[\w-]+\.md)\)", index)]
    assert tuple(dict.fromkeys(listed)) == API_PAGES, "docs/api.md lists the pages API_PAGES runs"
    assert set(API_PAGES) == {f"docs/{p.name}" for p in (ROOT / "docs").glob("api-*.md")}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "pages", [("README.md",), API_PAGES, (TUTORIAL,)], ids=["README.md", "docs/api", TUTORIAL]
)
def test_python_blocks_run_in_order(
    pages: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    namespace: dict[str, object] = {"__name__": pages[0]}
    for doc in pages:
        found = [b for b in _of("python", doc) if not b.skipped_because]
        assert found, f"{doc} has no python block that runs"
        for b in found:
            exec(compile(b.code, b.where, "exec"), namespace)
    out = capsys.readouterr().out
    if pages == (TUTORIAL,):
        assert "word a" in out
    if pages == API_PAGES:
        assert "token what:3 llm.generate 0" in out and "ok [] []" in out
    if pages == ("README.md",):
        assert out.splitlines()[:2] == ["token what:6", "token is:6"]


# -- text: the exception tree ----------------------------------------------------------------


def test_the_exception_tree_is_the_class_tree() -> None:
    (tree,) = _of("text", "docs/api-runtime.md")
    parents: list[tuple[int, type]] = []
    names = []
    for line in tree.code.splitlines():
        m = re.match(r"^([ │├└─]*)(\w+)", line)
        assert m is not None, line
        depth, name = len(m.group(1)), m.group(2)
        cls = getattr(of, name)
        while parents and parents[-1][0] >= depth:
            parents.pop()
        if parents:
            assert cls.__bases__[0] is parents[-1][1], f"{name} is not a {parents[-1][1]}"
        parents.append((depth, cls))
        names.append(name)
        for sub in re.findall(r"\((\w+Error)\)", line):  # "DataError ... (DataTimeoutError)"
            assert issubclass(getattr(of, sub), cls), f"{sub} is not a {name}"
    assert names[0] == "OmniflowError" and len(names) >= 7


# -- yaml: deploy files ----------------------------------------------------------------------


def _yaml_name(b: Block) -> str:
    m = re.match(r"#\s*([\w.-]+\.ya?ml):", b.code)
    assert m is not None, f"{b.where}: a yaml block starts with '# NAME.yaml: ...'"
    return m.group(1)


@pytest.mark.parametrize("block", _of("yaml", *DOCS), ids=lambda b: b.where)
def test_deploy_file_plans_for_its_graph(block: Block, tmp_path: Path) -> None:
    path = tmp_path / _yaml_name(block)
    path.write_text(block.code)
    graphs = load_graphs(ROOT / YAML_GRAPH[path.name])
    roles = [name for g in graphs for name in g.roles]
    plan = of.Ray.from_file(path).plan(roles)
    assert set(plan.roles) == set(roles)


# -- shell -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


_SERVER = re.compile(r"^((?:\w+=\S*\s+)*)(?:\.venv/bin/)?omniflow serve\b")


def shell_script(code: str, port: int) -> str:
    """The block as a script: continuation lines joined, port 8000 replaced, a foreground
    ``omniflow serve`` run in the background until its ``/readyz`` answers."""
    code = re.sub(r"\\\n\s*", "", code)
    code = re.sub(r"(?<=[:\s])8000\b", str(port), code)
    lines = [
        "set -eo pipefail",
        # At the end, SIGTERM what the block started and wait for it: servers drain and close.
        "trap 'for p in $(jobs -p); do kill \"$p\" 2>/dev/null || true; done; wait || true' EXIT",
        "ready() {  # until the server answers /readyz; fail if it died first",
        f"  until curl -sf localhost:{port}/readyz >/dev/null; do",
        '    kill -0 "$1" 2>/dev/null || { echo "the server exited" >&2; exit 1; }',
        "    sleep 0.2",
        "  done",
        "}",
    ]
    for line in code.splitlines():
        if _SERVER.match(line) and not line.rstrip().endswith("&"):
            lines += [line + " &", 'ready "$!"']
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def run_shell(block: Block, tmp: Path) -> str:
    for name in ("graphs", "scripts", "design"):
        (tmp / name).symlink_to(ROOT / name)
    (tmp / ".venv").symlink_to(Path(sys.prefix))
    (tmp / "home").mkdir()
    (tmp / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIFLOW_")}
    env |= {"HOME": str(tmp / "home"), "TMPDIR": str(tmp / "tmp"), "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    script = shell_script(block.code, _free_port())
    log = tmp / "output.log"
    # Output to a file, not a pipe: a server the block left running keeps its stdout open.
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", script],
            cwd=tmp,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # what the block leaves running is killed with its group
        )
    try:
        proc.wait(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{script}\n{text}"
    return text


def _shell_blocks() -> list[Block]:
    return [b for b in _of("bash|", *DOCS) if not b.skipped_because]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", _shell_blocks(), ids=lambda b: b.where)
def test_shell_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    out = run_shell(block, tmp_path)
    for key, expected in SHELL_OUTPUT.items():
        if key in block.code:
            for text in expected:
                assert text in out, f"{block.where} did not print {text!r}:\n{out}"


def test_shell_script_backgrounds_a_foreground_server() -> None:
    script = shell_script(
        "OMNIFLOW_X=1 omniflow serve g.py --port 8000\ncurl -N localhost:8000/v1/graphs \\\n"
        "  -d '{}'\n",
        1234,
    )
    assert 'OMNIFLOW_X=1 omniflow serve g.py --port 1234 &\nready "$!"\n' in script
    assert "curl -N localhost:1234/v1/graphs -d '{}'\n" in script
    background = shell_script("{ omniflow serve g.py --port 8000 & } && curl x", 1)
    assert 'ready "$!"' not in background


# -- the reference pages ---------------------------------------------------------------------

#: The reference pages: short, present tense, their links whole. docs/contract.md (the team's
#: text, copied) is not held to this.
REFERENCE_PAGES = sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if p.name != "contract.md"
)
#: Pages that must stay short; benchmarks/journal/ (the dated history) is exempt.
SHORT_PAGES = [*REFERENCE_PAGES, "design/ARCHITECTURE.md", "benchmarks/README.md"]
MAX_LINES = 300
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: A date (2026-11-28) or a commit hash (7-40 hex digits, at least one letter and one digit).
_DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


def prose(doc: str) -> list[tuple[int, str]]:
    """The lines of a page outside its fenced code blocks, with their 1-based numbers."""
    inside = {n for b in blocks(doc) for n in range(b.line, b.line + b.code.count("\n") + 2)}
    lines = (ROOT / doc).read_text().splitlines()
    return [(n, line) for n, line in enumerate(lines, 1) if n not in inside]


def test_the_reference_pages_are_there() -> None:
    for name in ("call-core", "cluster", "fast-path", "data-plane", "params-pool", "compute"):
        assert f"docs/{name}.md" in REFERENCE_PAGES
    for name in ("serving", "security", "failure"):
        assert f"docs/{name}.md" in REFERENCE_PAGES
    for doc in ("docs/api.md", *API_PAGES):
        assert doc in REFERENCE_PAGES


@pytest.mark.parametrize("doc", SHORT_PAGES)
def test_a_page_is_short(doc: str) -> None:
    n = len((ROOT / doc).read_text().splitlines())
    assert n <= MAX_LINES, (
        f"{doc} has {n} lines (at most {MAX_LINES}): split it by concern into a page of docs/, "
        "or move dated history to benchmarks/journal/"
    )


@pytest.mark.parametrize("doc", [*SHORT_PAGES, "README.md"])
def test_every_relative_link_resolves(doc: str) -> None:
    for n, line in prose(doc):
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (https:, mailto:) or an anchor of this page
            path = (ROOT / doc).parent / target.split("#")[0]
            assert path.exists(), f"{doc}:{n}: the link {target!r} names no file"


@pytest.mark.parametrize("doc", [*REFERENCE_PAGES, "design/ARCHITECTURE.md"])
def test_a_reference_page_has_no_dates_or_commit_hashes(doc: str) -> None:
    for n, line in prose(doc):
        m = _DATED.search(line)
        assert m is None, (
            f"{doc}:{n}: {m.group(0)!r}: reference pages say what is, not when it changed; "
            "dated measurements go to benchmarks/journal/, history to the commit log"
        )


def test_the_checks_see_dates_hashes_and_broken_links() -> None:
    assert _DATED.search("measured 2026-11-28") and _DATED.search("after 8fcc22b")
    assert not _DATED.search("1000000 frames, a deadbeef-free line, 0xFFFFFFFF")
    assert _LINK.findall("see [x](a.md#b) and ![img](img/p.png)") == ["a.md#b", "img/p.png"]


_CITED = re.compile(r"(tests/[\w/]+\.py)((?:,?\s*::\w+)*)")


@pytest.mark.parametrize("doc", [*REFERENCE_PAGES, "design/ARCHITECTURE.md"])
def test_every_test_a_page_cites_exists(doc: str) -> None:
    """``tests/x.py::test_a, ::test_b``: the invariants lists name the tests that hold them."""
    for m in _CITED.finditer((ROOT / doc).read_text()):
        path = ROOT / m.group(1)
        assert path.exists(), f"{doc} cites {m.group(1)}, which is not there"
        source = path.read_text()
        for name in re.findall(r"::(\w+)", m.group(2)):
            assert re.search(rf"def {name}\b", source), f"{doc} cites {m.group(1)}::{name}"
