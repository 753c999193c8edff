"""Field names cost nothing on the wire: a message travels as the msgpack array of its fields in
declaration order, so each kind's bytes are pinned here. The samples are built by field name
(every field set, none at its default); the expected bytes were encoded from the same values,
given by position, before the fields got their readable names. A change of a field's position,
type or default shows up here as a changed byte."""

from __future__ import annotations

from typing import Any

import pytest

from omniflow.cluster._forward import Route, parse_routes
from omniflow.transport._protocol import (
    MESSAGES,
    Batch,
    Bye,
    CallEnded,
    Cancel,
    Claim,
    Claimed,
    CloseSession,
    Done,
    Dones,
    EndCall,
    Forward,
    Forwards,
    Frame,
    Frames,
    Heartbeat,
    Hello,
    MetaCall,
    MetaNotify,
    MetaReply,
    Pull,
    Pulled,
    PullFailed,
    Ready,
    Release,
    Run,
    SourceLost,
    StatsReply,
    StatsRequest,
    Stop,
    decode_msg,
    encode_msg,
    kind_of,
)

_SUB = ["x", "n", 0, "a", "r", None, None, None, False, None]
ROUTE = Route(
    field="image",
    node="vit.encode",
    group=1,
    address="ipc:///tmp/w1",
    replica="r1",
    offload=["pixels"],
    threshold=4096,
    connectors={"llm.gen": "shm"},
    seq_from_frame=True,
    subroutes=[_SUB],
)

#: One message of each kind, every field given by name.
SAMPLES: list[Any] = [
    Batch(messages=[b"\x01\x02", b"\x03"]),
    Hello(front="front-1", interval=0.5),
    Ready(replica="rep-1", roles=["vit", "llm"], pid=4242),
    Run(
        call_id="call-1", aid=7, node="vit.encode", kwargs={"image": 3}, session="sess-1",
        group=2, seq=5, graph="graph-1", offload=["pixels"], threshold=1024,
        connectors={"llm.gen": "shm"}, routes=[ROUTE.wire()], traceparent="00-ab-cd-01",
    ),
    Forward(
        front="front-1", replica="rep-2", call_id="call-1", aid="7.0.1", node="llm.gen",
        kwargs={"tokens": [1, 2]}, session=None, group=0, seq=3, graph="graph-1", offload=None,
        threshold=2048, connectors=None, routes=[ROUTE.wire()], traceparent="00-ab-cd-02",
    ),
    Forwards(
        front="front-1", replica="rep-2", call_id="call-1", node="llm.gen", field="tokens",
        session="sess-2", group=1, graph="graph-1", aids=["7.0.0", "7.1.0"], values=[1, "two"],
        seqs=[0, 1], offload=["out"], threshold=99, connectors={"a": "b"},
        routes=[ROUTE.wire()], traceparent="00-ab-cd-03",
    ),
    Cancel(call_id="call-1", aid="7.0.1"),
    Frame(call_id="call-1", aid=7, frame={"text": "hi"}, forwarded=[[0, "7.0.0"]]),
    Frames(call_id="call-1", aid=7, frames=[1, 2, 3], forwarded=[None, [[0, "7.1.0"]], None]),
    Done(
        call_id="call-1", aid=8, frame="last", error_type="ValueError", error_message="boom",
        cancelled=True, traceback="Traceback ...", forwarded=[[1, "8.0.1"]],
    ),
    Dones(
        call_ids=["call-1", "call-2"], aids=[7, "9.0.0"], frames=[None, 5],
        forwarded=[None, [[0, "9.0.0.0.0"]]],
    ),
    Claim(request=11, call_id="call-1", wire_ids=["7.0.0", "7.1.0"]),
    Claimed(request=11, call_id="call-1", missing=["7.1.0"]),
    Release(refs=[[1, 2], "ref"]),
    EndCall(call_id="call-1", ack=True),
    CallEnded(call_id="call-1"),
    SourceLost(address="tcp://10.0.0.1:5000", pid=77),
    StatsRequest(request=12),
    StatsReply(
        request=12, replica="rep-1", pid=4242, plane={"sent": 1}, wire={"bytes": 2},
        work={"running": 3}, pools={"kv": {"pages": 4}},
    ),
    CloseSession(session="sess-1"),
    Stop(),
    Bye(),
    Heartbeat(batching={"vit.encode": {"batches": 2}}),
    Pull(request=13, handle=["blk", 1, 2]),
    Pulled(request=13, data=b"bytes"),
    PullFailed(request=13, error="gone"),
    MetaCall(request=14, op="publish", args=["p", 1]),
    MetaReply(request=14, value={"ok": 1}, error="no such pool"),
    MetaNotify(pool="kv", session="sess-1", keys=["k1", "k2"]),
]  # fmt: skip

