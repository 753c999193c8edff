"""of.Ray on one node: the deploy map's plan (pure), GPU bundles and layers, startup errors,
and teardown. The scenario suite runs with of.Ray too (test_placement.py); several nodes are
test_ray_multinode.py's."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import omniflow as of
from omniflow.cluster._ray_plan import STRATEGIES, load_deploy

from . import life_graphs as lg
from . import ray_graphs as rg
from .conftest import RAY_GPUS
from .test_placement import eventually

# ---------------------------------------------------------------- the plan (no Ray)


def test_layer0_bundles_hold_their_colocated_roles() -> None:
    plan = of.Ray(
        {
            "llm": {"replicas": 2, "num_gpus": 1, "strategy": "STRICT_PACK"},
            "dit": {"layer": 1, "colocate": "llm", "num_cpus": 2, "resources": {"ssd": 1}},
            "vae": {"layer": 2, "colocate": "dit", "replicas": 3},
        }
    ).plan(["llm", "dit", "vae", "parse"])
    assert plan.bundles == {
        "llm": [{"CPU": 3.0, "GPU": 1.0, "ssd": 1.0}, {"CPU": 3.0, "GPU": 1.0, "ssd": 1.0}],
        "parse": [{"CPU": 1.0}],
    }
    assert plan.roles["dit"].replicas == 2 and plan.roles["dit"].num_gpus == 0
    assert plan.roles["vae"].anchor == "llm"
    assert [plan.slot("vae", i) for i in range(3)] == [("llm", 0), ("llm", 1), ("llm", 0)]
    assert plan.roles["llm"].strategy == "STRICT_PACK" and plan.roles["parse"].strategy == "SPREAD"
    assert plan.layered() == ["llm", "parse", "dit", "vae"]


@pytest.mark.parametrize(
    ("deploy", "message"),
    [
        ({"nope": {}}, "of.Ray names role 'nope', which no graph"),
        ({"llm": {"replicas": 0}}, "role 'llm' replicas must be an int >= 1"),
        ({"llm": {"gpus": 1}}, "role 'llm' has unknown option(s) ['gpus']"),
        ({"llm": {"num_gpus": -1}}, "role 'llm' num_gpus must be a finite number >= 0"),
        ({"llm": {"num_cpus": float("inf")}}, "role 'llm' num_cpus must be a finite number"),
        ({"llm": {"resources": {"ssd": "x"}}}, "role 'llm' resource 'ssd' must be"),
        ({"llm": {"strategy": "PACKED"}}, "strategy 'PACKED' is not one of"),
        ({"llm": {"colocate": "dit"}}, "is at layer 0 but names colocate='dit'"),
        ({"dit": {"layer": 1}}, "must name the role it runs beside: add colocate="),
        ({"dit": {"layer": 1, "colocate": "x"}}, "colocates with 'x', which no graph"),
        ({"dit": {"layer": 1, "colocate": "llm", "num_gpus": 1}}, "asks Ray for no GPU"),
        ({"dit": {"layer": 1, "colocate": "llm", "strategy": "PACK"}}, "only layer-0 roles"),
        (
            {"dit": {"layer": 1, "colocate": "vae"}, "vae": {"layer": 1, "colocate": "llm"}},
            "it must colocate with a lower layer",
        ),
        ({"llm": {"num_cpus": 0}}, "role 'llm' asks Ray for nothing"),
        ({"llm": {"max_restarts": -2}}, "max_restarts must be an int >= -1"),
    ],
)
def test_bad_deploy_maps_are_clear_errors(deploy: dict[str, Any], message: str) -> None:
    with pytest.raises(of.OmniflowError) as info:
        of.Ray(deploy).plan(["llm", "dit", "vae"])
    assert message in str(info.value)


def test_runtime_checks_the_deploy_map_at_construction() -> None:
    with pytest.raises(of.OmniflowError, match=r"of\.Ray names role 'nope'"):
        of.Runtime(rg.gpu, placement=of.Ray({"nope": {}}))
    with pytest.raises(of.OmniflowError, match=r"of\.Ray takes a dict"):
        of.Ray([("llm", {})])  # type: ignore[arg-type]


_ROLE = st.fixed_dictionaries(
    {"replicas": st.integers(1, 4), "num_gpus": st.sampled_from([0, 0.5, 1, 2])},
    optional={"strategy": st.sampled_from(STRATEGIES), "num_cpus": st.integers(1, 3)},
)


@settings(max_examples=60, deadline=None)
@given(
    base=st.lists(_ROLE, min_size=1, max_size=3),
    layered=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 5)), max_size=4
    ),
)
def test_every_replica_lands_in_a_bundle_of_its_anchor(
    base: list[dict[str, Any]], layered: list[tuple[int, int, int]]
) -> None:
    """Random deploy maps: each layer >= 1 chain ends at layer 0, each replica's slot is a
    bundle of that role's group, and the groups hold exactly the layer-0 GPUs."""
    deploy: dict[str, dict[str, Any]] = {f"b{i}": r for i, r in enumerate(base)}
    names = list(deploy)
    for j, (target, cpus, replicas) in enumerate(layered):
        below = names[target % len(names)]
        layer = deploy[below].get("layer", 0) + 1
        deploy[f"l{j}"] = {"layer": layer, "colocate": below, "num_cpus": cpus,
                           "replicas": replicas}  # fmt: skip
        names.append(f"l{j}")
    plan = of.Ray(deploy).plan(names)
    for name, role in plan.roles.items():
        assert plan.roles[role.anchor].layer == 0
        for i in range(role.replicas):
            anchor, bundle = plan.slot(name, i)
            assert anchor == role.anchor and 0 <= bundle < len(plan.bundles[anchor])
    gpus = sum(b.get("GPU", 0) for bs in plan.bundles.values() for b in bs)
    assert gpus == sum(r["replicas"] * r["num_gpus"] for r in base)
    cpus = sum(b.get("CPU", 0) for bs in plan.bundles.values() for b in bs)
    assert cpus == sum(r.replicas * r.num_cpus for r in plan.roles.values())


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_deploy_files(tmp_path: Path, suffix: str) -> None:
    want = {"llm": {"replicas": 2, "num_gpus": 1}, "dit": {"layer": 1, "colocate": "llm"}}
    path = tmp_path / f"deploy{suffix}"
    if suffix == ".yaml":
        path.write_text(
            "roles:\n  llm: {replicas: 2, num_gpus: 1}\n  dit:\n    layer: 1\n    colocate: llm\n"
        )
    else:
        path.write_text(json.dumps(want))
    assert load_deploy(path) == want
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(of.OmniflowError, match="must map role names to option maps"):
        load_deploy(bad)
    bad.write_text("{nope")
    with pytest.raises(of.OmniflowError, match="is not valid JSON"):
        load_deploy(bad)


