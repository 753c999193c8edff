"""The exception tree: messages name the graph, and every error survives pickling."""

from __future__ import annotations

import pickle

import pytest

import omniflow as of


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("node 'a.b': boom", "graph 'g': node 'a.b': boom"),
        # A message about graph outputs starts with "graph " yet does not name the graph.
        ("graph output 'x' is produced by no node", "graph 'g': graph output 'x' is produced"),
        ("graph 'g': already named", "graph 'g': already named"),
    ],
)
def test_graph_error_names_the_graph_once(message: str, expected: str) -> None:
    err = of.GraphError(message, graph="g", node="a.b", field="x")
    assert str(err).startswith(expected)
    assert str(err).count("graph 'g'") == 1
    assert (err.graph, err.node, err.field) == ("g", "a.b", "x")


def test_graph_error_without_graph_is_the_bare_message() -> None:
    assert str(of.GraphError("plain")) == "plain"


@pytest.mark.parametrize(
    "err",
    [
        of.GraphError("node 'a.b': boom", graph="g", node="a.b", field="x"),
        of.InputError("missing 'request'", graph="g", field="request"),
        of.NodeError("vit.encode", "boom", kind="cancel", field="f", call_id="c1", graph="g"),
        of.RuntimeClosedError("closed"),
        of.TransportError("lost"),
        of.RegistryError("no replica"),
        of.DataError("no buffer"),
        of.DataTimeoutError("late"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_survive_pickling(err: of.OmniflowError) -> None:
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is type(err)
    assert str(again) == str(err)
    assert again.__dict__ == err.__dict__


def test_node_error_dict_round_trip() -> None:
    err = of.NodeError("vit.encode", "boom", field="image", exc_type="ValueError")
    again = of.NodeError.from_dict(err.to_dict())
    assert str(again) == "node 'vit.encode': boom"
    assert again.to_dict() == err.to_dict()


def test_the_drawn_tree_shows_every_error_class_of_the_package() -> None:
    """The module docstring of omniflow._exceptions draws every OmniflowError subclass that any
    module of the package defines, under its parent."""
    import importlib
    import pkgutil

    import omniflow
    from omniflow import _exceptions

    for info in pkgutil.walk_packages(omniflow.__path__, "omniflow."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    drawn: dict[str, int] = {}
    for line in (_exceptions.__doc__ or "").splitlines():
        stripped = line.lstrip(" │├└─")
        name = stripped.split()[0] if stripped else ""
        if name.isidentifier() and (name.endswith("Error") or name.startswith("_")):
            drawn[name] = len(line) - len(stripped)

    def walk(cls: type, depth: int) -> None:
        assert cls.__name__ in drawn, f"{cls.__module__}.{cls.__name__} is not drawn"
        for sub in cls.__subclasses__():
            assert drawn.get(sub.__name__, -1) > drawn[cls.__name__], sub.__name__
            walk(sub, depth + 1)

    walk(_exceptions.OmniflowError, 0)
