"""A module-level graph for the fork server tests (test_forkserver.py): its role reports the
process facts a worker forked by a fork server must share with a spawned one.

Imports only the standard library and omniflow (a worker imports this file by path).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import omniflow as of

#: The variable a test sets in the front's environment before its workers start.
PROBE_ENV = "OMNIFLOW_FORK_PROBE"


class Where(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y", "facts"])
    async def run(self, x: int) -> dict[str, Any]:
        return {
            "y": x + 1,
            "facts": {
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "sid": os.getsid(0),
                "cwd": os.getcwd(),
                "path0": sys.path[0],
                "argv0": sys.argv[0],
                "argv": sys.argv[1:3],
                "probe": os.environ.get(PROBE_ENV),
                "start_error_file": os.environ.get("OMNIFLOW_START_ERROR_FILE", ""),
            },
        }


where = of.Graph(
    "fork_where",
    roles={"w": Where()},
    inputs=[of.Placeholder("x")],
    outputs=["y", "facts"],
)
