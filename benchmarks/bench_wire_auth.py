"""What authentication adds to one cross-process hop, in CPU time per hop.

    .venv/bin/python benchmarks/bench_wire_auth.py

A hop is a ``run`` to the worker and its ``done`` back. Each message is sealed once (HMAC over
its frames, by its sender) and opened once (MAC check and replay check, by its receiver), and
decoded into its typed message (field checks). This measures, in one process, the per-hop cost
of the codec alone (what the wire did before: ``encode`` + ``decode``) and of the authenticated,
typed path (``encode_msg`` + ``seal`` + ``open`` + ``decode_msg``), with the same bodies as a
1-node call, interleaved in rounds so load bursts hit both alike; the difference is what the
hop pays for authentication. Compare it with the hop of bench_multiprocess.py.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omniflow.transport import decode_message, encode
from omniflow.transport._auth import Opener, Sealer
from omniflow.transport._protocol import Done, Run, decode_msg, encode_msg

N = 20_000
KEY = b"k" * 64


def plain() -> None:
    run = {"c": "call-12", "a": 3, "n": "hop.run", "k": {"x": 7}, "s": None, "g": 0, "q": 0,
           "gr": "hop"}  # fmt: skip
    done = {"c": "call-12", "a": 3, "e": None, "f": {"y": 7}}
    decode_message(encode(run, kind="run", pickle=True), allow_pickle=True)
    decode_message(encode(done, kind="done", pickle=True), allow_pickle=True)


front, worker = Sealer(KEY), Sealer(KEY)
at_worker, at_front = Opener(KEY), Opener(KEY)


def sealed() -> None:
    run = Run("call-12", 3, "hop.run", {"x": 7}, None, 0, 0, "hop")
    msg = at_worker.open(front.seal(encode_msg(run)))
    assert msg is not None
    decode_msg(msg)
    back = at_front.open(worker.seal(encode_msg(Done("call-12", 3, {"y": 7}))))
    assert back is not None
    decode_msg(back)


def per_hop(fn: object) -> float:
    t0 = time.process_time()
    for _ in range(N):
        fn()  # type: ignore[operator]
    return (time.process_time() - t0) / N * 1e6


def main() -> None:
    a, b = [], []
    for _ in range(7):
        a.append(per_hop(plain))
        b.append(per_hop(sealed))
    pa, pb = statistics.median(a), statistics.median(b)
    print("| per hop (run + done), CPU | µs (median of 7 rounds) |")
    print("|---|---:|")
    print(f"| codec only (before) | {pa:.1f} |")
    print(f"| typed + sealed + opened (after) | {pb:.1f} |")
    print(f"| **added by authentication and typing** | **{pb - pa:.1f}** |")


if __name__ == "__main__":
    main()