#: kind -> the sample's one encoded frame, hex (encoded before the fields were renamed).
GOLDEN: dict[str, str] = {
    "batch": "4f460193a56261746368009192c4020102c40103",
    "bye": "4f460193a36279650090",
    "call_ended": "4f460193aa63616c6c5f656e6465640091a663616c6c2d31",
    "cancel": "4f460193a663616e63656c0092a663616c6c2d31a5372e302e31",
    "claim": "4f460193a5636c61696d00930ba663616c6c2d3192a5372e302e30a5372e312e30",
    "claimed": "4f460193a7636c61696d656400930ba663616c6c2d3191a5372e312e30",
    "close_session": "4f460193ad636c6f73655f73657373696f6e0091a6736573732d31",
    "done": (
        "4f460193a4646f6e650098a663616c6c2d3108a46c617374aa56616c75654572726f72a4626f6f6dc3ad5472"
        "6163656261636b202e2e2e919201a5382e302e31"
    ),
    "dones": (
        "4f460193a5646f6e6573009492a663616c6c2d31a663616c6c2d329207a5392e302e3092c00592c0919200a9"
        "392e302e302e302e30"
    ),
    "end_call": "4f460193a8656e645f63616c6c0092a663616c6c2d31c3",
    "forward": (
        "4f460193a7666f7277617264009fa766726f6e742d31a57265702d32a663616c6c2d31a5372e302e31a76c6c"
        "6d2e67656e81a6746f6b656e73920102c00003a767726170682d31c0cd0800c0919aa5696d616765aa766974"
        "2e656e636f646501ad6970633a2f2f2f746d702f7731a2723191a6706978656c73cd100081a76c6c6d2e6765"
        "6ea373686dc3919aa178a16e00a161a172c0c0c0c2c0ab30302d61622d63642d3032"
    ),
    "forwards": (
        "4f460193a8666f72776172647300dc0010a766726f6e742d31a57265702d32a663616c6c2d31a76c6c6d2e67"
        "656ea6746f6b656e73a6736573732d3201a767726170682d3192a5372e302e30a5372e312e309201a374776f"
        "92000191a36f75746381a161a162919aa5696d616765aa7669742e656e636f646501ad6970633a2f2f2f746d"
        "702f7731a2723191a6706978656c73cd100081a76c6c6d2e67656ea373686dc3919aa178a16e00a161a172c0"
        "c0c0c2c0ab30302d61622d63642d3033"
    ),
    "frame": "4f460193a56672616d650094a663616c6c2d310781a474657874a26869919200a5372e302e30",
    "frames": "4f460193a66672616d65730094a663616c6c2d31079301020393c0919200a5372e312e30c0",
    "heartbeat": "4f460193a9686561727462656174009181aa7669742e656e636f646581a76261746368657302",
    "hello": "4f460193a568656c6c6f0092a766726f6e742d31cb3fe0000000000000",
    "meta_call": "4f460193a96d6574615f63616c6c00930ea77075626c69736892a17001",
    "meta_notify": "4f460193ab6d6574615f6e6f746966790093a26b76a6736573732d3192a26b31a26b32",
    "meta_reply": "4f460193aa6d6574615f7265706c7900930e81a26f6b01ac6e6f207375636820706f6f6c",
    "pull": "4f460193a470756c6c00920d93a3626c6b0102",
    "pull_failed": "4f460193ab70756c6c5f6661696c656400920da4676f6e65",
    "pulled": "4f460193a670756c6c656400920dc4056279746573",
    "ready": "4f460193a572656164790093a57265702d3192a3766974a36c6c6dcd1092",
    "release": "4f460193a772656c65617365009192920102a3726566",
    "run": (
        "4f460193a372756e009da663616c6c2d3107aa7669742e656e636f646581a5696d61676503a6736573732d31"
        "0205a767726170682d3191a6706978656c73cd040081a76c6c6d2e67656ea373686d919aa5696d616765aa76"
        "69742e656e636f646501ad6970633a2f2f2f746d702f7731a2723191a6706978656c73cd100081a76c6c6d2e"
        "67656ea373686dc3919aa178a16e00a161a172c0c0c0c2c0ab30302d61622d63642d3031"
    ),
    "source_lost": "4f460193ab736f757263655f6c6f73740092b37463703a2f2f31302e302e302e313a353030304d",
    "stats": "4f460193a5737461747300910c",
    "stats_reply": (
        "4f460193ab73746174735f7265706c7900970ca57265702d31cd109281a473656e740181a562797465730281"
        "a772756e6e696e670381a26b7681a5706167657304"
    ),
    "stop": "4f460193a473746f700090",
}


def test_every_kind_has_a_sample() -> None:
    assert sorted(kind_of(m) for m in SAMPLES) == sorted(MESSAGES)


@pytest.mark.parametrize("msg", SAMPLES, ids=kind_of)
def test_a_message_encodes_to_its_pinned_bytes(msg: Any) -> None:
    frames = [bytes(b) for b in encode_msg(msg)]
    assert [f.hex() for f in frames] == [GOLDEN[kind_of(msg)]]


@pytest.mark.parametrize("msg", SAMPLES, ids=kind_of)
def test_the_pinned_bytes_decode_to_the_message(msg: Any) -> None:
    assert decode_msg([bytes.fromhex(GOLDEN[kind_of(msg)])]) == msg


def test_a_route_travels_as_its_fields_in_order() -> None:
    assert ROUTE.wire() == [
        "image", "vit.encode", 1, "ipc:///tmp/w1", "r1", ["pixels"], 4096, {"llm.gen": "shm"},
        True, [_SUB],
    ]  # fmt: skip
    assert parse_routes([ROUTE.wire()]) == (ROUTE,)
