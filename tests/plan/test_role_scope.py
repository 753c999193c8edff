"""Roles are scoped to the module that declares their graph (unless shared by RoleRef)."""

from __future__ import annotations

from pathlib import Path

import pytest

import omniflow as of

MODULE = """
import omniflow as of


class Vae(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x):
        return {{"y": "{tag}:" + x}}


{name} = of.Graph("{name}", roles={{"vae": Vae()}}, inputs=[of.Placeholder("x")],
                  outputs=["y"])
"""

SHARED = """
import omniflow as of

{name} = of.Graph("{name}", roles={{"vae": of.RoleRef("vae")}}, inputs=[of.Placeholder("x")],
                  outputs=["y"])
"""


def files(tmp_path: Path) -> tuple[Path, Path]:
    a = tmp_path / "mod_a.py"
    b = tmp_path / "mod_b.py"
    a.write_text(MODULE.format(tag="A", name="ga"))
    b.write_text(MODULE.format(tag="B", name="gb"))
    return a, b


def test_same_role_name_in_two_modules_are_two_roles(tmp_path: Path) -> None:
    a, b = files(tmp_path)
    graphs = [*of.load_graphs(a), *of.load_graphs(b)]
    plans = of.parse_graphs(graphs)
    assert plans["ga"].roles["vae"] is not plans["gb"].roles["vae"]
    assert type(plans["ga"].roles["vae"]).__module__ != type(plans["gb"].roles["vae"]).__module__


async def test_runtime_keeps_same_named_roles_of_two_modules_apart(tmp_path: Path) -> None:
    a, b = files(tmp_path)
    async with of.Runtime(*of.load_graphs(a), *of.load_graphs(b)) as rt:
        assert await rt.run("ga", {"x": "1"}) == {"y": ["A:1"]}
        assert await rt.run("gb", {"x": "1"}) == {"y": ["B:1"]}


def test_process_placement_says_what_to_rename(tmp_path: Path) -> None:
    a, b = files(tmp_path)
    with pytest.raises(of.OmniflowError, match=r"role name 'vae' names different roles.*rename"):
        of.Runtime(*of.load_graphs(a), *of.load_graphs(b), placement="process")


def test_roleref_prefers_its_own_module_then_the_only_declaration(tmp_path: Path) -> None:
    a, b = files(tmp_path)
    c = tmp_path / "mod_c.py"
    c.write_text(SHARED.format(name="gc"))
    plans = of.parse_graphs([*of.load_graphs(a), *of.load_graphs(c)])
    assert plans["gc"].roles["vae"] is plans["ga"].roles["vae"]
    with pytest.raises(of.GraphError, match=r"RoleRef\('vae'\).*ambiguous.*rename"):
        of.parse_graphs([*of.load_graphs(a), *of.load_graphs(b), *of.load_graphs(c)])