def test_serve_builds_the_ray_placement_from_its_flags(tmp_path: Path) -> None:
    from omniflow._cli_serve import placement_from_args
    from omniflow.cli import build_parser

    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("llm: {replicas: 2, num_gpus: 1}\n")
    args = build_parser().parse_args(
        ["serve", "g.py", "--placement", "ray", "--ray-address", "auto", "--deploy", str(deploy)]
    )
    placement = placement_from_args(args)
    assert isinstance(placement, of.Ray)
    assert placement.deploy == {"llm": {"replicas": 2, "num_gpus": 1}}
    assert placement.address == "auto"


# ---------------------------------------------------------------- on a local Ray


async def test_layers_share_their_bundle_gpus(ray_local: Any) -> None:
    """2 replicas of a 1-GPU layer-0 role get one GPU each; a layer-1 role colocated with it
    sees its bundle's CUDA_VISIBLE_DEVICES from the first import on; Ray counts 2 GPUs used."""
    ray = ray_local
    placement = of.Ray(
        {
            "gpu_llm": {"replicas": 2, "num_gpus": 1},
            "gpu_dit": {"layer": 1, "colocate": "gpu_llm"},
        }
    )
    async with of.Runtime(rg.gpu, placement=placement, validate=True) as rt:
        frames = [f async for f in rt.call("ray_gpu", {"go": 1})]
        assert rt.remote is not None
        launcher = rt.remote.fleet.launcher
        placed = {r["pid"]: r for r in launcher.replicas()}
        llm = [f.value for f in frames if f.field == "llm_env"]
        dit = [f.value for f in frames if f.field == "dit_env"]
        assert len(llm) == 2 and len(dit) == 2
        assert sorted(v["cuda"] for v in llm) == ["0", "1"]
        by_bundle: dict[int, str] = {}
        for v in llm:
            slot = placed[v["pid"]]
            assert slot["role"] == "gpu_llm" and slot["gpu_ids"] == [v["cuda"]]
            by_bundle[slot["bundle"]] = v["cuda"]
        assert sorted(by_bundle) == [0, 1]
        for v in dit:
            slot = placed[v["pid"]]
            assert slot["role"] == "gpu_dit" and slot["gpu_ids"] == []
            want = by_bundle[slot["bundle"]]
            assert v["cuda"] == v["cuda_at_import"] == v["cuda_at_setup"] == want
        assert {placed[v["pid"]]["bundle"] for v in dit} == {0, 1}
        assert ray.cluster_resources()["GPU"] == RAY_GPUS

        def two_used() -> bool:  # Ray's resource view syncs from the raylet every ~100 ms
            return bool(ray.available_resources().get("GPU", 0) == RAY_GPUS - 2)

        await eventually(two_used, "Ray to count 2 GPUs used", 20)
        assert rt.readiness() == []
        actors = list(launcher.actors.values())
        groups = [pg.id.hex() for pg in launcher.groups.values()]
    # Shutdown: close returns once Ray has every actor dead (not restarted: a call would be
    # answered), and every placement group is removed.
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            await asyncio.wait_for(actor.wait.remote(), 20)
    table = ray.util.placement_group_table()
    assert {table[g]["state"] for g in groups} == {"REMOVED"}

    def gpus_back() -> bool:
        return bool(ray.available_resources().get("GPU", 0) == RAY_GPUS)

    await eventually(gpus_back, "Ray to count the GPUs free again", 20)


