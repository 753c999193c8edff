"""One suite, both metadata backends: chains, providers, locks, run locks, atomic eviction.

The race at the end is the Lua atomicity acceptance: 8 clients, 10k operations on one Redis.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from _hosted_wire import hosted_client

from omniflow._exceptions import DataError
from omniflow.data.kv._hosted import HostedMetadata, check, serve
from omniflow.data.kv._meta import PUBLIC, MemoryMetadata, Metadata
from omniflow.data.kv._notice import NoticeSeal
from omniflow.data.kv._redis import RedisMetadata
from omniflow.transport._auth import generate_key

P = "pool"


@pytest.fixture(params=["memory", "redis", "front"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], Metadata]]:
    """A factory of clients of one metadata store (every client sees the same truth)."""
    made: list[Metadata] = []
    if request.param == "memory":
        shared = MemoryMetadata()

        def make() -> Metadata:
            return shared

    elif request.param == "front":
        hosted = MemoryMetadata()

        def make() -> Metadata:
            return hosted_client(hosted)

    else:
        server = request.getfixturevalue("redis")

        def make() -> Metadata:
            client = RedisMetadata(server.url)
            made.append(client)
            return client

    yield make
    for client in made:
        await client.close()


async def test_session_chains_are_isolated_and_public_is_shared(backend: Any) -> None:
    m = backend()
    await m.publish(P, "n1", "s1", ["a", "b", "c"], ["0:0:4", "0:1:4", "0:2:4"])
    await m.publish(P, "n1", None, ["sys"], ["0:3:4"])
    assert len(await m.match(P, "s1", ["a", "b", "c", "d"])) == 3
    assert await m.match(P, "s2", ["a", "b"]) == []
    assert await m.match(P, "s2", ["sys", "x"]) == [{"n1": "0:3:4"}]
    assert await m.match(P, None, ["a"]) == []
    assert (await m.dump(P))["chains"][PUBLIC] == ["sys"]


async def test_drop_of_the_last_replica_truncates_every_chain(backend: Any) -> None:
    m = backend()
    await m.publish(P, "n1", "s1", ["a", "b", "c"], ["0:0:4", "0:1:4", "0:2:4"])
    await m.publish(P, "n2", "s2", ["b"], ["1:0:4"])
    assert await m.evict(P, "n1", ["b"], [None]) == [True]  # n2 still holds b
    assert len(await m.match(P, "s1", ["a", "b", "c"])) == 3
    assert await m.evict(P, "n2", ["b"], [None]) == [True]  # last replica gone
    assert len(await m.match(P, "s1", ["a", "b", "c"])) == 1
    dump = await m.dump(P)
    assert all("b" not in keys for keys in dump["chains"].values())
    assert "b" not in dump["providers"]


async def test_replica_lock_refuses_move_and_drop_until_unlocked(backend: Any) -> None:
    m = backend()
    await m.publish(P, "n1", "s1", ["a"], ["1:5:4"])
    assert await m.lock(P, "reader", "n1", ["a", "zz"]) == ["1:5:4", None]
    assert await m.evict(P, "n1", ["a"], ["2:0:4"]) == [False]
    assert await m.evict(P, "n1", ["a"], [None]) == [False]
    await m.unlock(P, "reader", "n1", ["a"])
    await m.unlock(P, "reader", "n1", ["a"])  # idempotent: never below zero
    assert (await m.dump(P))["locks"] == {}
    assert await m.evict(P, "n1", ["a"], ["m"]) == [True]  # marked moving
    assert await m.lock(P, "reader", "n1", ["a"]) == [None]  # a moving replica is not lent
    assert await m.evict(P, "n1", ["a"], ["2:0:4"]) == [True]
    assert await m.match(P, "s1", ["a"]) == [{"n1": "2:0:4"}]


async def test_run_lock_keeps_the_last_replica_of_a_running_session(backend: Any) -> None:
    m = backend()
    await m.publish(P, "n1", "s1", ["a"], ["0:0:4"])
    await m.run(P, "s1", +1)
    assert await m.evict(P, "n1", ["a"], ["2:1:4"]) == [True]  # may move down
    assert await m.evict(P, "n1", ["a"], [None]) == [False]  # is not dropped
    assert await m.provide(P, "n2", ["a", "gone"], ["1:0:4", "1:1:4"]) == [True, False]
    assert await m.evict(P, "n1", ["a"], [None]) == [True]  # n2 still holds it
    await m.run(P, "s1", -1)
    await m.run(P, "s1", -1)  # never below zero
    assert (await m.dump(P))["runs"] == {}
    assert await m.evict(P, "n2", ["a"], [None]) == [True]
    assert await m.match(P, "s1", ["a"]) == []


async def test_a_match_can_take_the_run_lock_in_the_same_step(backend: Any) -> None:
    m = backend()
    await m.publish(P, "n1", "s1", ["a", "b"], ["0:0:4", "0:1:4"])
    assert await m.match(P, "s1", ["a", "x"], True) == [{"n1": "0:0:4"}]
    assert await m.match(P, "s1", [], True) == []  # a lock even for an empty query
    assert (await m.dump(P))["runs"] == {"s:s1": 2}
    assert await m.evict(P, "n1", ["a"], [None]) == [False]  # the session runs
    assert await m.match(P, None, ["a"], True) == []  # no session: no run lock
    await m.run(P, "s1", -1)
    await m.run(P, "s1", -1)
    assert (await m.dump(P))["runs"] == {}
    assert await m.evict(P, "n1", ["a"], [None]) == [True]


async def test_leave_forgets_a_node_and_its_locks(backend: Any) -> None:
    m = backend()
    await m.register(P, "n1", {"host": "h", "addr": ""})
    await m.publish(P, "n1", "s1", ["a", "b"], ["0:0:4", "0:1:4"])
    await m.publish(P, "n2", "s1", ["b"], ["0:0:4"])
    await m.lock(P, "n1", "n2", ["b"])
    assert (await m.nodes(P, ["n1", "nx"])) == {"n1": {"host": "h", "addr": ""}}
    await m.leave(P, "n1")
    dump = await m.dump(P)
    assert dump["providers"] == {"b": {"n2": "0:0:4"}} and dump["locks"] == {}
    assert dump["chains"] == {"s:s1": ["b"]}
    assert await m.nodes(P, ["n1"]) == {}


async def test_publish_chain_only_needs_a_provider(backend: Any) -> None:
    m = backend()
    await m.publish(P, "n1", "s1", ["ghost"], [""])  # nobody holds it: not chained
    assert (await m.dump(P))["chains"] == {}
    await m.publish(P, "n1", "s1", ["a"], ["0:0:4"])
    await m.publish(P, "n2", "s2", ["a"], [""])  # chain only: n1 provides it
    assert await m.match(P, "s2", ["a"]) == [{"n1": "0:0:4"}]


async def test_a_lapsed_lease_forgets_the_node_until_it_registers_again(backend: Any) -> None:
    """Leases are timed by the backend's clock: a 1 ms lease has run out once a little wall
    time passed (the loop waits for that, bounded; no assertion races the clock)."""
    m = backend()
    await m.register(P, "n1", {"host": "h"}, ttl_ms=600_000)
    await m.register(P, "n2", {"host": "h"}, ttl_ms=600_000)
    await m.register(P, "n3", {"host": "h"})  # no lease: never expired
    await m.publish(P, "n1", "s1", ["a", "b"], ["1:0:4", "1:1:4"])
    await m.publish(P, "n2", "s1", ["b"], ["1:0:4"])
    await m.publish(P, "n3", None, ["sys"], ["1:2:4"])
    assert await m.lock(P, "n2", "n1", ["a"]) == ["1:0:4"]  # n2 reads n1's replica
    assert await m.heartbeat(P, "n1", 1)  # n1's last renewal: 1 ms
    for _ in range(2000):
        if await m.match(P, "s1", ["a", "b"]) == []:  # the match itself forgot n1
            break
        await asyncio.sleep(0.005)
    dump = await m.dump(P)
    assert dump["providers"] == {"b": {"n2": "1:0:4"}, "sys": {"n3": "1:2:4"}}
    assert dump["chains"] == {"s:s1": ["b"], PUBLIC: ["sys"]}
    assert dump["locks"] == {"a|n1": {"n2": 1}}  # a reader's lock stays until it unlocks
    assert await m.nodes(P, ["n1", "n3"]) == {"n3": {"host": "h"}}
    assert await m.sweep(P) == []  # forgotten once
    # Forgotten, n1 provides and locks nothing until it registers again.
    assert not await m.heartbeat(P, "n1", 600_000)
    await m.publish(P, "n1", "s1", ["c"], ["1:3:4"])
    assert await m.provide(P, "n1", ["b"], ["1:4:4"]) == [False]
    assert await m.lock(P, "n1", "n2", ["b"]) == [None]
    assert "c" not in (await m.dump(P))["providers"]
    await m.register(P, "n1", {"host": "h"}, ttl_ms=600_000)
    assert await m.heartbeat(P, "n1", 600_000)
    assert await m.provide(P, "n1", ["b"], ["1:4:4"]) == [True]
    assert await m.match(P, "s1", ["b"]) == [{"n1": "1:4:4", "n2": "1:0:4"}]
    await m.unlock(P, "n2", "n1", ["a"])
    assert (await m.dump(P))["locks"] == {}
    if isinstance(m, MemoryMetadata):
        m.validate(P)


async def check_invariants(m: Metadata, held: dict[str, set[str]]) -> None:
    dump = await m.dump(P)
    providers: dict[str, dict[str, str]] = dump["providers"]  # type: ignore[assignment]
    for chain, keys in dump["chains"].items():  # type: ignore[attr-defined]
        for key in keys:
            assert providers.get(key), f"chain {chain} points at evicted page {key}"
    for key, prov in providers.items():
        assert prov, f"page {key} with an empty provider record"
        for node in prov:
            assert key in held[node], f"{node} provides {key} without holding it"
    for node, keys in held.items():
        for key in keys:
            assert node in providers.get(key, {}), f"{node} holds {key} unregistered"


async def test_subscribers_get_one_batch_per_publish_of_their_chain(
    backend: Any, request: pytest.FixtureRequest
) -> None:
    """Through Redis the batches are sealed pub/sub messages (each node seals its own)."""
    pub, sub = backend(), backend()
    redis = "redis" in request.node.callspec.id
    key = generate_key()
    n1, n2 = NoticeSeal(P, "n1", key), NoticeSeal(P, "n2", key)
    pub.use_seal(P, "n1", n1)
    sub.use_seal(P, "n2", n2)
    got: list[tuple[str, str | None, list[str]]] = []
    await sub.register(P, "n2", {"host": "h"})
    sub.listen(P, "n2", lambda pool, s, keys: got.append((pool, s, keys)))
    await sub.subscribe(P, "n2", "s1", True)
    await sub.subscribe(P, "n2", None, True)
    await pub.publish(P, "n1", "s1", ["a", "b"], ["0:0:4", "0:1:4"])
    await pub.publish(P, "n1", "s2", ["x"], ["0:2:4"])  # another session: not told
    await pub.publish(P, "n1", None, ["sys"], ["0:3:4"])
    await pub.publish(P, "n1", "s1", ["ghost", "b"], ["", ""])  # ghost never joins
    await sub.publish(P, "n2", "s1", ["c"], ["0:0:4"])  # its own publish: not told
    await sub.settle(P)  # every notification of a publish that finished has arrived
    assert got == [(P, "s1", ["a", "b"]), (P, None, ["sys"]), (P, "s1", ["b"])]
    if not redis:  # Redis keeps subscriptions on the pub/sub connection, not in keys
        assert (await pub.dump(P))["subs"] == {"s:s1": ["n2"], PUBLIC: ["n2"]}
    await sub.subscribe(P, "n2", "s1", False)
    await pub.publish(P, "n1", "s1", ["d"], ["0:4:4"])
    await sub.settle(P)
    await sub.leave(P, "n2")  # leaving ends every subscription
    await pub.publish(P, "n1", None, ["sys2"], ["0:5:4"])
    await sub.settle(P)
    assert len(got) == 3
    if not redis:
        assert (await pub.dump(P))["subs"] == {}
    else:
        assert n2.stats.accepted == 4 and sum(n2.stats.dropped.values()) == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_eight_clients_race_publish_match_evict(backend: Any) -> None:
    """8 clients, 10k operations: no chain points at an evicted page, no provider without it."""
    clients = [backend() for _ in range(8)]
    nodes = [f"n{i}" for i in range(8)]
    held: dict[str, set[str]] = {n: set() for n in nodes}
    universe = [f"k{i}" for i in range(40)]
    sessions = ["s0", "s1", "s2", None]
    ops = 0

    async def client(i: int) -> None:
        nonlocal ops
        m, node, rng = clients[i], nodes[i], random.Random(i)
        for _ in range(1250):
            op = rng.random()
            session = rng.choice(sessions)
            if op < 0.3:
                start = rng.randrange(0, 36)
                keys = universe[start : start + rng.randint(1, 4)]
                held[node].update(keys)  # before: a reader may lock them as soon as they exist
                await m.publish(P, node, session, keys, [f"0:{j}:4" for j in range(len(keys))])
            elif op < 0.55:
                keys = universe[: rng.randint(1, 8)]
                found = await m.match(P, session, keys)
                if found:
                    provider = rng.choice(sorted(found[-1]))
                    key = keys[len(found) - 1]
                    if provider != node:
                        (loc,) = await m.lock(P, node, provider, [key])
                        if loc is not None:
                            assert key in held[provider], "lent a page its provider dropped"
                            if rng.random() < 0.5 and key not in held[node]:
                                held[node].add(key)
                                (ok,) = await m.provide(P, node, [key], ["1:0:4"])
                                if not ok:
                                    held[node].discard(key)
                            await m.unlock(P, node, provider, [key])
            elif op < 0.85:
                mine = sorted(held[node])
                if mine:
                    keys = rng.sample(mine, min(len(mine), rng.randint(1, 3)))
                    done = await m.evict(P, node, keys, [None] * len(keys))
                    for key, ok in zip(keys, done, strict=True):
                        if ok:
                            held[node].discard(key)
            else:
                s = rng.choice(["s0", "s1", "s2"])
                await m.run(P, s, +1)
                await asyncio.sleep(0)
                await m.run(P, s, -1)
            ops += 1

    await asyncio.gather(*(client(i) for i in range(8)))
    assert ops == 10_000
    await check_invariants(clients[0], held)
    dump = await clients[0].dump(P)
    assert dump["locks"] == {} and dump["runs"] == {}


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("nope", ["p"]),
        ("__init__", ["p"]),
        ("match", "p"),
        ("match", ["p", None]),
        ("match", ["p", None, ["a", 1]]),
        ("match", ["p", None, ["a"], 1]),
        ("match", ["p", None, ["a"], True, True]),
        ("publish", ["p", "n", None, ["a"], [None]]),
        ("register", ["p", "n", {"host": 1}]),
        ("run", ["p", "s", True]),
        ("subscribe", ["p", "n", "s", 1]),
        ("evict", [1, "n", ["a"], [None]]),
        ("dump", ["p", "extra"]),
    ],
)
async def test_the_front_refuses_a_malformed_call_and_changes_nothing(op: str, args: Any) -> None:
    front = MemoryMetadata()
    with pytest.raises(DataError, match="hosted metadata"):
        check(op, args)
    with pytest.raises(DataError, match="hosted metadata"):
        await serve(front, op, args)
    assert front._pools == {}


async def test_a_hosted_client_fails_fast_without_a_front_and_when_it_goes() -> None:
    client = HostedMetadata(timeout=10)
    with pytest.raises(DataError, match="hosted by the front"):
        await client.match(P, "s", ["a"])
    sent: list[int] = []
    client.attach(lambda r, op, args: sent.append(r))
    waiting = asyncio.ensure_future(client.match(P, "s", ["a"]))
    await asyncio.sleep(0)
    assert sent and client.pending == 1
    client.reply(sent[0] + 100, [], None)  # an answer nobody asked for is ignored
    client.detach("the front went away")
    with pytest.raises(DataError, match="went away"):
        await waiting
    assert client.pending == 0


async def test_a_register_before_the_front_attaches_is_sent_first_when_it_does() -> None:
    # A worker's setup() opens its pools before the front says hello (docs/contract.md §8).
    client = HostedMetadata(timeout=10)
    assert await client.register(P, "n1", {"host": "h"}, ttl_ms=3000) is None
    assert await client.heartbeat(P, "n1", 3000)  # the lease starts at the attach
    with pytest.raises(DataError, match="hosted by the front"):
        await client.heartbeat(P, "n2", 3000)  # (a node that never registered)
    with pytest.raises(DataError, match="hosted by the front"):
        await client.match(P, "s", ["a"])
    front = MemoryMetadata()
    sent: list[tuple[int, str, list[Any]]] = []
    client.attach(lambda r, op, args: sent.append((r, op, args)))
    assert [(op, args) for _r, op, args in sent] == [("register", [P, "n1", {"host": "h"}, 3000])]
    r, op, args = sent[0]
    client.reply(r, await serve(front, op, args), None)
    assert client.pending == 0
    assert "n1" in await front.nodes(P, ["n1"])
    client.detach("the front went away")
    with pytest.raises(DataError, match="hosted by the front"):  # attached once: none kept
        await client.register(P, "n3", {"host": "h"})


async def test_leaving_without_a_front_is_a_no_op_and_drops_a_deferred_register() -> None:
    """A stopping worker's pools leave at once (their shared memory goes then), whether the
    front never attached or its connection is gone; the front forgets a lost replica's pools."""
    client = HostedMetadata(timeout=10)
    await client.register(P, "n1", {"host": "h"})
    await client.register(P, "n2", {"host": "h"})
    await client.leave(P, "n1")  # never attached: n1's deferred register is dropped, n2 kept
    sent: list[tuple[str, list[Any]]] = []
    client.attach(lambda r, op, args: sent.append((op, args)))
    assert sent == [("register", [P, "n2", {"host": "h"}])]
    client.detach("the worker stopped")
    await asyncio.wait_for(client.leave(P, "n2"), 1)  # gone: no round trip, no wait
    assert len(sent) == 1 and client.pending == 0


