"""The private test Redis server (omniflow.testing.redis_server)."""

from __future__ import annotations

import shutil
import socket

import pytest

from omniflow.testing import RedisServer, RedisServerError, _redis, find_redis_server, redis_server


def _command(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(command)
        return sock.recv(256)


def test_private_server_restarts_empty_on_the_same_port() -> None:
    with redis_server() as server:
        assert server.port != 6379 and server.running
        assert _command(server.port, b"SET k v\r\n") == b"+OK\r\n"
        port = server.port
        server.restart()
        assert server.port == port and server.running
        assert _command(port, b"GET k\r\n") == b"$-1\r\n"  # nothing was persisted
        assert _command(port, b"CONFIG GET save\r\n").endswith(b"$0\r\n\r\n")
    assert not server.running


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RedisServerError, match="apt-get install redis-server"):
        find_redis_server(install=False)


def test_a_server_that_cannot_start_reports_its_log() -> None:
    with redis_server() as taken:
        clash = RedisServer(taken.port, executable=_redis.find_redis_server())
        with pytest.raises(RedisServerError, match="did not come up"):
            clash.start(timeout=5)
        clash.close()
