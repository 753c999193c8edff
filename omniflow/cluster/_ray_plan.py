"""``of.Ray``: the deploy map of a Ray placement, checked and planned (no Ray import here).

    >>> plan = Ray({"llm": {"replicas": 2, "num_gpus": 1},
    ...             "dit": {"layer": 1, "colocate": "llm"}}).plan(["llm", "dit", "vae"])
    >>> plan.bundles["llm"]
    [{'CPU': 1.0, 'GPU': 1.0}, {'CPU': 1.0, 'GPU': 1.0}]
    >>> plan.slot("dit", 1)
    ('llm', 1)

A role's replica is the resource unit (the paper's §6). Roles at layer 0 (the default) form a
placement group each, one bundle per replica, holding that replica's ``num_cpus``,
``num_gpus`` and ``resources`` plus whatever the layer >= 1 roles colocated with it ask.
A role at layer >= 1 asks Ray for no GPU and runs in the bundle of the role it ``colocate``s
with (replica ``i`` in bundle ``i mod n``; by default one replica per bundle), where it later
receives that bundle's ``CUDA_VISIBLE_DEVICES``. Roles the map does not name get one
replica of one CPU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniflow._exceptions import OmniflowError

__all__ = ["STRATEGIES", "Ray", "RayPlan", "RayRole", "load_deploy"]

#: Ray's placement-group strategies.
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_KEYS = frozenset(
    {"replicas", "num_gpus", "num_cpus", "resources", "layer", "colocate", "strategy",
     "max_restarts"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RayRole:
    """One role's resource unit, as planned."""

    name: str
    #: Ray actors of this role (one omniflow replica each).
    replicas: int
    #: What each replica asks Ray for (a layer >= 1 role: never a GPU).
    num_cpus: float
    num_gpus: float
    resources: dict[str, float]
    #: 0: owns placement-group bundles; >= 1: runs in the bundles of ``anchor``.
    layer: int
    #: The role it names in ``colocate`` (None at layer 0).
    colocate: str | None
    #: The layer-0 role whose bundles it runs in (itself at layer 0).
    anchor: str
    #: Placement-group strategy (layer 0 only).
    strategy: str
    #: Ray restarts of each actor after a failure (-1: without end).
    max_restarts: int


@dataclass(slots=True)
class RayPlan:
    """Every role's unit, and the bundles of each layer-0 role's placement group."""

    roles: dict[str, RayRole]
    #: Layer-0 role -> one bundle (resource dict) per replica.
    bundles: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def slot(self, role: str, replica: int) -> tuple[str, int]:
        """(placement-group owner, bundle index) where replica ``replica`` of ``role`` runs."""
        r = self.roles[role]
        return r.anchor, replica % self.roles[r.anchor].replicas

    def layered(self) -> list[str]:
        """Role names, layer 0 first (a layer's bundle environment comes from below)."""
        return sorted(self.roles, key=lambda n: (self.roles[n].layer, n))