async def test_a_deferred_register_the_front_refuses_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = HostedMetadata(timeout=10)
    await client.register(P, "n1", {"host": "h"})
    client.attach(lambda r, op, args: client.reply(r, None, "boom"))
    assert client.pending == 0
    await asyncio.sleep(0)  # (a future's callbacks run in the next loop turn)
    assert "registering with the front's metadata failed" in caplog.text
    assert "boom" in caplog.text


async def test_a_hosted_client_times_out_instead_of_hanging() -> None:
    client = HostedMetadata(timeout=0.01)
    client.attach(lambda r, op, args: None)  # a front that never answers
    with pytest.raises(DataError, match="did not answer 'dump'"):
        await client.dump(P)
    assert client.pending == 0


async def test_a_front_error_reaches_the_caller_as_a_data_error() -> None:
    client = HostedMetadata(timeout=10)
    client.attach(lambda r, op, args: client.reply(r, None, "boom"))
    with pytest.raises(DataError, match="the front refused: boom"):
        await client.leave(P, "n")


def test_metadata_messages_round_trip_and_malformed_ones_are_refused() -> None:
    from omniflow.transport._codec import encode
    from omniflow.transport._protocol import (
        MetaCall,
        MetaNotify,
        MetaReply,
        ProtocolError,
        decode_msg,
        encode_msg,
    )

    for msg in (
        MetaCall(3, "match", ["kv", None, ["a", "b"]]),
        MetaReply(3, [{"n1": "1:0:4"}]),
        MetaReply(4, None, "refused"),
        MetaNotify("kv", "chat", ["a"]),
        MetaNotify("kv", None, []),
    ):
        assert decode_msg(encode_msg(msg)) == msg
    for kind, body in (
        ("meta_call", [3, "match"]),
        ("meta_call", ["3", "match", []]),
        ("meta_call", [3, 7, []]),
        ("meta_reply", [3]),
        ("meta_reply", [3, None, 5]),
        ("meta_notify", ["kv", 1, []]),
        ("meta_notify", ["kv", "s", "a"]),
    ):
        with pytest.raises(ProtocolError, match="malformed"):
            decode_msg(encode(body, kind=kind))
