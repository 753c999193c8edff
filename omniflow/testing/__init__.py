"""Helpers for testing omniflow and code built on it (not imported by omniflow itself)."""

from __future__ import annotations

from omniflow.testing._redis import RedisServer, RedisServerError, find_redis_server, redis_server

__all__ = ["RedisServer", "RedisServerError", "find_redis_server", "redis_server"]