class Ray:
    """Place every role's replicas on Ray actors (docs/contract.md §6).

    >>> Ray({"llm": {"replicas": 2, "num_gpus": 1}})
    Ray({'llm': {'replicas': 2, 'num_gpus': 1}}, address=None)

    ``address=None`` uses the Ray this process already initialised, or starts a local one
    (and shuts it down at close); ``"auto"`` or ``"ray://host:port"`` joins a cluster.
    Options per role: ``replicas`` (1), ``num_cpus`` (1 at layer 0, else 0), ``num_gpus`` (0),
    ``resources`` ({}), ``layer`` (0), ``colocate`` (required at layer >= 1), ``strategy``
    (layer 0: one of STRATEGIES, default "SPREAD"; "STRICT_PACK" keeps its replicas on one
    node) and ``max_restarts`` (-1: Ray restarts a failed actor without end).
    ``ready_timeout`` bounds the wait for a placement group the cluster cannot hold.
    """

    def __init__(
        self,
        deploy: dict[str, dict[str, Any]] | None = None,
        address: str | None = None,
        *,
        ready_timeout: float = 30.0,
    ) -> None:
        deploy = {} if deploy is None else deploy
        if not isinstance(deploy, dict):
            raise OmniflowError(
                "of.Ray takes a dict: {role name: {'replicas': n, 'num_gpus': g, ...}}"
            )
        for name, opts in deploy.items():
            if not isinstance(name, str) or not isinstance(opts, dict):
                raise OmniflowError(f"of.Ray: options of role {name!r} must be a dict")
            unknown = set(opts) - _KEYS
            if unknown:
                raise OmniflowError(
                    f"of.Ray: role '{name}' has unknown option(s) {sorted(unknown)}; "
                    f"use {sorted(_KEYS)}"
                )
        if address is not None and not isinstance(address, str):
            raise OmniflowError(f"of.Ray: address must be a str or None, got {address!r}")
        #: Role name -> its options, as given.
        self.deploy = {k: dict(v) for k, v in deploy.items()}
        #: Where Ray runs (None: already initialised here, else a local instance).
        self.address = address
        self.ready_timeout = ready_timeout

    def __repr__(self) -> str:
        return f"Ray({self.deploy!r}, address={self.address!r})"

    @classmethod
    def from_file(cls, path: str | Path, address: str | None = None) -> Ray:
        """``Ray(load_deploy(path), address)``: the deploy map from a YAML or JSON file."""
        return cls(load_deploy(path), address)

    def plan(self, role_names: Iterable[str]) -> RayPlan:
        """Check the deploy map against the runtime's roles and plan every unit."""
        names = list(role_names)
        for name in self.deploy:
            if name not in names:
                raise OmniflowError(
                    f"of.Ray names role '{name}', which no graph of this runtime declares; "
                    f"roles: {sorted(names)}"
                )
        roles = {name: self._role(name, self.deploy.get(name, {})) for name in names}
        anchors = {n: _anchor_of(r, roles) for n, r in roles.items()}
        roles = {
            n: RayRole(
                **{
                    **_fields(r),
                    "anchor": anchors[n],
                    "replicas": r.replicas or roles[anchors[n]].replicas,
                }
            )
            for n, r in roles.items()
        }
        plan = RayPlan(roles)
        for role in roles.values():
            if role.layer == 0:
                plan.bundles[role.name] = [_bundle(role) for _ in range(role.replicas)]
        for role in roles.values():
            if role.layer:
                bundles = plan.bundles[role.anchor]
                for i in range(role.replicas):
                    into = bundles[i % len(bundles)]
                    _add(into, "CPU", role.num_cpus)
                    for k, v in role.resources.items():
                        _add(into, k, v)
        for role_name, bundles in plan.bundles.items():
            if not all(bundles):
                raise OmniflowError(
                    f"of.Ray: role '{role_name}' asks Ray for nothing (num_cpus=0, num_gpus=0, "
                    "no resources), but a placement-group bundle needs at least one resource; "
                    "give it num_cpus > 0"
                )
        return plan

    def _role(self, name: str, opts: dict[str, Any]) -> RayRole:
        def number(key: str, default: float) -> float:
            return _number(name, key, opts.get(key, default))

        def integer(key: str, default: int, low: int) -> int:
            v = opts.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise OmniflowError(
                    f"of.Ray: role '{name}' {key} must be an int >= {low}, got {v!r}"
                )
            return v

        layer = integer("layer", 0, 0)
        # A layer >= 1 role that does not say: one replica per bundle it colocates in (0 here
        # means "not said"; ``plan`` fills it in once the anchor is known).
        replicas = 0 if layer and "replicas" not in opts else integer("replicas", 1, 1)
        max_restarts = integer("max_restarts", -1, -1)
        resources = opts.get("resources", {})
        if not isinstance(resources, dict) or not all(isinstance(k, str) for k in resources):
            raise OmniflowError(
                f"of.Ray: role '{name}' resources must be a dict {{name: amount}}, "
                f"got {resources!r}"
            )
        res = {k: _number(name, f"resource {k!r}", v) for k, v in resources.items()}
        colocate = opts.get("colocate")
        strategy = opts.get("strategy", "SPREAD")
        if layer == 0:
            if colocate is not None:
                raise OmniflowError(
                    f"of.Ray: role '{name}' is at layer 0 but names colocate={colocate!r}; a "
                    "colocated role runs in another role's bundle: give it layer >= 1"
                )
            if strategy not in STRATEGIES:
                raise OmniflowError(
                    f"of.Ray: role '{name}' strategy {strategy!r} is not one of {list(STRATEGIES)}"
                )
            num_gpus = number("num_gpus", 0)
        else:
            if not isinstance(colocate, str):
                raise OmniflowError(
                    f"of.Ray: role '{name}' is at layer {layer} and must name the role it runs "
                    "beside: add colocate='<role>'"
                )
            if "strategy" in opts:
                raise OmniflowError(
                    f"of.Ray: role '{name}' is at layer {layer}; only layer-0 roles own a "
                    "placement group, so 'strategy' belongs on the role it colocates with"
                )
            num_gpus = number("num_gpus", 0)
            if num_gpus:
                raise OmniflowError(
                    f"of.Ray: role '{name}' is at layer {layer} and asks num_gpus={num_gpus}; "
                    f"a layer >= 1 role asks Ray for no GPU and shares the GPU of the bundle "
                    f"it colocates in ('{colocate}'): drop num_gpus"
                )
        return RayRole(
            name=name,
            replicas=replicas,
            num_cpus=number("num_cpus", 0 if layer else 1),
            num_gpus=num_gpus,
            resources=res,
            layer=layer,
            colocate=colocate if layer else None,
            anchor=name,
            strategy=strategy if layer == 0 else "",
            max_restarts=max_restarts,
        )


