"""Fixtures shared by several test packages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from omniflow.testing import RedisServer, RedisServerError, redis_server


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A private redis-server on a free port, killed after the test."""
    try:
        with redis_server() as server:
            yield server
    except RedisServerError as exc:
        pytest.fail(f"cannot start a private redis-server: {exc}")
