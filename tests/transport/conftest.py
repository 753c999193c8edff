from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture(params=["inproc", "ipc", "tcp", "uds"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    """An address to bind, one per transport. ipc paths stay short (sun_path is ~107 bytes)."""
    if request.param == "inproc":
        yield f"inproc://test-{uuid.uuid4().hex[:8]}"
    elif request.param in ("ipc", "uds"):
        with tempfile.TemporaryDirectory(prefix="of-", dir="/tmp") as tmp:  # mode 0700
            yield f"{request.param}://{tmp}/w.sock"
    else:
        yield "tcp://127.0.0.1:0"
