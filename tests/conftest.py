"""Fixtures shared by several test packages, and the rule that marks process tests slow."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from omniflow.testing import RedisServer, RedisServerError, redis_server

# Hypothesis on a loaded machine: no per-example deadline and no "too slow" health check (any
# example can be slow now and then when 2 cores run 8 suites; the per-test timeout still catches
# a hang). Loaded before the test modules, so their own settings(...) inherit it.
settings.register_profile("omniflow", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("omniflow")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test parametrized to run across processes (``placement`` "process" or "ray"), or
    that starts Ray (the ``ray_local`` / ``cluster`` fixtures), is slow: it starts workers.
    (The other slow tests carry ``@pytest.mark.slow`` themselves.)"""
    for item in items:
        callspec = getattr(item, "callspec", None)
        placement = callspec.params.get("placement") if callspec is not None else None
        uses_ray = {"ray_local", "cluster"} & set(getattr(item, "fixturenames", ()))
        if placement in ("process", "ray") or uses_ray:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A private redis-server on a free port, killed after the test."""
    try:
        with redis_server() as server:
            yield server
    except RedisServerError as exc:
        pytest.fail(f"cannot start a private redis-server: {exc}")
