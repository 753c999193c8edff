"""``omniflow run`` and ``omniflow serve`` on the command line: output, errors, exit codes."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path
from unittest.mock import ANY

import pytest

from omniflow import cli
from omniflow._cli_run import parse_input

from .conftest import CHAT, FIG3, ROOT, TEST_GRAPHS

Capsys = pytest.CaptureFixture[str]


def run_cli(capsys: Capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_lists_every_subcommand(capsys: Capsys) -> None:
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0
    for command in ("plan", "run", "serve"):
        assert f"    {command} " in out
    rc, out, _ = run_cli(capsys, "serve", "--help")
    for flag in (
        "--host",
        "--port",
        "--max-inflight",
        "--api-key",
        "--drain-timeout",
        "--placement",
        "--registry",
        "--max-body-mb",
        "--header-timeout",
        "--body-timeout",
        "--idle-timeout",
        "--max-connections",
        "--allowed-host",
        "--session-ttl",
        "--log-format",
    ):
        assert flag in out


def test_run_prints_frames_human_readable(capsys: Capsys) -> None:
    msg = '[{"role": "user", "content": "a b c"}]'
    rc, out, err = run_cli(capsys, "run", CHAT, "--input", f"messages={msg}")
    assert (rc, err) == (0, "")
    assert out.splitlines() == [
        "text[0] from reverser.generate: c",
        "text[1] from reverser.generate:  b",
        "text[2] from reverser.generate:  a",
    ]


def test_run_json_is_the_http_stream(capsys: Capsys, tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"parts": [{"text": "ab"}]}))
    rc, out, _ = run_cli(capsys, "run", FIG3, "--input", f"request=@{request}", "--json")
    assert rc == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0] == {"field": "token", "value": "txt0:6", "node": "llm.generate", "seq": 0}
    assert lines[-1] == {"done": True, "status": "ok", "errors": [], "warnings": [], "call_id": ANY}
    assert [ln["field"] for ln in lines[:-1]] == ["token", "token", "picture"]


def test_run_values_json_or_plain_string() -> None:
    assert parse_input("x=3") == ("x", 3)
    assert parse_input('x={"a": [1]}') == ("x", {"a": [1]})
    assert parse_input("x=hello world") == ("x", "hello world")
    assert parse_input("x=") == ("x", "")
    assert parse_input('x="3"') == ("x", "3")
    assert parse_input('x={"$bytes": "AP8="}') == ("x", b"\x00\xff")
    assert parse_input("x=a=b") == ("x", "a=b")


def test_run_graph_selection_and_session(capsys: Capsys) -> None:
    rc, out, _ = run_cli(capsys, "run", TEST_GRAPHS, "-g", "echo", "-i", "x=7", "-s", "s1")
    assert (rc, out) == (0, "y[0] from echo.run: 7\n")
    rc, out, _ = run_cli(capsys, "run", TEST_GRAPHS, "-g", "values", "-i", "kind=bytes", "--json")
    assert json.loads(out.splitlines()[1])["value"] == {"$bytes": "AP9vbW5p"}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", FIG3], "graph 'fig3' needs 'request'; add --input request=..."),
        (["run", FIG3, "--input", "request"], "expected NAME=VALUE"),
        (["run", FIG3, "--input", "=3"], "expected NAME=VALUE"),
        (["run", FIG3, "-i", "request=@/nonexistent/r.json"], "'/nonexistent/r.json' does not"),
        (["run", FIG3, "-i", "request=1", "-i", "request=2"], "given twice"),
        (["run", FIG3, "-i", "request=1", "-i", "other=2"], "unknown input 'other'"),
        (["run", FIG3, "-i", 'request={"$bytes": 1}'], "base64 string"),
        (
            ["run", "missing_graphs.py", "-i", "a=1"],
            "graph file 'missing_graphs.py' does not exist",
        ),
        (["run", TEST_GRAPHS, "-i", "x=1"], "defines several graphs"),
        (["run", FIG3, "-g", "nope", "-i", "request=1"], "defines no graph named 'nope'"),
        (["run", str(ROOT / "pyproject.toml"), "-i", "a=1"], ""),
    ],
)
def test_run_usage_errors_exit_2(capsys: Capsys, argv: list[str], needle: str) -> None:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2, err
    assert out == ""
    assert err.startswith("omniflow run: error: ")
    assert needle in err
    assert "Traceback" not in err


def test_run_no_graph_in_module_exits_2(capsys: Capsys, tmp_path: Path) -> None:
    empty = tmp_path / "empty_graphs.py"
    empty.write_text("x = 1\n")
    rc, _, err = run_cli(capsys, "run", str(empty), "-i", "a=1")
    assert rc == 2
    assert "defines no omniflow.Graph" in err


def test_run_call_error_exits_1(capsys: Capsys) -> None:
    rc, out, err = run_cli(capsys, "run", TEST_GRAPHS, "-g", "values", "-i", "kind=fail")
    assert rc == 1
    assert out == "value[0] from values.make: before\n"
    assert "error in node 'values.make'" in err
    assert "boom on purpose" in err
    assert "status 'error'" in err
    rc, out, err = run_cli(capsys, "run", TEST_GRAPHS, "-g", "values", "-i", "kind=set", "--json")
    assert rc == 1
    done = json.loads(out.splitlines()[-1])
    assert done["status"] == "error"
    assert done["errors"][0]["exc_type"] == "ValueEncodingError"


def test_run_prints_frames_as_they_come(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    cmd = [
        sys.executable,
        "-m",
        "omniflow",
        "run",
        TEST_GRAPHS,
        "-g",
        "gated",
        "-i",
        f"gate={gate}",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready
        assert proc.stdout.readline() == b"step[0] from gate.wait: started\n"
        assert proc.poll() is None  # still waiting on the gate
        gate.touch()
        out, err = proc.communicate(timeout=20)
        assert out == b"step[1] from gate.wait: released\n"
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize(
    ("argv", "rc", "needle"),
    [
        (["--registry", "redis://localhost:6379/0"], 1, "needs a multi-process placement"),
        (["--placement", "gpu"], 2, "use 'inproc', 'process', 'ray', or a Deploy spec"),
        (["--placement", "[1]"], 2, "use 'inproc', 'process', 'ray', or a Deploy spec"),
        (["--placement", "@/nonexistent.json"], 2, "cannot read '/nonexistent.json'"),
        (["--placement", '{"nope": {}}'], 1, "Deploy names role 'nope'"),
        (["--placement", '{"reverser": {"replicas": 0}}'], 1, "replicas must be an int >= 1"),
        (["--deploy", "d.yaml"], 1, "--deploy and --ray-address go with --placement ray"),
        (["--placement", "ray", "--deploy", "/nonexistent.yaml"], 1, "cannot be read"),
        (["--registry", "localhost:6379"], 2, "is not a registry URL"),
        (["--port", "70000"], 2, "not in 0..65535"),
        (["--max-inflight", "0"], 2, "must be at least 1"),
        (["--drain-timeout", "-1"], 2, "must be >= 0"),
        (["--max-body-mb", "-1"], 2, "must be >= 0 MiB"),
        (["--max-body-mb", "nan"], 2, "must be >= 0 MiB"),
        (["--header-timeout", "0"], 2, "must be a number of seconds > 0"),
        (["--idle-timeout", "inf"], 2, "must be a number of seconds > 0"),
        (["--body-timeout", "x"], 2, "is not a number of seconds"),
        (["--max-connections", "0"], 2, "must be at least 1"),
        (["--session-ttl", "0"], 2, "must be a number of seconds > 0"),
        (["--log-format", "xml"], 2, "invalid choice"),
    ],
)
def test_serve_flag_errors(capsys: Capsys, argv: list[str], rc: int, needle: str) -> None:
    code, _, err = run_cli(capsys, "serve", CHAT, *argv)
    assert code == rc
    assert needle in err
    assert "Traceback" not in err


def test_serve_missing_file_and_busy_port(capsys: Capsys, tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "serve", str(tmp_path / "nope.py"))
    assert code == 2
    assert "does not exist" in err
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = run_cli(capsys, "serve", CHAT, "--port", str(port))
    assert code == 1
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_serve_role_setup_failure_is_one_line(capsys: Capsys, tmp_path: Path) -> None:
    broken = tmp_path / "broken_setup.py"
    broken.write_text(
        "import omniflow as of\n"
        "class Bad(of.Role):\n"
        "    async def setup(self):\n"
        "        raise RuntimeError('weights not found')\n"
        "    @of.interface(inputs_or=[['x']], outputs=['y'])\n"
        "    async def run(self, x):\n"
        "        return {'y': x}\n"
        "g = of.Graph('broken', roles={'bad_setup': Bad()}, inputs=[of.Placeholder('x')],\n"
        "             outputs=['y'])\n"
    )
    code, out, err = run_cli(capsys, "serve", str(broken), "--port", "0")
    assert code == 1
    assert out == ""
    assert err == (
        "omniflow serve: error: role 'bad_setup' setup() failed: RuntimeError: weights not found\n"
    )


def test_allowed_hosts_follow_the_bind_address(capsys: Capsys) -> None:
    from omniflow._cli_serve import allowed_hosts

    loopback = ["localhost", "127.0.0.1", "::1"]
    assert allowed_hosts("127.0.0.1", []) == loopback
    assert allowed_hosts("::1", ["API.example"]) == [*loopback, "api.example"]
    assert allowed_hosts("10.1.2.3", []) == [*loopback, "10.1.2.3"]
    assert allowed_hosts("0.0.0.0", ["api.example"]) == [*loopback, "api.example"]
    assert capsys.readouterr().err == ""
    assert allowed_hosts("0.0.0.0", []) == ["*"]
    assert "any Host header is answered" in capsys.readouterr().err