async def test_setup_failure_names_the_role_and_replica(ray_local: Any) -> None:
    rt = of.Runtime(lg.bad_setup, placement=of.Ray())
    with pytest.raises(of.OmniflowError) as info:
        await asyncio.wait_for(rt.start(), 60)
    text = str(info.value)
    assert "role 'vae' setup() failed: RuntimeError: weights not found at /nowhere" in text
    assert "role(s) ['vae']" in text
    assert rt.state.value == "closed"


async def test_a_group_the_cluster_cannot_hold_is_an_actionable_error(ray_local: Any) -> None:
    placement = of.Ray({"gpu_llm": {"replicas": RAY_GPUS + 1, "num_gpus": 1}}, ready_timeout=1)
    rt = of.Runtime(rg.gpu, placement=placement)
    with pytest.raises(of.OmniflowError) as info:
        await asyncio.wait_for(rt.start(), 60)
    text = str(info.value)
    assert "placement group of role 'gpu_llm' (5 bundle(s)" in text
    assert "lower the role's replicas or resources, or add nodes" in text
    assert rt.state.value == "closed"


def test_the_readme_deploy_file_plans_for_its_graph(tmp_path: Path) -> None:
    """README's "Scaling out" deploy file is valid for the graph its command serves."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Scaling out", 1)[1]
    yaml_text, after = section.split("```yaml\n", 1)[1].split("```", 1)
    block = after.split("```bash\n", 1)[1].split("```", 1)[0]
    command = "\n".join(ln for ln in block.splitlines() if not ln.startswith("#"))
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml_text)
    graph_file = command.split()[2]
    assert command.split()[:2] == ["omniflow", "serve"] and "--deploy deploy.yaml" in command
    (graph,) = of.load_graphs(Path(__file__).resolve().parents[2] / graph_file)
    plan = of.Ray(load_deploy(path)).plan(graph.roles)
    assert plan.roles["dit"].anchor == "llm" and plan.bundles["llm"][0]["GPU"] == 1


@pytest.mark.slow
def test_serve_with_placement_ray_end_to_end(tmp_path: Path) -> None:
    """``omniflow serve --placement ray --deploy``: it starts a Ray of its own (no Ray runs in
    that process), serves through actors, reports ready, and drains and exits 0 on SIGTERM."""
    import select
    import signal
    import subprocess
    import sys

    import httpx

    pytest.importorskip("ray", reason="of.Ray needs the 'ray' extra")
    graph = tmp_path / "echo_graph.py"
    graph.write_text(
        "import os\nimport omniflow as of\n\n"
        "class Echo(of.Role):\n"
        "    @of.interface(inputs_or=[['x']], outputs=['y'])\n"
        "    async def run(self, x):\n"
        "        return {'y': [x, os.getpid()]}\n\n"
        "g = of.Graph('ray_echo', roles={'echo': Echo()}, inputs=[of.Placeholder('x')],\n"
        "             outputs=['y'])\n"
    )
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("echo: {replicas: 2, num_cpus: 1}\n")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "omniflow", "serve", str(graph), "--port", "0",
           "--placement", "ray", "--deploy", str(deploy)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 50)
        assert ready, "no announce line within 50 s"
        line = proc.stdout.readline().decode()
        assert line.startswith("omniflow serve: serving ray_echo on http://"), line
        url = line.rsplit(" ", 1)[1].strip()
        with httpx.Client(base_url=url, timeout=20) as c:
            assert c.get("/readyz").json() == {"status": "ready"}
            pids = set()
            for i in range(4):
                r = c.post("/v1/graphs/ray_echo/call", json={"inputs": {"x": i}, "stream": False})
                [[x, pid]] = r.json()["outputs"]["y"]
                assert x == i
                pids.add(pid)
            assert len(pids) == 2 and proc.pid not in pids  # two actors, round robin
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert b"Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


async def test_a_driver_that_dies_leaves_no_actor_running(ray_local: Any, tmp_path: Path) -> None:
    """Nothing is detached: SIGKILL the front (a driver joined to this module's Ray) and Ray
    ends every actor it placed."""
    import signal
    import subprocess
    import sys

    ray = ray_local
    address = ray.get_runtime_context().gcs_address
    script = tmp_path / "driver.py"
    script.write_text(
        "import asyncio, sys\nimport omniflow as of\n"
        "from tests.runtime import ray_graphs as rg\n\n"
        "async def main():\n"
        f"    rt = of.Runtime(rg.gpu, placement=of.Ray(address={address!r}))\n"
        "    await rt.start()\n"
        "    print(*[r['pid'] for r in rt.remote.fleet.launcher.replicas()], flush=True)\n"
        "    await asyncio.sleep(3600)\n\n"
        "asyncio.run(main())\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        cwd=root,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 50)
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, (line, proc.stderr.read() if proc.poll() is not None else b"")
        proc.send_signal(signal.SIGKILL)
        proc.wait()

        def gone() -> bool:
            for pid in pids:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                return False
            return True

        await eventually(gone, "Ray to end the dead driver's actors", 30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


async def test_the_cluster_key_reaches_actors_but_no_log(ray_local: Any) -> None:
    """The key travels as a hidden ``start`` argument: the replicas authenticate with it, and
    no file of Ray's session (logs of the driver, raylet and every worker) contains it."""
    ray = ray_local
    key = "ray-test-key-" + os.urandom(16).hex()
    async with of.Runtime(rg.gpu, placement=of.Ray(), cluster_key=key) as rt:
        frames = [f async for f in rt.call("ray_gpu", {"go": 1})]
        assert {f.field for f in frames} == {"llm_env", "dit_env"}
        assert rt.wire_stats()["accepted"] > 0
        assert sum(v for k, v in rt.wire_stats().items() if k.startswith("dropped")) == 0
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    needle = key.encode()
    assert any(logs.glob("worker-*")), f"no worker logs under {logs}"  # we look at the right place
    leaked = [p for p in logs.rglob("*") if p.is_file() and needle in p.read_bytes()]
    assert leaked == []


async def test_a_second_start_replaces_the_worker_an_actor_runs(
    ray_local: Any, tmp_path: Path
) -> None:
    """A front that lost sight of a live actor (a transient Ray error) starts it again: the
    old worker leaves and a new one serves on a fresh endpoint, in the same process."""
    from omniflow.cluster._ray_actor import ReplicaHost, Secret

    ray = ray_local
    actor = ray.remote(ReplicaHost).options(max_concurrency=4).remote({"OMNIFLOW_FAST_PATH": "1"})
    node = ray.get_runtime_context().get_node_id()
    module = rg.gpu.module
    assert module is not None
    args = ("owner", 1.0, None, Secret(b"k" * 32), str(tmp_path), node, 30.0)
    try:
        first = await actor.start.remote([module], ["gpu_llm"], "a-0", *args)
        second = await actor.start.remote([module], ["gpu_llm"], "a-1", *args)
        assert first["pid"] == second["pid"] and first["address"] != second["address"]
        assert first["address"] == f"uds://{tmp_path}/a-0.sock" and first["node"] == node
        assert not (tmp_path / "a-0.sock").exists()  # the first worker left
        assert (tmp_path / "a-1.sock").exists()
    finally:
        ray.kill(actor)
