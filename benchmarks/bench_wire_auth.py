"""What authentication costs: per cross-process hop, and per byte of bulk data (CPU time).

    .venv/bin/python benchmarks/bench_wire_auth.py            # ~1 min on 2 loaded cores
    .venv/bin/python benchmarks/bench_wire_auth.py --only mac # the MAC throughput table only

A hop is a ``run`` to the worker and its ``done`` back. Each message is sealed once (HMAC over
its frames, by its sender) and opened once (MAC check and replay check, by its receiver), and
decoded into its typed message (field checks). This measures, in one process, the per-hop cost
of the codec alone (what the wire did before: ``encode`` + ``decode``) and of the authenticated,
typed path (``encode_msg`` + ``seal`` + ``open`` + ``decode_msg``), with the same bodies as a
1-node call, interleaved in rounds so load bursts hit both alike; the difference is what the
hop pays for authentication. Compare it with the hop of bench_multiprocess.py.

Then the MACs that could cover bulk data (an inline tensor, a pulled block), as CPU GB/s over a
16 MiB buffer (``time.process_time``, so the neighbours' load disturbs it little; candidates
interleaved, median of 9 rounds), each with its per-message cost on a 200-byte message:
HMAC-SHA256 (what every message used before), keyed BLAKE2b (hashlib), Poly1305 and GMAC (AES-GCM
with the data as associated data) from ``cryptography``, the last two under a one-time key
derived per message from the cluster key, sender and counter (HMAC-SHA256 of the head), as
``_auth`` does. ``Sealer.seal`` + ``Opener.open`` of a 64 MiB message, and a plain copy of the
same bytes, give the scale.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives.ciphers import Cipher
from cryptography.hazmat.primitives.ciphers.algorithms import AES
from cryptography.hazmat.primitives.ciphers.modes import GCM
from cryptography.hazmat.primitives.poly1305 import Poly1305

from omniflow.transport import decode_message, encode
from omniflow.transport._auth import BULK_BYTES, Opener, Sealer, _Keys
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


def hop_table() -> None:
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


KEYS = _Keys(KEY)
HEAD = b"OA" + os.urandom(16)
_NONCE = bytes(12)


def hmac_sha256(data: memoryview) -> bytes:
    mac = KEYS.hmac.copy()
    mac.update(HEAD)
    mac.update(data)
    return mac.digest()


def blake2b(data: memoryview) -> bytes:
    return hashlib.blake2b(data, key=KEY[:64], digest_size=32).digest()


def poly1305(data: memoryview) -> bytes:
    # The head is not fed first here: an 18-byte update before the data halves OpenSSL's
    # Poly1305 throughput (its bulk path wants the stream 16-byte aligned); GMAC's does not care.
    mac = Poly1305(KEYS.one_time_key(HEAD))
    mac.update(data)
    return mac.finalize()


def gmac(data: memoryview) -> bytes:
    enc = Cipher(AES(KEYS.one_time_key(HEAD)), GCM(_NONCE)).encryptor()
    enc.authenticate_additional_data(HEAD)
    enc.authenticate_additional_data(data)
    enc.finalize()
    return enc.tag


def copy(data: memoryview) -> bytes:
    return bytes(data)


CANDIDATES: dict[str, Callable[[memoryview], bytes]] = {
    "HMAC-SHA256 (before)": hmac_sha256,
    "keyed BLAKE2b (hashlib)": blake2b,
    "Poly1305, one-time key": poly1305,
    "**GMAC, one-time key (now)**": gmac,
    "copy of the bytes (scale)": copy,
}


def cpu_s(fn: Callable[[], object], n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n


def mac_table() -> None:
    big = memoryview(os.urandom(16 << 20))
    small = memoryview(os.urandom(200))
    rounds: dict[str, list[float]] = {k: [] for k in CANDIDATES}
    per_msg: dict[str, list[float]] = {k: [] for k in CANDIDATES}
    for _ in range(9):
        for name, fn in CANDIDATES.items():
            rounds[name].append(cpu_s(lambda fn=fn: fn(big), 2))  # type: ignore[misc]
            per_msg[name].append(cpu_s(lambda fn=fn: fn(small), 2000))  # type: ignore[misc]
    base = statistics.median(rounds["HMAC-SHA256 (before)"])
    print("| MAC over bulk data | CPU GB/s (16 MiB) | vs HMAC-SHA256 | ms per 64 MiB pass "
          "| µs per 200 B message |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for name in CANDIDATES:
        t = statistics.median(rounds[name])
        print(f"| {name} | {big.nbytes / t / 1e9:.2f} | {base / t:.1f}x | {t * 4e3:.1f} "
              f"| {statistics.median(per_msg[name]) * 1e6:.2f} |")  # fmt: skip
    # The wire itself: one 64 MiB message sealed by its sender and opened by its receiver.
    frames = [b"header", memoryview(os.urandom(64 << 20))]
    assert sum(memoryview(f).nbytes for f in frames) >= BULK_BYTES
    sealer, opener = Sealer(KEY), Opener(KEY)
    times = [cpu_s(lambda: opener.open(sealer.seal(frames)), 1) for _ in range(5)]
    print(f"\nSealer.seal + Opener.open of a 64 MiB message: "
          f"{statistics.median(times) * 1e3:.1f} ms CPU (two passes)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["hop", "mac"], help="one table")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, nproc {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f}\n")  # fmt: skip
    if args.only in (None, "hop"):
        hop_table()
        print()
    if args.only in (None, "mac"):
        mac_table()


if __name__ == "__main__":
    main()
