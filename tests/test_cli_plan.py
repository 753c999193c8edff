"""``omniflow plan``: the three formats, the error messages, and the subcommand registry."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import omniflow as of
from omniflow import cli

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"
FIG3 = str(GRAPHS / "fig3.py")
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' not installed")

TWO_GRAPHS = """
import omniflow as of

class Enc(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x):
        return {"y": x}

one = of.Graph("one", roles={"enc": Enc()}, inputs=[of.Placeholder("x")], outputs=["y"])
two = of.Graph("two", roles={"enc": of.RoleRef("enc")}, inputs=[of.Placeholder("x")],
               outputs=["y"])
"""


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def dot_to_svg(source: str) -> str:
    done = subprocess.run(
        ["dot", "-Tsvg"], input=source, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr and "Error" not in done.stderr, done.stderr
    return done.stdout


def test_table_is_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "plan", FIG3)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "graph 'fig3'"
    assert "  inputs:  request" in lines
    assert "  outputs: token <- llm.generate; picture <- vae.decode" in lines
    assert "  params:  history" in lines
    assert "    parse.run  lb=round_robin  [generator  diamond-root]" in lines
    assert "    llm.generate  lb=session  [generator  session]" in lines
    assert "      or 0: text_emb" in lines
    assert "      or 1: vit_feat & vae_feat  (bucket, root parse.run)" in lines
    assert "      ->   token" in lines
    assert "      or 0: token  activate_by_count token=ALL  (bucket, root <input>)" in lines
    buckets = lines[lines.index("  buckets") :]
    assert buckets[1:4] == [
        "    llm.generate or 1  root=parse.run",
        "      vae_feat <- vae.encode  critical",
        "      vit_feat <- vit.encode  critical",
    ]
    assert "    llm.generate or 1: vit_feat <- vit.encode  [bucket]" in lines
    assert "    embedding.embed or 0: text <- parse.run" in lines


def test_table_of_a_loop_and_of_collect(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, _ = run_cli(capsys, "plan", str(GRAPHS / "agent_loop.py"))
    assert rc == 0
    assert "  max_iterations: 16 (per call, per node on a cycle)" in out
    assert "    llm.think  lb=session  [generator  session  on-cycle]" in out
    assert "    calc.run  lb=round_robin  [on-cycle]" in out
    assert "    (none: every node fires once per arriving frame)" in out

    f = tmp_path / "collecting.py"
    f.write_text(
        "import omniflow as of\n"
        "class C(of.Role):\n"
        "    @of.interface(inputs_or=[['x']], outputs=['y'], collect=['x'])\n"
        "    async def run(self, x):\n"
        "        return {'y': x}\n"
        "g = of.Graph('c', roles={'c': C()}, inputs=[of.Placeholder('x')], outputs=['y'])\n"
    )
    rc, out, _ = run_cli(capsys, "plan", str(f))
    assert rc == 0
    assert "      or 0: x  collect=x  (bucket, root <input>)" in out


def test_json_is_to_dict_by_graph_name(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "plan", FIG3, "--format", "json")
    assert (rc, err) == (0, "")
    expected = {"fig3": of.parse(FIG3)["fig3"].to_dict()}
    assert json.loads(out) == json.loads(json.dumps(expected))


def test_graph_option_selects_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "two_graphs.py"
    f.write_text(TWO_GRAPHS)
    rc, out, _ = run_cli(capsys, "plan", str(f), "-f", "json")
    assert rc == 0
    assert list(json.loads(out)) == ["one", "two"]
    rc, out, _ = run_cli(capsys, "plan", str(f), "--graph", "two", "-f", "json")
    assert rc == 0
    assert list(json.loads(out)) == ["two"]
    rc, out, _ = run_cli(capsys, "plan", str(f))
    assert "graph 'one'" in out and "graph 'two'" in out


@needs_dot
def test_dot_renders_and_marks_buckets_and_critical_slots(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, err = run_cli(capsys, "plan", FIG3, "--format", "dot")
    assert (rc, err) == (0, "")
    assert out.startswith('digraph "fig3" {')
    assert '"fig3/<input>" [label="<input>\\nrequest"' in out
    assert '"fig3/<output>" [label="<output>\\ntoken\\npicture"' in out
    bucket = next(ln for ln in out.splitlines() if ln.strip().startswith('"fig3/llm.generate" ['))
    assert "bucket g1 root=parse.run" in bucket
    assert 'peripheries="2"' in bucket
    plain = next(ln for ln in out.splitlines() if ln.strip().startswith('"fig3/vit.encode" ['))
    assert "peripheries" not in plain
    crit = next(ln for ln in out.splitlines() if '"fig3/vit.encode" -> "fig3/llm.generate"' in ln)
    assert 'label="vit_feat [g1]"' in crit and 'color="red"' in crit and 'style="bold"' in crit
    text = next(
        ln for ln in out.splitlines() if '"fig3/embedding.embed" -> "fig3/llm.generate"' in ln
    )
    assert 'label="text_emb [g0]"' in text and "red" not in text
    single = next(ln for ln in out.splitlines() if '"fig3/parse.run" -> "fig3/vit.encode"' in ln)
    assert 'label="image"' in single  # one OR group: no group tag
    assert '"fig3/vae.decode" -> "fig3/<output>" [label="picture"' in out
    assert "<svg" in dot_to_svg(out)


@needs_dot
@pytest.mark.parametrize("name", ["t2i.py", "agent_loop.py"])
def test_dot_of_the_other_examples_renders(capsys: pytest.CaptureFixture[str], name: str) -> None:
    rc, out, _ = run_cli(capsys, "plan", str(GRAPHS / name), "-f", "dot")
    assert rc == 0
    assert "<svg" in dot_to_svg(out)


@needs_dot
def test_dot_of_several_graphs_is_one_digraph_with_clusters(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    f = tmp_path / "two_graphs.py"
    f.write_text(TWO_GRAPHS)
    rc, out, _ = run_cli(capsys, "plan", str(f), "-f", "dot")
    assert rc == 0
    assert out.count("digraph") == 1
    assert "subgraph cluster_0" in out and "subgraph cluster_1" in out
    assert '"one/enc.run"' in out and '"two/enc.run"' in out
    assert dot_to_svg(out).count("<svg") == 1


def test_dot_escapes_quotes_and_backslashes() -> None:
    from omniflow._cli_plan import _q

    assert _q('a"b\\c') == '"a\\"b\\\\c"'
    assert _q("line1\nline2") == '"line1\\nline2"'


@needs_dot
def test_the_installed_command_pipes_into_dot(tmp_path: Path) -> None:
    """The acceptance line: ``omniflow plan graphs/fig3.py --format dot | dot -Tsvg``."""
    svg = tmp_path / "fig3.svg"
    cmd = f"{sys.executable} -m omniflow plan {FIG3} --format dot | dot -Tsvg > {svg}"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], timeout=60, check=False)
    assert done.returncode == 0
    assert "llm.generate" in svg.read_text()


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert "Traceback" not in err
    assert err.startswith("omniflow plan: error: "), err
    return err


def test_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = _error(capsys, "plan", str(tmp_path / "nope.py"))
    assert "nope.py' does not exist; pass the path to a .py file" in err


def test_module_without_graph(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "nothing_here.py"
    f.write_text("x = 1\n")
    err = _error(capsys, "plan", str(f))
    assert "defines no omniflow.Graph at module level" in err


def test_unknown_graph_name(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, "plan", FIG3, "--graph", "t2i")
    assert "defines no graph named 't2i'; its graphs are 'fig3'" in err


def test_graph_error_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "broken.py"
    f.write_text(
        "import omniflow as of\n"
        "class V(of.Role):\n"
        "    @of.interface(inputs_or=[['image']], outputs=['feat'])\n"
        "    async def encode(self, image):\n"
        "        return {}\n"
        "g = of.Graph('bad', roles={'vit': V()}, inputs=[of.Placeholder('x')], outputs=['feat'])\n"
    )
    err = _error(capsys, "plan", str(f))
    assert err == (
        "omniflow plan: error: graph 'bad': node 'vit.encode': input 'image' has no producer; "
        "add a Placeholder('image') or a role output named 'image'\n"
    )


def test_file_that_raises_on_import(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "raising.py"
    f.write_text("import omniflow\nraise KeyError('model weights')\n")
    err = _error(capsys, "plan", str(f))
    assert "importing graph file" in err and "KeyError('model weights')" in err


def test_usage_errors_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err
    assert cli.main(["plan"]) == 2
    assert "GRAPH_FILE" in capsys.readouterr().err
    assert cli.main(["plan", FIG3, "--format", "yaml"]) == 2
    assert "invalid choice: 'yaml'" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out
    assert cli.main(["plan", "--help"]) == 0
    assert "--format" in capsys.readouterr().out
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"omniflow {of.__version__}"


def test_subcommands_register_from_their_own_module(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """How `serve`, `run` and `worker` plug in: a module with register(subparsers)."""
    mod = types.ModuleType("omniflow_test_cli_echo")

    def handler(args: argparse.Namespace) -> int:
        if args.fail == "node":
            raise of.NodeError("llm.generate", "boom")
        if args.fail == "input":
            raise of.InputError("missing Placeholder 'request'")
        print(f"echo {args.word}")
        return 0

    def register(subparsers: cli.Subparsers) -> None:
        p = subparsers.add_parser("echo", help="test command")
        p.add_argument("word")
        p.add_argument("--fail", choices=["node", "input"])
        p.set_defaults(handler=handler)

    mod.register = register  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(cli, "SUBCOMMANDS", (*cli.SUBCOMMANDS, mod.__name__))

    assert run_cli(capsys, "echo", "hi") == (0, "echo hi\n", "")
    rc, _, err = run_cli(capsys, "echo", "hi", "--fail", "node")
    assert (rc, err) == (1, "omniflow echo: error: node 'llm.generate': boom\n")
    rc, _, err = run_cli(capsys, "echo", "hi", "--fail", "input")
    assert (rc, err) == (2, "omniflow echo: error: missing Placeholder 'request'\n")
    rc, out, _ = run_cli(capsys, "plan", FIG3)
    assert rc == 0 and out.startswith("graph 'fig3'")
