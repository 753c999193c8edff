"""``omniflow worker``: host replicas of roles in this process for front processes.

    $ omniflow worker graphs/fig3.py --role llm --registry redis://127.0.0.1:6379/0

With a registry the worker binds a free TCP port on ``--host`` (or ``--bind URL``), registers
each role under a heartbeat, and any front process routing that role starts sending it work:
this is how a replica is added by hand. The front's ``placement="process"`` spawns workers the
same way, with ``--bind uds:///<dir>/wN.sock`` (plain Unix-domain sockets, the same-node fast
path; ``ipc://...`` over pyzmq when ``OMNIFLOW_FAST_PATH=0``) and ``--replica-id``.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omniflow.cli import Subparsers

__all__ = ["register"]


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "worker",
        help="host replicas of roles for front processes (multi-process placement)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("graphs", nargs="+", metavar="GRAPH", help="graph .py files or modules")
    p.add_argument(
        "--role", action="append", required=True, help="role to host (repeat for several)"
    )
    p.add_argument(
        "--bind",
        default=None,
        help="address to bind: tcp://HOST:PORT, uds:///abs/path.sock (same-node fronts, "
        "fastest) or ipc:///abs/path.sock (default tcp://HOST:0)",
    )
    p.add_argument("--host", default="127.0.0.1", help="host for the default tcp address")
    p.add_argument("--registry", default=None, help="service registry URL (redis://host:port/db)")
    p.add_argument("--replica-id", default=None, help="unique replica id (default role-pid)")
    p.add_argument(
        "--heartbeat", type=float, default=1.0, help="registry heartbeat interval in seconds"
    )
    p.add_argument(
        "--drain",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let running activations finish before cancelling them",
    )
    p.add_argument(
        "--cluster-key-file",
        default=None,
        metavar="PATH",
        help="file holding the cluster key (default: $OMNIFLOW_CLUSTER_KEY); every front and "
        "worker of a deployment must use the same key",
    )
    # Set by a front that spawns the worker: leave when that process is gone; only the front
    # whose hello carries this token may stop it.
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--owner", default=None, help=argparse.SUPPRESS)
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from omniflow._exceptions import OmniflowError
    from omniflow.cluster._worker import Worker, run_worker
    from omniflow.transport._auth import load_key_file, resolve_key

    if args.bind is None and args.registry is None:
        raise OmniflowError(
            "a hand-started worker needs --registry (so front processes can find it) or --bind"
        )
    address = args.bind or f"tcp://{args.host}:0"
    if args.cluster_key_file is not None:
        key = load_key_file(args.cluster_key_file)
    else:
        key = resolve_key(generate=False)[0]  # a worker cannot make one up: fronts must agree
    return run_worker(
        lambda: Worker(
            list(args.graphs),
            list(args.role),
            address,
            replica_id=args.replica_id,
            registry=args.registry,
            heartbeat_interval=args.heartbeat,
            drain_timeout=args.drain,
            parent_pid=args.parent_pid,
            cluster_key=key,
            owner=args.owner,
        )
    )


def fork_server() -> int:
    """The program of a launcher's fork server (``cluster/_forkserver.py``, started as ``python
    -c ENTRY FD``): import what every worker runs (this command line, the worker's runtime,
    transport and codec, uvloop where installed), then fork workers on the connection at fd
    FD; each child runs its ``omniflow`` command line as ``python -m omniflow`` would."""
    import contextlib
    import importlib
    import os
    import sys

    import omniflow
    from omniflow.cli import main
    from omniflow.cluster import _forkserver, _worker  # noqa: F401  (shared with the children)

    with contextlib.suppress(ImportError):
        importlib.import_module("uvloop")
    program = os.path.join(os.path.dirname(omniflow.__file__), "__main__.py")
    return _forkserver.main(int(sys.argv[1]), main, program)
