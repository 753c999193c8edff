"""The Params Pool's cross-node pulls are authenticated with the cluster key (CONTRACT §5).

A provider without the key, a hostile listener behind a forged metadata address, or a client
without the key never gets or gives a page: what fails authentication is dropped and counted
(``pool.stats()["wire"]``), a failed pull is a miss (recomputed), and honest pulls still work.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import omniflow as of
from omniflow.data.kv import MemoryMetadata
from omniflow.data.kv._pull import NONCE_BYTES
from omniflow.transport import bind, connect, decode_message, encode
from omniflow.transport._auth import TAG_BYTES, Opener, Sealer

LAYOUT = of.PageLayout(("l0",), {"k": (2, 4), "v": (2, 4)}, page_tokens=4, dtype="float32")
KEY_A = b"a" * 32
KEY_B = b"b" * 32
PAGES = 4


@pytest.fixture
def make(params_pools: Callable[..., of.ParamsPool]) -> Callable[..., of.ParamsPool]:
    """Pools named "kv" on LAYOUT (``layout=``, ``name=``, ``capacity=`` override)."""
    return functools.partial(params_pools, layout=LAYOUT, capacity={"l1": 8, "l2": 8, "l3": 0})


def keys() -> list[str]:
    return of.chain_hashes([[i, i + 1] for i in range(PAGES)])


async def provide(pool: of.ParamsPool) -> list[dict[tuple[str, str], torch.Tensor]]:
    """Publish a PAGES-page public chain from ``pool`` and unpin it; returns its bytes."""
    slots = await pool.alloc("w", PAGES)
    out = []
    for i, slot in enumerate(slots):
        page = {}
        for sub, sl in LAYOUT.coords():
            t = torch.full(pool.view(slot, sub, sl).shape, float(i + 1))
            pool.view(slot, sub, sl).copy_(t)
            page[(sub, sl)] = t
        out.append(page)
    await pool.publish(None, keys(), slots)
    await pool.release("w")
    return out


def holds(pool: of.ParamsPool, slot: int, page: dict[tuple[str, str], torch.Tensor]) -> bool:
    return all(torch.equal(pool.view(slot, s, c), t) for (s, c), t in page.items())


POISON = 666.0


class Hostile:
    """A listener behind a forged provider address: reads each (readable, not forgeable) pull
    request and answers it with poisoned page bytes, unsealed or sealed with the wrong key."""

    def __init__(self, seal_key: bytes | None) -> None:
        self.ep = bind("tcp://127.0.0.1:0")
        self.sealer = Sealer(seal_key) if seal_key is not None else None
        self.asked = 0
        self.task = asyncio.get_running_loop().create_task(self.serve())

    async def serve(self) -> None:
        while True:
            peer, frames = await self.ep.recv()
            self.asked += 1
            first = bytes(frames[0])[TAG_BYTES:]  # skip the tag: the body is in clear
            body = decode_message([first, *frames[1:]]).body
            n = len(body["k"])
            poison = [torch.full((n, 4, *dict(LAYOUT.slices)[c[1]]), POISON).numpy().tobytes()
                      for c in LAYOUT.coords()]  # fmt: skip
            reply = encode({"r": body["r"], "f": [4] * n, "d": poison}, kind="pages")
            if self.sealer is not None:
                reply = self.sealer.seal(reply)
            await self.ep.send(reply, peer=peer)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.ep.close()


async def forge_provider(
    meta: Any, name: str, address: str, signer: of.ParamsPool | None = None, shm: str = ""
) -> None:
    """What an attacker who can write the metadata (Redis) does: a node record whose address
    is its own listener, listed as a provider of every page of the chain. With ``signer`` the
    record carries a valid MAC: an honest record whose address a hostile process took over
    (the node died, its port was reused)."""
    info = {"host": "evil-host", "pid": "1", "shm": shm, "l2": "8", "addr": address,
            "layout": LAYOUT.canonical_json(), "lid": LAYOUT.layout_id}  # fmt: skip
    if signer is not None:
        info["mac"] = signer._record_mac(name, info)
    await meta.register("kv", name, info)
    await meta.publish("kv", name, None, keys(), [f"0:{i}:4" for i in range(PAGES)])


async def test_a_provider_with_another_key_is_never_trusted(make: Any) -> None:
    meta = MemoryMetadata()
    a = make(metadata=meta, host="node-a", cluster_key=KEY_A)
    b = make(metadata=meta, host="node-b", cluster_key=KEY_B, pull_timeout=0.5)
    await provide(a)
    m = await b.match(None, keys(), "r")
    assert m.pages == 0  # a miss: the engine recomputes
    assert b.stats()["wire"]["forged_records"] == 1  # a's record is not signed with b's key
    await b.release("r")
    # Even with a record b accepts, a server without b's key is asked and never answers
    # anything b trusts (it drops b's request itself): a miss after the pull timeout.
    info = dict((await meta.nodes("kv", [a.node]))[a.node])
    info.pop("mac")
    await meta.register("kv", a.node, {**info, "mac": b._record_mac(a.node, info)})
    m = await b.match(None, keys(), "r")
    assert m.pages == 0
    assert b.stats()["wire"]["pull_failures"] == 1 and b.stats()["pulled"] == 0
    assert a.stats()["wire"]["dropped_bad_mac"] == 1 and a.stats()["wire"]["accepted"] == 0
    await b.release("r")
    assert b.stats()["pinned"] == 0 and b.stats()["pages"]["l1"] == 0  # nothing kept
    assert (await meta.dump("kv"))["locks"] == {}


@pytest.mark.parametrize("seal_key", [None, KEY_B], ids=["unsealed", "wrong-key"])
async def test_poisoned_answers_from_a_forged_address_never_reach_a_match(
    make: Any, seal_key: bytes | None
) -> None:
    meta = MemoryMetadata()
    b = make(metadata=meta, host="node-b", cluster_key=KEY_A, pull_timeout=30.0)
    await b.open()
    for sub, sl in LAYOUT.coords():  # fresh tiers are uninitialised memory: start from zeros
        b.storage(sub, sl).zero_()
    evil = Hostile(seal_key)
    try:
        await forge_provider(meta, "evil", evil.ep.url, signer=b)
        # No wait for the timeout: a bad answer ends the pull at once (well within 30 s).
        m = await asyncio.wait_for(b.match(None, keys(), "r"), 20)
        assert evil.asked == 1 and m.pages == 0
        wire = b.stats()["wire"]
        assert wire["pull_failures"] == 1 and wire["accepted"] == 0
        assert wire["dropped_bad_mac"] == 1
        for sub, sl in LAYOUT.coords():  # the poison never reached the pool's memory
            assert not bool((b.storage(sub, sl) == POISON).any())
        await b.release("r")
        assert b.stats()["pinned"] == 0
    finally:
        await evil.close()


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_forged_provider_address_fails_counted_then_falls_back(
    make: Any, backend: str, request: pytest.FixtureRequest
) -> None:
    meta: Any = MemoryMetadata()
    if backend == "redis":
        from omniflow.data.kv._redis import RedisMetadata

        meta = RedisMetadata(request.getfixturevalue("redis").url)
    a = make(metadata=meta, host="node-a", cluster_key=KEY_A)
    b = make(metadata=meta, host="node-b", cluster_key=KEY_A)
    pages = await provide(a)
    evil = Hostile(KEY_B)
    try:
        # Ranked before the honest "node-a"; a record with a valid MAC at a hostile address.
        await forge_provider(meta, "0-evil", evil.ep.url, signer=b)
        m = await asyncio.wait_for(b.match(None, keys(), "r"), 20)
        assert evil.asked == 1  # it was asked first ...
        assert m.pages == PAGES and all(  # ... and the honest provider answered
            holds(b, s, p) for s, p in zip(m.slots, pages, strict=True)
        )
        assert b.stats()["wire"]["pull_failures"] == 1 and b.stats()["pulled"] == PAGES
        assert b.stats()["wire"]["dropped_bad_mac"] == 1
        await b.release("r")
    finally:
        await evil.close()
        if backend == "redis":
            await b.aclose()
            await a.aclose()
            await meta.close()


@pytest.mark.parametrize("mac", ["none", "wrong-key"])
async def test_a_forged_node_record_is_never_used(make: Any, mac: str) -> None:
    """A record without a valid MAC (an attacker who can write Redis but has no key) is
    dropped and counted: its address is never asked, its shm never mapped."""
    meta = MemoryMetadata()
    a = make(metadata=meta, host="node-a", cluster_key=KEY_A)
    b = make(metadata=meta, host="node-b", cluster_key=KEY_A)
    stranger = make(metadata=MemoryMetadata(), host="node-x", cluster_key=KEY_B)
    pages = await provide(a)
    evil = Hostile(KEY_A)  # would even answer validly: it must not be asked at all
    try:
        signer = stranger if mac == "wrong-key" else None
        # Claims b's host and an shm prefix: b would map it in place if it trusted the record.
        await forge_provider(meta, "0-evil", evil.ep.url, signer=signer, shm="ofkv_evil")
        await meta.register("kv", "0-evil", {**(await meta.nodes("kv", ["0-evil"]))["0-evil"],
                                              "host": b.host})  # fmt: skip
        m = await asyncio.wait_for(b.match(None, keys(), "r"), 20)
        assert evil.asked == 0 and b.stats()["wire"]["forged_records"] == 1
        assert m.pages == PAGES and all(
            holds(b, s, p) for s, p in zip(m.slots, pages, strict=True)
        )  # from the honest provider
        await b.release("r")
    finally:
        await evil.close()


async def test_a_hostile_client_gets_nothing_and_honest_pulls_still_work(make: Any) -> None:
    meta = MemoryMetadata()
    a = make(metadata=meta, host="node-a", cluster_key=KEY_A)
    b = make(metadata=meta, host="node-b", cluster_key=KEY_A)
    await provide(a)
    addr = (await meta.nodes("kv", [a.node]))[a.node]["addr"]

    def request(to: str = a.node) -> list[Any]:
        body = {"r": b"n" * NONCE_BYTES, "pool": "kv", "to": to, "k": keys()}
        return encode(body, kind="pull")

    # One honest request, answered: the hostile client replays what it captured of it.
    honest, captured = connect(addr), Sealer(KEY_A).seal(request())
    await honest.send(captured)
    answer = await asyncio.wait_for(honest.recv(), 20)
    opened = Opener(KEY_A).open(answer.frames)
    assert opened is not None
    msg = decode_message(opened)
    assert msg.kind == "pages" and msg.body["f"] == [4] * PAGES
    honest.close()

    hostile = connect(addr)
    good = Sealer(KEY_A)
    sent = {"unsigned": 0, "wrong_key": 0, "replayed": 0, "truncated": 0, "foreign": 0}
    for i in range(1000):
        kind = list(sent)[i % len(sent)]
        sent[kind] += 1
        if kind == "unsigned":
            frames = request()
        elif kind == "wrong_key":
            frames = Sealer(KEY_B).seal(request())
        elif kind == "replayed":
            frames = captured
        elif kind == "truncated":
            sealed = good.seal(request())
            frames = [bytes(sealed[0])[: i % (TAG_BYTES + 8)], *sealed[1:]]
        else:  # authentic, but addressed to another pool (a replay elsewhere)
            frames = good.seal(request(to="node-x:1:feed"))
        await hostile.send(frames)
    wire = a.stats()["wire"]
    for _ in range(2000):  # every message counted (bounded wait, not a timing assertion)
        wire = a.stats()["wire"]
        if sum(v for k, v in wire.items() if k.startswith("dropped_")) >= 1000:
            break
        await asyncio.sleep(0.01)
    # The MAC holds only for the honest request and the misaddressed ones (then refused).
    assert wire["accepted"] == 1 + sent["foreign"]
    assert wire["dropped_bad_mac"] == sent["unsigned"] + sent["wrong_key"] + sent["truncated"]
    assert wire["dropped_replay"] == sent["replayed"]
    assert wire["dropped_foreign"] == sent["foreign"]
    with pytest.raises(TimeoutError):  # nothing came back for any of them
        await asyncio.wait_for(hostile.recv(), 0.3)
    hostile.close()

    m = await b.match(None, keys(), "r")  # an honest pull still works
    assert m.pages == PAGES and b.stats()["pulled"] == PAGES
    assert a.stats()["wire"]["accepted"] == 2 + sent["foreign"]
    assert b.stats()["wire"]["accepted"] == 1
    await b.release("r")


async def test_the_runtime_hands_its_key_to_its_pools_and_an_open_pool_rekeys(make: Any) -> None:
    meta = MemoryMetadata()
    a = make(metadata=meta, host="node-a", cluster_key=KEY_A)
    b = make(metadata=meta, host="node-b", pull_timeout=0.5)
    await provide(a)

    class Noop(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["y"])
        async def run(self, x: int) -> dict[str, Any]:
            return {"y": x}

    graph = of.Graph("g", roles={"n": Noop()}, inputs=[of.Placeholder("x")], outputs=["y"],
                     pools=[b])  # fmt: skip
    assert (await b.match(None, keys(), "r1")).pages == 0  # b's own (process) key: a miss
    await b.release("r1")
    of.Runtime(graph, cluster_key=KEY_A.decode())  # the runtime gives the open pool its key
    m = await b.match(None, keys(), "r2")
    assert m.pages == PAGES and b.stats()["wire"]["forged_records"] == 1  # the first time
    await b.release("r2")
    with pytest.raises(of.OmniflowError, match="cluster_key"):  # a pool's own key must agree
        of.Runtime(of.Graph("h", roles={"n": Noop()}, inputs=[of.Placeholder("x")],
                            outputs=["y"], pools=[a]), cluster_key=KEY_B)  # fmt: skip
