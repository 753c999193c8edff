"""The declaration layer: @interface, Role, Graph and friends check their own shape."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest

import omniflow as of
from omniflow.dsl import InterfaceSpec, interfaces_of
from omniflow.dsl._context import _current


class Vae(of.Role):
    @of.interface(inputs_or=[["image"]], outputs=["vae_feat"])
    async def encode(self, image: Any) -> dict[str, Any]:
        return {"vae_feat": image}

    @of.interface(inputs_or=[["latent"]], outputs=["picture"], lb="session", max_concurrency=2)
    async def decode(self, latent: Any) -> dict[str, Any]:
        return {"picture": latent}

    async def helper(self) -> None:
        """Not an interface: no node."""


def test_interface_records_a_spec() -> None:
    spec = Vae.decode.__omniflow_interface__  # type: ignore[attr-defined]
    assert spec == InterfaceSpec(
        inputs_or=(("latent",),),
        outputs=("picture",),
        lb="session",
        collect=frozenset(),
        activate_by_count=None,
        max_concurrency=2,
    )


def test_interface_normalises_containers() -> None:
    @of.interface(
        inputs_or=(("a", "b"), ["c"]),
        outputs=("x",),
        collect={"a"},
        activate_by_count=None,
    )
    async def m(self: Any, **kw: Any) -> None: ...

    spec = m.__omniflow_interface__  # type: ignore[attr-defined]
    assert spec.inputs_or == (("a", "b"), ("c",))
    assert spec.outputs == ("x",)
    assert spec.collect == frozenset({"a"})


def test_activate_by_count_is_recorded_in_order() -> None:
    @of.interface(inputs_or=[["t", "c"]], outputs=["x"], activate_by_count={"c": of.ALL, "t": 3})
    async def m(self: Any, **kw: Any) -> None: ...

    assert m.__omniflow_interface__.activate_by_count == (("c", of.ALL), ("t", 3))  # type: ignore[attr-defined]


def test_the_decorator_returns_the_method_itself() -> None:
    async def m(self: Any, x: Any) -> None: ...

    assert of.interface(inputs_or=[["x"]], outputs=[])(m) is m


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"inputs_or": "image"}, "inputs_or must be a list of OR groups"),
        ({"inputs_or": 3}, "inputs_or must be a list of OR groups"),
        ({"inputs_or": ["image"]}, "each OR group must be a list of field names, got 'image'"),
        ({"inputs_or": [["image", 3]]}, "each OR group holds 3, which is not a field name"),
        ({"inputs_or": [["image", ""]]}, "holds '', which is not a field name"),
        ({"outputs": "feat"}, "outputs must be a list of field names"),
        ({"outputs": [None]}, "outputs holds None"),
        ({"collect": "image"}, "collect must be a list of field names"),
        ({"activate_by_count": {}}, "activate_by_count must be a non-empty dict"),
        ({"activate_by_count": ["image"]}, "activate_by_count must be a non-empty dict"),
        ({"activate_by_count": {"image": 0}}, "activate_by_count['image'] is 0"),
        ({"activate_by_count": {"image": True}}, "activate_by_count['image'] is True"),
        ({"activate_by_count": {"image": "all"}}, "use an int >= 1 or omniflow.ALL"),
        ({"max_concurrency": 0}, "max_concurrency must be an int >= 1 or None"),
        ({"max_concurrency": True}, "max_concurrency must be an int >= 1 or None"),
        ({"max_concurrency": 1.5}, "max_concurrency must be an int >= 1 or None"),
    ],
)
def test_interface_rejects_malformed_declarations(kwargs: dict[str, Any], fragment: str) -> None:
    decl: dict[str, Any] = {"inputs_or": [["image"]], "outputs": ["feat"], **kwargs}

    async def encode(self: Any, **kw: Any) -> None: ...

    with pytest.raises(of.GraphError) as info:
        of.interface(**decl)(encode)
    assert fragment in str(info.value)
    assert "interface '" in str(info.value) and "encode'" in str(info.value)


def test_interfaces_of_follows_the_mro() -> None:
    class Base(of.Role):
        @of.interface(inputs_or=[["a"]], outputs=["b"])
        async def first(self, a: Any) -> None: ...

        @of.interface(inputs_or=[["a"]], outputs=["c"])
        async def second(self, a: Any) -> None: ...

    class Child(Base):
        async def second(self, a: Any) -> None:  # overridden without the decorator: no node
            ...

        @of.interface(inputs_or=[["b"]], outputs=["d"])
        async def third(self, b: Any) -> None: ...

    class Redeclared(Base):
        @of.interface(inputs_or=[["a"]], outputs=["e"])
        async def first(self, a: Any) -> None: ...

    assert [n for n, _ in interfaces_of(Base())] == ["first", "second"]
    assert [n for n, _ in interfaces_of(Child())] == ["first", "third"]
    assert [(n, s.outputs) for n, s in interfaces_of(Redeclared())] == [
        ("second", ("c",)),
        ("first", ("e",)),
    ]
    assert [n for n, _ in interfaces_of(Vae())] == ["encode", "decode"]


async def test_role_setup_and_teardown_default_to_no_ops() -> None:
    role = Vae()
    assert await role.setup() is None
    assert await role.teardown() is None


def test_all_is_a_pickleable_singleton() -> None:
    assert type(of.ALL)() is of.ALL
    assert pickle.loads(pickle.dumps(of.ALL)) is of.ALL
    assert repr(of.ALL) == "omniflow.ALL"


@pytest.mark.parametrize("bad", ["", 3, None])
def test_placeholder_and_params_need_a_name(bad: Any) -> None:
    with pytest.raises(of.GraphError, match="Placeholder name must be a non-empty str"):
        of.Placeholder(bad)
    with pytest.raises(of.GraphError, match="GlobalParameters name must be a non-empty str"):
        of.GlobalParameters(bad, factory=list)


def test_global_parameters_factory_must_be_callable() -> None:
    with pytest.raises(of.GraphError, match="GlobalParameters 'hist': factory must be callable"):
        of.GlobalParameters("hist", factory=[])  # type: ignore[arg-type]


def test_declarations_are_values() -> None:
    assert of.Placeholder("x") == of.Placeholder("x")
    assert of.RoleRef("vae") == of.RoleRef("vae")
    assert of.GlobalParametersRef("h") == of.GlobalParametersRef("h")
    assert pickle.loads(pickle.dumps(of.Placeholder("x"))) == of.Placeholder("x")


def test_graph_keeps_its_declaration() -> None:
    vae = Vae()
    g = of.Graph(
        "vae",
        roles={"vae": vae},
        inputs=[of.Placeholder("image"), of.Placeholder("latent")],
        outputs=("vae_feat", "picture"),
        params=[of.GlobalParameters("h", factory=dict)],
        max_iterations=3,
    )
    assert g.roles == {"vae": vae}
    assert g.inputs == (of.Placeholder("image"), of.Placeholder("latent"))
    assert g.outputs == ("vae_feat", "picture")
    assert g.max_iterations == 3
    assert g.module == __file__  # where a worker process finds the graph again
    assert repr(g) == "Graph('vae', roles=['vae'], outputs=['vae_feat', 'picture'])"
    assert of.Graph("d", roles={"vae": vae}).max_iterations == 1024


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"name": ""}, "Graph name must be a non-empty str"),
        ({"name": 7}, "Graph name must be a non-empty str"),
        ({"roles": {}}, "graph 'g': roles must be a non-empty dict"),
        ({"roles": [Vae()]}, "graph 'g': roles must be a non-empty dict"),
        ({"inputs": ["image"]}, "graph 'g': inputs must be Placeholder objects, got 'image'"),
        ({"outputs": "picture"}, "graph 'g': outputs must be a list, got 'picture'"),
        ({"inputs": of.Placeholder("x")}, "graph 'g': inputs must be a list, got Placeholder"),
        ({"params": of.GlobalParametersRef("h")}, "graph 'g': params must be a list"),
        ({"inputs": 3}, "graph 'g': inputs must be a list, got 3"),
        ({"outputs": [""]}, "graph 'g': outputs must be field names"),
        ({"params": [list]}, "graph 'g': params must be GlobalParameters or GlobalParametersRef"),
        ({"max_iterations": 0}, "graph 'g': max_iterations must be an int >= 1"),
        ({"max_iterations": True}, "graph 'g': max_iterations must be an int >= 1"),
        ({"max_iterations": 2.0}, "graph 'g': max_iterations must be an int >= 1"),
    ],
)
def test_graph_rejects_malformed_declarations(kwargs: dict[str, Any], fragment: str) -> None:
    decl: dict[str, Any] = {"name": "g", "roles": {"vae": Vae()}, **kwargs}
    with pytest.raises(of.GraphError) as info:
        of.Graph(**decl)
    assert fragment in str(info.value)


def test_context_outside_an_activation() -> None:
    with pytest.raises(of.OmniflowError, match=r"context\(\) was called outside"):
        of.context()


async def test_context_inside_an_activation() -> None:
    ctx = of.ActivationContext(
        graph="g",
        session="s1",
        call_id="c1",
        node="vae.encode",
        or_group=0,
        params={},
        seq=0,
        aid=1,
    )

    async def method() -> of.ActivationContext:
        return of.context()

    async def run() -> of.ActivationContext:
        _current.set(ctx)  # what the runtime does around each activation
        return await method()

    assert await asyncio.create_task(run()) is ctx
    with pytest.raises(of.OmniflowError):
        of.context()  # the task's context did not leak out