def _number(role: str, what: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0 or not math.isfinite(v):
        raise OmniflowError(f"of.Ray: role '{role}' {what} must be a finite number >= 0, got {v!r}")
    return float(v)


def _fields(r: RayRole) -> dict[str, Any]:
    return {k: getattr(r, k) for k in RayRole.__slots__}


def _anchor_of(role: RayRole, roles: dict[str, RayRole]) -> str:
    """The layer-0 role at the end of ``role``'s colocate chain (each step a lower layer)."""
    cur = role
    while cur.layer:
        target = roles.get(cur.colocate or "")
        if target is None:
            raise OmniflowError(
                f"of.Ray: role '{cur.name}' colocates with '{cur.colocate}', which no graph of "
                f"this runtime declares; roles: {sorted(roles)}"
            )
        if target.layer >= cur.layer:
            raise OmniflowError(
                f"of.Ray: role '{cur.name}' (layer {cur.layer}) colocates with "
                f"'{target.name}' (layer {target.layer}); it must colocate with a lower layer"
            )
        cur = target
    return cur.name


def _bundle(role: RayRole) -> dict[str, float]:
    out: dict[str, float] = {}
    _add(out, "CPU", role.num_cpus)
    _add(out, "GPU", role.num_gpus)
    for k, v in role.resources.items():
        _add(out, k, v)
    return out


def _add(bundle: dict[str, float], key: str, amount: float) -> None:
    if amount:
        bundle[key] = bundle.get(key, 0.0) + amount


def load_deploy(path: str | Path) -> dict[str, dict[str, Any]]:
    """A deploy map from a ``.yaml``/``.yml`` (PyYAML) or JSON file: ``{role: {options}}``.

    The file may also hold the map under a top-level ``roles:`` key.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise OmniflowError(f"deploy file {str(p)!r} cannot be read: {exc}") from exc
    data: Any
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError as exc:
            raise OmniflowError(
                f"deploy file {str(p)!r} is YAML, which needs PyYAML: pip install "
                "'omniflow[ray]' (or write the same map as JSON)"
            ) from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise OmniflowError(f"deploy file {str(p)!r} is not valid YAML: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise OmniflowError(
                f"deploy file {str(p)!r} is not valid JSON (name it .yaml for YAML): {exc}"
            ) from exc
    if isinstance(data, dict) and set(data) == {"roles"}:
        data = data["roles"]
    if data is None:
        data = {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise OmniflowError(
            f"deploy file {str(p)!r} must map role names to option maps, e.g. "
            "{'llm': {'replicas': 2, 'num_gpus': 1}}"
        )
    return data
